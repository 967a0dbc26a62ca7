"""Step time of one layout: the pipeline simulator on the lowered schedule IR, timed with the cost model.

Per-action durations (all from `tessera.planner.cost`):

- ``F`` of a chunk: its L/(p·v) blocks' forward compute + exposed tensor-parallel time (`stage_time`); the last
  global stage adds the output layer and loss (`logits_time`). ``B``: backward + recompute + exposed TP (+ logits
  backward on the last stage).
- ``SEND``/``RECV``: free on the rank; the transfer (`p2p_time_per_microbatch`) is the simulator's
  ``comm_latency`` between a SEND's end and the earliest end of its RECV (asynchronous p2p, exposed only when a
  rank has nothing else to do).
- ``REDUCE``: free on the rank; its data-parallel reduction is queued on the rank's DP channel, released layer by
  layer during the stage's last backward (bucketed overlap), and only what is still running after the rank's
  last compute is exposed (`dp_exposure`), and each hidden second slows the compute under it by the hardware's
  `overlap_slowdown` (`dp_cost`). ZeRO-3's parameter gathers (before each use) go through the same
  queue, released evenly over the step (prefetch), except the first, which is exposed; ZeRO-1/2's all-gather of
  the updated parameters runs inside the optimizer step and is exposed in full, or with `Plan.overlap_param_gather`
  is deferred to the next step, its first stage's share exposed and the rest queued from the step's start
  (`_gathers`, as `parallel/zero.py` does it). Data-parallel collectives are issued per block (`dp_parts`
  buckets). With hybrid sharding (`Plan.zero_shard`) ZeRO's collectives are priced on the shard group's placement
  and each stage's all-reduce of its gradient shard over the replica group (`cost.replica_reduce_time`) joins
  the queue at the rank's first reduction after the stage's last one, the last reduced stage's at the end of the
  backward, as `ZeroStageComm` launches them (`_replica_releases`, `_fast_replica`): hidden under the backward it
  slows it, whatever runs past the last compute is exposed. Tensor-parallel time is
  `cost.tp_comm_time_per_layer` in each F/B (rings under the GEMM chunks with `Plan.tp_comm_overlap`,
  `cost.tp_overlap`).
- ``EXCHANGE`` (a tied embedding and head on two pipeline ranks): both ranks swap the table's gradient
  (`tied_exchange_time`) once both reached it, at the end of their lists (counted as PP time); the two stages'
  one REDUCE follows it and is released whole when it runs, not under a backward (`fast_step` likewise).
- Gradient clipping's norm all-reduce and the optimizer step (`optimizer_time`) follow, unoverlapped.

Two ways to get the number, which agree (tests/unit/test_search.py checks them against each other):

- `simulate_step`: builds, lowers and simulates the exact schedule (used for the reported top layouts and
  pictures; cost grows with p·v·m actions).
- `fast_step`: closed forms checked against the simulator for equal chunk costs. With f, b the forward and
  backward (incl. recompute and TP) of one chunk and k the number of p2p transfers on the critical path:
  ``T_pipe = (v·m + p − 1)·(f + b) + m·(f_out + b_out) + k·t_p2p`` for GPipe, 1F1B and interleaved, with
  k = 2(p − 1) (GPipe), 2(p·v − 1) (interleaved), max(2(p − 1), (2 − 2/p)·m + 2(p − 2)) (1F1B: its F/B pairs
  wait for each transfer in steady state; exact for m ≥ p). Breadth-first:
  ``(v·m + p − 1)(f + b) + 2(p − 1)·t + (v − 1)·[max(0, p(f + t) − m·f) + max(0, p(b + t) − m·b)] + m·(f_out +
  b_out)``: each of the v − 1 wrap-arounds stalls until the first micro-batch has looped through the p ranks
  (exact vs the simulator, including m < p). The DP queue is the same function fed with release times derived
  from the schedule's order. This is what the search uses (microseconds per layout).

Breakdown (seconds on the critical rank; the parts add up to the step time): compute (F/B incl. recompute and
the output layer), exposed TP, bubble (idle time of the pipeline with free p2p), PP (extra time the p2p transfers
add), DP (exposed data-parallel traffic and the compute its hidden part slows), optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import lru_cache

from tessera.pipeline.build import compute_options
from tessera.pipeline.ir import ActionKind
from tessera.pipeline.passes import lower, tied_stages
from tessera.pipeline.schedules import build_schedule
from tessera.planner.cost import (
    OPTIMIZER_BYTES_PER_PARAM,
    LayerTime,
    ModelShape,
    Plan,
    cp_comm_time_per_layer,
    dp_collective_times,
    embedding_time,
    layer_time,
    layers_per_stage,
    logits_time,
    p2p_time_per_microbatch,
    params_per_rank,
    per_microbatch_reduction,
    replica_reduce_time,
    stage_params_per_rank,
    tied_exchange_time,
    tp_comm_time_per_layer,
)
from tessera.planner.hardware import Hardware
from tessera.planner.network import collective_time, placement
from tessera.sim.simulator import SimResult, TimelineEntry, simulate, step_time, timeline

__all__ = [
    "CONFIG_TO_IR",
    "FP32_OPTIMIZER_BYTES_PER_PARAM",
    "ChunkCosts",
    "PipelineCosts",
    "StepBreakdown",
    "balanced_stage_layers",
    "chunk_costs",
    "chunk_from_layer",
    "clip_norm_time",
    "dp_cost",
    "dp_exposure",
    "dp_parts",
    "fast_step",
    "gather_units",
    "inflight_microbatches",
    "most_params",
    "optimizer_time",
    "p2p_hops",
    "pipeline_costs",
    "pipeline_from_layer",
    "pipeline_time",
    "pipeline_units",
    "rank_blocks",
    "simulate_step",
    "simulated_breakdown",
]

CONFIG_TO_IR = {
    "1f1b": "1f1b",
    "gpipe": "gpipe",
    "interleaved": "interleaved_1f1b",
    "breadth_first": "breadth_first",
}
"""Schedule names of `tessera.config` → names of the schedule registry (`tessera.pipeline.schedules`)."""

FP32_OPTIMIZER_BYTES_PER_PARAM = 28
"""Plain fp32 AdamW: read param, grad, m, v (16) and write param, m, v (12). Assumption, like the mixed value."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StepBreakdown:
    """Seconds of one optimizer step on the critical rank; the parts add up to `step_time`."""

    compute: float
    tp_comm: float
    cp_comm: float = 0.0
    """Context parallelism's K/V all-gathers and dK/dV reduce-scatters (`cost.cp_comm_time_per_layer`): exposed."""
    bubble: float
    pp_comm: float
    dp_comm: float
    optimizer: float

    @property
    def step_time(self) -> float:
        return (
            self.compute
            + self.tp_comm
            + self.cp_comm
            + self.bubble
            + self.pp_comm
            + self.dp_comm
            + self.optimizer
        )

    def as_dict(self) -> dict[str, float]:
        """The parts by name plus ``step_time``."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"step_time": self.step_time}

    @property
    def parts(self) -> dict[str, float]:
        """The parts by name (no total)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(kw_only=True, slots=True, frozen=True)
