"""Step-time pieces that communicate: exposed tensor-parallel time per block, one pipeline stage (compute +
exposed tensor-parallel time), one stage boundary's transfer, the data-parallel reduction. Pure Python.
"""

from __future__ import annotations

from tessera.modes import REPLAYS_FORWARD_COLLECTIVES
from tessera.planner.cost.collectives import group_placement, p2p_time, traffic_time
from tessera.planner.cost.compute import LayerTime, layer_time, linear_gemm_times, local_tokens, logits_time
from tessera.planner.cost.plan import Plan, per_microbatch_reduction
from tessera.planner.cost.shape import ModelShape
from tessera.planner.cost.tp_overlap import ring_lanes, tensor_traffic_time
from tessera.planner.cost.volume import tied_exchange_bytes
from tessera.planner.hardware import Hardware
from tessera.planner.network import bus_bandwidth, collective_time
from tessera.traffic import BACKWARD, FORWARD, Collective, context_block, tensor_calls

__all__ = [
    "context_calls",
    "cp_comm_time_per_layer",
    "dp_collective_times",
    "dp_time",
    "p2p_time_per_microbatch",
    "replica_reduce_time",
    "stage_time",
    "tp_comm_time_per_layer",
]


def tp_comm_time_per_layer(shape: ModelShape, hw: Hardware, plan: Plan) -> LayerTime:
    """Seconds tensor-parallel communication adds per block per micro-batch, split like `LayerTime`: the block's
    collectives as the runtime issues them (`tessera.traffic.tensor_calls`), each priced on its group
    (`traffic_time`).

    Not overlapped with compute by default (Megatron 2021 behaviour). 1D: two all-reduces of b·s·h per pass on
    the tensor group (stride 1); with SP all-gather + reduce-scatter pairs, plus backward's re-gathers and the
    replicated vectors' gradient all-reduces. 2D: per Linear q rounds of block broadcasts / reduces on row groups
    (stride 1) and column groups (stride q), plus the norms' statistics and the bias / norm gradient sums. Full
    recompute replays what the runtime replays (`tensor_calls(..., "replay")`: the block's forward collectives
    but the last 1D exit, unless a post-norm saves its output, `traffic.replayed_1d`), or the whole forward with
    `plan.replays_last_exit` (Megatron).

    With `Plan.tp_comm_overlap` (1D + SP) every all-gather / reduce-scatter is a ring under its GEMM chunks
    (`cost.tp_overlap`), priced as what it adds beyond the GEMMs (`_ring_gemms` pairs them); a replay replays
    the rings."""
    block = tensor_calls(shape, plan, "block")
    fwd_gemms, bwd_gemms = _ring_gemms(shape, hw, plan)
    fwd = tensor_traffic_time(hw, plan, block, FORWARD, fwd_gemms)
    return LayerTime(
        forward=fwd,
        backward=tensor_traffic_time(hw, plan, block, BACKWARD, bwd_gemms),
        recompute=_replay_time(shape, hw, plan, fwd, fwd_gemms),
    )


def context_calls(shape: ModelShape, plan: Plan) -> list[Collective]:
    """One block's context-group collectives for one micro-batch (`tessera.traffic.context_block`, the formula
    the dry run and the distributed tests check against the bytes a run moves): forward an all-gather of K and
    one of V, [b, n_kv/t, s, hd] each gathered, backward a reduce-scatter of dK and dV of that size, in the
    compute dtype. Empty without context parallelism."""
    return context_block(shape, plan.micro_batch, plan.cp, plan.tp, plan.act_bytes)


def cp_comm_time_per_layer(shape: ModelShape, hw: Hardware, plan: Plan) -> LayerTime:
    """Seconds context-parallel communication adds per block per micro-batch (`context_calls`), each collective
    priced by `network.collective_time` on the context group's placement: c ranks t apart in tessera's rank
    order (data, pipe, context, tensor), so inside one node while c·t fits in it, else a ring across nodes.

    Exposed, not overlapped: tessera's `attend` gathers K and V synchronously (`comm.all_gather_to_region`, an
    autograd function whose backward reduce-scatters dK, dV) and the attention core waits for them. Full
    checkpointing replays the block's forward, gather included (`recompute` = the forward's seconds), as the
    dry run's formula counts, and so does op checkpointing (SDPA's backward reads the gathered K and V); selective
    checkpointing replays only the core, after the gather (0)."""
    calls = context_calls(shape, plan)
    if not calls:
        return LayerTime(forward=0.0, backward=0.0, recompute=0.0)
    forward = traffic_time(hw, plan, calls, FORWARD)
    return LayerTime(
        forward=forward,
        backward=traffic_time(hw, plan, calls, BACKWARD),
        recompute=forward if plan.recompute in REPLAYS_FORWARD_COLLECTIVES else 0.0,
    )


