"""Training curves from a run's metrics.jsonl: loss (and validation loss) and throughput against step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.errors import DataError
from tessera.figures import save_figure
from tessera.train.run_files import METRICS_FILE, read_metrics

__all__ = ["plot_run"]

FORMATS = ("png", "svg", "pdf")
"""Picture formats ``--out``'s suffix may name."""


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Draw loss (+ ``val_loss`` when logged) and tokens/s against step as a two-panel picture; return its path.

    Writes ``run_dir/curves.png`` unless ``out`` is given (its suffix names the format: `FORMATS`). Uses
    matplotlib's Agg canvas directly, so it works without a display and never touches pyplot's global state. The
    metrics are read and checked before matplotlib is imported (a second or so), so a wrong ``run_dir`` is named
    at once.
    """
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "curves.png"
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise DataError(
            f"--out {out} does not end in {', '.join('.' + f for f in FORMATS)}; name the picture file with "
            "one of them (the suffix chooses the format)"
        )
    records = read_metrics(run_dir, skip_bad=True)  # plot what survives of a crashed and resumed run
    loss = _series(records, "loss")
    if not loss:
        raise DataError(
            f"{run_dir / METRICS_FILE} has no loss records\n    fix: plot a run that trained at least one "
            "logged step (log.every <= train.steps)"
        )
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_tps = fig.subplots(1, 2)
    ax_loss.plot(*zip(*loss, strict=True), label="train")
    val = _series(records, "val_loss")
    if val:
        ax_loss.plot(*zip(*val, strict=True), marker="o", label="validation")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    tps = _series(records, "tokens_per_s")
    if tps:
        ax_tps.plot(*zip(*tps, strict=True), color="tab:green")
    else:
        ax_tps.text(0.5, 0.5, "no tokens_per_s logged", ha="center", va="center", transform=ax_tps.transAxes)
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.suptitle(run_dir.name)
    return save_figure(fig, out, fmt, dpi=120)


def _series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (r["step"], r[key])
        for r in records
        if isinstance(r, dict)
        and isinstance(r.get(key), int | float)
        and isinstance(r.get("step"), int | float)
    ]
