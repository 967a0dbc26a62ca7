"""How one rank turns a step's micro-batches into gradients, in two shapes the trainer picks between.

- ``DirectStepper``: no pipeline and no ZeRO. The (possibly tensor-parallel) module runs the micro-batches one
  after another and ``GradSync`` all-reduces data-parallel gradients in buckets overlapped with the last backward.
- ``ScheduledStepper``: a pipeline, ZeRO (with or without a pipeline), or layered accumulation. The schedule IR
  runtime executes the step the execution plan resolved (`tessera.execution`: on one pipeline rank, breadth-first
  with one stage per block).

Which one runs, and with which schedule and stages, is the plan's decision (``plan.runner``); nothing here
re-derives it.

Both are a `Stepper`: the one surface the trainer, the health checks, checkpoints, export and the dry run use.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tessera import comm
from tessera.config import Config, TrainConfig
from tessera.execution import SCHEDULE_RUNTIME, ExecutionPlan, resolve
from tessera.groups import Groups
from tessera.layout import Axis, Layout
from tessera.model.documents import Batch, batch_parts
from tessera.model.materialize import ShardSpec, release_parameters
from tessera.parallel.apply import norm_weights, tensor_groups
from tessera.parallel.checkpointing import apply_checkpointing
from tessera.parallel.clipping import clip_grad_norm
from tessera.parallel.data import GradSync
from tessera.parallel.precision import DynamicLossScaler, autocast, reduce_dtype
from tessera.parallel.saved_activations import SavedActivationCounter
from tessera.parallel.zero import ShardedAdamW
from tessera.pipeline.runtime import build_pipeline
from tessera.pipeline.stage_comm import DataParallelStageComm, ZeroStageComm
from tessera.train.checkpoint.state import RankState, specs_by_param, whole_regions, zero_regions

__all__ = ["DirectStepper", "ScheduledStepper", "Stepper", "make_optimizer", "make_stepper"]


class Stepper(Protocol):
    """How the trainer runs one rank's part of a step, whichever runner the execution plan chose."""

    optimizer: torch.optim.Optimizer
    state_module: nn.Module
    """This rank's tensors as a module (the model, its stages, or its ZeRO shards): what the health check reads
    and what a rank-local (format 1) checkpoint held; checkpoints now save `rank_state`."""
    shard_id: str | None
    """Which rank-local slice ``state_module`` is (format 1 checkpoints); None when every rank holds all of it."""
    scaler: DynamicLossScaler | None
    """fp16's dynamic loss scaler (saved with checkpoints, logged as loss_scale); None for other dtypes."""
    zero: ZeroStageComm | None
    """The ZeRO buffers when parallel.zero > 0 (export and the dry run read their shards); else None."""
    skip_step: bool
    """The last ``run`` overflowed in fp16: skip the update on every rank."""
    saved_bytes: int
    """Most activation bytes this rank held for backward during the last ``run``."""

    def run(self, batches: list[Batch], loss_weight: float | None = None) -> float:
        """Accumulate the step's gradients (synchronised on return); this replica's mean loss. With
        ``loss_weight`` (a loss mask: the data-parallel size / the global batch's target count) each
        micro-batch's loss is its sum over the targets the mask keeps times ``loss_weight`` instead of its mean
        / the number of micro-batches, and the return is their sum."""
        ...

    def evaluate(self, batches: list[Batch], loss_weight: float | None = None) -> float:
        """This replica's mean loss, forward only (validation); ``loss_weight`` as in ``run``."""
        ...

    def clip(self, max_norm: float) -> float:
        """Clip the gradients to ``max_norm`` by their global norm; returns the norm before clipping."""
        ...

    def rank_state(self, model: nn.Module, specs: dict[str, ShardSpec]) -> RankState:
        """What a checkpoint saves and loads on this rank: its blocks of the global tensors (layout-free)."""
        ...

    def close(self) -> None:
        """Release what the stepper registered (hooks)."""
        ...