class ChunkCosts:
    """Per-micro-batch seconds of one chunk (L/(p·v) blocks) on one rank, and of the other step pieces."""

    fwd_compute: float
    bwd_compute: float
    """Backward + recompute."""
    fwd_tp: float
    bwd_tp: float
    """Exposed tensor-parallel time in backward, incl. replayed forward collectives under full recompute."""
    out_fwd: float
    out_bwd: float
    """Output layer + loss on the last global stage."""
    p2p: float
    """One boundary transfer, one direction."""
    layers: int
    """Blocks per chunk."""
    fwd_cp: float = 0.0
    bwd_cp: float = 0.0
    """Exposed context-parallel time (K/V gathers forward; dK/dV reduce-scatters and replayed gathers backward)."""

    @property
    def fwd(self) -> float:
        return self.fwd_compute + self.fwd_tp + self.fwd_cp

    @property
    def bwd(self) -> float:
        return self.bwd_compute + self.bwd_tp + self.bwd_cp


def _per_layer(
    shape: ModelShape, hw: Hardware, plan: Plan
) -> tuple[LayerTime, LayerTime, LayerTime, float, LayerTime]:
    return (
        layer_time(shape, hw, plan),
        tp_comm_time_per_layer(shape, hw, plan),
        logits_time(shape, hw, plan),
        p2p_time_per_microbatch(shape, hw, plan),
        cp_comm_time_per_layer(shape, hw, plan),
    )


def chunk_costs(shape: ModelShape, hw: Hardware, plan: Plan) -> ChunkCosts:
    """Durations of one chunk's F and B for one micro-batch with equal stages (module docstring); raises when
    the layers do not split evenly (use `pipeline_costs`, which honours `plan.stage_layers`)."""
    lt, tp, lg, p2p, cp = _per_layer(shape, hw, plan)
    return chunk_from_layer(layers_per_stage(shape, plan)[0], lt, tp, lg, p2p, cp)


@dataclass(kw_only=True, slots=True, frozen=True)
class PipelineCosts:
    """Per-micro-batch costs of every global stage: `counts[s]` blocks of `block` each, the embedding on global
    stage 0 and the output layer (`block.out_fwd/out_bwd`) on the last one."""

    block: ChunkCosts
    """One block (layers = 1), the output layer and one p2p transfer."""
    counts: tuple[int, ...]
    """Blocks per global stage (c·p + r is chunk c of pipeline rank r)."""
    emb: LayerTime
    """Embedding compute on global stage 0."""
    emb_tp: LayerTime
    """Embedding's exposed tensor-parallel collective on global stage 0."""

    def forward(self, stage: int) -> float:
        """F duration of global stage `stage`."""
        t = self.counts[stage] * self.block.fwd
        t += self.emb.forward + self.emb_tp.forward if stage == 0 else 0.0
        return t + (self.block.out_fwd if stage == len(self.counts) - 1 else 0.0)

    def backward(self, stage: int) -> float:
        """B duration of global stage `stage` (backward + recompute + exposed TP)."""
        t = self.counts[stage] * self.block.bwd
        t += self.emb.backward + self.emb_tp.backward if stage == 0 else 0.0
        return t + (self.block.out_bwd if stage == len(self.counts) - 1 else 0.0)

    def rank_parts(self, p: int, rank: int) -> tuple[float, float, float]:
        """(compute, exposed TP, exposed context-parallel) seconds of pipeline rank `rank` for one micro-batch
        over all its chunks."""
        blocks = rank_blocks(self.counts, p)[rank]
        b = self.block
        compute = blocks * (b.fwd_compute + b.bwd_compute)
        tp = blocks * (b.fwd_tp + b.bwd_tp)
        if rank == 0:
            compute, tp = compute + self.emb.forward + self.emb.backward, tp + self.emb_tp.forward
        if rank == p - 1:
            compute += b.out_fwd + b.out_bwd
        return compute, tp, blocks * (b.fwd_cp + b.bwd_cp)

    def critical_rank(self, p: int) -> int:
        """The pipeline rank with the most work per micro-batch (the last one on ties: it holds the head)."""
        return max((sum(self.rank_parts(p, r)), r) for r in _ends_or_all(self.counts, p))[1]

    def chunk(self, p: int, v: int) -> ChunkCosts:
        """An average chunk (the rank's blocks / v), for the closed forms' fill terms and the DP queue."""
        blocks = sum(self.counts) / (p * v)
        b = self.block
        return ChunkCosts(
            fwd_compute=blocks * b.fwd_compute,
            bwd_compute=blocks * b.bwd_compute,
            fwd_tp=blocks * b.fwd_tp,
            bwd_tp=blocks * b.bwd_tp,
            fwd_cp=blocks * b.fwd_cp,
            bwd_cp=blocks * b.bwd_cp,
            out_fwd=b.out_fwd,
            out_bwd=b.out_bwd,
            p2p=b.p2p,
            layers=max(1, round(blocks)),
        )


