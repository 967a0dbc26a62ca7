"""What the `parallel.tp_comm_overlap` rings hold in their backward, beyond the block's saved tensors: the MLP's,
and at their own widths the attention's (`rank_memory.ring_moment_bytes` places both).

With `Plan.tp_comm_overlap` (1D + SP) the sequence-parallel entry and exit are rings (`tessera.parallel.ring_1d`):
the MLP's input Linears read the gathered input through `_RingGatheredLinears`, its output Linear reduce-scatters
through `_RingRowParallel`. Their backward keeps what the plain collectives' does not: the chunks in flight on
both rings, each Linear's weight cast to the gradient's dtype, and the weight gradients as partial sums, one per
lane (`ring_1d._Lanes`: min(`traffic.RING_GEMM_LANES`, t) CUDA streams, chunk k's GEMMs on lane k mod S) until
their join adds them. Those weight gradients are [f/t, h] each in fp32, larger than the [N/t, h] chunks wherever
f > N (megatron-1t at tensor 4: 2.44 GiB each, f/t = h = 25 600), which is why the rings' moment can be the rank's
peak (docs/memory.md, "The tensor-parallel rings' backward").

The functions below replay each backward's allocations step by step, in the order the code makes and frees them
(the autograd engine's reference counting: a temporary lives until its statement ends, a variable until it is
rebound), and return the fullest moment; nothing is fitted. Each is a moment beyond the saved tensors of the block
whose backward it is (`tessera.planner.cost.rank_memory.ring_moment_bytes` places them).

The lanes are a CUDA run's: the estimate is for the device the plan runs on. A CPU process runs one lane
(`ring_1d._open_lanes`); `tessera.dryrun` runs the rings on a CUDA run's lanes (synchronous stand-in streams) so
that its count is the CUDA run's. Shapes: N = b·s tokens of the rank's micro-batch, n = s/t a chunk's sequence
rows, h the model width, f/t the rank's MLP features; c, r the compute and stream dtypes' bytes, the weights'
`Plan.param_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tessera.planner.cost.plan import Plan
from tessera.planner.cost.shape import ModelShape
from tessera.traffic import ring_gemm_lanes

__all__ = ["ring_entry_backward_bytes", "ring_exit_backward_bytes"]


@dataclass
class _Tally:
    """Live bytes of one backward and the fullest moment seen."""

    live: float = 0.0
    peak: float = 0.0

    def note(self, extra: float = 0.0) -> None:
        """A moment: what is live, and ``extra`` bytes of temporaries beside it."""
        self.peak = max(self.peak, self.live + extra)


def _cast(plan: Plan, elements: float) -> float:
    """Bytes of a weight's cast to the compute dtype (``w.to(c)``): none when it is already that dtype."""
    return plan.act_bytes * elements if plan.act_bytes != plan.param_bytes else 0.0


def _lane_total(tally: _Tally, parts: int, nbytes: float) -> float:
    """`_Lanes.total`: functools.reduce(torch.add) over ``parts`` partial sums of ``nbytes`` each, all alive (the
    lanes keep them): the running sum and the next beside them (one new tensor for two parts, none for one).
    Returns the result's new bytes, alive after the call."""
    if parts < 2:
        return 0.0
    tally.note((2 if parts > 2 else 1) * nbytes)
    return nbytes


def _add_to_lane(tally: _Tally, sums: list[bool], k: int, lanes: int, grad: float) -> None:
    """`_Lanes.accumulate` of a new weight gradient (``grad`` bytes, already live): the first on its lane is kept
    as the lane's sum; a later one makes the sum of the two (the old sum and the gradient freed after)."""
    j = k % lanes
    if sums[j]:
        tally.note(grad)  # the new sum beside the old and the gradient
        tally.live -= grad
    sums[j] = True


def ring_exit_backward_bytes(shape: ModelShape, plan: Plan, width: float | None = None) -> float:
    """The MLP output Linear's ring backward (`ring_1d._RingRowParallel.backward`) at its fullest, beyond its
    saved input x ([b, s, f/t] in c) and weight; 0 without the rings. Alive throughout: its output gradient g
    ([b, n, h] in c), the input gradient gx it fills chunk by chunk ([b, s, f/t], c) and the weight's cast
    ([h, f/t], c). At step k: the chunk received at k − 1 (k ≥ 1) and the one arriving (k < t − 1), both
    [b, n, h]; the chunk's input-gradient product ([b, n, f/t]) or its weight gradient: x's chunk flattened (a
    copy when b > 1, the chunk a strided view), their product ([h, f/t], c), its fp32 cast, added to its lane's
    sum. After the loop the lanes' sums are added (`_Lanes.total`). ``width``: the Linear's input features
    (default the MLP's f; the attention's output projection reads q_dim = n_heads·head_dim), f/t on the rank."""
    if not plan.tp_comm_overlap:
        return 0.0
    t, b, c = plan.tp, plan.micro_batch, plan.act_bytes
    n, h = shape.seq_len // t, shape.d_model
    f = (shape.ffn_hidden if width is None else width) / t
    chunk = c * b * n * h  # [b, n, h]
    weight = h * f  # [h, f/t] elements
    grad = plan.param_bytes * weight  # a weight gradient in the weight's dtype
    product = c * weight
    cast = grad if c != plan.param_bytes else 0.0  # .to(weight dtype) of the product
    copy = c * b * n * f if b > 1 else 0.0  # _flat of x's chunk
    lanes = ring_gemm_lanes(t)
    tally = _Tally(live=chunk + c * b * shape.seq_len * f + _cast(plan, weight))  # g, gx, the weight's cast
    sums = [False] * lanes
    for k in range(t):
        ring = (chunk if k >= 1 else 0.0) + (chunk if k < t - 1 else 0.0)  # held (received), the next
        tally.live += ring
        tally.note(c * b * n * f)  # the input gradient's chunk product, copied into gx
        tally.note(copy + product)
        tally.note(product + cast)
        tally.live += grad if cast else product  # the gradient, until its lane's sum takes it
        _add_to_lane(tally, sums, k, lanes, grad)
        tally.live -= ring
    tally.live += chunk if t > 1 else 0.0  # the last chunk received
    _lane_total(tally, sum(sums), grad)
    return tally.peak