def make_optimizer(params: list[nn.Parameter], tr: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm weights, biases and 1-D tensors are not decayed)."""
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tr.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tr.lr, betas=(tr.beta1, tr.beta2), eps=tr.eps, foreach=False)


def _shard_id(layout: Layout, groups: Groups | None, zero: int) -> str | None:
    """Names this rank's slice of model-parallel (or ZeRO-sharded) state; None when every rank holds all of it."""
    if groups is None:
        return None
    parts = []
    if layout.pp > 1:
        parts.append(f"pp{groups.coord(Axis.PIPE)}")
    if layout.tensor_size > 1:
        parts.append(f"tp{groups.rank % layout.tensor_size}")
    if zero > 0 and layout.dp > 1:
        parts.append(f"dp{groups.coord(Axis.DATA)}")
    if zero > 0 and layout.cp > 1:  # ZeRO shards over data × context
        parts.append(f"cp{groups.coord(Axis.CONTEXT)}")
    return ".".join(parts) or None


def _replica_group(plan: ExecutionPlan, groups: Groups | None) -> torch.distributed.ProcessGroup | None:
    """Hybrid sharding's replica group, checked against the plan: groups built without the plan's shard size
    would shard over the whole data group and silently skip the replicas' all-reduce."""
    if plan.zero_replicas == 1 or groups is None:
        return None
    if groups.replica is None or comm.group_size(groups.zero_shard) != plan.zero_shard:
        raise ValueError(
            f"the plan shards ZeRO over {plan.zero_shard} of {plan.batch_ranks} data-parallel ranks, but the groups were "
            "built without that shard size: build_groups(layout, device, zero_shard=plan.zero_shard)"
        )
    return groups.replica


class DirectStepper:
    """Micro-batches one after another through the module; data-parallel sync overlapped with the last backward."""

    def __init__(self, module: nn.Module, cfg: Config, layout: Layout, groups: Groups | None) -> None:
        apply_checkpointing(module, cfg.parallel.checkpointing)
        self.module = self.state_module = module
        self.dtype = cfg.train.dtype
        # fp16 needs loss scaling; every group that holds gradients votes on an overflow
        self.scaler = DynamicLossScaler(cfg.train.fp16_init_scale) if self.dtype == "fp16" else None
        self.zero = None  # no ZeRO on the direct loop (the plan routes ZeRO to the schedule runtime)
        self.norm_groups, self.weights = tensor_groups(layout, groups), norm_weights(module)
        self.overflow_groups = self.norm_groups + ([groups.batch] if groups is not None else [])
        self.skip_step = False
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, cfg.train)
        dp_group = groups.batch if groups is not None else None  # data × context: who averages gradients
        self.sync = GradSync(self.params, dp_group, int(cfg.train.bucket_mb * 2**20))
        self.shard_id = _shard_id(layout, groups, 0)
        self.saved_bytes = 0

    def run(self, batches: list[Batch], loss_weight: float | None = None) -> float:
        """Accumulate every micro-batch's gradient; returns this replica's mean loss (`Stepper.run`)."""
        losses, m = [], len(batches)
        self.saved_bytes = 0  # the largest micro-batch's bytes saved for backward on this rank
        for i, batch in enumerate(batches):
            if i == m - 1:
                self.sync.arm()
            with autocast(self.dtype, batch[0].device), SavedActivationCounter(self.module) as saved:
                loss = self._weighted_loss(batch, m, loss_weight)
            self.saved_bytes = max(self.saved_bytes, saved.bytes)
            (self.scaler.scale_loss(loss) if self.scaler else loss).backward()
            losses.append(loss.detach().float())
        self.sync.finish()
        if self.scaler is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            ok = self.scaler.unscale_and_check(grads, self.overflow_groups)
            self.scaler.update(ok)
            self.skip_step = not ok  # an overflow skips the update on every rank; the scale backs off
        return float(torch.stack(losses).sum())  # one host sync per step, not one per micro-batch

    @torch.no_grad()
    def evaluate(self, batches: list[Batch], loss_weight: float | None = None) -> float:
        """This replica's mean loss over the micro-batches, forward only (validation; `Stepper.evaluate`)."""
        losses = []
        for batch in batches:
            with autocast(self.dtype, batch[0].device):
                if loss_weight is None:
                    losses.append(self._loss(batch).detach().float() / len(batches))
                else:
                    losses.append(self._weighted_loss(batch, len(batches), loss_weight).detach().float())
        return float(torch.stack(losses).sum())

    def _weighted_loss(self, batch: Batch, m: int, loss_weight: float | None) -> torch.Tensor:
        """One micro-batch's share of the step's loss: its mean / m, or with a loss mask its sum over the kept
        targets times ``loss_weight`` (the trainer's count of the global batch's targets is in it)."""
        if loss_weight is None:
            return self._loss(batch) / m
        return self._loss(batch, "sum") * loss_weight

    def _loss(self, batch: Batch, reduction: str = "mean") -> torch.Tensor:
        """The module's loss on one micro-batch (`tessera.model.targets`'s ``reduction``), given its document
        positions when it has them."""
        x, y, positions = batch_parts(batch)
        side = {} if reduction == "mean" else {"reduction": reduction}
        if positions is not None:
            side["positions"] = positions
        return self.module(x, y, **side)

    def clip(self, max_norm: float) -> float:
        """Clip to max_norm by the global norm; tensor-parallel modules count every shard once."""
        return clip_grad_norm(self.params, max_norm, weights=self.weights, groups=self.norm_groups)

    def rank_state(self, model: nn.Module, specs: dict[str, ShardSpec]) -> RankState:
        """What this rank checkpoints: its whole (possibly tensor-parallel) parameters under their global names
        (``specs``: `shard_specs` of ``model``, this rank's module)."""
        return RankState(
            whole_regions(self.params, self.optimizer), specs_by_param(model, specs), self.optimizer
        )

    def close(self) -> None:
        self.sync.remove()