@lru_cache(maxsize=4096)
def rank_blocks(counts: tuple[int, ...], p: int) -> tuple[int, ...]:
    """Blocks held by each pipeline rank: the sum over its chunks c·p + r."""
    return tuple(sum(counts[r::p]) for r in range(p))


def _ends_or_all(counts: tuple[int, ...], p: int) -> list[int]:
    """Ranks that can be critical: with equal per-rank blocks only the first and last (embedding, head)."""
    blocks = rank_blocks(counts, p)
    if blocks.count(blocks[0]) == len(blocks):
        return sorted({0, p - 1})
    return list(range(p))


@lru_cache(maxsize=1024)  # pure; the search asks once per layout variant, for a few hundred distinct splits
def balanced_stage_layers(n_layers: int, p: int, first_extra: float, last_extra: float) -> tuple[int, ...]:
    """Blocks per stage (one chunk per rank) that even out the work when the first stage also runs the embedding
    and the last the output layer and loss, `first_extra`/`last_extra` in units of one block's work: the ends get
    round(target − extra) blocks (≥ 0), target = (L + extras)/p, and the middle stages share the rest evenly."""
    from tessera.config import even_split  # torch-free; the one place that splits layers evenly

    if p <= 1:
        return (n_layers,)
    target = (n_layers + first_extra + last_extra) / p
    first = min(n_layers, max(0, round(target - first_extra)))
    if p == 2:
        return (first, n_layers - first)
    last = min(n_layers - first, max(0, round(target - last_extra)))
    return (first, *even_split(n_layers - first - last, p - 2), last)


def pipeline_costs(shape: ModelShape, hw: Hardware, plan: Plan) -> PipelineCosts:
    """Every global stage's costs for `plan` (`layers_per_stage`: `stage_layers` or an even split)."""
    lt, tp, lg, p2p, cp = _per_layer(shape, hw, plan)
    emb, emb_tp = embedding_time(shape, hw, plan)
    return pipeline_from_layer(layers_per_stage(shape, plan), lt, tp, lg, p2p, emb, emb_tp, cp)


def pipeline_from_layer(
    counts: tuple[int, ...],
    lt: LayerTime,
    tp: LayerTime,
    lg: LayerTime,
    p2p: float,
    emb: LayerTime,
    emb_tp: LayerTime,
    cp: LayerTime | None = None,
) -> PipelineCosts:
    """`PipelineCosts` from one block's compute, TP and context-parallel time, the output layer, one transfer
    and the embedding."""
    return PipelineCosts(
        block=chunk_from_layer(1, lt, tp, lg, p2p, cp), counts=tuple(counts), emb=emb, emb_tp=emb_tp
    )


def chunk_from_layer(
    layers: int, lt: LayerTime, tp: LayerTime, lg: LayerTime, p2p: float, cp: LayerTime | None = None
) -> ChunkCosts:
    """A chunk of ``layers`` layers from one layer's compute ``lt``, exposed TP time ``tp`` and exposed
    context-parallel time ``cp`` (none without), plus the output layer ``lg`` (charged on the last stage) and one
    boundary transfer ``p2p``."""
    cp = cp or LayerTime(forward=0.0, backward=0.0, recompute=0.0)
    return ChunkCosts(
        fwd_compute=layers * lt.forward,
        bwd_compute=layers * (lt.backward + lt.recompute),
        fwd_tp=layers * tp.forward,
        bwd_tp=layers * (tp.backward + tp.recompute),
        fwd_cp=layers * cp.forward,
        bwd_cp=layers * (cp.backward + cp.recompute),
        out_fwd=lg.forward,
        out_bwd=lg.backward,
        p2p=p2p,
        layers=max(1, layers),
    )


def inflight_microbatches(schedule: str, p: int, m: int, v: int, stage: int) -> float:
    """Peak stored activations of pipeline rank `stage`, in units of all its L/p blocks for one micro-batch
    (the `inflight_microbatches` argument of `memory_per_rank`). Checked against the simulator's peak count:
    1F1B min(p − r, m); GPipe m; interleaved min(2(p−1−r) + (v−1)p + 1, v·m)/v (m when m = p);
    breadth-first m."""
    if schedule == "1f1b":
        return float(min(p - stage, m))
    if schedule == "interleaved":
        if m == p:  # Megatron's rule: with m == p every rank runs all forwards first
            return float(m)
        return min(2 * (p - 1 - stage) + (v - 1) * p + 1, v * m) / v
    return float(m)


def pipeline_units(schedule: str, p: int, m: int, v: int) -> float:
    """Pipeline length in chunk (f + b) units with equal chunks and free p2p (exact vs the simulator)."""
    stall = (v - 1) * max(0, p - m) if schedule == "breadth_first" else 0
    return v * m + p - 1 + stall


