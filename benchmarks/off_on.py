"""What the flag-off-vs-on benchmarks share (tp_overlap.py, param_gather_overlap.py): the machine line, a median
with its range, the on/off ratio, the bar chart and writing the results. Each benchmark keeps what it measures
and its reading."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("off", "on")
"""The two runs of the flag, in the order they are reported and drawn."""


def machine_line(load: tuple[float, float], detail: str = "") -> str:
    """The CPU gloo setting and the 1-minute load at the start and end (`detail` goes before the load)."""
    return (
        f"Machine: {os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, gloo, fp32, one "
        f"thread per rank{detail}; shared with other jobs (1-minute load {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end)."
    )


def median_range_ms(xs: list[float], decimals: int) -> str:
    """Seconds as "median ms (min–max)"."""
    f = f".{decimals}f"
    return f"{statistics.median(xs) * 1e3:{f}} ms ({min(xs) * 1e3:{f}}–{max(xs) * 1e3:{f}})"


def on_off_ratio(times: dict[str, list[float]]) -> float:
    """Median step time with the flag on over off."""
    return statistics.median(times["on"]) / statistics.median(times["off"])


def bar_chart(
    rows: list[dict[str, Any]],
    path: Path,
    *,
    flag: str,
    labels: list[str],
    ylabel: str,
    title: str,
    ranges: bool = False,
) -> None:
    """Median step time per row, off and on side by side; `ranges` adds min–max error bars (the value labels then
    move right, clear of the caps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.38
    for k, (v, color) in enumerate(zip(VARIANTS, ("tab:gray", "tab:blue"), strict=True)):
        vals = [statistics.median(r["times"][v]) * 1e3 for r in rows]
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        bars: dict[str, Any] = {"color": color, "label": f"{flag} {v}"}
        label_offset: dict[str, Any] = {}
        if ranges:
            lo = [val - min(r["times"][v]) * 1e3 for val, r in zip(vals, rows, strict=True)]
            hi = [max(r["times"][v]) * 1e3 - val for val, r in zip(vals, rows, strict=True)]
            bars |= {"yerr": [lo, hi], "capsize": 3}
            label_offset = {"xytext": (8, 2), "textcoords": "offset points"}
        ax.bar(xs, vals, width, **bars)
        for x, val in zip(xs, vals, strict=True):
            ax.annotate(f"{val:.0f}", (x, val), ha="center", va="bottom", fontsize=8, **label_offset)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(out: Path, name: str, text: str, draw: Callable[[Path], None]) -> None:
    """`name`.md (the report) and `name`.png (`draw`) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    draw(out / f"{name}.png")
    print(f"wrote {out / f'{name}.md'} and {out / f'{name}.png'}")


def publish(
    name: str,
    rows: list[dict[str, Any]],
    args: Any,
    argv: Sequence[str] | None,
    report: Callable[[list[dict[str, Any]], Any, str], str],
    plot: Callable[[list[dict[str, Any]], Path], None],
) -> None:
    """Print `report` (rows, args, the command that ran, from ``argv`` or the process's) and, unless
    ``args.quick``, write it and `plot`'s picture as `name`.md / .png under ``args.out``."""
    command = f"python benchmarks/{name}.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = report(rows, args, command.strip())
    print(text)
    if not args.quick:
        write_results(args.out, name, text, lambda path: plot(rows, path))
