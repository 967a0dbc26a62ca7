"""Communication volume: payload bytes per rank per step by collective kind (what a per-collective byte counter
records). Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from tessera.planner.cost.plan import Plan, per_microbatch_reduction
from tessera.planner.cost.rank_memory import boundary_bytes
from tessera.planner.cost.shape import ModelShape, linears
from tessera.traffic import FORWARD, Collective, linear_2d

__all__ = ["CommVolume", "dp_volume", "pp_p2p_volume", "tp1d_layer_volume", "tp2d_layer_volume", "volume_of"]


@dataclass(kw_only=True, slots=True)
class CommVolume:
    """Payload bytes handed to each kind of collective by one rank (full-size buffer for all-reduce, the gathered
    output for all-gather, the unreduced input for reduce-scatter, the block for broadcast/reduce, the tensor
    for send/recv), and the number of calls."""

    all_reduce: float = 0.0
    all_gather: float = 0.0
    reduce_scatter: float = 0.0
    broadcast: float = 0.0
    reduce: float = 0.0
    send: float = 0.0
    recv: float = 0.0
    calls: int = 0

    def __add__(self, other: CommVolume) -> CommVolume:
        return CommVolume(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def scaled(self, k: float) -> CommVolume:
        """Volume of `k` repetitions."""
        out = CommVolume(**{f.name: getattr(self, f.name) * k for f in fields(self)})
        out.calls = round(self.calls * k)
        return out

    def wire_bytes(self, n: int) -> float:
        """Bytes each rank sends on the wire with ring algorithms in a group of n (broadcast/reduce: one block
        moved per rank on average, (n−1)/n of the payload)."""
        if n <= 1:
            return self.send
        frac = (n - 1) / n
        collective = (
            2 * self.all_reduce + self.all_gather + self.reduce_scatter + self.broadcast + self.reduce
        )
        return frac * collective + self.send


def volume_of(calls: list[Collective]) -> CommVolume:
    """The `CommVolume` of a list of `tessera.traffic` collectives (every group summed)."""
    vol = CommVolume()
    for c in calls:
        vol = vol + CommVolume(**{c.kind: c.total}, calls=c.calls)
    return vol


def tp1d_layer_volume(shape: ModelShape, plan: Plan) -> CommVolume:
    """Megatron 1D tensor parallelism, one block, one micro-batch, per rank, as published (payload of b·s·h
    elements each); kept to compare with the papers. What tessera's runtime moves, and the planner prices, is
    `tessera.traffic.block_1d`: the same without SP, plus backward's re-gathers and the replicated vectors'
    gradients with SP, and one exit fewer replayed (tests/unit/test_traffic.py relates the two).

    Without sequence parallelism: forward 2 all-reduces, backward 2 (Narayanan §3.2: 8·b·s·h·(t−1)/t on the wire);
    with sequence parallelism: each all-reduce becomes an all-gather + a reduce-scatter (Korthikanti §4.2.2).
    Full recompute replays the forward's 2 collectives. 0 when t = 1.
    """
    if plan.tp <= 1 or plan.tp_kind != "1d":
        return CommVolume()
    n_fwd = 2 + (2 if plan.recompute == "full" else 0)
    nbytes = shape.seq_len * plan.micro_batch * shape.d_model * plan.act_bytes
    n = n_fwd + 2
    if plan.sequence_parallel:
        return CommVolume(all_gather=n * nbytes, reduce_scatter=n * nbytes, calls=2 * n)
    return CommVolume(all_reduce=n * nbytes, calls=n)


def tp2d_layer_volume(shape: ModelShape, plan: Plan) -> CommVolume:
    """Optimus 2D (SUMMA) tensor parallelism, one block, one micro-batch, per rank, as published (fused QKV, no
    biases); kept to compare with the paper. tessera's own (separate q, k, v Linears, biases, norm statistics and
    gradients), which the runtime moves and the planner prices, is `tessera.traffic.block_2d`.

    Sum of `traffic.linear_2d` (forward C = A·B, backward dA = dC·Bᵀ and dB = Aᵀ·dC, q steps each) over QKV, proj,
    fc1(+gate), fc2: for GPT wire (q−1)/q²·(21·M·h + 36·h²) elements (Xu et al. 2021, derived in
    docs/cost-model.md §5), M = b·s. Full recompute replays the forward broadcasts. Plus LayerNorm statistics:
    per norm an all-reduce of 2 fp32 values per local token (M/q) along the row, forward and backward.
    """
    q = plan.q
    if q <= 1:
        return CommVolume()
    m, nb = shape.seq_len * plan.micro_batch / q, plan.act_bytes
    calls: list[Collective] = []
    for k_in, n_out in linears(shape):
        one = linear_2d(m, k_in, n_out, q, False, nb)
        calls += one
        if plan.recompute == "full":  # forward broadcasts of A and B replayed
            calls += [c for c in one if c.phase == FORWARD]
    stats = 2 * m * 4  # (sum, sum of squares) in fp32 per local token
    norms = len(shape.features.block_norms)  # each all-reduces its statistics forward and backward
    return volume_of(calls) + CommVolume(all_reduce=norms * 2 * stats, calls=2 * norms)


def pp_p2p_volume(shape: ModelShape, plan: Plan, stage: int) -> CommVolume:
    """Pipeline sends/receives of one rank (pipeline position `stage`) per step.

    Chunk c of rank `stage` is global stage c·p + stage (looping assignment). Each micro-batch sends its
    activation b·s·h forward from every chunk with a successor and its gradient backward from every chunk with a
    predecessor (Narayanan §3.2), divided by t with the scatter/gather optimisation (sequence parallel / 2D
    layouts hold sharded boundary activations: /t, /q²), in the residual stream's dtype (`boundary_bytes`: fp32
    under tessera's autocast). Receives mirror the sends.
    """
    p, v, m = plan.pp, plan.virtual_stages, plan.n_microbatches
    if p <= 1:
        return CommVolume()
    positions = [c * p + stage for c in range(v)]
    with_next = sum(pos < v * p - 1 for pos in positions)
    with_prev = sum(pos > 0 for pos in positions)
    nbytes = boundary_bytes(shape, plan)
    sends = m * (with_next + with_prev)
    return CommVolume(send=sends * nbytes, recv=sends * nbytes, calls=2 * sends)


def tied_exchange_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes one EXCHANGE sends (and receives): the gradient of this rank's shard of a tied embedding table,
    V·h/t in the parameters' dtype (fp32 under tessera's autocast, `Plan.param_bytes`)."""
    return shape.vocab_size * shape.d_model / plan.tp * plan.param_bytes


