"""``tessera export``: merge a run's sharded checkpoint into one copy of the plain model's weights.

A checkpoint written with tensor, pipeline or ZeRO parallelism holds each rank's slice only (docs/checkpoints.md),
so it loads only in the layout that wrote it. Export runs in that layout, on the same number of ranks:

1. every rank rebuilds its part of the model exactly as the trainer does and loads its slice;
2. ZeRO-3 gathers each stage's full parameters; tensor-parallel modules unshard them (`full_parameters`:
   all-gathers within the tensor group, padding dropped), keyed by the plain model's names;
3. the first rank of each pipeline stage's tensor group sends its stages' weights to global rank 0;
4. rank 0 copies them into a plain model, checks every parameter arrived, and writes
   ``RUN_DIR/export/step_N`` with `save_model_weights` (atomic; one unsharded copy).

`tessera generate RUN_DIR` then reads the export in one process. A data-parallel checkpoint needs no export
(every rank saved the whole model), but exporting it works too, in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import Config, from_dict
from tessera.errors import CheckpointError
from tessera.layout import Axis
from tessera.model.build import build_model
from tessera.train import checkpoint as ckpt
from tessera.train.trainer import TrainingRun, checkpoint_dir, init_distributed

__all__ = [
    "EXPORT_DIR",
    "export_weights",
    "run_config",
    "source_checkpoint",
    "wrong_world_size",
]

EXPORT_DIR = "export"
"""Exports go to RUN_DIR/export/step_N, next to RUN_DIR/checkpoints."""


def run_config(run_dir: Path) -> Config:
    """The config a run was trained with (RUN_DIR/config.json, written by `tessera train`)."""
    config_file = Path(run_dir) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{run_dir} has no config.json; pass the run directory that `tessera train` wrote"
        )
    return from_dict(json.loads(config_file.read_text()))


def source_checkpoint(run_dir: Path, checkpoint: Path | None = None) -> dict:
    """meta.json (+ "path") of ``checkpoint``, or of the run's newest complete training checkpoint."""
    ckpt_dir = checkpoint_dir(run_dir, run_config(run_dir))
    path = Path(checkpoint) if checkpoint is not None else ckpt.latest_checkpoint(ckpt_dir)
    if path is None:
        raise CheckpointError(
            f"no complete checkpoint in {ckpt_dir}; train with checkpoint.every > 0 or to the end"
        )
    return ckpt.checkpoint_meta(path)


def export_weights(
    run_dir: Path, checkpoint: Path | None = None, fmt: str = "dcp", out: Path | None = None
) -> Path | None:
    """Write the plain model's weights of ``checkpoint`` (default: the newest) to RUN_DIR/export/step_N, or
    with ``fmt = "hf"`` as a Hugging Face folder ``out`` (default RUN_DIR/export/hf_step_N).

    Collective when the checkpoint holds shards: call it on as many ranks as saved it (``tessera export``
    starts them). Returns the export folder on rank 0, None elsewhere.
    """
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    meta = source_checkpoint(run_dir, checkpoint)
    source = {"path": meta["path"], "layout": meta.get("layout"), "world_size": meta.get("world_size")}
    out_dir = run_dir / EXPORT_DIR
    if meta.get("weights_only"):
        raise CheckpointError(f"{meta['path']} is already an export; pass a training checkpoint")
    sharded = ckpt.is_sharded(meta)
    rank, world = init_distributed()
    if not sharded and rank == 0:  # every rank saved the whole model: one process suffices
        plain = build_model(cfg.model)
        ckpt.load_model_weights(Path(meta["path"]), plain)
        return _save(plain, cfg, fmt, out, out_dir, int(meta["step"]), source)
    if not sharded:
        return None
    if world != meta.get("world_size"):
        raise CheckpointError(wrong_world_size(run_dir, meta, world))
    weights = _gather_plain_weights(cfg, rank, world, Path(meta["path"]))
    path = None
    if rank == 0:
        plain = build_model(cfg.model)
        _fill(plain, weights)
        path = _save(plain, cfg, fmt, out, out_dir, int(meta["step"]), source)
    dist.barrier()  # no rank reports success before the export is on disk
    return path


def _save(plain: nn.Module, cfg: Config, fmt: str, out: Path | None, out_dir: Path, step: int, source: dict):
    """Write the filled plain model as a tessera weights checkpoint, or (fmt "hf") a Hugging Face folder."""
    if fmt == "hf":
        from tessera.hf.export import save_hf

        params = dict(plain.named_parameters())
        return save_hf(out or out_dir / f"hf_step_{step:08d}", cfg, params.__getitem__)
    return ckpt.save_model_weights(out_dir, step, plain, source)


def wrong_world_size(run_dir: Path, meta: dict, world: int) -> str:
    """The message for exporting a sharded checkpoint on a number of ranks other than the one that saved it."""
    return (
        f"checkpoint {meta['path']} was saved by {meta.get('world_size')} ranks ({meta.get('layout')}), but "
        f"export was asked to run on {world}; each rank loads its own slice\n    fix: run `tessera export "
        f"{run_dir}` without --nproc (it starts the ranks it needs), or with --nproc {meta.get('world_size')}"
    )


def _gather_plain_weights(cfg: Config, rank: int, world: int, path: Path) -> dict[str, torch.Tensor]:
    """This run's full weights by plain name, on global rank 0 (others: an empty dict); collective."""
    run = TrainingRun(cfg, rank, world, with_data=False)
    ckpt.load_checkpoint(
        path,
        run.stepper.state_module,
        run.optimizer,
        shard_id=run.stepper.shard_id,
        layout=run.layout.describe(),
    )
    local = _local_full_weights(run)
    if run.layout.pp == 1 or run.groups is None:
        return local if rank == 0 else {}
    # one sender per pipeline stage: the data-parallel replica 0, tensor rank 0 (tensor ranks are innermost)
    if run.groups.coord(Axis.DATA) != 0 or rank % run.layout.tensor_size != 0:
        return {}
    parts: list[dict[str, torch.Tensor]] | None = [{} for _ in range(run.layout.pp)] if rank == 0 else None
    dist.gather_object(local, parts, dst=0, group=run.groups.pp)
    merged: dict[str, torch.Tensor] = {}
    for part in parts or []:
        for name, t in part.items():
            merged.setdefault(name, t)  # a weight tied across stages: the lower stage's copy
    return merged


def _local_full_weights(run: TrainingRun) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights this rank's pipeline stages own, by plain name, on the CPU; collective within
    the tensor and (ZeRO-3) data-parallel groups."""
    zero = getattr(run.stepper, "zero", None)
    if zero is not None:
        zero.gather_all()  # ZeRO-3: materialise every local stage's parameters (a no-op for ZeRO-1/2)
    try:
        if hasattr(run.model, "full_parameters"):
            weights = run.model.full_parameters()
        else:
            weights = {n: p.detach() for n, p in run.model.named_parameters() if p.numel() > 0}
        return {n: t.to("cpu", copy=True) for n, t in weights.items()}  # copies: ZeRO-3 frees the buffers
    finally:
        if zero is not None:
            zero.free_all()


def _fill(plain: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``plain`` by name; every parameter must arrive with its plain shape."""
    params = dict(plain.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise CheckpointError(
            f"export found no weights for {missing}; the checkpoint does not cover the model"
        )
    with torch.no_grad():
        for name, p in params.items():
            if weights[name].shape != p.shape:
                raise CheckpointError(
                    f"export: {name} has shape {tuple(weights[name].shape)}, the model expects {tuple(p.shape)}"
                )
            p.copy_(weights[name])
