"""Step-time pieces that communicate: exposed tensor-parallel time per block, one pipeline stage (compute +
exposed tensor-parallel time), one stage boundary's transfer, the data-parallel reduction. Pure Python.
"""

from __future__ import annotations

from tessera.planner.cost.collectives import group_placement, p2p_time, traffic_time
from tessera.planner.cost.compute import LayerTime, layer_time, logits_time
from tessera.planner.cost.plan import Plan, per_microbatch_reduction
from tessera.planner.cost.shape import ModelShape
from tessera.planner.cost.volume import tied_exchange_bytes
from tessera.planner.hardware import Hardware
from tessera.planner.network import bus_bandwidth, collective_time
from tessera.traffic import BACKWARD, FORWARD, tensor_calls

__all__ = [
    "dp_collective_times",
    "dp_time",
    "p2p_time_per_microbatch",
    "stage_time",
    "tp_comm_time_per_layer",
]


def tp_comm_time_per_layer(shape: ModelShape, hw: Hardware, plan: Plan) -> LayerTime:
    """Exposed tensor-parallel seconds per block per micro-batch, split like `LayerTime`: the block's collectives
    as the runtime issues them (`tessera.traffic.tensor_calls`), each priced on its group (`traffic_time`).

    Assumed not overlapped with compute (Megatron 2021 behaviour). 1D: two all-reduces of b·s·h per pass on the
    tensor group (stride 1); with SP all-gather + reduce-scatter pairs, plus backward's re-gathers and the
    replicated vectors' gradient all-reduces. 2D: per Linear q rounds of block broadcasts / reduces on row groups
    (stride 1) and column groups (stride q), plus the norms' statistics and the bias / norm gradient sums. Full
    recompute replays what the runtime replays (`tensor_calls(..., "replay")`: the block's forward collectives
    but the last 1D exit, `traffic.replayed_1d`), or the whole forward with `plan.replays_last_exit` (Megatron)."""
    block = tensor_calls(shape, plan, "block")
    fwd = traffic_time(hw, plan, block, FORWARD)
    return LayerTime(
        forward=fwd,
        backward=traffic_time(hw, plan, block, BACKWARD),
        recompute=_replay_time(shape, hw, plan, fwd),
    )


def _replay_time(shape: ModelShape, hw: Hardware, plan: Plan, forward: float) -> float:
    """Seconds of the collectives full recompute replays per block: the whole forward's (``forward``) when the
    framework re-runs it all (`Plan.replays_last_exit`), else the runtime's replay list."""
    if plan.recompute != "full":
        return 0.0
    if plan.replays_last_exit:
        return forward
    return traffic_time(hw, plan, tensor_calls(shape, plan, "replay"), FORWARD)


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
    group, placed by `plan.rank_order`: the collectives of `dp_volume` (ZeRO-0 one all-reduce; ZeRO ≥ 1 a
    reduce-scatter, ×m with depth-first ZeRO-2/3; all-gathers once, twice for ZeRO-3, ×m depth-first), each
    split into `buckets` calls (one per layer in the trainer) and priced by `network.collective_time`, so the
    latency terms count every call."""
    if plan.dp <= 1:
        return 0.0, 0.0
    group = group_placement(hw, plan, "data")
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


def dp_time(
    params_local: float, hw: Hardware, plan: Plan, *, grad_bytes: int = 2, param_bytes: int = 2
) -> float:
    """Seconds of this stage's data-parallel traffic per step (`dp_collective_times`, one bucket), not
    overlapped. The caller decides how much of it hides behind backward (schedule dependent)."""
    reduce, gather = dp_collective_times(
        params_local, hw, plan, grad_bytes=grad_bytes, param_bytes=param_bytes
    )
    return reduce + gather