def pipeline_time(schedule: str, p: int, m: int, v: int, f: float, b: float, t: float) -> float:
    """Pipeline length with equal chunks (f, b) and p2p time t, without the output layer (module docstring)."""
    t = t if p > 1 else 0.0  # one rank: no transfers
    if schedule == "breadth_first":
        hops = 2 * (p - 1) * t if p > 1 else 0.0
        stall = (v - 1) * (max(0.0, p * (f + t) - m * f) + max(0.0, p * (b + t) - m * b))
        return (v * m + p - 1) * (f + b) + hops + stall
    return pipeline_units(schedule, p, m, v) * (f + b) + p2p_hops(schedule, p, m, v) * t


def p2p_hops(schedule: str, p: int, m: int, v: int) -> float:
    """Transfers on the critical path: d(step time)/d(p2p time) of the simulator (module docstring)."""
    if p <= 1:
        return 0.0
    if schedule == "gpipe" or (schedule == "breadth_first" and m >= p):
        return 2.0 * (p - 1)
    if schedule in ("interleaved", "breadth_first"):
        return 2.0 * (p * v - 1)
    return max(2.0 * (p - 1), (2 - 2 / p) * m + 2 * (p - 2))


def dp_parts(params_local: float, hw: Hardware, plan: Plan, buckets: int = 1) -> tuple[float, float]:
    """(reduction, parameter all-gather) seconds per step of `params_local` parameters over the data group:
    `cost.dp_collective_times` with parameters `Plan.param_bytes` wide (fp32 under tessera's autocast, the
    compute dtype in the published accounting) and gradients `Plan.grad_reduce_width` wide (the same unless a
    bf16 ZeRO reduce-scatter narrows them), one call per bucket (the search and the simulator pass the rank's
    layer count: the trainer reduces and gathers per block)."""
    return dp_collective_times(
        params_local,
        hw,
        plan,
        grad_bytes=plan.grad_reduce_width,
        param_bytes=plan.param_bytes,
        buckets=buckets,
    )


def dp_exposure(items: list[tuple[float, float]], end: float) -> float:
    """Exposed seconds of a FIFO communication channel: `items` are (release time, duration), served in release
    order, one at a time; whatever is still running after `end` (the rank's last compute) is exposed."""
    clock = 0.0
    for release, duration in sorted(items):
        clock = max(clock, release) + duration
    return max(0.0, clock - end)


def dp_cost(items: list[tuple[float, float]], end: float, hw: Hardware) -> float:
    """Seconds a rank's data-parallel channel adds to its step: what still runs after `end` (`dp_exposure`) plus
    the compute it slows while hidden under it, `hw.overlap_slowdown` × the hidden seconds (first order: the
    slowed compute does not move the releases)."""
    exposed = dp_exposure(items, end)
    hidden = max(0.0, sum(duration for _, duration in items) - exposed)
    return exposed + hw.overlap_slowdown * hidden


def optimizer_time(shape: ModelShape, hw: Hardware, plan: Plan) -> float:
    """Per-step fixed work after the last backward, unoverlapped: gradient clipping's norm (an all-reduce of one
    fp32 over all ranks: pure latency, `clip_norm_time`) and the Adam step, memory bound: Ψ_local (÷d with
    ZeRO ≥ 1) × bytes per parameter / HBM bandwidth, on the rank with the most parameters (`most_params`): the
    fp32 AdamW's 28 when the parameters are fp32 (`Plan.param_bytes`: fp32 training, tessera's autocast, whose
    master weights are the parameters), the mixed-precision step's 32 otherwise."""
    psi = most_params(shape, plan)
    if plan.zero_stage >= 1:
        psi /= plan.zero_dp  # the shard group's size (hybrid sharding), else d
    per = FP32_OPTIMIZER_BYTES_PER_PARAM if plan.param_bytes == 4 else OPTIMIZER_BYTES_PER_PARAM
    return psi * per / hw.hbm_bandwidth + clip_norm_time(hw, plan)


def most_params(shape: ModelShape, plan: Plan) -> float:
    """Parameters of the pipeline rank holding the most (`params_per_rank` on the actual stage split): the first
    or last rank with even stages, any rank with uneven ones (whose ends are usually lightened)."""
    ranks = range(plan.pp) if plan.stage_layers is not None else sorted({0, plan.pp - 1})
    return max(params_per_rank(shape, plan, r) for r in ranks)


def clip_norm_time(hw: Hardware, plan: Plan) -> float:
    """Gradient clipping's global norm: partial sums of squares all-reduced over every rank (data, tensor and
    pipeline groups together, ZeRO shards included), 4 bytes: the collective's latency on the whole world."""
    return collective_time(hw, "all_reduce", 4.0, placement(plan.world_size, 1, hw.gpus_per_node))


MAX_GATHER_ITEMS = 64
"""ZeRO-3's gathers after the first are queued as at most this many items (each a share of the rest)."""


def gather_units(plan: Plan) -> int:
    """Parameter all-gathers a rank issues per step, one per stage and use: ZeRO-3 gathers each of its v stages
    before the forward and again before the backward (2·v; ×m with depth-first accumulation, which gathers per
    micro-batch); ZeRO-1/2 gather each stage's updated parameters once (v)."""
    v, m = plan.virtual_stages, plan.n_microbatches
    if plan.zero_stage == 3:
        return 2 * v * (m if plan.accumulation == "depth_first" else 1)
    return v


