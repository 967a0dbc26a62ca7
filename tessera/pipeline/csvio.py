"""CSV form of a schedule: a header ``rank,step,action`` and one row per action.

``step`` is the position in that rank's list (0, 1, 2, ... with no gap); ``action`` is the compact text form
(``2F0``, ``2SEND_F0->r1``, ``2REDUCE``). Rows may come in any order. This lets a user hand-write or edit a
schedule in a spreadsheet; ``from_csv`` checks the format, ``validate`` then checks the schedule itself.
"""

from __future__ import annotations

import csv
import io

from tessera.pipeline.ir import Action, Schedule, ScheduleError

__all__ = ["from_csv", "to_csv"]

_HEADER = ["rank", "step", "action"]


def to_csv(schedule: Schedule) -> str:
    """Serialise per-rank lists (compute-only or lowered) to CSV text."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(_HEADER)
    for rank, actions in enumerate(schedule):
        for step, action in enumerate(actions):
            writer.writerow([rank, step, str(action)])
    return out.getvalue()


def _parse_row(line_no: int, row: list[str]) -> tuple[int, int, Action]:
    if len(row) != 3:
        raise ScheduleError(f"CSV line {line_no}: expected 3 columns rank,step,action, got {len(row)}: {row}")
    rank_text, step_text, action_text = (cell.strip() for cell in row)
    try:
        rank, step = int(rank_text), int(step_text)
    except ValueError:
        raise ScheduleError(
            f"CSV line {line_no}: rank and step must be integers, got {rank_text!r}, {step_text!r}"
        ) from None
    if rank < 0 or step < 0:
        raise ScheduleError(f"CSV line {line_no}: rank and step must be >= 0, got {rank}, {step}")
    try:
        action = Action.parse(action_text)
    except ScheduleError as error:
        raise ScheduleError(f"CSV line {line_no}: {error}") from None
    return rank, step, action


def from_csv(text: str, p: int | None = None) -> Schedule:
    """Parse CSV text into per-rank lists. ``p`` (if given) fixes the rank count; otherwise max rank + 1."""
    rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    if not rows or [cell.strip().lower() for cell in rows[0]] != _HEADER:
        raise ScheduleError(f"CSV must start with the header line {','.join(_HEADER)}")
    cells: dict[tuple[int, int], Action] = {}
    for line_no, row in enumerate(rows[1:], start=2):
        rank, step, action = _parse_row(line_no, row)
        if (rank, step) in cells:
            raise ScheduleError(f"CSV line {line_no}: rank {rank} step {step} appears twice")
        cells[(rank, step)] = action
    ranks = p if p is not None else max((r for r, _ in cells), default=-1) + 1
    schedule: Schedule = []
    for rank in range(ranks):
        steps = sorted(step for r, step in cells if r == rank)
        if steps != list(range(len(steps))):
            gap = next(i for i, step in enumerate(steps) if step != i)
            raise ScheduleError(f"CSV: rank {rank} has no step {gap}; steps must be 0, 1, 2, ... with no gap")
        schedule.append([cells[(rank, step)] for step in steps])
    extra = sorted({r for r, _ in cells if r >= ranks})
    if extra:
        raise ScheduleError(f"CSV: ranks {extra} are out of range for p = {ranks}")
    return schedule
