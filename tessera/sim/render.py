"""Schedule pictures: a text timeline (rank rows × time columns) and PNG/SVG images via matplotlib (Agg).

``show_schedule`` is the one-call path used by ``tessera schedule show``: build → lower → validate → simulate
with unit costs (t_f = 1, t_b = 2, free communication) → text, and optionally a picture.
"""

from __future__ import annotations

import math
from pathlib import Path

from tessera.figures import save_figure
from tessera.pipeline.ir import ActionKind, ScheduleError, infer_stage_ranks
from tessera.pipeline.passes import lower
from tessera.pipeline.schedules import build_schedule
from tessera.sim.simulator import CostTable, TimelineEntry, simulate

__all__ = ["KIND_COLORS", "TEXT_LIMIT", "render_image", "render_text", "show_schedule", "text_size"]

KIND_COLORS = {
    ActionKind.FORWARD: "#4c72b0",
    ActionKind.BACKWARD: "#dd8452",
    ActionKind.BACKWARD_INPUT: "#c44e52",
    ActionKind.BACKWARD_WEIGHT: "#8172b3",
    ActionKind.SEND_F: "#55a868",
    ActionKind.RECV_F: "#55a868",
    ActionKind.SEND_B: "#64b5cd",
    ActionKind.RECV_B: "#64b5cd",
    ActionKind.REDUCE_GRAD: "#937860",
    ActionKind.REDUCE_MICROBATCH: "#937860",
    ActionKind.GATHER_PARAMS: "#da8bc3",
    ActionKind.FREE_PARAMS: "#8c8c8c",
}
"""Colour of each action kind in pictures (seaborn 'deep' palette)."""

_EPS = 1e-9

TEXT_LIMIT = 1_000_000
"""Characters of text timeline `tessera schedule show` prints unless given --full-text: a pipeline of p ranks
draws p rows of about 3 (m + p) columns, 1.2 MB at p = 256, m = 8 and 84 MB at p = 2000, which no one reads on
a terminal and which took minutes to print; below it (p = 128 and m = 128 is 0.8 MB) the output is unchanged."""


def _drawn(timeline: list[TimelineEntry]) -> list[TimelineEntry]:
    """Entries that take time (zero-cost communication and bookkeeping actions are not drawn)."""
    return [entry for entry in timeline if entry.end - entry.start > _EPS]


def _layout(drawn: list[TimelineEntry]) -> tuple[float, int, int]:
    """(time per column, columns, cell width) of the text timeline of ``drawn`` (not empty)."""
    unit = min(entry.end - entry.start for entry in drawn)
    columns = math.ceil(max(entry.end for entry in drawn) / unit - _EPS)
    width = max(len(entry.action.short()) for entry in drawn)
    return unit, columns, width


def text_size(timeline: list[TimelineEntry], p: int) -> tuple[int, int]:
    """(time columns, characters) of ``render_text(timeline, p)``, without drawing it: p rows of columns cells
    grow as p × (m + p) for a pipeline of p stages, so a caller can decline to print a huge one."""
    drawn = _drawn(timeline)
    if not drawn:
        return 0, sum(len(f"r{r:<3}") for r in range(p)) + p - 1
    _, columns, width = _layout(drawn)
    row = columns * (width + 1) - 1  # cells and the spaces between them
    return columns, sum(len(f"r{r:<3} ") + row for r in range(p)) + p - 1


def render_text(timeline: list[TimelineEntry], p: int) -> str:
    """Rank rows × time columns; one column per smallest action duration. An action shows its label in its
    first column and ``-`` in the columns it continues over; ``.`` is idle time."""
    drawn = _drawn(timeline)
    if not drawn:
        return "\n".join(f"r{r:<3}" for r in range(p))
    unit, columns, width = _layout(drawn)
    # cells are padded once per action, not once per cell: the text has p × columns cells (84 MB at p = 2000)
    idle, continued = f"{'.':<{width}}", "-" * width
    rows = [[idle] * columns for _ in range(p)]
    for entry in drawn:
        first = round(entry.start / unit)
        last = max(first + 1, round(entry.end / unit))
        row = rows[entry.rank]
        row[first] = f"{entry.action.short():<{width}}"
        end = min(last, columns)
        row[first + 1 : end] = [continued] * (end - first - 1)
    return "\n".join(f"r{r:<3} " + " ".join(row) for r, row in enumerate(rows))


def render_image(timeline: list[TimelineEntry], p: int, path: str | Path, title: str = "") -> Path:
    """Draw a Gantt chart (ranks as rows) to ``path``; the format (png or svg) follows the extension.

    Colour by kind (lighter for later local chunks), micro-batch number inside each bar."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise ScheduleError(f"picture path must end in .png or .svg, got {path.name!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = _drawn(timeline)
    end = max((entry.end for entry in drawn), default=1.0)
    fig, ax = plt.subplots(figsize=(min(40.0, 2.0 + 0.35 * end), 1.2 + 0.5 * p))
    for entry in drawn:
        a = entry.action
        chunk = a.stage // p
        alpha = max(0.35, 1.0 - 0.25 * chunk)
        ax.barh(
            p - 1 - entry.rank,
            entry.end - entry.start,
            left=entry.start,
            height=0.8,
            color=KIND_COLORS[a.kind],
            alpha=alpha,
            edgecolor="white",
            linewidth=0.5,
        )
        label = "" if a.microbatch is None else str(a.microbatch)
        ax.text(
            (entry.start + entry.end) / 2, p - 1 - entry.rank, label, ha="center", va="center", fontsize=7
        )
    ax.set_yticks(range(p), [f"rank {r}" for r in reversed(range(p))])
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    kinds = sorted({entry.action.kind for entry in drawn}, key=list(ActionKind).index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS[k]) for k in kinds]
    ax.legend(
        handles,
        [k.name.lower() for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 - 0.1 / p),
        fontsize=7,
        ncols=len(kinds) or 1,
        frameon=False,
    )
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    try:
        return save_figure(fig, path, fmt)
    finally:
        plt.close(fig)


def show_schedule(
    name: str,
    p: int,
    m: int,
    v: int = 1,
    out: str | Path | None = None,
    *,
    zero3: bool = False,
    max_text: int | None = None,
    **opts: object,
) -> str:
    """Build, lower, validate and simulate schedule ``name`` with unit costs; return a header line plus the
    text timeline, and write a PNG/SVG picture to ``out`` if given. A timeline longer than ``max_text``
    characters (None: no limit) is replaced by a line saying its size."""
    schedule = build_schedule(name, p, m, v, **opts)
    placement = str(opts.get("placement", "loop"))
    lowered = lower(schedule, p, placement, zero3=zero3)
    result = simulate(lowered, p, CostTable())
    stages = len(infer_stage_ranks(schedule))
    extras = "".join(f" {key}={value}" for key, value in sorted(opts.items()))
    header = (
        f"{name} p={p} m={m} v={v}{extras}: {stages} stages, step time {result.step_time:g} "
        f"(t_f=1, t_b=2), bubble {result.bubble_fraction:.1%}, "
        f"peak in-flight activations per rank {[int(x) for x in result.peak_activations]}"
    )
    if out is not None:
        render_image(
            result.timeline, p, out, title=f"{header.split(':')[0]} — bubble {result.bubble_fraction:.1%}"
        )
    columns, size = text_size(result.timeline, p)
    if max_text is not None and size > max_text:
        return (
            f"{header}\n(the text timeline is not shown: {p} rank rows × {columns} time columns, "
            f"{size:,} characters, over {max_text:,}; `tessera schedule show --full-text` prints it)"
        )
    return header + "\n" + render_text(result.timeline, p)