def _gathers(
    shape: ModelShape, plan: Plan, rank: int, gather: float, end: float, params: float | None = None
) -> tuple[list[tuple[float, float]], float]:
    """(queued gathers, exposed gather seconds) of a step, as the trainer runs them (`parallel/zero.py`), with
    `gather_units` units: ZeRO-3 gathers each stage's parameters at its GATHER action, prefetched, so they queue
    evenly over the step — except the first, which nothing can hide (the step starts with it); ZeRO-1/2
    all-gather the updated parameters inside the optimizer step and wait for them, so all of it is exposed —
    unless `Plan.overlap_param_gather` defers them: the optimizer step launches every stage's gather (in the order
    of the next step's first computes) and each stage waits only before its first compute, so pipeline rank
    `rank`'s first stage's share (`stage_params_per_rank`, with the embedding on rank 0, of the `params` the
    gather moves: the rank's own by default) is exposed and the rest queues on the data-parallel channel from
    the step's start, ahead of the reductions. That never prices slower: an item of R seconds adds at most
    R·(s + (1 − s)) = R to `dp_cost`."""
    if gather <= 0:
        return [], 0.0
    units = gather_units(plan)
    if plan.zero_stage < 3:
        if not plan.overlap_param_gather:
            return [], gather
        params = params or params_per_rank(shape, plan, rank)
        first = min(gather, gather * stage_params_per_rank(shape, plan, rank) / params)
        return ([(0.0, gather - first)] if gather > first else []), first
    first = gather / units  # one unit's, however many units the step has
    queued = min(units, MAX_GATHER_ITEMS) - 1  # the rest in a bounded number of items: the search's speed
    rest = (gather - first) / queued if queued else 0.0
    return [(k * end / (queued + 1), rest) for k in range(1, queued + 1)], first


REDUCE_PIECES = 8
"""At most this many buckets per chunk: a chunk's reduction is released in min(layers, 8) equal pieces."""


def _reduce_items(release_end: float, bwd: float, layers: int, total: float) -> list[tuple[float, float]]:
    """A chunk's reduction released bucket by bucket (≤ one per layer) during its last backward
    [release_end − bwd, release_end]."""
    n = min(layers, REDUCE_PIECES)
    start = release_end - bwd
    return [(start + (i + 1) * bwd / n, total / n) for i in range(n)]


def fast_step(shape: ModelShape, hw: Hardware, plan: Plan, schedule: str) -> StepBreakdown:
    """Closed-form step time (module docstring); `schedule` is a config name (1f1b, gpipe, interleaved,
    breadth_first)."""
    return _fast(shape, hw, plan, schedule, pipeline_costs(shape, hw, plan))


def _fast(shape: ModelShape, hw: Hardware, plan: Plan, schedule: str, pc: PipelineCosts) -> StepBreakdown:
    """With W_r the work of pipeline rank r per micro-batch (its blocks, + embedding on rank 0, + head on rank
    p − 1): pipeline = m·max W + (ΣW − max W)/v (+ breadth-first's wrap-around stall), which is
    (v·m + p − 1)(f + b) + m·(head) for equal stages; transfers add `p2p_hops`·t on the average chunk.
    Breadth-first one micro-batch at a time (`_sweeps`): m·ΣW, and m times one micro-batch's transfers."""
    p, m, v = plan.pp, plan.n_microbatches, plan.virtual_stages
    c = pc.chunk(p, v)
    crit = pc.critical_rank(p)
    compute, tp, cp = (m * x for x in pc.rank_parts(p, crit))
    loads = _rank_loads(pc, p)
    if _sweeps(schedule, plan):  # one micro-batch at a time through every rank's chunks and back: in series
        free = m * sum(loads)
        pp = m * (
            pipeline_time(schedule, p, 1, v, c.fwd, c.bwd, c.p2p)
            - pipeline_time(schedule, p, 1, v, c.fwd, c.bwd, 0.0)
        )
    else:
        # what the pipeline holds beyond its plain v·m + p − 1 chunk units: breadth-first's wrap-around stall,
        # (v − 1)(p − m) units when m < p (subtracting `pipeline_units`, which counts that stall too, left it out)
        stall = pipeline_time(schedule, p, m, v, c.fwd, c.bwd, 0.0) - (v * m + p - 1) * (c.fwd + c.bwd)
        free = m * max(loads) + (sum(loads) - max(loads)) / v + stall
        pp = pipeline_time(schedule, p, m, v, c.fwd, c.bwd, c.p2p) - pipeline_time(
            schedule, p, m, v, c.fwd, c.bwd, 0.0
        )
    exchange = _tied_exchange(shape, hw, plan)  # both end ranks, once both are done: it ends the step
    dp = _fast_dp(shape, hw, plan, schedule, c, free + pp, exchange)
    return StepBreakdown(
        compute=compute,
        tp_comm=tp,
        cp_comm=cp,
        bubble=max(0.0, free - compute - tp - cp),
        pp_comm=pp + exchange,
        dp_comm=dp,
        optimizer=optimizer_time(shape, hw, plan),
    )


def _rank_loads(pc: PipelineCosts, p: int) -> list[float]:
    """W_r for every rank; with equal per-rank blocks computed from the first and last rank only."""
    ends = _ends_or_all(pc.counts, p)
    if len(ends) == p:
        return [sum(pc.rank_parts(p, r)) for r in range(p)]
    first, last = sum(pc.rank_parts(p, 0)), sum(pc.rank_parts(p, p - 1))
    middle = rank_blocks(pc.counts, p)[0] * (pc.block.fwd + pc.block.bwd)
    return [first, *([middle] * (p - 2)), last]


def _tied_exchange(shape: ModelShape, hw: Hardware, plan: Plan) -> float:
    """Seconds of the EXCHANGE that ends the step when a tied embedding and head sit on two pipeline ranks
    (the loop placement puts stage 0 on rank 0 and the last on rank p − 1); 0 otherwise."""
    return tied_exchange_time(shape, hw, plan) if shape.tied and plan.pp > 1 else 0.0


