"""Schedule pictures: a text timeline (rank rows × time columns) and PNG/SVG images via matplotlib (Agg).

``show_schedule`` is the one-call path used by ``tessera schedule show``: build → lower → validate → simulate
with unit costs (t_f = 1, t_b = 2, free communication) → text, and optionally a picture.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tessera.figures import save_figure
from tessera.pipeline.ir import ActionKind, ScheduleError, infer_stage_ranks
from tessera.pipeline.passes import lower
from tessera.pipeline.schedules import build_schedule
from tessera.sim.simulator import CostTable, TimelineEntry, simulate

__all__ = [
    "IMAGE_BAR_LIMIT",
    "IMAGE_HEIGHT_IN",
    "KIND_COLORS",
    "TEXT_LIMIT",
    "image_note",
    "image_rows",
    "render_image",
    "render_text",
    "show_schedule",
    "text_size",
]

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


IMAGE_HEIGHT_IN = 40.0
"""Tallest picture `render_image` draws, in inches (its width is capped at the same): a rank row is 0.5 inch up
to 77 ranks and thinner beyond, so that p = 2000 is a 4000 × 4000 pixel picture instead of one 100,000 pixels
tall, which matplotlib refuses (after minutes of drawing)."""

IMAGE_BAR_LIMIT = 200_000
"""Most bars `render_image` draws (about 2 s of matplotlib at 100 dpi); a schedule with more, which no picture
at this size can show one by one anyway, is refused at once with the count (`ScheduleError`). The text
timeline's limit is `TEXT_LIMIT`."""

_ROW_IN = 0.5  # a rank row's height, in inches, while the picture is under IMAGE_HEIGHT_IN
_MARGIN_IN = 1.2  # title, time axis and legend
_LABEL_ROW_IN = 0.25  # the thinnest row a micro-batch number (7 pt) is written in
_LEGEND_BELOW_IN = 0.55  # from the plot's bottom to the legend, below the time axis
_DIGIT_IN = 0.07  # width of a 7 pt digit
_MAX_LABELS = 2000  # micro-batch numbers written at most (about 4 s)
_MAX_TICKS = 64  # rank names on the vertical axis at most; beyond, every k-th rank is named


def image_rows(p: int) -> float:
    """Height of a rank row in inches in a picture of ``p`` ranks: 0.5 while that fits `IMAGE_HEIGHT_IN`."""
    return min(_ROW_IN, (IMAGE_HEIGHT_IN - _MARGIN_IN) / max(p, 1))


def image_note(p: int) -> str | None:
    """How a picture of ``p`` ranks was fitted to `IMAGE_HEIGHT_IN`, in words; None when its rows are whole."""
    row = image_rows(p)
    return None if row >= _ROW_IN else f"{p} rank rows of {row:.3g} in, to fit {IMAGE_HEIGHT_IN:g} in"


def _labels(drawn: list[TimelineEntry], row: float, inch_per_time: float) -> list[TimelineEntry] | None:
    """The bars whose micro-batch number fits inside them (7 pt digits, about 0.07 in wide each), or None when
    their numbers are left out: rows thinner than a digit's height, or more than `_MAX_LABELS` numbers (a text
    costs about 2 ms to draw; so many are unreadable at this size anyway)."""
    if row < _LABEL_ROW_IN:
        return None
    fits = [
        e
        for e in drawn
        if e.action.microbatch is not None
        and (e.end - e.start) * inch_per_time >= _DIGIT_IN * (len(str(e.action.microbatch)) + 1)
    ]
    return fits if len(fits) <= _MAX_LABELS else None


def render_image(timeline: list[TimelineEntry], p: int, path: str | Path, title: str = "") -> Path:
    """Draw a Gantt chart (ranks as rows) to ``path``; the format (png or svg) follows the extension.

    Colour by kind (lighter for later local chunks), micro-batch number inside each bar it fits in. At most
    `IMAGE_HEIGHT_IN` inches high: beyond 77 ranks the rows get thinner (`image_rows`); bars are drawn as one
    collection per colour, so a large pipeline takes seconds. A timeline of more than `IMAGE_BAR_LIMIT` bars is
    refused before any drawing."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise ScheduleError(f"picture path must end in .png or .svg, got {path.name!r}")
    drawn = _drawn(timeline)
    if len(drawn) > IMAGE_BAR_LIMIT:
        raise ScheduleError(
            f"the picture would hold {len(drawn):,} bars ({p} ranks), over the {IMAGE_BAR_LIMIT:,} a picture "
            "is drawn with; fix: leave out --out (the text header has the step time and bubble), or draw a "
            "smaller --pp or --microbatches, whose picture has the same shape"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max((entry.end for entry in drawn), default=1.0)
    width, row = min(IMAGE_HEIGHT_IN, 2.0 + 0.35 * end), image_rows(p)
    fig, ax = plt.subplots(figsize=(width, _MARGIN_IN + row * p))
    _draw_bars(ax, drawn, p, thin=row < _ROW_IN)
    labels = _labels(drawn, row, (width - 2.0) / end)  # the plot is about 2 in narrower than the figure
    for entry in labels or ():
        y, label = p - 1 - entry.rank, str(entry.action.microbatch)
        ax.text((entry.start + entry.end) / 2, y, label, ha="center", va="center", fontsize=7)
    named = range(0, p, max(1, -(-p // _MAX_TICKS)))
    ax.set_yticks([p - 1 - r for r in named], [f"rank {r}" for r in named])
    ax.set_ylim(-0.5, p - 0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    kinds = sorted({entry.action.kind for entry in drawn}, key=list(ActionKind).index)
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLORS[k]) for k in kinds]
    ax.legend(
        handles,
        [k.name.lower() for k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -_LEGEND_BELOW_IN / (row * p)),  # the same distance below at any p
        fontsize=7,
        ncols=len(kinds) or 1,
        frameon=False,
    )
    notes = [image_note(p), "micro-batch numbers left out" if labels is None and drawn else None]
    note = "; ".join(n for n in notes if n)
    ax.set_title("\n".join(t for t in (title, f"({note})" if note else "") if t), fontsize=9)
    fig.tight_layout()
    try:
        return save_figure(fig, path, fmt)
    finally:
        plt.close(fig)


def _draw_bars(ax: Any, drawn: list[TimelineEntry], p: int, thin: bool) -> None:
    """One bar per entry (rank r's row at height p - 1 - r, 0.8 high), gathered into one collection per
    (kind, chunk) colour: a matplotlib artist per bar (`barh`) made p = 200 take 30 s. Thin rows get no white
    edge, which would cover them."""
    from matplotlib.collections import PolyCollection

    groups: dict[tuple[ActionKind, float], list[list[tuple[float, float]]]] = {}
    for entry in drawn:
        a = entry.action
        key = (a.kind, max(0.35, 1.0 - 0.25 * (a.stage // p)))  # lighter for later local chunks
        y0, y1, x0, x1 = p - 1.4 - entry.rank, p - 0.6 - entry.rank, entry.start, entry.end
        groups.setdefault(key, []).append([(x0, y0), (x0, y1), (x1, y1), (x1, y0)])
    for (kind, alpha), boxes in groups.items():
        bars = PolyCollection(
            boxes,
            facecolors=KIND_COLORS[kind],
            alpha=alpha,
            edgecolors="white",
            linewidths=0.0 if thin else 0.5,
        )
        ax.add_collection(bars)


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