def dp_volume(
    params_local: float, plan: Plan, *, grad_bytes: int = 2, param_bytes: int = 2, reduced_once: float = 0.0
) -> CommVolume:
    """Data-parallel payload per rank per step for `params_local` parameters (those held by this rank's stage
    and tensor shard, before ZeRO sharding).

    ZeRO 0: all-reduce of gradients (2Ψ on the wire). ZeRO 1/2: reduce-scatter gradients + all-gather updated
    params (2Ψ). ZeRO 3: all-gather params for forward and again for backward + reduce-scatter gradients (3Ψ)
    (Rajbhandari 2020 Table). Depth-first accumulation: ZeRO 2 reduce-scatters every micro-batch (×m) and ZeRO 3
    also gathers every micro-batch (×m); layered accumulation does each once per step (layered-pipeline §2.2).
    ZeRO 0 depth-first in tessera's pipeline runtime all-reduces every micro-batch (×m, `per_microbatch_reduction`).
    ``reduced_once`` of the `params_local` are reduced once per step whatever the accumulation: the stages tied
    to another pipeline rank's, reduced after their EXCHANGE (`tessera.pipeline.passes.tied_across`).
    """
    if plan.batch_ranks <= 1:
        return CommVolume()
    g, w, once = params_local * grad_bytes, params_local * param_bytes, reduced_once * grad_bytes
    m = plan.n_microbatches if plan.accumulation == "depth_first" else 1
    if plan.zero_stage == 0:
        reps = m if per_microbatch_reduction(plan) else 1
        return CommVolume(all_reduce=reps * (g - once) + once, calls=_reduce_calls(reps, g, once))
    if plan.zero_stage == 1:
        return CommVolume(reduce_scatter=g, all_gather=w, calls=2)
    if plan.zero_stage == 2:
        return CommVolume(
            reduce_scatter=m * (g - once) + once, all_gather=w, calls=_reduce_calls(m, g, once) + 1
        )
    if plan.zero_stage == 3:
        return CommVolume(
            reduce_scatter=m * (g - once) + once,
            all_gather=2 * m * w,
            calls=_reduce_calls(m, g, once) + 2 * m,
        )
    raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {plan.zero_stage}")


def _reduce_calls(reps: int, g: float, once: float) -> int:
    """Reductions per step: ``reps`` of the gradients reduced every time, one of those reduced once."""
    return (reps if g > once else 0) + (1 if once else 0)