def ring_entry_backward_bytes(shape: ModelShape, plan: Plan, widths: Sequence[float] | None = None) -> float:
    """The MLP input Linears' ring backward (`ring_1d._RingGatheredLinears.backward`) at its fullest, beyond its
    saved input shard ([b, n, h] in r) and the input Linears' output gradients ([b, s, f/t] in c each, its inputs:
    the caller counts them); 0 without the rings. Alive throughout: each weight's cast ([f/t, h], c). At step k:
    the gather ring's received chunk (k ≥ 1) and the one arriving (k < t − 1), [b, n, h] in r; the reduce ring's
    received running sum ([b, n, h], c); the input-gradient part Σ_i g_i[chunk]·W_i ([b, n, h], c; each g_i
    chunk flattened by the product, a copy when b > 1), the previous part alive until the new one is bound; then
    each Linear's weight gradient from the gathered chunk (g_i's chunk flattened, the chunk cast to c when r > c,
    their product [f/t, h] in c, its fp32 cast) added to its lane's sum. After the loop each Linear's lane sums
    are added (`_Lanes.total`; the lanes keep their sums until the backward returns) and the part is cast back to
    the input's dtype. ``widths``: each input Linear's output features (default the MLP's: f for each of
    `mlp_in`; the attention's entry: q_dim, kv_dim, kv_dim), out_i/t on the rank."""
    if not plan.tp_comm_overlap:
        return 0.0
    t, b, c, r = plan.tp, plan.micro_batch, plan.act_bytes, plan.stream_bytes
    n, h = shape.seq_len // t, shape.d_model
    if widths is None:
        widths = [shape.ffn_hidden] * len(shape.features.mlp_in)
    outs = [w / t for w in widths]  # each Linear's out_i/t
    linears = len(outs)
    gathered, part = r * b * n * h, c * b * n * h  # a gather-ring chunk, a reduce-ring chunk
    weights = [f * h for f in outs]
    grads_of = [plan.param_bytes * w for w in weights]  # a weight gradient in the weight's dtype, per Linear
    products = [c * w for w in weights]
    g_copies = [c * b * n * f if b > 1 else 0.0 for f in outs]  # a g_i chunk flattened
    x_cast = c * b * n * h if c != r else 0.0  # the gathered chunk in c
    lanes = ring_gemm_lanes(t)
    casts = sum(_cast(plan, w) for w in weights)
    sums = [[False] * lanes for _ in range(linears)]
    held = pending = current = grads = 0.0  # received chunk, received running sum, part, lane sums (bytes)
    tally = _Tally()
    for k in range(t):
        nxt = gathered if k < t - 1 else 0.0  # the gather ring's next chunk
        tally.live = casts + held + nxt + pending + current + grads
        made = 0.0  # the new part: a term, then the sum of the terms so far; the last part still bound
        for i in range(linears):
            tally.note(made + g_copies[i] + part)  # g_i's chunk copied for its product (the term)
            if i:
                tally.note(made + 2 * part)  # part + term beside both
            made = part
        current = made  # bound: the last part freed; the received sum is added in place
        tally.live = casts + held + nxt + pending + current + grads
        if k < t - 1:  # passed on: a buffer for r − 1's sum beside the last received, freed once rebound
            tally.note(part)
        pending = part if k < t - 1 else 0.0
        tally.live = casts + held + nxt + pending + current + grads
        for i in range(linears):
            grad, product = grads_of[i], products[i]
            cast = grad if c != plan.param_bytes else 0.0
            tally.note(g_copies[i] + x_cast + product)
            tally.note(product + cast)
            tally.live += grad if cast else product
            before = sum(sums[i])
            _add_to_lane(tally, sums[i], k, lanes, grad)
            grads += grad * (sum(sums[i]) - before)
            tally.live = casts + held + nxt + pending + current + grads
        if k < t - 1:
            held = nxt  # the chunk just received; the one before freed
    # the last chunk received, the input gradient, the lanes' sums
    tally.live = casts + held + current + grads
    for i in range(linears):
        tally.live += _lane_total(tally, sum(sums[i]), grads_of[i])
    tally.note(r * b * n * h if r != c else 0.0)  # the input gradient in x's dtype
    return tally.peak
