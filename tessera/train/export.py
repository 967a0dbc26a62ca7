"""``tessera export``: one copy of the plain model's weights (tessera's DCP format, or Hugging Face) from a run's
checkpoint, written one tensor at a time.

A layout-free checkpoint (format 2, docs/checkpoints.md) holds every tensor under its global name, whatever the
layout that wrote it: rank 0 alone reads each tensor from it (`checkpoint.read_tensor`, DCP assembling the
saved ranks' blocks) as the writer reaches it, so host memory is bounded by the largest tensor; other ranks, if
any, return at once. Nothing is built or drawn: the writer names the tensors by the plain model on the meta
device, after checking that the checkpoint holds each of them. `tessera generate RUN_DIR` reads such a
checkpoint directly, no export needed.

A rank-local checkpoint of format 1 (written before checkpoints became layout-free) with tensor, pipeline or
ZeRO shards loads only in the layout that wrote it. Export then runs in that layout, on the same number of ranks:

1. every rank rebuilds its part of the model exactly as the trainer does (sharded), but without drawing initial
   values (`InitSource`'s ``values=False``, as the dry run builds), checks with the others that the checkpoint
   holds every tensor they are about to load (else nothing is exported), and loads its slice;
2. rank 0 writes ``RUN_DIR/export/step_N`` with `save_model_weights` (atomic; one unsharded copy), pulling each
   tensor as the writer reaches it: it names the tensor to every rank, the pipeline position holding it gathers
   it (ZeRO-3: that stage's flat buffer; tensor parallelism: `full_parameter`, an all-gather within the tensor
   group, padding dropped) and its first rank sends it to rank 0, which writes it and drops it. Host memory on
   rank 0 is bounded by the largest tensor plus the writer's buffer, never the model.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from tessera.config import Config
from tessera.errors import CheckpointError
from tessera.layout import Axis
from tessera.model.build import meta_model
from tessera.train import checkpoint as ckpt
from tessera.train.run_files import EXPORT_DIR, run_config, source_checkpoint, wrong_world_size
from tessera.train.trainer import TrainingRun, init_distributed

__all__ = [
    "EXPORT_DIR",
    "export_weights",
    "run_config",
    "source_checkpoint",
    "wrong_world_size",
]


def export_weights(
    run_dir: Path, checkpoint: Path | None = None, fmt: str = "dcp", out: Path | None = None
) -> Path | None:
    """Write the plain model's weights of ``checkpoint`` (default: the newest) to RUN_DIR/export/step_N, or
    with ``fmt = "hf"`` as a Hugging Face folder ``out`` (default RUN_DIR/export/hf_step_N).

    Returns the export folder on rank 0, None elsewhere. A layout-free checkpoint is read by rank 0 alone, one
    tensor at a time (any number of ranks may call this; none waits for another). A format 1 checkpoint with
    shards is collective: call it on as many ranks as saved it (``tessera export`` starts them); the writer on
    rank 0 pulls one full tensor at a time from the ranks that hold it (`_PlainWeights`)."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    meta = source_checkpoint(run_dir, checkpoint)
    source = {"path": meta["path"], "layout": meta.get("layout"), "world_size": meta.get("world_size")}
    out_dir = run_dir / EXPORT_DIR
    sharded = ckpt.is_sharded(meta)
    rank, world = init_distributed()
    if not sharded:  # any rank can read every tensor: rank 0 does it alone, the others have nothing to do
        if rank != 0:
            return None
        model = meta_model(cfg.model)
        return _save(
            _reader(Path(meta["path"]), model, run_dir / "config.json"),
            model,
            cfg,
            fmt,
            out,
            out_dir,
            int(meta["step"]),
            source,
        )
    if world != meta.get("world_size"):
        raise CheckpointError(wrong_world_size(run_dir, meta, world))
    weights = _PlainWeights(_load_run(cfg, rank, world, Path(meta["path"]), run_dir / "config.json"))
    path = None
    if rank == 0:
        try:
            path = _save(
                weights.get, meta_model(cfg.model), cfg, fmt, out, out_dir, int(meta["step"]), source
            )
        finally:
            weights.stop()
    else:
        weights.serve()
    dist.barrier()  # no rank reports success before the export is on disk
    return path


def _save(
    get: Callable[[str], torch.Tensor],
    model: nn.Module,
    cfg: Config,
    fmt: str,
    out: Path | None,
    out_dir: Path,
    step: int,
    source: dict,
) -> Path:
    """Write the plain model's tensors, each fetched by ``get(name)`` when the writer reaches it, as a tessera
    weights checkpoint (``model``, possibly on meta, names and shapes them) or (fmt "hf") a Hugging Face folder."""
    if fmt == "hf":
        from tessera.hf.export import save_hf

        return save_hf(out or out_dir / f"hf_step_{step:08d}", cfg, get)
    return ckpt.save_model_weights(out_dir, step, model, source, _PullPlanner(get))


def _reader(path: Path, model: nn.Module, config_file: Path) -> Callable[[str], torch.Tensor]:
    """``get(name)``: the plain model's tensor ``name`` read from the checkpoint when the writer reaches it (one
    at a time: host memory is bounded by the largest tensor), after the checksums are verified once and the
    checkpoint is known to hold every tensor of ``model`` (the meta model the writer names them by): a missing
    one would otherwise stop the writer halfway, inside DCP, with its traceback."""
    ckpt_meta = ckpt.checkpoint_meta(path)
    if ckpt_meta.get("files"):
        problems = ckpt.verify_checkpoint(path, collective=False)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems[:5])}")
    _require_covered(path, model, None, config_file, collective=False)  # rank 0 alone
    metadata = ckpt.read_metadata_safely(path)
    return lambda name: ckpt.read_tensor(path, f"model.{name}", metadata)


