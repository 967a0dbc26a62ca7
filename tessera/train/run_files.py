"""What a run folder holds, found and read without torch: the config it was trained with (config.json), its
training checkpoints and exports, and its metrics (metrics.jsonl).

`tessera generate`, `export` and `plot` look their run folder up here before they import torch (seconds), so a
wrong or incomplete folder is named in milliseconds; the library functions behind them (tessera/train/generate.py,
export.py, plot.py) call the same lookups, so both paths raise the same message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessera.config import Config, from_dict
from tessera.errors import CheckpointError, DataError
from tessera.train import checkpoint_files as ckpt

__all__ = [
    "EXPORT_DIR",
    "METRICS_FILE",
    "checkpoint_dir",
    "newest_weights",
    "previous_checkpoint_dir",
    "read_metrics",
    "read_records",
    "run_config",
    "source_checkpoint",
    "wrong_world_size",
]

EXPORT_DIR = "export"
"""Exports go to RUN_DIR/export/step_N, next to RUN_DIR/checkpoints."""
METRICS_FILE = "metrics.jsonl"


def run_config(run_dir: Path) -> Config:
    """The config a run was trained with (RUN_DIR/config.json, written by `tessera train`)."""
    config_file = Path(run_dir) / "config.json"
    if not Path(run_dir).is_dir():
        raise CheckpointError(
            f"run directory {run_dir} does not exist; pass the run directory that `tessera train` wrote "
            "(its log.run_dir)"
        )
    if not config_file.is_file():
        raise CheckpointError(
            f"{run_dir} has no config.json; pass the run directory that `tessera train` wrote"
        )
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError):  # unreadable, torn or not UTF-8 (UnicodeDecodeError is a ValueError)
        raw = None
    if not isinstance(raw, dict):
        raise CheckpointError(
            f"{config_file} is not a JSON object of config sections\n    fix: pass the run directory that "
            "`tessera train` wrote (it writes config.json at each start)"
        )
    return from_dict(raw)


def checkpoint_dir(run_dir: Path, cfg: Config) -> Path:
    """Where a run's training checkpoints go: ``checkpoint.dir``, or RUN_DIR/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def previous_checkpoint_dir(run_dir: Path) -> Path | None:
    """Where the last run in ``run_dir`` saved its checkpoints (its config.json's checkpoint.dir), or None when
    there is no readable config.json. Read as plain JSON: the config of an older version need not load."""
    try:
        raw = json.loads((Path(run_dir) / "config.json").read_text())
        folder = raw.get("checkpoint", {}).get("dir")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(folder) if isinstance(folder, str) and folder else Path(run_dir) / "checkpoints"


def source_checkpoint(run_dir: Path, checkpoint: Path | None = None) -> dict[str, Any]:
    """meta.json (+ "path") of the training checkpoint ``checkpoint``, or of the run's newest complete one: what
    `tessera export` reads."""
    ckpt_dir = checkpoint_dir(run_dir, run_config(run_dir))
    path = Path(checkpoint) if checkpoint is not None else ckpt.latest_checkpoint(ckpt_dir)
    if path is None:
        raise CheckpointError(
            f"no complete checkpoint in {ckpt_dir}; train with checkpoint.every > 0 or to the end"
        )
    meta = ckpt.checkpoint_meta(path)
    if meta.get("weights_only"):
        raise CheckpointError(f"{meta['path']} is already an export; pass a training checkpoint")
    return meta


def wrong_world_size(run_dir: Path, meta: dict[str, Any], world: int) -> str:
    """The message for exporting a sharded checkpoint on a number of ranks other than the one that saved it."""
    return (
        f"checkpoint {meta['path']} was saved by {meta.get('world_size')} ranks ({meta.get('layout')}), but "
        f"export was asked to run on {world}; each rank loads its own slice\n    fix: run `tessera export "
        f"{run_dir}` without --nproc (it starts the ranks it needs), or with --nproc {meta.get('world_size')}"
    )


def newest_weights(run_dir: Path) -> Path:
    """The run's newest checkpoint that one process can load: its newest training checkpoint (any layout's, once
    layout-free; of the older rank-local format only a replicated one), else the export of that step."""
    run_dir = Path(run_dir)
    ckpt_dir = checkpoint_dir(run_dir, run_config(run_dir))
    trained = ckpt.latest_checkpoint(ckpt_dir)
    exported = ckpt.latest_checkpoint(run_dir / EXPORT_DIR) if (run_dir / EXPORT_DIR).is_dir() else None
    if trained is None and exported is None:
        raise CheckpointError(
            f"no complete checkpoint in {ckpt_dir}; train with checkpoint.every > 0 or to the end"
        )
    if trained is None:
        return exported
    meta = ckpt.checkpoint_meta(trained)
    if not ckpt.is_sharded(meta):
        return trained
    export_step = ckpt.checkpoint_meta(exported)["step"] if exported is not None else None
    if export_step == meta["step"]:
        return exported
    older = f" (the newest export is of step {export_step})" if export_step is not None else ""
    raise CheckpointError(
        f"the newest checkpoint, {trained}, holds the weights split over {meta.get('world_size')} ranks "
        f"({meta.get('layout')}){older}\n    fix: run `tessera export {run_dir}` first; it merges them into "
        f"{run_dir / EXPORT_DIR}"
    )


def read_metrics(run_dir: Path, *, skip_bad: bool = False) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, one per step in step order: the records of one step are merged,
    later values winning (a step's validation loss may come in its own record, and a file written before
    resumes truncated it can hold a step twice). A torn last line (a crash mid-write) is skipped, and so is any
    line that is not JSON when ``skip_bad`` (a torn record a resumed run wrote after, in older files)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise DataError(
            f"{path} does not exist\n    fix: pass the run directory of a run that logged metrics"
        )
    by_step: dict[int, dict[str, Any]] = {}
    for record in read_records(path, skip_bad=skip_bad):
        if isinstance(record, dict) and "step" in record:
            by_step.setdefault(record["step"], {}).update(record)
    return [by_step[k] for k in sorted(by_step)]


def read_records(path: Path, *, skip_bad: bool = False) -> list[dict[str, Any]]:
    """Every record of a metrics file as written (`read_metrics` merges them by step); see there for
    ``skip_bad``. A record is a JSON object with an integer ``step``, as `MetricsLogger.log` writes it; any
    other line is a bad one (steps of other types could be neither merged nor ordered)."""
    lines = path.read_text(errors="replace").splitlines()  # a torn write may split a character
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            out.append(record)
        elif i < len(lines) - 1 and not skip_bad:
            raise DataError(
                f"{path}:{i + 1} is not a JSON object with an integer step: {line[:80]!r}\n    fix: delete "
                "that line (tessera writes one record per line)"
            )
    return out