def _fast_dp(
    shape: ModelShape,
    hw: Hardware,
    plan: Plan,
    schedule: str,
    c: ChunkCosts,
    end: float,
    exchange: float = 0.0,
) -> float:
    """DP exposure of rank 0 with release times from the schedule order: local chunk j's last backward is
    followed by j·K backwards of earlier chunks (K = p interleaved, m breadth-first, 0 otherwise). With a tied
    embedding on another rank than the head (``exchange`` > 0), chunk 0 (stage 0) is reduced once, whole, after
    the ``exchange`` that follows the last compute at ``end``; per micro-batch, its m backwards are taken to
    be every v-th from the end (exact for v = 1); the ranks between hold no tied stage and reduce all of theirs,
    so where there are such ranks (p > 2) the larger of rank 0's and rank 1's exposure is the step's."""
    if plan.batch_ranks <= 1:
        return 0.0
    p, m, v = plan.pp, plan.n_microbatches, plan.virtual_stages
    # rank 0's timing with the heavier end's parameters (the simulator prices every rank with its own)
    psi = max(params_per_rank(shape, plan, 0), params_per_rank(shape, plan, p - 1))
    reduce, gather = dp_parts(psi, hw, plan, buckets=c.layers * v)
    sweeps = _sweeps(schedule, plan)
    after = p if sweeps else {"interleaved": p, "breadth_first": m}.get(schedule, 0)
    tied = exchange > 0
    items: list[tuple[float, float]] = []
    per_microbatch = _per_microbatch_reduce(plan)
    if per_microbatch:  # one reduction per micro-batch and chunk, under its backward
        skip = v if tied else 0
        items += _backward_releases(
            schedule, p, m, v, c, end, reduce / (m * v), skip_every=skip, sweeps=sweeps
        )
    else:
        for j in range(1 if tied else 0, v):
            items += _reduce_items(end - j * after * c.bwd, c.bwd, c.layers, reduce / v)
    if tied:
        items.append((end + exchange, reduce / (v * (m if per_microbatch else 1))))
    replica = replica_reduce_time(psi, hw, plan)
    if replica:  # hybrid sharding, on the same channel: each chunk's at the rank's next reduction
        items += _fast_replica(schedule, plan, c, end, exchange, replica)
    # a deferred ZeRO-1/2 gather exposes the larger of the end ranks' first stages (rank 0's holds the embedding)
    first = (
        max(sorted({0, p - 1}), key=lambda r: stage_params_per_rank(shape, plan, r))
        if plan.overlap_param_gather
        else 0
    )
    queued, exposed = _gathers(shape, plan, first, gather, end, psi)
    cost = dp_cost(items + queued, end + exchange, hw)
    if tied and per_microbatch and p > 2:  # rank 1 holds no tied stage: it reduces every micro-batch's
        # gradients, its last backward ending one chunk backward before rank 0's
        middle_reduce = dp_parts(params_per_rank(shape, plan, 1), hw, plan, buckets=c.layers * v)[0]
        middle_end = end - c.bwd
        middle = _backward_releases(
            schedule, p, m, v, c, middle_end, middle_reduce / (m * v), sweeps=_sweeps(schedule, plan)
        )
        if replica:
            middle_replica = replica_reduce_time(params_per_rank(shape, plan, 1), hw, plan)
            middle += _fast_replica(schedule, plan, c, middle_end, 0.0, middle_replica)
        cost = max(cost, dp_cost(middle + queued, middle_end, hw) - (end + exchange - middle_end))
    return cost + exposed


BUCKETED_RELEASES = 16
"""Chunk backwards nearest the step end whose reduction is released layer by layer; earlier ones release theirs
as one item at their end, in at most `MAX_RELEASES` groups so a layout costs O(1) however many micro-batches
it has."""
MAX_RELEASES = 256


def _fast_replica(
    schedule: str, plan: Plan, c: ChunkCosts, end: float, exchange: float, replica: float
) -> list[tuple[float, float]]:
    """Hybrid sharding's all-reduce of rank 0's v gradient shards (`replica` seconds in all, 1/v each) as
    `ZeroStageComm` issues them: chunk j's once its last reduction of the step is done, at the rank's next
    reduction — layered, chunk j − 1's (released j − 1 chunk sweeps of K backwards before `end`, K as in
    `_fast_dp`); per micro-batch, the backward right after chunk j's last, the (j·K − 1)-th from the end
    (`_backward_ends`; breadth-first one micro-batch at a time, `_sweeps`: the last sweep's, chunk j − 1's) — and
    chunk 0's (the last reduced) in ``finish`` after the last compute (after the ``exchange`` with a tied stage,
    which chunk 1's waits for too: chunk 0 reduces only then). ZeRO-1 with depth-first accumulation reduces
    once per step at each chunk's last backward, as layered does (`ZeroStageComm.reduce`): the same releases."""
    p, m, v = plan.pp, plan.n_microbatches, plan.virtual_stages
    finish = end + exchange
    per_microbatch = _per_microbatch_reduce(plan)
    sweeps = _sweeps(schedule, plan)
    after = p if sweeps else {"interleaved": p, "breadth_first": m}.get(schedule, 0)
    backward_end = _backward_ends(schedule, p, m, v, c, end, sweeps=sweeps)
    items = [(finish, replica / v)]
    for j in range(1, v):
        if (exchange > 0 and j == 1) or not after:
            release = finish
        elif per_microbatch:
            release = backward_end(j - 1 if sweeps else j * after - 1)
        else:
            release = end - (j - 1) * after * c.bwd
        items.append((release, replica / v))
    return items


def _sweeps(schedule: str, plan: Plan) -> bool:
    """Breadth-first with depth-first accumulation: the runtime runs it one micro-batch at a time
    (`compute_options`: ``consecutive = 1``), each a sweep of the rank's v chunks forward, then backward — the
    order a pipeline-free ZeRO run with depth-first accumulation executes (one stage per block)."""
    return bool(compute_options(CONFIG_TO_IR.get(schedule, schedule), plan.accumulation))