def _load_run(cfg: Config, rank: int, world: int, path: Path, config_file: Path) -> TrainingRun:
    """This rank's part of the run, as the trainer builds it, with the checkpoint's slice loaded.

    Built without initial values (`InitSource`'s ``values=False``, as the dry run builds): the load overwrites
    every tensor, so drawing them would be wasted. That holds only if the checkpoint covers the whole state this
    rank loads, so `_require_covered` checks it first, on every rank, before anything is read."""
    run = TrainingRun(cfg, rank, world, with_data=False, values=False)
    _require_covered(path, run.stepper.state_module, run.stepper.shard_id, config_file)
    ckpt.load_checkpoint(
        path,
        run.stepper.state_module,
        run.optimizer,
        shard_id=run.stepper.shard_id,
        layout=run.layout.describe(),
    )
    return run


def _require_covered(
    path: Path, model: nn.Module, shard_id: str | None, config_file: Path, *, collective: bool = True
) -> None:
    """Refuse a checkpoint that lacks a parameter or persistent buffer of ``model`` (built without values, that
    tensor would be exported without ever having been loaded); ``collective``: on every rank alike."""
    ckpt.require_model_state(
        path, model, shard_id, str(config_file), "export", "nothing was exported", collective=collective
    )


class _PullPlanner(DefaultSavePlanner):
    """DCP's default planner over the plain model's (meta) state dict, whose data is pulled when DCP writes
    each item: the writer holds one tensor at a time (plus DCP's copy-ahead buffer on a GPU machine)."""

    def __init__(self, get: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._get = get

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self._get(write_item.index.fqn.removeprefix("model."))


class _PlainWeights:
    """Full plain-model tensors by name, one at a time, from a sharded run; collective.

    Global rank 0 calls `get(name)` in whatever order its writer needs and finally `stop()`; every other rank
    calls `serve()`, which follows rank 0's requests (each name is broadcast first). For each name the ranks of
    the pipeline position holding it gather it (ZeRO-3: that stage's flat buffer, kept until a name of another
    stage comes; tensor parallelism: `full_parameter`, within the tensor group), and the first of them (data
    replica 0, tensor rank 0) sends it to rank 0.
    """

    def __init__(self, run: TrainingRun) -> None:
        self.run, self.zero = run, run.stepper.zero
        named = [(n, p) for n, p in run.model.named_parameters(remove_duplicate=False) if p.numel() > 0]
        self.local = dict(named)
        first: dict[int, str] = {}
        self.canonical = {n: first.setdefault(id(p), n) for n, p in named}  # a tied alias -> its first name
        groups, layout = run.groups, run.layout
        me = (
            dist.get_rank(),
            groups.coord(Axis.PIPE) if groups else 0,
            groups.coord(Axis.DATA) if groups else 0,
            dist.get_rank() % layout.tensor_size,
            sorted(self.local),
        )
        table: list = [None] * dist.get_world_size()
        dist.all_gather_object(table, me)
        self.pipe = me[1]
        self.holder: dict[str, int] = {}  # name -> lowest pipeline position holding it
        self.sender: dict[int, int] = {}  # pipeline position -> the global rank that sends its tensors
        for rank, pipe, data, tensor, names in table:
            for name in names:
                self.holder[name] = min(self.holder.get(name, pipe), pipe)
            if data == 0 and tensor == 0:
                self.sender.setdefault(pipe, rank)
        self.shapes = {
            n: tuple(p.shape) for n, p in meta_model(run.cfg.model).named_parameters(remove_duplicate=False)
        }
        self._flat = None  # the ZeRO-3 flat buffer currently gathered here

    def get(self, name: str) -> torch.Tensor:
        """Rank 0: the full tensor ``name`` on the CPU."""
        dist.broadcast_object_list([name], src=0)
        return self._fetch(name)

    def stop(self) -> None:
        dist.broadcast_object_list([None], src=0)
        self._release()

    def serve(self) -> None:
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                self._release()
                return
            self._fetch(box[0])

    def _fetch(self, name: str) -> torch.Tensor | None:
        if name not in self.holder:
            raise CheckpointError(
                f"export found no weights for {name}; the checkpoint does not cover the model"
            )
        pipe = self.holder[name]
        sender = self.sender[pipe]
        full = self._unshard(name) if pipe == self.pipe else None
        if dist.get_rank() == sender == 0:
            return full.to("cpu", copy=True)
        if dist.get_rank() == sender:
            dist.send(full.contiguous(), dst=0)
        elif dist.get_rank() == 0:
            buf = torch.empty(self.shapes[name], dtype=torch.float32, device=self.run.device)
            dist.recv(buf, src=sender)
            return buf.cpu()
        return None

    def _unshard(self, name: str) -> torch.Tensor:
        """This pipeline position's full ``name``; collective over its data (ZeRO-3) and tensor groups."""
        p = self.local[name]
        if self.zero is not None:
            flat = next(f for f in self.zero.flats.values() if any(q is p for q in f.params))
            if flat is not self._flat:
                self._release()
                flat.launch_gather()  # ZeRO-3: this stage's parameters (a no-op for ZeRO-1/2)
                flat.wait_gather()
                self._flat = flat
        if hasattr(self.run.model, "full_parameter"):
            return self.run.model.full_parameter(self.canonical[name])
        return p.detach()

    def _release(self) -> None:
        if self._flat is not None:
            self._flat.release()
            self._flat = None