def _ring_gemms(
    shape: ModelShape, hw: Hardware, plan: Plan
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(forward, backward) (chunk, whole) GEMM seconds each ring collective of a block runs under, in the order of
    `traffic.block_1d`; empty without `Plan.tp_comm_overlap`. Per region (attention: QKV then proj; MLP: fc1 then
    fc2): forward, the entry's all-gather under the column-parallel GEMM and the exit's reduce-scatter under the
    row-parallel one; backward, the entry's input-gradient reduce-scatter under the column GEMM's dgrad chunks and
    its re-gather under the wgrad chunks (each a forward-shaped GEMM, as `layer_time` prices backward), the
    exit's output-gradient all-gather under the row GEMM's dgrad and wgrad chunks together. A chunk's seconds are
    the ring's t chunk GEMMs on the runtime's `tp_overlap.ring_lanes` streams, / t."""
    if not plan.tp_comm_overlap:
        return [], []
    rows = local_tokens(shape, plan)
    chunks = linear_gemm_times(shape, hw, plan, rows / plan.tp, chunks=plan.tp, lanes=ring_lanes(hw, plan))
    wholes = linear_gemm_times(shape, hw, plan, rows)
    qkv, proj, fc1, fc2 = zip(chunks, wholes, strict=True)
    fwd = [qkv, proj, fc1, fc2]
    bwd = []
    for column, row in ((qkv, proj), (fc1, fc2)):
        bwd += [column, column, (2 * row[0], 2 * row[1])]
    return fwd, bwd


def _replay_time(
    shape: ModelShape, hw: Hardware, plan: Plan, forward: float, gemms: list[tuple[float, float]]
) -> float:
    """Seconds the collectives full (or op) recompute replays add per block: the whole forward's (``forward``)
    when the framework re-runs it all (`Plan.replays_last_exit`), else the runtime's replay list (its rings under
    the forward's GEMMs, ``gemms``, in order; op mode replays the same list: `modes.REPLAYS_FORWARD_COLLECTIVES`)."""
    if plan.recompute not in REPLAYS_FORWARD_COLLECTIVES:
        return 0.0
    if plan.replays_last_exit and plan.recompute == "full":
        return forward
    return tensor_traffic_time(hw, plan, tensor_calls(shape, plan, "replay"), FORWARD, gemms)


def stage_time(
    shape: ModelShape, hw: Hardware, plan: Plan, n_layers: int, *, last: bool = False
) -> tuple[float, float]:
    """(forward, backward incl. recompute) seconds of one pipeline chunk of `n_layers` blocks for one
    micro-batch: compute + exposed tensor-parallel communication; `last` adds the output layer and loss."""
    lt = layer_time(shape, hw, plan)
    tp = tp_comm_time_per_layer(shape, hw, plan)
    fwd = n_layers * (lt.forward + tp.forward)
    bwd = n_layers * (lt.backward + lt.recompute + tp.backward + tp.recompute)
    if last:
        lg = logits_time(shape, hw, plan)
        fwd, bwd = fwd + lg.forward, bwd + lg.backward
    return fwd, bwd


def p2p_time_per_microbatch(shape: ModelShape, hw: Hardware, plan: Plan) -> float:
    """Seconds to move one micro-batch's boundary tensor (b·s·h, /t with scatter/gather) across one stage
    boundary in one direction. Pipeline neighbours sit `axis_stride(rank_order, "pipe")` ranks apart (t·d in
    Megatron's order, t in tessera's), so they share a node only if that fits in one node. With 1D tensor
    parallelism (no SP) the scatter/gather optimisation sends 1/t and re-assembles with an all-gather on the
    tensor group (Narayanan §4.1). The tensor is in the residual stream's dtype (fp32 under tessera's autocast,
    `Plan.stream_bytes`)."""
    if plan.pp <= 1:
        return 0.0
    full = shape.seq_len * plan.micro_batch * shape.d_model * plan.stream_bytes
    pair = group_placement(hw, plan, "pipe")
    latency = hw.intra_node_latency if pair.intra_node else hw.inter_node_latency
    t = p2p_time(full / plan.tp, bus_bandwidth(hw, pair), latency)
    if plan.tp_kind == "1d" and not plan.sequence_parallel and plan.tp > 1:
        t += collective_time(hw, "all_gather", full, group_placement(hw, plan, "tensor"))
    return t


def tied_exchange_time(shape: ModelShape, hw: Hardware, plan: Plan) -> float:
    """Seconds of one EXCHANGE (`tied_exchange_bytes` sent and received at once, each direction on its own
    link) between the embedding's and the head's pipeline ranks, placed like pipeline neighbours."""
    pair = group_placement(hw, plan, "pipe")
    latency = hw.intra_node_latency if pair.intra_node else hw.inter_node_latency
    return p2p_time(tied_exchange_bytes(shape, plan), bus_bandwidth(hw, pair), latency)


def dp_collective_times(
    params_local: float,
    hw: Hardware,
    plan: Plan,
    *,
    grad_bytes: int = 2,
    param_bytes: int = 2,
    buckets: int = 1,
) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) seconds per step of `params_local` parameters on the data
    group (data × context with context parallelism: `Plan.batch_ranks`), placed by `plan.rank_order`: the collectives of `dp_volume` (ZeRO-0 one all-reduce; ZeRO ≥ 1 a
    reduce-scatter, ×m with depth-first ZeRO-2/3; all-gathers once, twice for ZeRO-3, ×m depth-first), each
    split into `buckets` calls (one per layer in the trainer) and priced by `network.collective_time`, so the
    latency terms count every call."""
    if plan.batch_ranks <= 1:
        return 0.0, 0.0
    # ZeRO's collectives run on its shard group (the whole data group without hybrid sharding); with context
    # parallelism every gradient collective spans data × context (`Groups.batch`)
    axis = "data_shard" if plan.zero_stage else "data"
    group = group_placement(hw, plan, "data_context" if plan.cp > 1 else axis)
    m = plan.n_microbatches if plan.accumulation == "depth_first" else 1
    g, w = params_local * grad_bytes, params_local * param_bytes
    if plan.zero_stage == 0:
        calls = [("all_reduce", g, m if per_microbatch_reduction(plan) else 1)]
    elif plan.zero_stage in (1, 2, 3):
        reps = m if plan.zero_stage >= 2 else 1
        calls = [("reduce_scatter", g, reps)]
    else:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {plan.zero_stage}")
    gathers = {0: 0, 1: 1, 2: 1, 3: 2 * m}[plan.zero_stage]
    buckets = max(1, buckets)

    def price(kind: str, total: float, reps: int) -> float:
        return reps * buckets * collective_time(hw, kind, total / buckets, group)

    reduce = sum(price(*c) for c in calls)
    gather = price("all_gather", w, gathers) if gathers else 0.0
    return reduce, gather


def replica_reduce_time(params_local: float, hw: Hardware, plan: Plan) -> float:
    """Hybrid sharding: seconds per step of the all-reduce of this rank's gradient shards (`params_local` / s
    elements, `Plan.replica_reduce_width` bytes each) over its replica group, once per step whatever the
    accumulation, one call per stage (`ZeroStageComm` launches each once the stage's shard is final), each the
    ring or tree `network.collective_time` picks on the replica group's placement (across nodes when a shard
    group fills a node). 0 without hybrid sharding."""
    if not plan.zero_stage or plan.zero_replicas <= 1:
        return 0.0
    shard = params_local * plan.replica_reduce_width / plan.zero_dp
    calls = max(1, plan.virtual_stages)
    return calls * collective_time(
        hw, "all_reduce", shard / calls, group_placement(hw, plan, "data_replicate")
    )


def dp_time(
    params_local: float, hw: Hardware, plan: Plan, *, grad_bytes: int = 2, param_bytes: int = 2
) -> float:
    """Seconds of this stage's data-parallel traffic per step (`dp_collective_times`, one bucket), not
    overlapped. The caller decides how much of it hides behind backward (schedule dependent)."""
    reduce, gather = dp_collective_times(
        params_local, hw, plan, grad_bytes=grad_bytes, param_bytes=param_bytes
    )
    return reduce + gather