def _backward_ends(
    schedule: str, p: int, m: int, v: int, c: ChunkCosts, end: float, *, sweeps: bool = False
) -> Callable[[int], float]:
    """When rank 0's k-th chunk backward from the end (k = 0: the last) ends, as `_backward_releases` counts
    them. ``sweeps`` (`_sweeps`): micro-batch by micro-batch, k = g·v + i is chunk i's backward of the g-th sweep
    from the end; a sweep's backwards are p·b apart (each goes through the other p − 1 ranks' chunks first) and a
    sweep lasts v·p·(f + b) (one micro-batch through all v·p stages and back, latencies left out)."""
    if sweeps:
        sweep, gap = v * p * (c.fwd + c.bwd), p * c.bwd
        return lambda k: end - (k // v) * sweep - (k % v) * gap
    total = m * v
    all_at_end = schedule == "gpipe" or (schedule == "interleaved" and m == p)
    tail = total if all_at_end else min(total, (v - 1) * p + 1)
    last_of_tail = end - (tail - 1) * c.bwd
    slot = c.fwd + c.bwd
    return lambda k: end - k * c.bwd if k < tail else last_of_tail - (k - tail + 1) * slot


def _backward_releases(
    schedule: str,
    p: int,
    m: int,
    v: int,
    c: ChunkCosts,
    end: float,
    share: float,
    skip_every: int = 0,
    *,
    sweeps: bool = False,
) -> list[tuple[float, float]]:
    """Rank 0's m·v chunk backwards, each releasing `share` of reduction, counted back from `end`. The last ones
    run back to back, c.bwd apart — all of them in GPipe (and interleaved with m = p), the last (v − 1)·p + 1
    otherwise (1 in 1F1B) — and the earlier ones one per 1F1B slot, f + b apart (the simulator's timeline of the
    schedules in `tessera.pipeline.schedules`, checked in tests/unit/test_search.py). The nearest
    `BUCKETED_RELEASES` release layer by layer during their backward, as the simulator's REDUCE_MB do.
    ``sweeps``: breadth-first one micro-batch at a time (`_backward_ends`)."""
    total = m * v
    backward_end = _backward_ends(schedule, p, m, v, c, end, sweeps=sweeps)
    # the backwards counted back from `end` (without chunk 0's, reduced once after the tied exchange instead);
    # only those that become items get an end: at most BUCKETED_RELEASES + MAX_RELEASES of the m·v
    kept, n_kept = _kept_backwards(total, skip_every)
    near = min(n_kept, BUCKETED_RELEASES)
    items: list[tuple[float, float]] = []
    for t in range(near):
        items += _reduce_items(backward_end(kept(t)), c.bwd, c.layers, share)
    rest = n_kept - near
    group = max(1, -(-rest // MAX_RELEASES))
    # a group releases at its earliest member's end (slightly early; groups form only past 256 backwards)
    for i in range(0, rest, group):
        stop = min(i + group, rest)
        items.append((backward_end(kept(near + stop - 1)), share * (stop - i)))
    return items


def _kept_backwards(total: int, skip_every: int) -> tuple[Callable[[int], int], int]:
    """(t -> the t-th of ``range(total)`` that is not a multiple of ``skip_every``, how many there are), without
    the list of all of them (m·v: thousands per layout). 0 keeps every k. Otherwise the multiples of s in
    [0, total) are ⌈total / s⌉; each block of s consecutive k from a multiple keeps its s − 1 others, so the t-th
    kept is in block ⌊t / (s − 1)⌋, at t + ⌊t / (s − 1)⌋ + 1 (integers: exactly the list's entry; s = 1 keeps
    none)."""
    if not skip_every:
        return (lambda t: t), total
    if skip_every == 1:
        return (lambda t: t), 0
    per_block = skip_every - 1
    return (lambda t: t + t // per_block + 1), total - -(-total // skip_every)


def _replica_releases(
    reductions: list[tuple[int, float]], shares: dict[int, float], finish: float
) -> list[tuple[float, float]]:
    """Hybrid sharding's all-reduce of each stage's gradient shard (``shares``: seconds by stage) as
    `ZeroStageComm` issues it: released at the rank's first reduction after the stage's last one
    (``reductions``: (stage, release) in list order), or at ``finish`` for the last reduced stage. Every
    reduction runs at its REDUCE action (ZeRO-1 depth-first too: its one per stage, `ZeroStageComm.reduce`)."""
    last = {stage: i for i, (stage, _) in enumerate(reductions)}
    return [
        (reductions[i + 1][1] if i + 1 < len(reductions) else finish, shares[stage])
        for stage, i in last.items()
    ]


def _per_microbatch_reduce(plan: Plan) -> bool:
    """Every micro-batch's gradient is reduced on its own (ZeRO-2/3 reduce-scatter, plain data parallelism in a
    pipeline all-reduce), each overlapping that micro-batch's backward: the lowered schedule's REDUCE_MB actions
    (`cost.per_microbatch_reduction`, one rule for runtime and planner)."""
    return plan.batch_ranks > 1 and per_microbatch_reduction(plan)


_FORWARD, _BACKWARD, _EXCHANGE = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.EXCHANGE_TIED


def _durations(pc: PipelineCosts, exchange: float = 0.0):
    # per stage once: the simulator asks for every action of the lowered lists (kinds compared by identity)
    forward = [pc.forward(s) for s in range(len(pc.counts))]
    backward = [pc.backward(s) for s in range(len(pc.counts))]

    def duration(action, rank: int) -> float:
        kind = action.kind
        if kind is _FORWARD:
            return forward[action.stage]
        if kind is _BACKWARD:
            return backward[action.stage]
        if kind is _EXCHANGE:
            return exchange
        return 0.0

    return duration


def simulate_step(
    shape: ModelShape, hw: Hardware, plan: Plan, schedule: str
) -> tuple[StepBreakdown, SimResult]:
    """Step time by simulating the lowered schedule (module docstring); also returns the timeline. Stages may
    be uneven (`plan.stage_layers`): each F/B lasts its own stage's time."""
    breakdown, sim = _simulate(shape, hw, plan, schedule, summary=True)
    assert isinstance(sim, SimResult)
    return breakdown, sim


def simulated_breakdown(shape: ModelShape, hw: Hardware, plan: Plan, schedule: str) -> StepBreakdown:
    """`simulate_step`'s breakdown without the simulation's summary (per-rank busy and idle time, a timeline
    sorted by start), which it does not read: what `tessera plan` re-times its top layouts with."""
    return _simulate(shape, hw, plan, schedule, summary=False)[0]


def _simulate(
    shape: ModelShape, hw: Hardware, plan: Plan, schedule: str, *, summary: bool
) -> tuple[StepBreakdown, SimResult | None]:
    pc = pipeline_costs(shape, hw, plan)
    p, m, v = plan.pp, plan.n_microbatches, plan.virtual_stages
    # the order the runtime runs: breadth-first with depth-first accumulation one micro-batch at a time
    name = CONFIG_TO_IR[schedule]
    ir = build_schedule(name, p, m, v, **compute_options(name, plan.accumulation))
    lowered = lower(
        ir,
        p,
        zero3=plan.zero_stage == 3 and plan.batch_ranks > 1,
        reduce_every_microbatch=_per_microbatch_reduce(plan),
        tied=tied_stages(shape.tied, p * v),
    )
    exchange = _tied_exchange(shape, hw, plan)
    p2p = pc.block.p2p
    sim: SimResult | None = None
    if summary:
        # check=False: the builders emit valid schedules and simulate() itself raises on a deadlock
        sim = simulate(lowered, p, _durations(pc, exchange), comm_latency=p2p, check=False)
        end, entries = sim.step_time, sim.timeline
    else:
        end, entries = timeline(lowered, p, _durations(pc, exchange), comm_latency=p2p)
    # the free-communication run: only its length is used
    free = step_time(lowered, p, _durations(pc)) if p2p > 0 or exchange > 0 else end
    compute, tp, cp = (m * x for x in pc.rank_parts(p, pc.critical_rank(p)))
    exposed = _simulated_dp(shape, hw, plan, entries, end, pc)
    breakdown = StepBreakdown(
        compute=compute,
        tp_comm=tp,
        cp_comm=cp,
        bubble=max(0.0, free - compute - tp - cp),
        pp_comm=max(0.0, end - free),
        dp_comm=exposed,
        optimizer=optimizer_time(shape, hw, plan),
    )
    return breakdown, sim


def _simulated_dp(
    shape: ModelShape,
    hw: Hardware,
    plan: Plan,
    entries: list[TimelineEntry],
    end_of_step: float,
    pc: PipelineCosts,
) -> float:
    """Per rank: reductions released from the timeline's REDUCE actions, layer by layer during the backward
    that precedes each (the stage's last one; for a REDUCE_MB j, micro-batch j's) — a REDUCE after the stage's
    EXCHANGE whole when it runs —, each stage's share in proportion to its blocks (one reduction: ÷ m where
    the step reduces every micro-batch); gathers spread over the step; the worst rank's lateness past the
    step end is exposed."""
    if plan.batch_ranks <= 1:
        return 0.0
    p, m = plan.pp, plan.n_microbatches
    worst = 0.0
    by_rank: list[list] = [[] for _ in range(p)]
    for e in entries:  # one pass: each rank's entries come in its list order (sorted by start or as run)
        by_rank[e.rank].append(e)
    for rank, own in enumerate(by_rank):
        end = max(e.end for e in own if e.action.kind.is_compute)
        blocks = rank_blocks(pc.counts, p)[rank]
        reduce, gather = dp_parts(params_per_rank(shape, plan, rank), hw, plan, buckets=max(1, blocks))
        last_b: dict[int, tuple[float, float]] = {}
        items: list[tuple[float, float]] = []
        reductions: list[tuple[int, float]] = []  # (stage, release) of each REDUCE in list order
        reps = m if _per_microbatch_reduce(plan) else 1  # `reduce` is reps reductions of every stage
        for e in own:
            if e.action.kind is _BACKWARD:  # B, by identity: an enum's .value is a call per entry
                last_b[e.action.stage] = (e.start, e.end)
            elif e.action.kind.is_exchange:
                last_b[e.action.stage] = (e.end, e.end)  # its REDUCE starts the reduction, all at once
            elif e.action.kind.is_reduce and blocks:
                start, stop = last_b[e.action.stage]
                layers = pc.counts[e.action.stage]
                share = reduce * layers / blocks / reps
                items += _reduce_items(stop, stop - start, max(1, layers), share)
                reductions.append((e.action.stage, stop))
        replica = replica_reduce_time(params_per_rank(shape, plan, rank), hw, plan)
        if replica:  # hybrid sharding, on the same channel
            finish = max([end, *(release for release, _ in items)])
            shares = {s: replica * pc.counts[s] / blocks for s, _ in reductions}
            items += _replica_releases(reductions, shares, finish) or [(finish, replica)]
        queued, exposed = _gathers(shape, plan, rank, gather, end)
        worst = max(worst, end + dp_cost(items + queued, end, hw) + exposed)
    return max(0.0, worst - end_of_step)
