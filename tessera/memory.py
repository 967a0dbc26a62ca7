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
- cast cache: under bf16 autocast with 1D + sequence parallelism, the compute-dtype copies of the weights the
  sequence-parallel entry casts but does not save (they live in autocast's cache for the step): not activations;
- communication buffers: one stage's flattened gradients in flight (ZeRO reduce-scatter or all-reduce), with
  ZeRO-2/3 also the full gradients of the stage in backward, with ZeRO-3 the gathered parameters of one stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

from tessera.config import Config, even_split
from tessera.execution import DIRECT, ExecutionPlan, resolve
from tessera.layout import Layout
from tessera.modes import BREADTH_FIRST, LAYERED, reduces_every_microbatch
from tessera.peak_memory import Moment, StageBytes, Walk, compile_walk, floor, lowered_events
from tessera.pipeline.build import compute_options
from tessera.pipeline.ir import ActionKind, Schedule
from tessera.pipeline.schedules import Step, build_schedule, rank_steps
from tessera.planner.cost import (
    REPLAYS_BLOCK,
    MemoryBreakdown,
    ModelShape,
    Plan,
    activation_bytes_per_layer,
    attention_entry_bytes,
    autocast_weight_bytes,
    autocast_weight_bytes_per_layer,
    boundary_bytes,
    cached_weight_bytes,
    first_backward_gradient_bytes,
    head_activation_bytes,
    head_transient_bytes,
    memory_per_rank,
    model_state_bytes,
    rank_layers,
    recompute_working_bytes,
    replay_gradient_bytes,
    replay_mask_bytes,
    replay_skipped_copy_bytes,
    shared_mask_bytes,
    tied_gradient_bytes,
    zero3_block_copies_bytes,
    zero3_cached_head_bytes,
    zero3_window_copies_bytes,
)
from tessera.planner.hardware import DTYPE_BYTES
from tessera.planner.network import TESSERA_ORDER
from tessera.planner.steptime import inflight_microbatches

__all__ = [
    "COMPONENTS",
    "MemoryEstimate",
    "cost_plan",
    "estimate",
    "estimate_plan",
    "memory_floor",
    "model_state_floor",
    "model_state_mean",
    "plan_from_config",
    "stage_params",
]

GIB = 2**30
_V = TypeVar("_V")
COMPONENTS = ("params", "grads", "optimizer", "activations", "working", "comm_buffers", "cast_cache")


_MEMO_SIZE = 4096
"""Entries a memo table (`_memo`) holds before it starts over: the planner's search of ~1e4 layouts has at most
a few thousand distinct keys per table."""


def _memo(table: dict[tuple, _V], key: tuple, compute: Callable[[], _V]) -> _V:
    """``table[key]``, computing it with ``compute()`` on a miss (the table starts over when full)."""
    value = table.get(key)
    if value is None:
        if len(table) >= _MEMO_SIZE:
            table.clear()
        value = table[key] = compute()
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Peak bytes of the fullest rank (pipeline position ``stage``), by component."""

    breakdown: MemoryBreakdown
    """Each component at its own size (model state by the ZeRO formulas, activations at their peak, the
    transients) and, as its ``total``, the peak: what coexists (``at_peak``), not their sum."""
    at_peak: MemoryBreakdown
    """What is alive at the rank's peak moment, by component (`tessera.peak_memory`): sums to ``total``."""
    grads_after_backward: float
    """Gradient bytes held once backward is over (ZeRO-1: the full gradients and the reduced shard)."""
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
        """What is alive at the peak, by component (sums to ``total``)."""
        return {name: float(getattr(self.at_peak, name)) for name in COMPONENTS}

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
    if component == "cast_cache":
        return (
            "raise parallel.tensor or parallel.pipeline (fewer weights per rank), or set train.dtype = 'fp32' "
            "(no compute-dtype copies)"
        )
    if component in ("optimizer", "grads", "params"):
        want = {"optimizer": 1, "grads": 2, "params": 3}[component]
        if plan.zero_stage < want and plan.dp > 1:
            return (
                f"set parallel.zero = {want} (shards {component} over the {plan.zero_dp} data-parallel ranks)"
            )
        if plan.zero_replicas > 1:
            return f"raise parallel.zero_shard_size (up to the data-parallel size {plan.dp}: shard over more ranks)"
        if plan.zero_stage < 3 and plan.dp > 1:
            return "set parallel.zero = 3"
        return "raise parallel.pipeline or parallel.tensor, or add data-parallel ranks with parallel.zero = 3"
    return "lower train.micro_batch or use fewer pipeline stages per rank (smaller stage buffers)"


@lru_cache(maxsize=16)  # the search asks for one layout's view three times (floor, estimate, step time)
def cost_plan(plan: ExecutionPlan) -> Plan:
    """The cost model's view of an execution plan (activation memory uses torch SDPA: no s×s score tensor)."""
    return Plan(
        **dict(_plan_sizes(plan.layout)),  # every dimension's rank count (tessera.axes.DIMS)
        tp_kind="2d" if plan.q > 1 else "1d",
        sequence_parallel=plan.sequence_parallel,
        tp_comm_overlap=plan.tp_comm_overlap,
        overlap_param_gather=plan.overlap_param_gather,
        virtual_stages=plan.stages_per_rank,
        zero_stage=plan.zero,
        # 0: over all dp ranks (plain ZeRO); context parallelism shards over dp·cp (`ExecutionPlan.zero_shard`)
        zero_shard=plan.zero_shard if plan.zero_replicas > 1 or plan.cp > 1 else 0,
        micro_batch=plan.micro_batch,
        n_microbatches=plan.micro_batches,
        recompute=plan.checkpointing,
        accumulation=plan.accumulation,
        dtype=plan.dtype,
        autocast=True,  # fp32 master weights under torch.autocast (tessera.parallel.precision)
        grad_reduce_bytes=DTYPE_BYTES[plan.grad_reduce_dtype],  # ZeRO's reduce-scatter (plain DP: fp32)
        flash_attention=True,  # torch SDPA (flash / memory-efficient kernels) keeps no s×s score tensor
        document_mask=plan.document_mask,  # but the layers keep the micro-batch's mask (rank_memory.shared_mask_bytes)
        rank_order=TESSERA_ORDER,  # ranks laid out by tessera.layout
        stage_layers=None if _even(plan) else plan.stage_layers,
    )


@lru_cache(maxsize=256)  # a few dozen layouts per search, each asked for by every plan built on it
def _plan_sizes(layout: Layout) -> tuple[tuple[str, int], ...]:
    """`Layout.plan_sizes` as (field, ranks) pairs (immutable: shared; the layout is frozen)."""
    return tuple(layout.plan_sizes().items())


def _even(plan: ExecutionPlan) -> bool:
    return len(set(plan.stage_layers)) == 1


def plan_from_config(cfg: Config, world_size: int) -> Plan:
    """The cost model's Plan for what a run configuration executes on ``world_size`` ranks."""
    return cost_plan(resolve(cfg, world_size, training=False))


def stage_params(
    shape: ModelShape, plan: Plan, stage_layers: list[int] | tuple[int, ...] | None = None
) -> list[float]:
    """Parameters of each global stage held by one tensor-parallel rank (before ZeRO sharding).

    Stage 0 adds the embedding (+ learned positions), the last stage the final norm and an untied head (or,
    when the head's stage is on another pipeline rank, its own copy of the tied embedding). Matrices are split
    over the tensor group; the vectors the family declares replicated are not (tessera/model/family.py): in
    Megatron 1D the norms, the row-parallel Linears' biases and the position table are whole on every rank, in
    Optimus 2D every vector (norms, biases, position table) is split by the grid's columns only (q of q²); the
    per-head q/k norms (Qwen3, [head_dim] each) are whole on every rank in both.
    """
    return list(_stage_params(shape, plan, tuple(stage_layers) if stage_layers else None))


@lru_cache(maxsize=64)  # the search asks for a layout's split twice (floor, estimate), the dry run per rank
def _stage_params(shape: ModelShape, plan: Plan, stage_layers: tuple[int, ...] | None) -> tuple[float, ...]:
    h, V, fam = shape.d_model, shape.vocab_size, shape.features
    layers = stage_layers or even_split(shape.n_layers, plan.pp * plan.virtual_stages)
    t = plan.tp
    vector_split = round(t**0.5) if plan.tp_kind == "2d" else 1  # 2D: vectors split by the grid's columns
    per_block = _block_params(shape, plan)
    out = [count * per_block for count in layers]
    out[0] += V * h / t + fam.position_params(shape.seq_len, h) / vector_split
    out[-1] += fam.norm_params(h) / vector_split + (0 if (shape.tied and plan.pp == 1) else V * h / t)
    return tuple(out)


def _block_params(shape: ModelShape, plan: Plan) -> float:
    """One block's parameters on a tensor rank: its matrices split t ways, its vectors replicated (1D: a
    column-parallel bias is split with its weight; 2D: vectors split by the grid's columns j, replicated over its
    rows i), per-head q/k norms whole on every rank."""
    h, fam, t = shape.d_model, shape.features, plan.tp
    whole = fam.head_norm_params(shape.head_dim)  # per-head q/k norms: whole on every tensor rank, 1D and 2D
    if plan.tp_kind == "2d":  # vectors: h by j, replicated over the grid rows i
        vector_split = round(t**0.5)
        block_vectors = shape.layer_params() - shape.block_matmul_params() - whole
    else:  # 1D: the replicated vectors of a block (a column-parallel bias is split with its weight)
        vector_split, block_vectors = 1, fam.replicated_block_vectors() * h
    return (shape.layer_params() - block_vectors - whole) / t + block_vectors / vector_split + whole


_STAGE_PARAMS: dict[tuple, tuple[float, ...]] = {}


def _plan_stage_params(shape: ModelShape, plan: ExecutionPlan) -> tuple[float, ...]:
    """`stage_params` of the plan's stages, memoized on what it reads: the layout (tensor ranks, 1D or 2D, the
    pipeline size) and the stage split (`cost_plan` takes its tp, tp_kind and pp from ``plan.layout``)."""
    key = (shape, plan.layout, plan.stage_layers)
    return _memo(_STAGE_PARAMS, key, lambda: _stage_params(shape, cost_plan(plan), plan.stage_layers))


_INFLIGHT: dict[tuple, tuple[list[float], list[int]]] = {}


def _inflight(plan: ExecutionPlan) -> tuple[list[float], list[int]]:
    """Per pipeline rank: peak (block × micro-batch) pairs saved for backward, and peak micro-batches of the last
    stage (0 on ranks without it). Not to be mutated: memoized.

    A rank runs its list in order, so these peaks follow from its action order alone. Named schedules with one
    stage per rank, equal stages, or breadth-first use closed forms (`steptime.inflight_microbatches`; equal to
    the scan, tests/unit) so the planner's search can price thousands of layouts; the rest (several uneven
    stages per rank, hand-written schedules) scan the list.
    """
    # a named schedule's counts read only these (not ZeRO, checkpointing or the micro-batch size: the search
    # prices each schedule under several of those); a hand-written one's lowered lists read the whole plan
    key = (
        (plan,)
        if (plan.schedule or "").endswith(".csv")
        else (
            plan.runner,
            plan.n_layers,
            plan.schedule,
            plan.layout.pp,
            plan.micro_batches,
            plan.stages_per_rank,
            plan.stage_layers,
            plan.placement,
            plan.accumulation,
        )
    )
    return _memo(_INFLIGHT, key, lambda: _count_inflight(plan))


def _count_inflight(plan: ExecutionPlan) -> tuple[list[float], list[int]]:
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


_STATE_FLOORS: dict[tuple, float] = {}
_RANK_STATES: dict[tuple, tuple[float, float, float]] = {}


def _state_key(shape: ModelShape, plan: ExecutionPlan) -> tuple:
    """What the model state of a plan's pipeline ranks reads: the layout (the ranks of each dimension, 1D/2D), the
    ZeRO stage, the stage split and its placement on the ranks (`stage_params`, `model_state_bytes`,
    `ExecutionPlan.rank_stages`). Not the schedule's name, the micro-batching, checkpointing or the overlaps: the
    search prices many layouts that differ only in those."""
    return (shape, plan.layout, plan.zero, plan.zero_shard, plan.stage_layers, plan.placement)


def model_state_floor(shape: ModelShape, plan: ExecutionPlan) -> float:
    """Bytes of model state (fp32 parameters, gradients and Adam moments, ZeRO-sharded) of the pipeline rank
    holding the most: a lower bound of `estimate_plan`'s total (the same `stage_params` and `model_state_bytes`
    its breakdown uses), cheap enough for the planner's search to reject a layout before pricing the rest.
    Memoized on `_state_key` and whether the schedule is hand-written (`_candidate_ranks` reads that too)."""
    key = (*_state_key(shape, plan), (plan.schedule or "").endswith(".csv"))
    return _memo(_STATE_FLOORS, key, lambda: _model_state_floor(shape, plan))


def _model_state_floor(shape: ModelShape, plan: ExecutionPlan) -> float:
    return max(sum(state) for state in _rank_states(shape, plan).values())


_BOUND_MARGIN = 1e-9
"""Relative margin of a cheap lower bound (`model_state_mean`, `_rank_state_floor`) below its exact value: its
float sums and those of the bound it is under round differently (a few ulps), and it must not exceed a bound it
equals exactly."""


def model_state_mean(shape: ModelShape, plan: Plan) -> float:
    """The model state (fp32 parameters, gradients and Adam moments, ZeRO-sharded, as `model_state_floor` counts
    it) of a pipeline rank holding the mean share of the parameters, for the layout (``plan.dp``, ``pp``, ``tp``,
    ``tp_kind``) and ZeRO stage (``zero_stage``) of ``plan``; its other fields are not read.

    A lower bound of `model_state_floor` of every execution plan with that layout and ZeRO stage, whatever its
    stage split, stages per rank, schedule, micro-batching or checkpointing: the stages' parameters
    (`stage_params`) sum to the same total however the blocks are split (each block once, the embedding and head
    once), the ranks' shares sum to it (each stage on one rank), the fullest rank holds at least the mean, the
    candidate ranks `model_state_floor` takes the largest of include the fullest (`_candidate_ranks`), and
    `model_state_bytes` is linear in the parameters. The planner's search rejects all the variants of a layout
    and ZeRO stage with it before building their configs."""
    total = sum(_stage_params(shape, plan, None))
    return (1 - _BOUND_MARGIN) * sum(
        model_state_bytes(total / plan.pp, plan.zero_dp, plan.zero_stage, "fp32")
    )


def memory_floor(shape: ModelShape, plan: ExecutionPlan, *, stop_above: float | None = None) -> float:
    """A lower bound of `estimate_plan`'s total without walking a schedule, for the planner's search to reject
    most layouts cheaply: the largest `_rank_floor` of the candidate ranks. With ``stop_above``, the first
    bound above it is returned without pricing the rest (the search only asks whether it exceeds): first each
    rank's `_rank_state_floor` (a lower bound of its `_rank_floor` from memoized parts: most rejected layouts
    stop there), then each `_rank_floor`."""
    ranks = _candidate_ranks(plan)
    if stop_above is not None:
        for rank in ranks:
            cheap = _rank_state_floor(shape, plan, rank)
            if cheap > stop_above:
                return cheap
    best = 0.0
    for rank in ranks:
        best = max(best, _rank_floor(shape, plan, rank))
        if stop_above is not None and best > stop_above:
            break
    return best


def _rank_floor(shape: ModelShape, plan: ExecutionPlan, rank: int) -> float:
    """A lower bound of pipeline rank ``rank``'s total (`estimate_plan` with ``stage=rank``), as `_at_peak`
    adds it up: parameters and optimizer state (alive throughout) and the point-to-point buffers, plus the
    larger of the optimizer step's moment (the gradients held after backward and the update's temporaries) and
    a lower bound of the walked moment (`peak_memory.floor`: the backward after the activations' peak, the last
    reduction) with autocast's step-long weight copies beside it. The activations at their peak come from the
    (block × micro-batch) pairs in flight (`_inflight`, the walk's own count; `_peak_activations`)."""
    params, grads, optimizer = _rank_state(shape, plan, rank)
    if plan.runner == DIRECT:  # no walk: the estimate adds every component
        return params + grads + optimizer
    cplan = cost_plan(plan)
    p2p = _p2p_buffer_bytes(shape, cplan, plan)
    sizes = _stage_sizes(shape, plan, rank)
    every = reduces_every_microbatch(plan.accumulation, plan.zero)
    # a stage tied across ranks has one REDUCE, at the end of the list (after its EXCHANGE)
    exchanged = len(set(plan.exchanged_stages(rank)))
    moment, after = floor(
        sizes,
        activations=_peak_activations(plan, sizes, _inflight(plan)[0][rank]),
        reductions=exchanged + (len(sizes.grads) - exchanged) * (plan.micro_batches if every else 1),
        # not where a hand-written list may split a backward into I and W, nor a tied stage's
        reduced_backwards=every and not exchanged and not (plan.schedule or "").endswith(".csv"),
    )
    held = max(
        moment + autocast_weight_bytes(shape, cplan, rank), after + _temporaries(shape, plan, sizes.grads)
    )
    return params + optimizer + p2p + held


def _rank_state_floor(shape: ModelShape, plan: ExecutionPlan, rank: int) -> float:
    """A lower bound of `_rank_floor` (pipeline rank ``rank``) from memoized parts, without the rank's stage
    sizes: its parameters and optimizer state, the point-to-point buffers and the (block × micro-batch) pairs in
    flight at one block's saved activations. `_rank_floor` adds the same state and buffers to ``held``, which is
    at least the walked moment's lower bound (`peak_memory.floor`: at least the activations at their peak), which
    is at least `_peak_activations`, which is at least the pairs at the smallest bytes per block of any of the
    rank's stages, each a block's activations or more (a stage adds its boundary or head). Less
    `_BOUND_MARGIN`: the two sums round differently."""
    params, grads, optimizer = _rank_state(shape, plan, rank)
    if plan.runner == DIRECT:  # `_rank_floor` is this sum
        return params + grads + optimizer
    per_block, p2p = _block_and_p2p(shape, plan)
    pairs = _inflight(plan)[0][rank]
    return (1 - _BOUND_MARGIN) * (params + optimizer + p2p + pairs * per_block)


_BLOCK_AND_P2P: dict[tuple, tuple[float, float]] = {}


def _block_and_p2p(shape: ModelShape, plan: ExecutionPlan) -> tuple[float, float]:
    """(one block's saved activations of one micro-batch, the point-to-point buffers): `_micro_batch_bytes`'
    first and `_p2p_buffer_bytes` of the plan's cost view (`cost_plan`), memoized on the execution-plan fields
    from which `cost_plan` derives what those two read (the layout: the tensor split, 1D or 2D, the pipeline;
    sequence parallelism, the micro-batch, checkpointing, the dtype; it fixes autocast and flash attention), so
    that the search's first check of a layout builds no cost view."""
    key = (
        shape,
        plan.layout,
        plan.sequence_parallel,
        plan.micro_batch,
        plan.checkpointing,
        plan.dtype,
        plan.document_mask,  # shared_mask_bytes, rope_position_bytes
    )
    return _memo(_BLOCK_AND_P2P, key, lambda: _price_block_and_p2p(shape, plan))


def _price_block_and_p2p(shape: ModelShape, plan: ExecutionPlan) -> tuple[float, float]:
    cplan = cost_plan(plan)
    return _micro_batch_bytes(shape, cplan)[0], _p2p_buffer_bytes(shape, cplan, plan)


def _peak_activations(plan: ExecutionPlan, sizes: StageBytes, pairs: float) -> float:
    """A lower bound of the activation bytes alive at the walk's peak on a rank holding ``sizes``' stages with
    ``pairs`` (block × micro-batch) pairs in flight: exact where each of its stages holds as many micro-batches
    then (one stage; layered breadth-first keeps a whole sweep of every stage), else the pairs at the smallest
    bytes per block of any of its stages."""
    layers = plan.stage_layers
    blocks = sum(layers[s] for s in sizes.activations)
    if len(sizes.activations) == 1 or (plan.schedule == BREADTH_FIRST and plan.accumulation == LAYERED):
        return pairs / (blocks or 1) * sum(sizes.activations.values())
    return pairs * min((a / layers[s] for s, a in sizes.activations.items() if layers[s]), default=0.0)


def _rank_states(shape: ModelShape, plan: ExecutionPlan) -> dict[int, tuple[float, float, float]]:
    """`_rank_state` of each rank that can be the fullest."""
    return {r: _rank_state(shape, plan, r) for r in _candidate_ranks(plan)}


def _rank_state(shape: ModelShape, plan: ExecutionPlan, rank: int) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes by the ZeRO formulas of pipeline rank ``rank`` (memoized on
    `_state_key`: `_price_rank_state` reads nothing else)."""
    return _memo(_RANK_STATES, (*_state_key(shape, plan), rank), lambda: _price_rank_state(shape, plan, rank))


def _price_rank_state(shape: ModelShape, plan: ExecutionPlan, rank: int) -> tuple[float, float, float]:
    cplan = cost_plan(plan)
    per_stage = _plan_stage_params(shape, plan)
    mine = (
        sum(per_stage[rank :: plan.pp])
        if plan.placement == "loop"
        else sum(per_stage[s] for s in plan.rank_stages(rank))
    )
    return model_state_bytes(mine, cplan.zero_dp, cplan.zero_stage, "fp32")


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
    # first: a config the shape cannot describe is a ConfigError, not a crash
    plan = resolve(cfg, world_size, training=False)
    return estimate_plan(ModelShape.from_config(cfg.model), plan, device_memory, stage=stage)


def estimate_plan(
    shape: ModelShape,
    plan: ExecutionPlan,
    device_memory: float | None = None,
    *,
    stage: int | None = None,
    stop_above: float | None = None,
) -> MemoryEstimate:
    """Peak memory per rank of an execution plan: the fullest pipeline rank's breakdown. The one memory model:
    `tessera memory` and the planner's search both call it. With ``stop_above``, the first rank whose total
    exceeds it is returned without walking the others (the search drops such a layout whichever rank it is)."""
    cplan = cost_plan(plan)
    per_stage = _plan_stage_params(shape, plan)
    peaks, last_mb = _inflight(plan)
    best: MemoryEstimate | None = None
    for rank in _candidate_ranks(plan) if stage is None else [stage]:
        mine = plan.rank_stages(rank)
        share = sum(plan.stage_layers[s] for s in mine) or 1
        # memory_per_rank multiplies by the rank's blocks; peaks[rank] already counts (block × micro-batch) pairs
        inflight = peaks[rank] / (rank_layers(shape, cplan, rank) or 1.0)
        base = memory_per_rank(shape, cplan, inflight_microbatches=inflight, stage=rank, precision="fp32")
        masked = _masked_micro_batches(plan, mine, peaks[rank] / share)
        bd = _adjust(base, shape, cplan, [per_stage[s] for s in mine], last_mb[rank], masked)
        if plan.runner == DIRECT:
            # the direct loop, after backward: the tied table's two gradients summed, or the optimizer step's
            # temporaries
            after = max(
                2 * tied_gradient_bytes(shape, cplan),
                _adamw_temporaries(shape, cplan, embedding=True, head=True),
            )
            replay = _direct_replay(bd, shape, cplan)
            at_peak, after_backward = _direct_at_peak(bd, plan.micro_batches, after, replay), bd.grads
        else:  # what coexists: the rank's action list walked (tessera.peak_memory)
            at_peak, after_backward = _at_peak(bd, shape, plan, rank)
        candidate = MemoryEstimate(
            breakdown=MemoryBreakdown(**{name: getattr(bd, name) for name in COMPONENTS}, peak=at_peak.total),
            at_peak=at_peak,
            grads_after_backward=after_backward,
            stage=rank,
            inflight=peaks[rank] / share,
            plan=cplan,
            device_memory=device_memory,
        )
        if best is None or candidate.total > best.total:
            best = candidate
        if stop_above is not None and best.total > stop_above:
            break
    assert best is not None  # pp >= 1
    return best


def _direct_replay(held: MemoryBreakdown, shape: ModelShape, cplan: Plan) -> MemoryBreakdown | None:
    """Under full recomputation, the direct loop's moment in the first block's replayed backward (its last and
    fullest: every later block's gradients are made by then). Alive: the gradients of the head and of every block
    but the first, and of the first block its MLP output Linear's weight (its backward comes before the MLP's
    activation backward, the replay's fullest moment); the first block's checkpointed input (the later blocks'
    and the head's saved tensors are freed); its replay (`recompute_working_bytes`) with its compute-dtype weight
    copies, which the replay makes again (the forward's autocast region, and its cache, are over). Not yet made:
    the rest of the first block's gradients and, untied, the embedding table's. None without full
    recomputation. Until 2026-12-03 the one-micro-batch moment held no gradients at all: -9 to -15 % under the
    dry run on small fp32 layouts (docs/memory.md, "Full recomputation's moments")."""
    if cplan.recompute not in REPLAYS_BLOCK:
        return None
    mlp_out = next(lin for lin in reversed(shape.block_linears()) if lin.name.startswith("mlp."))
    unmade = 4.0 * (shape.layer_params() - mlp_out.d_in * mlp_out.d_out) / cplan.tp
    if not shape.tied:
        unmade += _table_bytes(shape, cplan)
    copies = autocast_weight_bytes_per_layer(shape, cplan)
    return MemoryBreakdown(
        params=held.params,
        grads=max(held.grads - unmade, 0.0),
        optimizer=held.optimizer,
        activations=activation_bytes_per_layer(shape, cplan) + copies,
        working=recompute_working_bytes(shape, cplan) + replay_mask_bytes(shape, cplan),  # masks built again
        comm_buffers=0.0,
        cast_cache=0.0,
    )


def _direct_at_peak(
    held: MemoryBreakdown, micro_batches: int, after_backward: float, replay: MemoryBreakdown | None = None
) -> MemoryBreakdown:
    """The direct loop's peak (no action list to walk; one stage): the larger of two moments. The loss's (forward
    or backward): every component, as from the second micro-batch on the gradients accumulate beside the next
    one's activations and transients; with one micro-batch without the gradients, which its backward creates as
    it frees the activations (the walk's rule for a stage's first backward). Once the activations are freed: the
    gradients and ``after_backward``, the larger of the embedding's backward's transient (a tied table's two
    gradients summed out of place, 2 × `tied_gradient_bytes`) and the optimizer step's (`_temporaries`)."""
    both = {name: getattr(held, name) for name in COMPONENTS}
    during = held if micro_batches > 1 else MemoryBreakdown(**{**both, "grads": 0.0})
    after = MemoryBreakdown(**{**both, "activations": 0.0, "working": after_backward, "cast_cache": 0.0})
    return max((during, after) + ((replay,) if replay else ()), key=lambda moment: moment.total)


def _masked_micro_batches(plan: ExecutionPlan, mine: Sequence[int], per_block: float) -> float:
    """Micro-batches whose attention masks a rank holds at its peak (`shared_mask_bytes` each): the runtime
    builds one set per micro-batch and rank, shared by the rank's stages (`PipelineEngine._documents`).
    ``per_block``: the micro-batches in flight per block at the peak. With one stage of blocks, or every stage
    on the rank (no pipeline: ZeRO-3's stages of one block, which hold the same micro-batches), that is the
    count; with several pipeline stages per rank (interleaved) the stages' micro-batches may differ: at most
    their sum, and the step's micro-batches."""
    stages = sum(1 for s in mine if plan.stage_layers[s])
    if plan.pp == 1 or stages <= 1:
        return per_block if stages else 0.0
    return min(float(plan.micro_batches), stages * per_block)


def _at_peak(
    held: MemoryBreakdown, shape: ModelShape, plan: ExecutionPlan, rank: int
) -> tuple[MemoryBreakdown, float]:
    """(the breakdown at the rank's peak moment: model state plus what its action list has alive then, the
    gradient bytes the runtime holds once backward is over)."""
    cplan = cost_plan(plan)
    sizes = _stage_sizes(shape, plan, rank)
    moment, after_backward = _rank_walk(plan, rank, sizes).evaluate(sizes)
    # autocast's compute-dtype weight copies live through the forward/backward phase (one autocast region): the
    # ones a Linear saves for backward are activations, the ones only autocast's cache holds are not
    cached = cached_weight_bytes(shape, cplan, rank)
    moment.activations += autocast_weight_bytes(shape, cplan, rank) - cached
    # the optimizer step: the gradients held after backward and the update's temporaries (two of the
    # largest shard: ZeRO's Adam denominator) beside the state; the autocast region, and its cache, are gone
    temporaries = _temporaries(shape, plan, sizes.grads)
    if after_backward + temporaries > moment.total + cached:
        moment, cached = Moment(grads=after_backward, working=temporaries, label="optimizer step"), 0.0
    p2p = _p2p_buffer_bytes(shape, cplan, plan)
    at_peak = MemoryBreakdown(
        params=held.params,
        grads=moment.grads,
        optimizer=held.optimizer,
        activations=moment.activations,
        working=moment.working,
        comm_buffers=moment.buffers + p2p,
        cast_cache=cached,
    )
    return at_peak, after_backward


@lru_cache(maxsize=16)  # the search asks for a rank's sizes twice (floor, estimate)
def _stage_sizes(shape: ModelShape, plan: ExecutionPlan, rank: int) -> StageBytes:
    """The sizes the walk of pipeline rank ``rank``'s list prices, by its stages (not to be mutated: cached)."""
    cplan = cost_plan(plan)
    per_stage = _plan_stage_params(shape, plan)
    psi = {s: per_stage[s] for s in plan.rank_stages(rank)}
    per_layer, recompute, boundary, head, head_working = _micro_batch_bytes(shape, cplan)
    last = plan.n_stages - 1
    # on the 2D grid under no or selective recomputation, a stage input that no norm saves is kept for the stage's
    # backward: a local predecessor's output (`_kept_boundaries`) or a receive buffer (`_kept_inputs`); a
    # micro-batch's attention masks are one set per rank, shared by its stages
    # (`PipelineEngine._documents`): built by the first of them to run it, the rank's first stage with blocks,
    # whose backward is the micro-batch's last here
    mask = shared_mask_bytes(shape, cplan)
    first = min((s for s in psi if plan.stage_layers[s]), default=None)
    kept = _kept_boundaries(cplan, psi, last)
    received = _kept_inputs(cplan, psi)
    acts = {
        s: per_layer * plan.stage_layers[s]
        + boundary * ((s in kept) + (s in received))
        + (mask if s == first else 0.0)
        for s in psi
    }
    # full recomputation with masks: the micro-batch's first replay on the rank (its highest stage) builds them
    # again; its later stages' replays find them built, kept by the walk (`StageBytes.masks`) until its lowest
    masks = replay_mask_bytes(shape, cplan) if cplan.recompute in REPLAYS_BLOCK else 0.0
    top = max(psi)
    # ZeRO-3: the cache keeps every replayed block's weight copies until the stage's FREE (`recompute` has one)
    copies = zero3_block_copies_bytes(shape, cplan)
    more = {s: max(plan.stage_layers[s] - 1, 0) * copies for s in psi}
    # a stage whose forward ran in its backward's GATHER/FREE window cast every block's copies into the cache,
    # the ones its replays skip too (`replay_skipped_copy_bytes`): always the last stage's, often 1F1B's others
    skipped = replay_skipped_copy_bytes(shape, cplan) if copies else 0.0
    # without full recomputation, the column-parallel Linears' cache-only copies that such a forward cast: alive
    # beside the gathered parameters until the FREE (after the backward too), as the head's copy below
    cast = zero3_window_copies_bytes(shape, cplan)
    in_window = _forward_in_window(plan, rank) if skipped or cast else frozenset()
    for s in in_window:
        more[s] += plan.stage_layers[s] * skipped
    working = {s: recompute - (masks if s != top else 0.0) + more[s] for s in psi}
    if last in psi:
        acts[last] += head
        working[last] += head_working
        if cplan.recompute in REPLAYS_BLOCK:
            # the first replay on the last stage runs once the head's backward has freed its saved tensors (the
            # logits' softmax, the final norm's): the stage's moment is the larger of the head's and the replay's;
            # under ZeRO-3 its forward's block copies are in the cache at both (`zero3_block_copies_bytes`)
            own = copies if plan.stage_layers[last] else 0.0
            working[last] = max(recompute - head, head_transient_bytes(shape, cplan) + own) + more[last]
        else:
            # so do the last block's backward moments (the MLP's, an entry's, 2D's exit SUMMA): beside the
            # activations less the micro-batch's head tensors, freed by the loss's backward; beside them a 2D fp32
            # last pipeline rank and direct loop were +2.7 % / +2.3 % over the dry run ("The 2D grid's stage
            # boundaries" in docs/memory.md)
            working[last] = max(recompute - head, head_transient_bytes(shape, cplan)) + more[last]
    # full recomputation: a stage's backward leaves its input's gradient (fp32 like the input, its first block's
    # checkpoint) until the previous stage's backward, when that stage runs on this rank too; the input itself
    # (the previous stage's output) is freed with the backward, which starts from its gradient edge
    checkpoint = activation_bytes_per_layer(shape, cplan, recompute="full")  # a block's input
    held = {s: checkpoint for s in psi if s - 1 in psi} if cplan.recompute in REPLAYS_BLOCK else {}
    uses = {last: (last, 0)} if shape.tied and last != 0 and {0, last} <= psi.keys() else {}
    if uses:  # the embedding's backward makes the table's gradient beside the head's (``uses``), then adds it
        working[0] = max(working[0], tied_gradient_bytes(shape, cplan))
    # a stage's first backward: with the weight gradients it has made by its replay's moment
    replay_last = recompute - head + more.get(last, 0.0)
    first_bw = _first_backward(shape, cplan, plan, working, replay_last)
    grads = {s: 4.0 * n for s, n in psi.items()}
    # the flat copy that the data-parallel reduction sends is in the reduce dtype (ZeroStage.flat_grads)
    width = DTYPE_BYTES[plan.grad_reduce_dtype]
    # hybrid sharding: the replica all-reduce sends the fp32 shard itself, or a copy in a narrower reduce dtype
    wire = {s: width * n / plan.zero_shard for s, n in psi.items()} if _replica_copies(plan) else {}
    # the tied table's gradient (fp32), which the head's backward makes in stage 0's gradients
    tied = _table_bytes(shape, cplan) if uses else 0.0
    # ZeRO-3: the head's weight copy, in autocast's cache from its forward to the last stage's FREE
    head_copy = zero3_cached_head_bytes(shape, cplan) if last in psi else 0.0
    gathered = {last: grads[last] + head_copy} if head_copy else {}
    for s in in_window if cast else ():
        gathered[s] = gathered.get(s, grads[s]) + plan.stage_layers[s] * cast
    return StageBytes(
        activations=acts,
        grads=grads,
        flat={s: width * n for s, n in psi.items()},
        working=working,
        zero=plan.zero,
        dp=plan.zero_shard,  # what ZeRO shards over (hybrid sharding: the shard group)
        deferred_reduce=_deferred(plan.zero, plan.accumulation),
        uses=uses,
        tied=tied,
        wire=wire,
        held=held,
        gathered=gathered,
        first=first_bw,
        masks=masks,
    )


def _kept_boundaries(cplan: Plan, psi: dict[int, float], last: int) -> frozenset[int]:
    """The rank's stages whose output (the boundary tensor, `boundary_bytes`) the runtime keeps beside what
    autograd saves, from the stage's forward to its backward: on the 2D grid under no or selective recomputation,
    every stage but the last whose next stage is on this rank. The runtime keeps a stage's output only until its
    one reader (`PipelineEngine._forward`; its backward starts from the output's gradient edge): an output sent to
    another rank lives until its send completes (the p2p buffers, `_p2p_buffer_bytes`), and a next stage on this rank
    keeps it as its detached input until its own backward. A 1D stage's first norm saves that input, so the
    next stage's block activations count it; the 2D norm (`layers_2d._Norm2D`) saves its normalised x̂ instead,
    so nothing else counts it there (full recomputation's checkpoint saves the block's input: counted by the
    replayed block). Read off the dry run's live tensors (docs/memory.md, "The 2D grid's stage boundaries" and
    "Stage outputs freed once read")."""
    unsaved = cplan.tp_kind == "2d" and cplan.recompute != "full"
    return frozenset(s for s in psi if s != last and unsaved and s + 1 in psi)


def _kept_inputs(cplan: Plan, psi: dict[int, float]) -> frozenset[int]:
    """The rank's stages whose input, received from another rank, the runtime keeps beside what autograd saves
    until the stage's backward (`PipelineEngine._forward` keeps each stage's detached input, the receive buffer,
    as its backward's input-gradient leaf): on the 2D grid under no and selective recomputation every stage but
    the first whose previous stage runs on another rank. A 1D block's first norm saves that very storage, and
    full recomputation's checkpoint saves the block's input, so the block's activations count it there. Read
    off the dry run's live tensors: llama-70b, 2D 4×4 × pp4 breadth-first v2, the last pipeline rank holds its
    two stages' inputs for each of its 4 micro-batches (8 receive buffers, 16 MiB each) at its peak
    (docs/dryrun.md)."""
    if cplan.tp_kind != "2d" or cplan.recompute == "full":
        return frozenset()
    return frozenset(s for s in psi if s and s - 1 not in psi)


def _forward_in_window(plan: ExecutionPlan, rank: int) -> frozenset[int]:
    """ZeRO-3: the stages of pipeline rank ``rank`` of which a backward runs after a forward of the same stage
    in one GATHER/FREE window of its lowered list (a FREE clears autocast's cache, `precision.clear_weight_casts`),
    so that backward's replays find every weight copy that forward cast. The last stage's always do (each of its
    backwards follows one of its forwards in one window: `zero3_cached_head_bytes`); 1F1B's steady (F, B) pairs
    and a one-micro-batch rank's forward and backward run back to back do too; breadth-first's earlier stages
    and ZeRO-3's block stages without a pipeline do not. Read off the dry run (docs/memory.md, "The
    tensor-parallel rings' backward"): with the rings, a 1F1B pp2 first rank's stage of two blocks holds both
    blocks' exit copies at its peak (3.6 % under without them)."""
    if (plan.schedule or "").endswith(".csv"):  # a hand-written schedule: its lowered lists, as the runtime's
        return _in_window([(a.kind, a.stage) for a in plan.lowered()[rank]])
    name, p, m, v = plan.schedule or "", plan.pp, plan.micro_batches, plan.stages_per_rank
    return _named_in_window(name, p, m, v, rank, plan.placement, plan.accumulation)


@lru_cache(maxsize=1024)  # the search prices a list under several sizes, splits and ZeRO-3 shard groups
def _named_in_window(
    name: str, p: int, m: int, v: int, rank: int, placement: str, accumulation: str
) -> frozenset[int]:
    """`_forward_in_window` of a named schedule's list: it reads only these."""
    steps = _rank_steps(name, p, m, v, rank, placement, accumulation)
    return _in_window(lowered_events(steps, zero3=True, every_microbatch=False))


def _in_window(events: Sequence[tuple[ActionKind, int]]) -> frozenset[int]:
    """`_forward_in_window` of a lowered list given as (kind, stage)."""
    forwarded: set[int] = set()
    found: set[int] = set()
    for kind, stage in events:
        if kind is ActionKind.FORWARD:
            forwarded.add(stage)
        elif kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT) and stage in forwarded:
            found.add(stage)
        elif kind is ActionKind.FREE_PARAMS:
            forwarded.clear()  # the whole cache, whichever stage is freed
    return frozenset(found)


def _first_backward(
    shape: ModelShape, cplan: Plan, plan: ExecutionPlan, working: dict[int, float], last_replay: float
) -> dict[int, float]:
    """Under full recomputation, each stage's transient in its first backward of the step (after a ZeRO-2/3
    reduction dropped its gradients, the next backward is a first again) with the weight gradients that backward
    has made by its replayed block's moment, which the walk counts among the stage's gradients only once the
    backward is over: every later block's of the stage (their backwards ran before the first block's replay,
    the moment ``working`` prices), the first block's MLP output Linear's (fp32, its backward runs before the
    MLP's and the entry's moments) and, on the last stage, the head's ([V/t, h], fp32; with a tied table, the
    table's), made before the replay. ``last_replay``: the last stage's replay moment (``working`` there is the larger of it and
    the head's own). Read off the dry run's live tensors (docs/memory.md, "Full recomputation's moments"): with one
    micro-batch per stage every backward is a first.

    Under no and selective recomputation the block's moment holds the gradients its own backward has made by
    then (`first_backward_gradient_bytes`) and, on the last stage, the head's; the later blocks' gradients take
    the place of their freed activations, which the walk still counts (so none are added for them)."""
    if cplan.recompute not in REPLAYS_BLOCK:
        extra = first_backward_gradient_bytes(shape, cplan)
        last = plan.n_stages - 1
        first = {s: w + extra for s, w in working.items() if plan.stage_layers[s] and s != last}
        if last in working and plan.stage_layers[last]:
            first[last] = max(working[last], last_replay + extra + _table_bytes(shape, cplan))
        return first
    mlp_out = next(lin for lin in reversed(shape.block_linears()) if lin.name.startswith("mlp."))
    made = 4.0 * mlp_out.d_in * mlp_out.d_out / cplan.tp
    # at the attention entry's moment, the block's last, every other Linear's fp32 weight gradient is made (the
    # MLP's, the output projection's): it binds where those outweigh the MLP's moment, as at megatron-1t
    attention_in = {f"attn.{n}" for n in shape.features.attention_in}
    others = sum(lin.d_in * lin.d_out for lin in shape.block_linears() if lin.name not in attention_in)
    # the attention's moment in place of the replay's (the larger of its moments, ``working``'s part)
    shift = (
        attention_entry_bytes(shape, cplan) + 4.0 * others / cplan.tp - replay_gradient_bytes(shape, cplan)
    )
    extra = max(made, shift)
    # the backward replays a stage's blocks last to first: by its first block's moment (the one ``working``
    # prices: every block's weight copies cached) each later block's fp32 weight gradients are whole
    block = 4.0 * _block_params(shape, cplan)
    done = {s: (plan.stage_layers[s] - 1) * block for s in working if plan.stage_layers[s]}
    last = plan.n_stages - 1
    first = {s: w + extra + done[s] for s, w in working.items() if plan.stage_layers[s] and s != last}
    if last in working and plan.stage_layers[last]:
        first[last] = max(working[last], last_replay + extra + done[last] + _table_bytes(shape, cplan))
    return first


def _replica_copies(plan: ExecutionPlan) -> bool:
    """Hybrid sharding whose replica all-reduce sends a copy of each gradient shard in a reduce dtype narrower
    than the fp32 shard (`FlatStage.launch_replica_reduce`): the walk counts those copies."""
    return bool(plan.zero) and plan.zero_replicas > 1 and DTYPE_BYTES[plan.grad_reduce_dtype] < 4


_MICRO_BATCH_BYTES: dict[tuple, tuple[float, float, float, float, float]] = {}


def _micro_batch_bytes(shape: ModelShape, cplan: Plan) -> tuple[float, float, float, float, float]:
    """One micro-batch's (activations saved per block, a recomputed block's transient, the boundary tensor,
    the head's saved activations with its fp32 logits, the head's backward transient). Memoized on the fields
    `activation_bytes_per_layer`, `head_activation_bytes` and `boundary_bytes` read (the tensor split, the
    micro-batch, checkpointing, the dtypes, flash attention, whether ZeRO-3 clears autocast's cache): not the
    rest of ZeRO, the pipeline or the schedule, which the search varies around one micro-batch shape."""
    key = (
        shape,
        cplan.tp,
        cplan.tp_kind,
        cplan.sequence_parallel,
        cplan.micro_batch,
        cplan.recompute,
        cplan.dtype,
        cplan.autocast,
        cplan.flash_attention,
        cplan.document_mask,  # shared_mask_bytes, rope_position_bytes
        cplan.cp,  # a context rank's s/c tokens and gathered K/V
        cplan.zero_stage >= 3,  # full recomputation's replay recasts its weights (recompute_working_bytes)
        cplan.tp_comm_overlap,  # the rings' backward (ring_moment_bytes)
    )
    return _memo(_MICRO_BATCH_BYTES, key, lambda: _price_micro_batch(shape, cplan))


def _price_micro_batch(shape: ModelShape, cplan: Plan) -> tuple[float, float, float, float, float]:
    per_layer = activation_bytes_per_layer(shape, cplan)
    recompute = recompute_working_bytes(shape, cplan)
    # the replayed blocks build the micro-batch's masks again and share them (`replay_mask_bytes`: the walk
    # keeps them from the micro-batch's first replay on the rank to its last backward there)
    recompute += replay_mask_bytes(shape, cplan)
    logits = 4 * shape.seq_len // cplan.cp * cplan.micro_batch * shape.vocab_size / cplan.tp  # s/c tokens
    head = head_activation_bytes(shape, cplan) + logits
    # the loss's and the output layer's moment, before the stage's saved activations are freed: beside them, not
    # beside a recomputed block (the head's backward is over before the first block is recomputed)
    head_working = max(head_transient_bytes(shape, cplan) - recompute, 0.0)
    return per_layer, recompute, boundary_bytes(shape, cplan), head, head_working


def _p2p_buffer_bytes(shape: ModelShape, cplan: Plan, plan: ExecutionPlan) -> float:
    """The point-to-point buffers beside the walked moment: one micro-batch's send and receive of the boundary
    tensor, with a pipeline."""
    return 2 * boundary_bytes(shape, cplan) if plan.pp > 1 else 0.0


def _temporaries(shape: ModelShape, plan: ExecutionPlan, grads: dict[int, float]) -> float:
    """The optimizer step's temporaries beside the state: two of the largest shard (ZeRO's Adam denominator), or,
    once the update is done, with ``overlap_param_gather`` (d > 1) every stage's copy of its shard, the input of
    its all-gather left in flight (`ZeroStageComm.gather_updated_params`), if that is more. Without ZeRO:
    `_adamw_temporaries`."""
    if not plan.zero:
        return _adamw_temporaries(
            shape, cost_plan(plan), embedding=0 in grads, head=plan.n_stages - 1 in grads
        )
    s = plan.zero_shard  # the ranks ZeRO shards over
    adam = 2 * max(grads.values(), default=0.0) / s
    inputs = sum(grads.values()) / s if plan.overlap_param_gather and s > 1 else 0.0
    return max(adam, inputs)


def _adamw_temporaries(shape: ModelShape, cplan: Plan, *, embedding: bool, head: bool) -> float:
    """torch's AdamW without ZeRO (``foreach=False``, `make_optimizer`) updates one parameter at a time: its
    denominator sqrt(v), then that over the bias correction (two fp32 tensors of the parameter's shape), while the
    previous parameter's denominator is still referenced (the loop's variable is rebound only once the new one is
    made). The largest such moment: the vocabulary table's shard, twice, and when it is the output layer's own
    (untied, or a tied copy on the last pipeline rank) the block matrix updated before it (a block's largest
    Linear counted); the embedding's table is the first parameter, with nothing before it; or a block's largest
    Linear three times. Not counted before 2026-12-03 (docs/memory.md)."""
    block = _largest_parameter(shape, cplan, table=False)
    tables = 0.0
    if embedding or head:
        after_blocks = head and not (shape.tied and embedding)  # the output layer's table follows the blocks
        tables = 2 * _table_bytes(shape, cplan) + (block if after_blocks else 0.0)
    return max(tables, 3 * block)


def _largest_parameter(shape: ModelShape, cplan: Plan, table: bool) -> float:
    """fp32 bytes of the largest parameter tensor a rank holds: a block's largest Linear, or with ``table`` the
    vocabulary table's shard ([V/t, h] padded to a multiple of t; 2D: its [V_pad/q, h/q] block)."""
    block = max((lin.d_in * lin.d_out for lin in shape.block_linears()), default=0) / cplan.tp
    return max(4.0 * block, _table_bytes(shape, cplan) if table else 0.0)


def _table_bytes(shape: ModelShape, cplan: Plan) -> float:
    """fp32 bytes of a rank's shard of the vocabulary table (its gradient's too): [V/t, h], V padded to a multiple
    of t; 2D: its [V_pad/q, h/q] block."""
    side = cplan.q if cplan.tp_kind == "2d" else cplan.tp
    return 4.0 * -(-shape.vocab_size // side) * side * shape.d_model / cplan.tp


def _rank_walk(plan: ExecutionPlan, rank: int, sizes: StageBytes) -> Walk:
    """The compiled walk of the lowered list pipeline rank ``rank`` executes (`tessera.peak_memory`), for the
    stage sizes ``sizes`` (`_stage_sizes`: which stages share terms, which stages a GATHER brings)."""
    uses = sizes.uses
    classes = _stage_classes(plan, rank, sizes)
    held = _held_inputs(plan)
    if (plan.schedule or "").endswith(".csv"):  # a hand-written schedule: its lowered lists, as the runtime's
        events = ((a.kind, a.stage) for a in plan.lowered()[rank])
        deferred = _deferred(plan.zero, plan.accumulation)
        return compile_walk(
            events,
            zero=plan.zero,
            sharded=plan.zero_shard > 1,
            deferred_reduce=deferred,
            uses=uses,
            classes=classes,
            replicated=_replica_copies(plan),
            held_inputs=held,
        )
    name, p, m, v = plan.schedule or "", plan.pp, plan.micro_batches, plan.stages_per_rank
    args = (
        plan.placement,
        plan.accumulation,
        plan.zero,
        plan.zero_shard > 1,
        tuple(sorted(uses.items())),
        tuple(sorted(classes.items())),
        plan.exchanged_stages(rank),
        _replica_copies(plan),
        held,
    )
    if not steady_walk(name, p, m, v, rank, plan.accumulation):
        return _named_walk(name, p, m, v, rank, *args)
    # every steady count of this list has one walk (`steady_walk`): the first asked for is walked for all
    key = (name, p, v, rank, *args)
    return _memo(_STEADY_WALKS, key, lambda: _named_walk(name, p, m, v, rank, *args))


_STEADY_WALKS: dict[tuple, Walk] = {}

SPARE_PERIODS = 5
"""Whole periods of a steady list from which `steady_walk` shares its walk. Three suffice for the walk's moments
(its proof); `compile_walk`'s bookkeeping keeps the same `Walk` from four on in every case checked (interleaved
p = 8, v = 4, ZeRO-3 needs four; 1F1B and breadth-first three); one more for margin."""


def steady_walk(name: str, p: int, m: int, v: int, rank: int, accumulation: str) -> bool:
    """Whether pipeline rank ``rank``'s list of schedule ``name`` with ``m`` micro-batches repeats one period at
    least `SPARE_PERIODS` times after its warm-up: then its walk (`_named_walk`, every other argument the same)
    equals that of every larger such m (for interleaved, every larger multiple of p). The planner's search prices
    each layout under several m (the batch split into more or fewer micro-batches): the walk of a schedule, rank
    and reduction mode is compiled once for all its steady m.

    The lists. The walk (`tessera.peak_memory`) reads a list as (kind, stage) pairs, not micro-batch indices.

    - 1F1B, rank r, m > w = p - 1 - r: A = w forwards, then n = m - w periods U = (F, B), then C = w backwards.
    - interleaved, m = g·p with g ≥ 2: A = W = 2(p-1-r) + (v-1)·p forwards (W < m·v), then m·v - W
      forward/backward pairs (pair i: forward W + i, backward i), then W backwards. A virtual index k's stage
      depends on k mod p·v only (chunk (k mod p·v) // p), so the pairs repeat every p·v: n = g - ⌈W / p·v⌉
      whole periods U, then a partial one whose length (-W mod p·v) and the last W backwards' stages do not
      depend on g (m·v is a multiple of p·v); C is that partial period and the backwards. Every stage's last
      backward is among the last p·v, after the whole periods. (m = p: all forwards first, a ramp.)
    - breadth-first with depth-first accumulation (one micro-batch at a time): A empty, n = m periods U = the
      rank's stages forward, then backward in reverse.

    Lowering keeps the form: ZeRO-3's GATHER/FREE around each run of one stage depend on the neighbouring
    actions only (periodic inside, A and C at the ends), REDUCE_MB follows each backward, and a stage's one
    REDUCE (ZeRO-1, layered) and the tied stages' EXCHANGE/REDUCE come after its last backward (in C, or in
    the last period where C is empty).

    Why the moments are equal for every n ≥ 3. The walk's state (counts alive per term; the stages holding
    gradients, shards, gathered parameters, running totals, wire copies; the reduction in flight; the note
    bookkeeping) after A·U^k is a fixed point of U from k = 2 on: each period forwards and backwards every
    stage of the rank equally often (activations return), its first backward of each stage creates that
    stage's gradients, its first reduction of each stage makes ZeRO's shard (ZeRO-2/3 then drop the gradients
    at each reduction), ZeRO-3's gathers are freed inside the period or span the whole list, and plain data
    parallelism's running totals exist from the second period on (the first period's last reduction is settled
    in the second). ZeRO stages ≥ 1 already reach it at k = 1. A REDUCE in U is never its stage's last except
    in the last period when C is empty, and "last" matters only with ZeRO ≥ 1 (the deferred ZeRO-1 reduction,
    hybrid sharding's wire copies), whose state is fixed from k = 1. So with n ≥ 3, the periods from the third
    on start from the fixed point and note the moments of the third, and C starts from it: the distinct moments,
    in the order of their first occurrence, and what is held after backward, are those of n = 3, so the peak
    for any sizes is the same. `compile_walk` walks that same sequence of states, but its bookkeeping (period
    skips, ramps collapsed to their ends, covered moments dropped) can keep a few more or fewer of the moments
    that are never the only largest, depending on how many periods it sees: its `Walk` objects are equal from
    n = 4 on in every case checked, hence `SPARE_PERIODS` = 5, and that equality is the test (every m up to
    6·(p + 4)·v, every rank, ZeRO 0-3 with and without data parallelism, hybrid sharding's wire copies, tied
    stages, stage classes: tests/unit/test_plan_speed.py; it fails with 3).

    GPipe, 1F1B with m ≤ w, interleaved with m = p and layered breadth-first hold all m micro-batches in flight:
    their counts grow with m, and they are walked for each m (ramps: `compile_walk` collapses them to their
    ends, so they are cheap)."""
    if name == "1f1b":
        return m - (p - 1 - rank) >= SPARE_PERIODS
    if name == "interleaved":
        warmup = 2 * (p - 1 - rank) + (v - 1) * p
        return m % p == 0 and m > p and m // p - -(-warmup // (p * v)) >= SPARE_PERIODS
    return name == BREADTH_FIRST and accumulation != LAYERED and m >= SPARE_PERIODS


def _stage_classes(plan: ExecutionPlan, rank: int, sizes: StageBytes) -> dict[int, int]:
    """The rank's stages -> the first of its stages with the same place in the list (blocks, embedding, head,
    neighbours on the rank) and the same sizes in every per-stage table of ``sizes``, which the walk then prices
    once. The sizes decide, not a list of what makes them differ: until 2026-12-03 the key was the place alone,
    and a ZeRO-3 stage that holds its forward's cast copies through its backward (`_forward_in_window`, e.g.
    breadth-first's last stage on a rank) was priced as the rank's other one-block stages, without them:
    megatron-1t on 65,536 GPUs, rank 0, -1.8 % under the dry run (docs/memory.md, "A window stage is priced on
    its own")."""
    mine = plan.rank_stages(rank)
    local, last = set(mine), plan.n_stages - 1
    # the walk's other tables follow from these (the shard and a reduction's output from grads and flat), are
    # stage 0's (the tied table: its own class) or one size for every stage (the masks)
    tables = (
        sizes.activations,
        sizes.grads,
        sizes.flat,
        sizes.working,
        sizes.wire,
        sizes.held,
        sizes.first,
        sizes.gathered,
    )
    first: dict[tuple, int] = {}
    return {
        s: first.setdefault(
            (
                plan.stage_layers[s],
                s == 0,
                s == last,
                s + 1 in local,
                s - 1 in local,
                *[table.get(s) for table in tables],
            ),
            s,
        )
        for s in mine
    }


def _held_inputs(plan: ExecutionPlan) -> bool:
    """Whether the walk counts what a stage's backward leaves for the previous stage on the same rank (the input's
    gradient, `StageBytes.held`) and the masks a micro-batch's replays keep (`StageBytes.masks`): under full
    recomputation (measured with the dry run: docs/memory.md, "Full recomputation's moments" and "Stage outputs
    freed once read"). Under no or selective recomputation the same gradient is alive, but that was not
    measured: not counted."""
    return cost_plan(plan).recompute == "full"


@lru_cache(
    maxsize=4096
)  # a few hundred lists in a search of thousands of layouts; a Walk holds a few moments
def _named_walk(
    name: str,
    p: int,
    m: int,
    v: int,
    rank: int,
    placement: str,
    accumulation: str,
    zero: int,
    sharded: bool,
    uses: tuple[tuple[int, tuple[int, ...]], ...],
    classes: tuple[tuple[int, int], ...],
    exchanged: tuple[int, ...] = (),
    replicated: bool = False,
    held_inputs: bool = False,
) -> Walk:
    every = reduces_every_microbatch(accumulation, zero)
    events = _rank_events(name, p, m, v, rank, placement, accumulation, zero == 3, every, exchanged)
    deferred = _deferred(zero, accumulation)
    return compile_walk(
        events,
        zero=zero,
        sharded=sharded,
        deferred_reduce=deferred,
        uses=dict(uses),
        classes=dict(classes),
        replicated=replicated,
        held_inputs=held_inputs,
    )


@lru_cache(
    maxsize=128
)  # the search varies ZeRO and checkpointing around one schedule: its lists recur nearby
def _rank_events(
    name: str,
    p: int,
    m: int,
    v: int,
    rank: int,
    placement: str,
    accumulation: str,
    zero3: bool,
    every_microbatch: bool,
    exchanged: tuple[int, ...] = (),
) -> list[tuple[ActionKind, int]]:
    """The lowered list pipeline rank ``rank`` executes, as (kind, stage), without point-to-point actions
    (``exchanged``: its stages tied across ranks, `ExecutionPlan.exchanged_stages`)."""
    steps = _rank_steps(name, p, m, v, rank, placement, accumulation)
    return lowered_events(steps, zero3=zero3, every_microbatch=every_microbatch, exchanged=exchanged)


# the ZeRO stages of one schedule share its compute list: 188 distinct of 421 in 1T's search
@lru_cache(maxsize=256)
def _rank_steps(
    name: str, p: int, m: int, v: int, rank: int, placement: str, accumulation: str
) -> tuple[Step, ...]:
    """Pipeline rank ``rank``'s compute list (`schedules.rank_steps`), immutable: shared by the lowered lists of
    the ZeRO stages and reductions that `_rank_events` builds on it."""
    options: dict[str, object] = dict(compute_options(name, accumulation))
    if placement != "loop":
        options["placement"] = placement
    return tuple(rank_steps(name, p, m, v, rank, **options))


def _deferred(zero: int, accumulation: str) -> bool:
    """ZeRO-1 with depth-first accumulation reduce-scatters each stage once per step, at its last REDUCE (the full
    gradients stay; `ZeroStageComm.reduce` launches there, under the backwards of the stages below)."""
    return zero == 1 and accumulation != LAYERED


def _candidate_ranks(plan: ExecutionPlan) -> list[int]:
    """Pipeline ranks that can be the fullest: the first and the last (embedding, head), and of the others the
    first of each stage-size profile. A named schedule never holds more in flight on a later rank (warm-up
    shrinks with the rank; `_inflight`'s counts and the walked lists of tests/unit/test_peak_memory.py), so a
    later rank with the same stages holds no more. A hand-written schedule: every rank."""
    p = plan.pp
    if (plan.schedule or "").endswith(".csv"):
        return list(range(p))
    if _even(plan):
        return sorted({0, p - 1})
    first: dict[tuple[int, ...], int] = {}
    for r in range(1, p - 1):
        first.setdefault(tuple(plan.stage_layers[s] for s in plan.rank_stages(r)), r)
    return sorted({0, p - 1, *first.values()})


def _adjust(
    base: MemoryBreakdown,
    shape: ModelShape,
    plan: Plan,
    stage_psi: list[float],
    last_inflight: int,
    masked_pairs: float,
) -> MemoryBreakdown:
    """tessera-specific terms: exact per-rank parameters, the head's per-micro-batch activations, the document
    mask each stage keeps per micro-batch (``masked_pairs``: (stage × micro-batch) pairs in flight, of stages
    with blocks; `shared_mask_bytes`), and the buffers of tessera's ZeRO implementation (see the module
    docstring)."""
    params, grads, optimizer = model_state_bytes(sum(stage_psi), plan.zero_dp, plan.zero_stage, "fp32")
    sbh = shape.seq_len * plan.micro_batch * shape.d_model * plan.stream_bytes  # the fp32 residual stream
    logits = 4 * shape.seq_len // plan.cp * plan.micro_batch * shape.vocab_size / plan.tp  # s/c tokens
    head = last_inflight * (head_activation_bytes(shape, plan) + logits)
    # a recomputed block, or on the last stage the head's moment if larger (`memory_per_rank` puts it on the
    # pipeline's last position; here it follows the head, wherever the placement puts it)
    working = recompute_working_bytes(shape, plan)
    if last_inflight:
        # a block's moment comes after the loss's backward has freed the micro-batch's head tensors
        working = max(
            working - head_activation_bytes(shape, plan) - logits, head_transient_bytes(shape, plan)
        )
    largest = max(stage_psi, default=0.0)
    biggest = largest * 4.0
    flat = largest * plan.grad_reduce_width  # the reduction's flat copy, in its dtype
    buffers = (2 * sbh if plan.pp > 1 else 0.0) + (flat if plan.dp > 1 or plan.zero_stage else 0.0)
    if plan.zero_stage >= 2:
        buffers += biggest  # the full gradients of the stage in backward, before its reduce-scatter
    if plan.zero_stage >= 3 and plan.zero_dp > 1:
        buffers += biggest  # one stage's gathered parameters
    return MemoryBreakdown(  # built directly: dataclasses.replace costs a field scan per call in the search
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=base.activations + head + masked_pairs * shared_mask_bytes(shape, plan),
        working=max(working, 0.0),
        comm_buffers=buffers,
        cast_cache=base.cast_cache,
    )