class ScheduledStepper:
    """The schedule IR runtime runs the step: pipeline schedules, layered accumulation and ZeRO (also without a
    pipeline: one rank's stages, one per block, breadth-first)."""

    def __init__(
        self,
        module: nn.Module,
        cfg: Config,
        layout: Layout,
        groups: Groups | None,
        plan: ExecutionPlan | None = None,
    ) -> None:
        plan = plan or resolve(cfg, layout.world_size, training=False)  # a stepper reads no data
        self.dtype = cfg.train.dtype
        # data × context: the ranks that average gradients (`Groups.batch`)
        dp_group = groups.batch if groups is not None and layout.batch_ranks > 1 else None
        self.zero: ZeroStageComm | None = None

        def stage_comm(stages: dict) -> DataParallelStageComm | ZeroStageComm:
            if plan.zero == 0:
                return DataParallelStageComm(stages, dp_group)
            reduce = reduce_dtype(plan.grad_reduce_dtype)
            # The shard group (the data-parallel group without hybrid sharding) itself, even of size 1: ZeRO
            # treats a None group as the whole world, which with pipeline ranks reduce-scattered different
            # stages' gradients together.
            group = groups.zero_shard if groups is not None else None
            self.zero = ZeroStageComm(
                stages,
                group,
                plan.zero,
                plan.accumulation,
                reduce_dtype=reduce,
                overlap_param_gather=plan.overlap_param_gather,
                replica_group=_replica_group(plan, groups),
            )
            return self.zero

        self.engine = build_pipeline(module, layout, groups, cfg, plan=plan, stage_comm=stage_comm)
        self.norm_groups = tensor_groups(layout, groups) + (
            [groups.pp] if groups is not None and layout.pp > 1 else []
        )
        self.weights = norm_weights(module)
        for pid in self.engine.remote_tied_copies():
            self.weights[pid] = 0.0  # the other pipeline rank's copy is the one counted
        if self.zero is not None:
            self.optimizer = ShardedAdamW(
                self.zero,
                lr=cfg.train.lr,
                betas=(cfg.train.beta1, cfg.train.beta2),
                eps=cfg.train.eps,
                weight_decay=cfg.train.weight_decay,
                norm_groups=self.norm_groups,
                norm_weights=self.weights,
            )
            self.state_module: nn.Module = self.optimizer.module
        else:
            self.optimizer = make_optimizer(self.engine.parameters(), cfg.train)
            # one pipeline rank holds every stage: save the model under its plain names (generate, export)
            stages = nn.ModuleDict({str(s): st for s, st in self.engine.stages.items()})
            self.state_module = module if layout.pp == 1 else stages
        self.shard_id = _shard_id(layout, groups, plan.zero)
        self._release_remote_stages(module)
        self.module = module
        self.saved_bytes = 0
        self.scaler = DynamicLossScaler(cfg.train.fp16_init_scale) if self.dtype == "fp16" else None
        self.overflow_groups = [g for g in [dp_group, *self.norm_groups] if g is not None]
        self.skip_step = False

    def run(self, batches: list[Batch], loss_weight: float | None = None) -> float:
        """Execute this rank's lowered schedule for one step; returns this replica's mean loss (`Stepper.run`)."""
        if self.scaler is not None:
            self.engine.loss_scale = self.scaler.scale
        with autocast(self.dtype, batches[0][0].device):
            loss = self.engine.step(batches, loss_weight)
        self.saved_bytes = self.engine.peak_saved_bytes
        if self.scaler is not None:
            ok = self.scaler.unscale_and_check(self._grads(), self.overflow_groups)
            self.scaler.update(ok)
            self.skip_step = not ok  # an overflow anywhere skips the update on every rank
        return float(loss)

    def evaluate(self, batches: list[Batch], loss_weight: float | None = None) -> float:
        """This replica's mean loss over the micro-batches from a forward-only pass of the schedule
        (`Stepper.evaluate`)."""
        with autocast(self.dtype, batches[0][0].device):
            return float(self.engine.evaluate(batches, loss_weight))

    def _release_remote_stages(self, module: nn.Module) -> None:
        """Empty the parameters of stages other pipeline ranks own (never allocated when built on meta)."""
        release_parameters(module, {id(p) for p in self.engine.parameters()})

    def _grads(self) -> list[torch.Tensor]:
        if self.zero is not None:
            return self.zero.grad_shards()
        return [p.grad for p in self.engine.parameters() if p.grad is not None]

    def clip(self, max_norm: float) -> float:
        if self.zero is not None:
            return self.optimizer.clip_grad_norm_(max_norm)
        return clip_grad_norm(
            self.engine.parameters(), max_norm, weights=self.weights, groups=self.norm_groups
        )

    def rank_state(self, model: nn.Module, specs: dict[str, ShardSpec]) -> RankState:
        """What this rank checkpoints: its stages' parameters (ZeRO: its parts of them, from the flat shards)
        under their global names; a tied weight's copy is written by the rank of its lower stage. ZeRO: the
        parameter gathers still in flight finish first (a save reads, a load writes, the shards they write)."""
        if self.zero is not None:
            self.zero.finish_param_gathers()
            regions = zero_regions(self.zero, self.optimizer)
        else:
            regions = whole_regions(self.engine.parameters(), self.optimizer)
        return RankState(
            regions,
            specs_by_param(model, specs),
            self.optimizer,
            skip=self.engine.remote_tied_copies(),
            after_load=self.zero.refresh_params if self.zero is not None else None,
        )

    def close(self) -> None:
        """ZeRO: wait for the parameter gathers the last step left in flight; remove their guards."""
        if self.zero is not None:
            self.zero.close()


def make_stepper(
    module: nn.Module, cfg: Config, layout: Layout, groups: Groups | None, plan: ExecutionPlan | None = None
) -> Stepper:
    """The stepper the execution plan chose (``plan.runner``; resolved from ``cfg`` when not given).

    The schedule runtime for a pipeline, ZeRO or layered accumulation of several micro-batches; else the direct
    loop, which keeps one micro-batch in flight and overlaps the bucketed all-reduce with the last backward.
    """
    plan = plan or resolve(cfg, layout.world_size, training=False)  # TrainingRun passes its own, data checked
    if plan.runner == SCHEDULE_RUNTIME:
        return ScheduledStepper(module, cfg, layout, groups, plan)
    return DirectStepper(module, cfg, layout, groups)
