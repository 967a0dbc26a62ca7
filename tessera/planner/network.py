"""The network in levels: where a group's ranks sit, and what each collective costs there.

A node holds `gpus_per_node` devices on one fast fabric (NVLink/NVSwitch); nodes talk through their NICs, each
device owning a share (`inter_node_bandwidth`, one NIC per GPU on a rail-optimized fat tree). A group of n ranks
that spans N nodes with k members per node is priced with the algorithms NCCL chooses between (its tuning model,
NVIDIA/nccl `src/graph/tuning.cc`; formulas and sources in docs/cost-model.md §4):

- **ring** for every collective. Bus bandwidth: NVLink inside a node; across nodes the k NICs of a node carry the
  ring's node-crossing traffic, so min(NVLink, k × NIC share). Latency: one step per ring hop, the hops that
  cross nodes at the network latency, the others at the NVLink latency (all-reduce: 2(n − 1) steps of which
  2(N − 1) cross; reduce-scatter/all-gather: n − 1 and N − 1).
- **tree** (hierarchical: a chain inside each node, a double binary tree across nodes) for all-reduce when the
  group spans nodes: moves the whole buffer up and down at 90 % of the bus bandwidth, 2·bytes/(0.9·bus), with
  latency 2·((k − 1)·intra + ⌈log2 N⌉·inter). It wins for small messages on many nodes; the ring wins for large.

NCCL picks the faster of the two; so do we. Rank placement comes from the rank order of the layout (which axis is
innermost): `axis_stride` for a `Plan`, checked against `tessera.layout.Layout` in the tests.
Pure Python: no torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from tessera.axes import RANK_ORDER, Axis
from tessera.planner.hardware import Hardware

__all__ = [
    "COLLECTIVES",
    "MEGATRON_ORDER",
    "TESSERA_ORDER",
    "TREE_BANDWIDTH_FACTOR",
    "Placement",
    "axis_stride",
    "bus_bandwidth",
    "collective_time",
    "placement",
    "ring_time",
    "tree_all_reduce_time",
]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")

TESSERA_ORDER: tuple[str, ...] = RANK_ORDER
"""Dimensions outermost first as `tessera.layout.Layout` orders ranks (`tessera.axes.DIMS`): data, pipe, tensor."""
MEGATRON_ORDER: tuple[str, ...] = (Axis.PIPE.value, Axis.DATA.value, Axis.TENSOR.value)
"""Megatron-LM's default order, outermost first: pipeline, data, tensor (data groups stride t)."""

TREE_BANDWIDTH_FACTOR = 0.9
"""Fraction of the bus bandwidth NCCL's model gives its tree all-reduce (tuning.cc: busBw × 0.9)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the members of one group sit: `ranks` members on `nodes` nodes, at most `per_node` on one node."""

    ranks: int
    nodes: int
    per_node: int

    @property
    def intra_node(self) -> bool:
        return self.nodes <= 1


@lru_cache(maxsize=4096)
def placement(size: int, stride: int, gpus_per_node: int) -> Placement:
    """Placement of the group {0, stride, 2·stride, ...} of `size` ranks (the group of rank 0; groups of
    power-of-two layouts are all alike) on nodes of `gpus_per_node` consecutive ranks."""
    if size < 1 or stride < 1 or gpus_per_node < 1:
        raise ValueError(f"size ({size}), stride ({stride}) and gpus_per_node ({gpus_per_node}) must be >= 1")
    counts: dict[int, int] = {}
    for i in range(size):
        node = i * stride // gpus_per_node
        counts[node] = counts.get(node, 0) + 1
    return Placement(ranks=size, nodes=len(counts), per_node=max(counts.values()))


def axis_stride(order: tuple[str, ...], sizes: dict[str, int], axis: str) -> int:
    """Rank distance between neighbours along `axis` when ranks are laid out in `order` (outermost first):
    the product of the sizes of the axes inside it. Missing sizes count as 1."""
    if axis not in order:
        raise ValueError(f"axis {axis!r} is not in the rank order {order}")
    inner = order[order.index(axis) + 1 :]
    return math.prod(sizes.get(a, 1) for a in inner)


def bus_bandwidth(hw: Hardware, pl: Placement) -> float:
    """Bytes/s per rank per direction the group's ring can sustain: NVLink inside a node; across nodes the
    per_node NIC shares of each node carry the node-crossing traffic, min(NVLink, per_node × NIC share), divided
    by the fabric's oversubscription when the group spans more GPUs than one full-bisection pod."""
    if pl.intra_node:
        return hw.intra_node_bandwidth
    nic = pl.per_node * hw.inter_node_bandwidth
    if hw.pod_gpus and pl.nodes * hw.gpus_per_node > hw.pod_gpus:
        nic /= hw.oversubscription
    return min(hw.intra_node_bandwidth, nic)


def _ring_steps(kind: str, n: int) -> tuple[float, int]:
    """(bytes factor, ring steps) of a collective over n ranks on a buffer of `bytes` (the full buffer)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n, 2 * (n - 1)
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) / n, n - 1
    if kind in ("broadcast", "reduce"):  # pipelined chain: the whole buffer once, n − 1 hops of latency
        return 1.0, n - 1
    raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")


def ring_time(hw: Hardware, kind: str, nbytes: float, pl: Placement) -> float:
    """Ring (or pipelined chain) time: factor·bytes/bus + intra-node hops × intra latency + node-crossing hops ×
    network latency (the ring crosses a node boundary N times per round)."""
    if pl.ranks <= 1:
        return 0.0
    factor, steps = _ring_steps(kind, pl.ranks)
    crossing = 0 if pl.intra_node else steps * (pl.nodes - 1) // (pl.ranks - 1)
    latency = (steps - crossing) * hw.intra_node_latency + crossing * hw.inter_node_latency
    return factor * nbytes / bus_bandwidth(hw, pl) + latency


def tree_all_reduce_time(hw: Hardware, nbytes: float, pl: Placement) -> float:
    """Hierarchical tree all-reduce (chain in the node, double binary tree across nodes): reduce up and broadcast
    down move the whole buffer at 90 % of the bus bandwidth; latency 2·((k − 1)·intra + ⌈log2 N⌉·inter)."""
    if pl.ranks <= 1:
        return 0.0
    depth = math.ceil(math.log2(pl.nodes)) if pl.nodes > 1 else 0
    latency = 2 * ((pl.per_node - 1) * hw.intra_node_latency + depth * hw.inter_node_latency)
    return 2 * nbytes / (TREE_BANDWIDTH_FACTOR * bus_bandwidth(hw, pl)) + latency


def collective_time(hw: Hardware, kind: str, nbytes: float, pl: Placement) -> float:
    """Seconds of one collective on a buffer of `nbytes` (the full, unsharded buffer) over the group `pl`: the
    faster of the ring and, for an all-reduce that spans nodes, the tree (what NCCL's tuner picks)."""
    if pl.ranks <= 1 or nbytes <= 0:
        return 0.0
    ring = ring_time(hw, kind, nbytes, pl)
    if kind == "all_reduce" and not pl.intra_node:
        return min(ring, tree_all_reduce_time(hw, nbytes, pl))
    return ring
