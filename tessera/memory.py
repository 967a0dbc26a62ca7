"""Memory estimate per rank for a run configuration, and a plain-language explanation when it does not fit.

Pure Python (no torch): it reuses the cost model's formulas (``tessera.planner.cost``: `memory_per_rank`,
`model_state_bytes`, `activation_bytes_per_layer`) and the pipeline IR's simulator for the number of
micro-batches in flight, and adds what is specific to tessera's runtime (docs/memory.md):

- model state: tessera keeps fp32 parameters as master weights and autocasts compute, so per parameter
  4 (param) + 4 (grad) + 8 (Adam m, v) bytes, sharded by ZeRO-1/2/3 as in Rajbhandari 2020;
- activations: per-layer bytes (Korthikanti 2022, by checkpointing mode) × the peak number of
  (layer, micro-batch) pairs alive on the rank in the schedule the execution plan runs (`tessera.execution`:
  layered accumulation keeps all m micro-batches; one pipeline rank runs breadth-first with one stage per block);
  plus the head's input and fp32 logits of every in-flight micro-batch on the last stage;
- communication buffers: one stage's flattened gradients in flight (ZeRO reduce-scatter or all-reduce), with
  ZeRO-2/3 also the full gradients of the stage in backward, with ZeRO-3 the gathered parameters of one stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tessera.config import Config, even_split
from tessera.execution import DIRECT, ExecutionPlan, resolve
from tessera.modes import BREADTH_FIRST, LAYERED
from tessera.pipeline.ir import ActionKind, Schedule
from tessera.pipeline.schedules import build_schedule
from tessera.planner.cost import (
    MemoryBreakdown,
    ModelShape,
    Plan,
    head_activation_bytes,
    memory_per_rank,
    model_state_bytes,
    rank_layers,
)
from tessera.planner.network import TESSERA_ORDER
from tessera.planner.steptime import inflight_microbatches

__all__ = [
    "COMPONENTS",
    "MemoryEstimate",
    "cost_plan",
    "estimate",
    "estimate_plan",
    "model_state_floor",
    "plan_from_config",
    "stage_params",
]

GIB = 2**30
COMPONENTS = ("params", "grads", "optimizer", "activations", "working", "comm_buffers")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Peak bytes of the fullest rank (pipeline position ``stage``), by component."""

    breakdown: MemoryBreakdown
    stage: int
    """Pipeline rank (position) the estimate is for: the one with the largest total."""
    inflight: float
    """Peak micro-batches in flight on that rank, in units of its whole share of layers."""
    plan: Plan
    device_memory: float | None = None

    @property
    def total(self) -> float:
        return self.breakdown.total

    def components(self) -> dict[str, float]:
        return {name: float(getattr(self.breakdown, name)) for name in COMPONENTS}

    def fits(self, device_bytes: float | None = None) -> bool:
        limit = device_bytes if device_bytes is not None else self.device_memory
        return limit is None or self.total <= limit

    def explain_overflow(self, device_bytes: float | None = None) -> str | None:
        """None if the estimate fits; else which component is too large and the settings that would fix it."""
        limit = device_bytes if device_bytes is not None else self.device_memory
        if limit is None or self.total <= limit:
            return None
        name, size = max(self.components().items(), key=lambda item: item[1])
        lines = [
            f"estimated peak {_fmt(self.total)} per rank exceeds the device's {_fmt(limit)}; "
            f"largest part: {name} {_fmt(size)} of {_fmt(limit)}",
            "  " + ", ".join(f"{k} {_fmt(v)}" for k, v in self.components().items()),
            f"  fix: {_fix_for(name, self.plan)}",
        ]
        return "\n".join(lines)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {_fmt(v)}" for k, v in self.components().items())
        return f"pipeline rank {self.stage}: total {_fmt(self.total)} ({parts})"


