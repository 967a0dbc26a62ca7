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

__all__ = ["KIND_COLORS", "render_image", "render_text", "show_schedule"]

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


def _drawn(timeline: list[TimelineEntry]) -> list[TimelineEntry]:
    """Entries that take time (zero-cost communication and bookkeeping actions are not drawn)."""
    return [entry for entry in timeline if entry.end - entry.start > _EPS]


def render_text(timeline: list[TimelineEntry], p: int) -> str:
    """Rank rows × time columns; one column per smallest action duration. An action shows its label in its
    first column and ``-`` in the columns it continues over; ``.`` is idle time."""
    drawn = _drawn(timeline)
    if not drawn:
        return "\n".join(f"r{r:<3}" for r in range(p))
    unit = min(entry.end - entry.start for entry in drawn)
    columns = math.ceil(max(entry.end for entry in drawn) / unit - _EPS)
    width = max(len(entry.action.short()) for entry in drawn)
    rows = [["." * 1] * columns for _ in range(p)]
    for entry in drawn:
        first = round(entry.start / unit)
        last = max(first + 1, round(entry.end / unit))
        rows[entry.rank][first] = entry.action.short()
        for column in range(first + 1, min(last, columns)):
            rows[entry.rank][column] = "-" * width
    return "\n".join(f"r{r:<3} " + " ".join(f"{cell:<{width}}" for cell in row) for r, row in enumerate(rows))


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
    **opts: object,
) -> str:
    """Build, lower, validate and simulate schedule ``name`` with unit costs; return a header line plus the
    text timeline, and write a PNG/SVG picture to ``out`` if given."""
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
    return header + "\n" + render_text(result.timeline, p)
