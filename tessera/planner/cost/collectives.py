"""Seconds of one collective or point-to-point transfer, and where a plan's groups sit on the network.
Pure Python: no torch import.
"""

from __future__ import annotations

from tessera.axes import Axis
from tessera.planner.cost.plan import Plan
from tessera.planner.hardware import Hardware
from tessera.planner.network import Placement, axis_stride, bus_bandwidth, collective_time, placement
from tessera.traffic import Collective

__all__ = [
    "all_gather_time",
    "all_reduce_time",
    "broadcast_time",
    "group_bandwidth",
    "group_placement",
    "p2p_time",
    "reduce_scatter_time",
    "traffic_time",
]


def group_bandwidth(hw: Hardware, group_size: int, stride: int = 1) -> tuple[float, float]:
    """(bandwidth per rank per direction, latency per step) of a group of `group_size` ranks `stride` apart.

    Intra-node iff the group's ranks share one node (`network.placement`). Otherwise the ring crosses nodes: with
    k members per node the k NICs of a node carry its node-crossing traffic (NCCL runs one ring channel per NIC,
    intra-node hops on NVLink), so the per-rank bandwidth is k × inter_node_bandwidth capped by NVLink
    (`network.bus_bandwidth`); k = 1 when stride ≥ gpus_per_node.
    """
    pl = placement(group_size, stride, hw.gpus_per_node)
    latency = hw.intra_node_latency if pl.intra_node else hw.inter_node_latency
    return bus_bandwidth(hw, pl), latency


def group_placement(hw: Hardware, plan: Plan, axis: str) -> Placement:
    """Where one group along `axis` sits: a dimension of `tessera.axes.DIMS` ("data": d members; "pipe": two
    pipeline neighbours; "tensor": the 1D group, or in 2D one grid row) strided by `plan.rank_order`, or a mesh
    axis of the 2D grid: `Axis.TENSOR_COL` (a grid row, same i: q members, stride 1), `Axis.TENSOR_ROW` (a grid
    column, same j: q members, stride q), hybrid sharding's shard or replica group (`HYBRID_GROUPS`), or
    "data_context", context parallelism's data × context group (`_batch_placement`). The
    tensor dimension is innermost in both orders used."""
    G = hw.gpus_per_node
    if axis == "data_context":
        return _batch_placement(hw, plan)
    if axis in HYBRID_GROUPS:
        return _hybrid_placement(hw, plan, axis)
    if plan.tp_kind == "2d" and axis in ("tensor", Axis.TENSOR_COL, Axis.TENSOR_ROW):
        return placement(plan.q, plan.q if axis == Axis.TENSOR_ROW else 1, G)
    sizes = plan.sizes()
    if axis not in sizes:
        raise ValueError(
            f"axis must be one of {', '.join(sizes)} (or a 2D grid axis tensor_row, tensor_col), got {axis!r}"
        )
    size = min(2, sizes[axis]) if axis == "pipe" else sizes[axis]  # pipe: a sender and its receiver
    return placement(size, axis_stride(plan.rank_order, sizes, axis), G)


def _batch_placement(hw: Hardware, plan: Plan) -> Placement:
    """The data × context group (`tessera.groups.Groups.batch`: every gradient reduction and ZeRO's shards with
    context parallelism): dp·c ranks. Where data sits right outside context in the rank order (tessera's without
    a pipeline, which its context parallelism refuses; Megatron-Core's `tp-cp-ep-dp-pp` with one) the group is
    dp·c consecutive context coordinates, t apart. Tessera's order with a pipeline puts it between them."""
    order = plan.rank_order
    adjacent = order.index("data") + 1 == order.index("context")
    if plan.pp > 1 and plan.cp > 1 and not adjacent:
        raise ValueError(
            "the data × context group is priced without a pipeline in tessera's rank order (parallel.context "
            "refuses parallel.pipeline > 1); set pp = 1"
        )
    return placement(
        plan.batch_ranks, axis_stride(plan.rank_order, plan.sizes(), "context"), hw.gpus_per_node
    )


HYBRID_GROUPS = ("data_shard", "data_replicate")
"""Hybrid sharding's subgroups of the data dimension (`tessera.groups`): ZeRO's shard group, s consecutive data
coordinates, and the replica group, r = d / s members s data coordinates apart."""


def _hybrid_placement(hw: Hardware, plan: Plan, axis: str) -> Placement:
    """`group_placement` of a `HYBRID_GROUPS` member (without hybrid sharding the shard group is the data group
    and the replica group a single rank)."""
    stride = axis_stride(plan.rank_order, plan.sizes(), "data")
    if axis == "data_shard":
        return placement(plan.zero_dp, stride, hw.gpus_per_node)
    return placement(plan.zero_replicas, stride * plan.zero_dp, hw.gpus_per_node)


_GROUP_AXIS = {"tensor": "tensor", "row": Axis.TENSOR_COL, "col": Axis.TENSOR_ROW, "context": "context"}
"""`tessera.traffic`'s group names → `group_placement`'s: the Optimus row group (same i) is the group along the mesh
axis TENSOR_COL (stride 1), the column group along TENSOR_ROW (stride q)."""


def traffic_time(hw: Hardware, plan: Plan, calls: list[Collective], phase: str) -> float:
    """Seconds of the `tessera.traffic` collectives of `phase` ("forward" or "backward"), each call priced by
    `network.collective_time` on its group's placement (none overlapped with compute)."""
    return sum(
        c.calls * collective_time(hw, c.kind, c.nbytes, group_placement(hw, plan, _GROUP_AXIS[c.group]))
        for c in calls
        if c.phase == phase
    )


def all_reduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of an `nbytes` buffer over n ranks: 2(n−1)/n·bytes/bw + 2(n−1)·latency (0 if n = 1)."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def reduce_scatter_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter of a full `nbytes` buffer: (n−1)/n·bytes/bw + (n−1)·latency."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def all_gather_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather producing a full `nbytes` buffer: (n−1)/n·bytes/bw + (n−1)·latency."""
    return reduce_scatter_time(nbytes, n, bandwidth, latency)


def broadcast_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Pipelined (chain/ring) broadcast of `nbytes` to n ranks: bytes/bw + (n−1)·latency (0 if n = 1)."""
    return 0.0 if n <= 1 else nbytes / bandwidth + (n - 1) * latency


def p2p_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """One point-to-point transfer: bytes/bw + latency."""
    return nbytes / bandwidth + latency
