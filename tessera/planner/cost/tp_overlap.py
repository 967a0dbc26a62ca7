"""Tensor-parallel communication overlap (`Plan.tp_comm_overlap`, 1D with sequence parallelism): each of sequence
parallelism's all-gathers and reduce-scatters runs as a ring of t point-to-point steps under the GEMM chunks it
feeds or is fed by (the "collective matmul" decomposition of Wang et al., ASPLOS 2023; Megatron-Core's
``--tp-comm-overlap`` with Transformer Engine's userbuffers). Formulas and sources: docs/cost-model.md §6.

A ring over the t ranks of the tensor group has t GEMM chunks (m/t rows each, `chunk` seconds) and t − 1
transfers of 1/t of the collective's tensor to the ring neighbour (`ring_step_time`, `transfer` seconds). An
all-gather computes on the chunk it holds while the next one arrives; a reduce-scatter computes the partial for
one destination chunk while the previous step's sum travels on. Either way the GEMM stream and the transfer
stream overlap step by step, one GEMM chunk runs with no transfer under it, and the ring lasts

    T = max(t·chunk, chunk + (t − 1)·transfer)

so the exposed transfer is T − t·chunk and the hidden transfer (t − 1)·transfer − exposed. What the ring adds
to the step beyond the unchunked GEMM `whole` (which `compute` already counts) is

    added = T − whole + overlap_slowdown × hidden

the smaller chunks' GEMM efficiency (tile and wave quantization: t·chunk ≥ whole), the exposed transfer, and
the compute that the hidden transfer slows (`Hardware.overlap_slowdown`, as `steptime.dp_cost` charges
data-parallel overlap).

On a GPU the runtime issues the chunk GEMMs round-robin on `traffic.RING_GEMM_LANES` CUDA streams (Transformer
Engine's userbuffers overlap does the same with its default of 3), so a chunk's last, partly filled wave of
thread blocks overlaps the next chunk's: `chunk` is then 1/t of the t chunk GEMMs priced together on
``ring_lanes`` streams (`gemm.lanes_call_time`: one batched call when the lanes hold enough tiles to occupy every
SM, else rounds of ``ring_lanes`` calls). In a transfer-bound ring the chunks wait for their data rather than for
each other and the last one runs alone, which the packed time understates by at most its tail wave.
Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tessera.planner.cost.collectives import group_placement, p2p_time, traffic_time
from tessera.planner.cost.plan import Plan
from tessera.planner.hardware import Hardware
from tessera.planner.network import bus_bandwidth
from tessera.traffic import Collective, ring_gemm_lanes

__all__ = [
    "RING_KINDS",
    "RingCost",
    "ring_added_time",
    "ring_cost",
    "ring_lanes",
    "ring_step_time",
    "tensor_traffic_time",
]

RING_KINDS = ("all_gather", "reduce_scatter")
"""Sequence parallelism's collectives on the 1D tensor group: the ones the ring replaces."""


@dataclass(frozen=True, slots=True)
class RingCost:
    """One ring of t steps: its length and how much of its transfer is exposed or hidden under GEMM chunks."""

    seconds: float
    """T = max(t·chunk, chunk + (t − 1)·transfer)."""
    exposed: float
    """Transfer seconds past the GEMM chunks: T − t·chunk."""
    hidden: float
    """Transfer seconds under GEMM chunks: (t − 1)·transfer − exposed."""


def ring_cost(chunk: float, transfer: float, t: int) -> RingCost:
    """The ring of t GEMM chunks of `chunk` seconds and t − 1 transfers of `transfer` seconds (module docstring).
    Transfer-bound (transfer ≥ chunk): T = chunk + (t − 1)·transfer; GEMM-bound: T = t·chunk, every transfer
    hidden and one GEMM chunk with none under it."""
    if t < 2:
        raise ValueError(f"a ring needs a tensor group of at least 2 ranks, got t = {t}")
    total = max(t * chunk, chunk + (t - 1) * transfer)
    exposed = total - t * chunk
    return RingCost(seconds=total, exposed=exposed, hidden=(t - 1) * transfer - exposed)


def ring_added_time(chunk: float, whole: float, transfer: float, t: int, slowdown: float) -> float:
    """Seconds a ring adds to the step beyond its GEMM run whole (`whole`, counted as compute): T − whole +
    slowdown × hidden transfer (module docstring)."""
    ring = ring_cost(chunk, transfer, t)
    return ring.seconds - whole + slowdown * ring.hidden


def ring_lanes(hw: Hardware, plan: Plan) -> int:
    """Chunk GEMMs of a ring that run concurrently: min(`traffic.RING_GEMM_LANES`, t) on hardware priced by SM waves
    (`Hardware.sm_count` > 0, a GPU), 1 otherwise (a CPU runs the chunks one after the other; the size curve has
    no waves to fill)."""
    return ring_gemm_lanes(plan.tp) if hw.sm_count > 0 else 1


def ring_step_time(hw: Hardware, plan: Plan, nbytes: float) -> float:
    """One ring step of a collective on `nbytes` (the full buffer, comm.py's convention): 1/t of it sent to the
    ring neighbour on the tensor group's link (`p2p_time`: bytes / bus bandwidth + one hop's latency, the
    network's when the group spans nodes: the ranks step together, so the slowest hop sets the pace). The t − 1
    steps add up to the ring collective's `network.ring_time` on a group inside one node."""
    pl = group_placement(hw, plan, "tensor")
    latency = hw.intra_node_latency if pl.intra_node else hw.inter_node_latency
    return p2p_time(nbytes / plan.tp, bus_bandwidth(hw, pl), latency)


def tensor_traffic_time(
    hw: Hardware, plan: Plan, calls: list[Collective], phase: str, gemms: Sequence[tuple[float, float]] = ()
) -> float:
    """Seconds the tensor-parallel collectives of `phase` add to the step: `traffic_time` (none overlapped);
    with `Plan.tp_comm_overlap` each all-gather / reduce-scatter of the phase, in the order of `calls`, is a ring
    under the next entry of `gemms` ((chunk, whole) GEMM seconds, `ring_added_time`) and the rest keep
    `traffic_time`. Raises if the phase has more ring collectives than `gemms` names."""
    if not plan.tp_comm_overlap:
        return traffic_time(hw, plan, calls, phase)
    rings = [c for c in calls if c.phase == phase and c.kind in RING_KINDS and c.group == "tensor"]
    if len(rings) > len(gemms):
        raise ValueError(
            f"{len(rings)} {phase} ring collectives but {len(gemms)} GEMMs to run them under: the pairing in "
            "the cost model no longer matches tessera.traffic's collectives"
        )
    rest = [c for c in calls if c not in rings]
    added = sum(
        c.calls
        * ring_added_time(chunk, whole, ring_step_time(hw, plan, c.nbytes), plan.tp, hw.overlap_slowdown)
        for c, (chunk, whole) in zip(rings, gemms, strict=False)
    )
    return added + traffic_time(hw, plan, rest, phase)