def _fmt(nbytes: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB so small runs read sensibly."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


def _fix_for(component: str, plan: Plan) -> str:
    if component in ("activations", "working"):
        fixes = []
        if plan.recompute != "full":
            fixes.append("set parallel.checkpointing = 'full'")
        if plan.micro_batch > 1:
            fixes.append("lower train.micro_batch")
        if plan.accumulation == "layered" and plan.n_microbatches > 1:
            fixes.append("use fewer micro-batches per step (layered accumulation keeps all of them)")
        fixes.append("raise parallel.pipeline or the tensor degree (fewer layers / smaller shards per rank)")
        return " or ".join(fixes)
    if component in ("optimizer", "grads", "params"):
        want = {"optimizer": 1, "grads": 2, "params": 3}[component]
        if plan.zero_stage < want and plan.dp > 1:
            return f"set parallel.zero = {want} (shards {component} over the {plan.dp} data-parallel ranks)"
        if plan.zero_stage < 3 and plan.dp > 1:
            return "set parallel.zero = 3"
        return "raise parallel.pipeline or parallel.tensor, or add data-parallel ranks with parallel.zero = 3"
    return "lower train.micro_batch or use fewer pipeline stages per rank (smaller stage buffers)"


@lru_cache(maxsize=16)  # the search asks for one layout's view three times (floor, estimate, step time)
def cost_plan(plan: ExecutionPlan) -> Plan:
    """The cost model's view of an execution plan (activation memory uses torch SDPA: no s×s score tensor)."""
    return Plan(
        **plan.layout.plan_sizes(),  # every dimension's rank count (tessera.axes.DIMS)
        tp_kind="2d" if plan.q > 1 else "1d",
        sequence_parallel=plan.sequence_parallel,
        virtual_stages=plan.stages_per_rank,
        zero_stage=plan.zero,
        micro_batch=plan.micro_batch,
        n_microbatches=plan.micro_batches,
        recompute=plan.checkpointing,
        accumulation=plan.accumulation,
        dtype=plan.dtype,
        autocast=True,  # fp32 master weights under torch.autocast (tessera.parallel.precision)
        flash_attention=True,  # torch SDPA (flash / memory-efficient kernels) keeps no s×s score tensor
        rank_order=TESSERA_ORDER,  # ranks laid out by tessera.layout
        stage_layers=None if _even(plan) else plan.stage_layers,
    )


def _even(plan: ExecutionPlan) -> bool:
    return len(set(plan.stage_layers)) == 1


def plan_from_config(cfg: Config, world_size: int) -> Plan:
    """The cost model's Plan for what a run configuration executes on ``world_size`` ranks."""
    return cost_plan(resolve(cfg, world_size))


def stage_params(
    shape: ModelShape, plan: Plan, stage_layers: list[int] | tuple[int, ...] | None = None
) -> list[float]:
    """Parameters of each global stage (before tensor/ZeRO sharding are applied: divided by tp only).

    Stage 0 adds the embedding (+ learned positions), the last stage the final norm and an untied head (or,
    when the head's stage is on another pipeline rank, its own copy of the tied embedding).
    """
    h, V = shape.d_model, shape.vocab_size
    layers = stage_layers or even_split(shape.n_layers, plan.pp * plan.virtual_stages)
    per_block = shape.layer_params()
    out = [count * per_block for count in layers]
    out[0] += V * h + shape.features.position_params(shape.seq_len, h)
    out[-1] += shape.features.norm_params(h) + (0 if (shape.tied and plan.pp == 1) else V * h)
    return [x / plan.tp for x in out]


def _inflight(plan: ExecutionPlan) -> tuple[list[float], list[int]]:
    """Per pipeline rank: peak (block × micro-batch) pairs saved for backward, and peak micro-batches of the last
    stage (0 on ranks without it).

    A rank runs its list in order, so these peaks follow from its action order alone. Named schedules with one
    stage per rank, equal stages, or breadth-first use closed forms (`steptime.inflight_microbatches`; equal to
    the scan, tests/unit) so the planner's search can price thousands of layouts; the rest (several uneven
    stages per rank, hand-written schedules) scan the list.
    """
    p, m, v, n = plan.pp, plan.micro_batches, plan.stages_per_rank, plan.n_stages
    last_rank = plan.stage_rank(n - 1)
    if plan.runner == DIRECT:
        return [float(plan.n_layers)], [1]
    name = plan.schedule or ""
    if name.endswith(".csv") or not (v == 1 or _even(plan) or name == BREADTH_FIRST):
        return _scan(_compute_schedule(plan), plan.stage_layers, n - 1)
    # rank r's stages hold these blocks; one stage per rank (v = 1) or equal stages make the peak pair count
    # the peak micro-batch count times the rank's blocks
    blocks = _rank_blocks(plan)
    if name == BREADTH_FIRST:  # every local stage of a whole sweep's micro-batches is alive before backward
        group = m if plan.accumulation == LAYERED else 1
        units, last = [float(group)] * p, group
    else:
        units = [inflight_microbatches(name, p, m, v, r) for r in range(p)]
        last = {"1f1b": 1, "gpipe": m}.get(name, m if m == p else 1)
    return [u * b for u, b in zip(units, blocks, strict=True)], [
        last if r == last_rank else 0 for r in range(p)
    ]


def _rank_blocks(plan: ExecutionPlan) -> list[int]:
    """Blocks on each pipeline rank (the loop placement by slicing: the search calls this per layout)."""
    layers, p = plan.stage_layers, plan.pp
    if plan.placement == "loop":
        return [sum(layers[r::p]) for r in range(p)]
    return [sum(layers[s] for s in plan.rank_stages(r)) for r in range(p)]


def model_state_floor(shape: ModelShape, plan: ExecutionPlan) -> float:
    """Bytes of model state (fp32 parameters, gradients and Adam moments, ZeRO-sharded) of the pipeline rank
    holding the most: a lower bound of `estimate_plan`'s total (the same `stage_params` and `model_state_bytes`
    its breakdown uses), cheap enough for the planner's search to reject a layout before pricing the rest."""
    cplan = cost_plan(plan)
    per_stage = stage_params(shape, cplan, plan.stage_layers)
    p, ranks = plan.pp, _candidate_ranks(plan)  # even stages: the ends, which add the embedding or the head
    if plan.placement == "loop":
        most = max(sum(per_stage[r::p]) for r in ranks)
    else:
        most = max(sum(per_stage[s] for s in plan.rank_stages(r)) for r in ranks)
    return sum(model_state_bytes(most, cplan.dp, cplan.zero_stage, "fp32"))


def _compute_schedule(plan: ExecutionPlan) -> Schedule:
    if (plan.schedule or "").endswith(".csv"):
        return plan.lowered()
    options = {"consecutive": 1} if plan.schedule == BREADTH_FIRST and plan.accumulation != LAYERED else {}
    return build_schedule(plan.schedule or "", plan.pp, plan.micro_batches, plan.stages_per_rank, **options)


def _scan(schedule: Schedule, layers: tuple[int, ...], last: int) -> tuple[list[float], list[int]]:
    """Walk each rank's list: F saves its stage's blocks until the B (or W, when split) of the same pair."""
    peaks, lasts = [], []
    for actions in schedule:
        live = peak = live_last = peak_last = 0
        for a in actions:
            if a.kind is ActionKind.FORWARD:
                live += layers[a.stage]
                live_last += a.stage == last
            elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                live -= layers[a.stage]
                live_last -= a.stage == last
            peak, peak_last = max(peak, live), max(peak_last, live_last)
        peaks.append(float(peak))
        lasts.append(peak_last)
    return peaks, lasts


def estimate(
    cfg: Config, world_size: int, device_memory: float | None = None, *, stage: int | None = None
) -> MemoryEstimate:
    """Peak memory per rank for what ``cfg`` runs on ``world_size`` ranks: the fullest pipeline rank's
    breakdown, or that of pipeline position ``stage`` when given (the dry run compares rank by rank)."""
    plan = resolve(cfg, world_size)  # first: a config the shape cannot describe is a ConfigError, not a crash
    return estimate_plan(ModelShape.from_config(cfg.model), plan, device_memory, stage=stage)


def estimate_plan(
    shape: ModelShape, plan: ExecutionPlan, device_memory: float | None = None, *, stage: int | None = None
) -> MemoryEstimate:
    """Peak memory per rank of an execution plan: the fullest pipeline rank's breakdown. The one memory model:
    `tessera memory` and the planner's search both call it."""
    cplan = cost_plan(plan)
    per_stage = stage_params(shape, cplan, plan.stage_layers)
    peaks, last_mb = _inflight(plan)
    best: MemoryEstimate | None = None
    for rank in _candidate_ranks(plan) if stage is None else [stage]:
        mine = plan.rank_stages(rank)
        share = sum(plan.stage_layers[s] for s in mine) or 1
        # memory_per_rank multiplies by the rank's blocks; peaks[rank] already counts (block × micro-batch) pairs
        inflight = peaks[rank] / (rank_layers(shape, cplan, rank) or 1.0)
        base = memory_per_rank(shape, cplan, inflight_microbatches=inflight, stage=rank, precision="fp32")
        bd = _adjust(base, shape, cplan, [per_stage[s] for s in mine], last_mb[rank])
        candidate = MemoryEstimate(
            breakdown=bd, stage=rank, inflight=peaks[rank] / share, plan=cplan, device_memory=device_memory
        )
        if best is None or candidate.total > best.total:
            best = candidate
    assert best is not None  # pp >= 1
    return best


def _candidate_ranks(plan: ExecutionPlan) -> list[int]:
    """Pipeline ranks that can be the fullest. With even stages and a named schedule only the first or the last:
    every other rank holds as many blocks, no embedding or head, and no more micro-batches in flight (the
    in-flight counts of `_inflight` do not grow with the rank)."""
    even = _even(plan) and not (plan.schedule or "").endswith(".csv")
    return sorted({0, plan.pp - 1}) if even else list(range(plan.pp))


def _adjust(
    base: MemoryBreakdown, shape: ModelShape, plan: Plan, stage_psi: list[float], last_inflight: int
) -> MemoryBreakdown:
    """tessera-specific terms: exact per-rank parameters, the head's per-micro-batch activations, and the
    buffers of tessera's ZeRO implementation (see the module docstring)."""
    params, grads, optimizer = model_state_bytes(sum(stage_psi), plan.dp, plan.zero_stage, "fp32")
    sbh = shape.seq_len * plan.micro_batch * shape.d_model * plan.stream_bytes  # the fp32 residual stream
    logits = 4 * shape.seq_len * plan.micro_batch * shape.vocab_size / plan.tp
    head = last_inflight * (head_activation_bytes(shape, plan) + logits)
    working = base.working - (
        logits if last_inflight else 0.0
    )  # the logits are counted per micro-batch above
    biggest = max(stage_psi, default=0.0) * 4.0
    buffers = (2 * sbh if plan.pp > 1 else 0.0) + (biggest if plan.dp > 1 or plan.zero_stage else 0.0)
    if plan.zero_stage >= 2:
        buffers += biggest  # the full gradients of the stage in backward, before its reduce-scatter
    if plan.zero_stage >= 3 and plan.dp > 1:
        buffers += biggest  # one stage's gathered parameters
    return MemoryBreakdown(  # built directly: dataclasses.replace costs a field scan per call in the search
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=base.activations + head,
        working=max(working, 0.0),
        comm_buffers=buffers,
    )
