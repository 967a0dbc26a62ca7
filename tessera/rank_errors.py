"""A user error on many ranks, shown once: which ranks said it, and each different message once.

Two kinds of user error (`tessera.errors.TesseraError`) end a rank:

- **Decisions every rank makes alike** from the same inputs: the command line and the config (`cfg.validate`),
  and a resume refused because a setting differs from the checkpoint's (`tessera.train.compat`). Code that
  makes one marks the error inside `decided_on_every_rank`.
- **Everything else**, which may be one rank's own: a file missing on one node, one rank's shard, an error
  only one pipeline stage meets.

Under tessera's launcher (``tessera train --nproc N``) a rank does not print its error: it writes it to
``TESSERA_ERROR_DIR/rank{r}.json`` (`write_report`), and the launcher, once the ranks have ended, prints each
different message once with the ranks that reported it (`format_reports`: ``[ranks 0-1023] error: ...``). A rank
never waits for another to decide whether to print; the launcher waits (a bounded time) only after an
every-rank decision, for the other ranks to reach it too, and stops them as before otherwise. A rank that
cannot write its report prints it.

Under torchrun or srun no process sees the other ranks' output, so the same error cannot be merged after the
fact, and a rank must not wait on peers that may be dead: an every-rank decision is printed by rank 0 alone,
saying that the other ranks stop with it too; every other error is printed by each rank with its rank.
docs/launching.md, "Errors from many ranks".
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from tessera.errors import TesseraError
from tessera.files import temp_beside

__all__ = [
    "ERROR_DIR",
    "decided_on_every_rank",
    "format_reports",
    "rank_ranges",
    "read_reports",
    "report_error",
    "write_report",
]

ERROR_DIR = "TESSERA_ERROR_DIR"
"""Set by tessera's launcher in every rank's environment: the folder each rank writes its error report to."""


@contextlib.contextmanager
def decided_on_every_rank() -> Iterator[None]:
    """Mark a `TesseraError` raised inside as a decision every rank makes alike from the same inputs (the
    config, the command line, a checkpoint's recorded settings), so that one rank's message stands for all."""
    try:
        yield
    except TesseraError as e:
        e.same_on_every_rank = True
        raise


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2, 5, 7-8"``."""
    parts: list[str] = []
    ordered = sorted(set(ranks))
    start = prev = ordered[0] if ordered else 0
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts) if ordered else ""


def _who(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"


def report_error(e: TesseraError, environ: dict[str, str] | None = None) -> None:
    """Show ``e`` as this process's error (the `tessera` command's handler): plain in one process; in a rank of
    tessera's launcher, as a report the launcher prints; under torchrun/srun, with this rank's number, except
    an every-rank decision, which only rank 0 prints."""
    env = os.environ if environ is None else environ
    world, rank = int(env.get("WORLD_SIZE", "1")), env.get("RANK")
    if world <= 1 or rank is None:
        sys.stderr.write(f"error: {e}\n")
        return
    folder = env.get(ERROR_DIR)
    if folder and write_report(Path(folder), int(rank), str(e), e.same_on_every_rank):
        return  # the launcher prints it, once for all the ranks that report the same
    if not e.same_on_every_rank:
        sys.stderr.write(f"[rank {rank}] error: {e}\n")  # one write, so ranks' lines do not interleave
    elif rank == "0":
        others = "rank 1 exits" if world == 2 else f"ranks 1-{world - 1} exit"
        sys.stderr.write(
            f"[rank 0] error: {e}\n(every rank decides this alike, from the same command line, config and "
            f"checkpoint: {others} with status {e.exit_code} too, without repeating it)\n"
        )


def write_report(folder: Path, rank: int, message: str, same_on_every_rank: bool) -> bool:
    """Write rank ``rank``'s error to ``folder/rank{r}.json`` whole (a temp file renamed over it: a rank killed
    while writing leaves none); False when it cannot be written, and the rank prints it instead."""
    out = folder / f"rank{rank}.json"
    try:
        fd, tmp = temp_beside(out)
        with os.fdopen(fd, "w") as f:
            json.dump({"message": message, "same_on_every_rank": same_on_every_rank}, f)
        os.replace(tmp, out)
    except OSError:
        return False
    return True


def read_reports(folder: Path, nproc: int) -> dict[int, dict]:
    """The reports ranks 0..nproc-1 wrote to ``folder`` (rank -> {"message", "same_on_every_rank"})."""
    found = {}
    for rank in range(nproc):
        try:
            report = json.loads((folder / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            continue  # this rank wrote none: it succeeded, was stopped, or failed otherwise
        if isinstance(report, dict) and isinstance(report.get("message"), str):
            found[rank] = report
    return found


def format_reports(reports: dict[int, dict]) -> str:
    """Each different message once, after the ranks that reported it, lowest rank first:
    ``[ranks 0-1023] error: ...``; empty when there are none."""
    by_message: dict[str, list[int]] = {}
    for rank in sorted(reports):
        by_message.setdefault(reports[rank]["message"], []).append(rank)
    return "".join(f"[{_who(ranks)}] error: {message}\n" for message, ranks in by_message.items())
