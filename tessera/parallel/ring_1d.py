"""Sequence parallelism's all-gather and reduce-scatter decomposed into rings run under the GEMMs they feed.

This is the "collective matmul" of Wang et al., *Overlap Communication with Dependent Computation via
Decomposition in Large Deep Learning Models* (ASPLOS 2023), as Megatron-Core runs it with Transformer Engine's
userbuffers (``--tp-comm-overlap``): a collective whose result feeds a GEMM is split into t − 1 point-to-point
steps around the tensor group, and the GEMM into t chunks along the gathered (sequence) dimension, so that each
chunk's GEMM runs while the next chunk travels. docs/tensor-1d.md §"Communication overlap" explains when it pays.

Rank r of t holds sequence chunk r (n = s/t rows along ``dim``). Two rings, both sending to r + 1 and receiving
from r − 1:

- gather ring: at step k the rank holds chunk (r − k) mod t; it starts passing it on, then computes on it;
- reduce ring: at step k the rank computes its partial result for chunk (r − 1 − k) mod t, adds the running sum
  received from r − 1 and passes it on; after t steps the sum of chunk r, over every rank, ends at rank r.

Entry (all-gather, then column-parallel linears): forward is the gather ring writing each chunk's output rows;
backward runs the gather ring again (weight-gradient GEMM per chunk, only the shard was saved) and the reduce ring
for the input gradient, both in flight together (different tags). Exit (row-parallel linear, then reduce-scatter):
forward is the reduce ring; backward the gather ring of the output gradient under the input- and weight-gradient
GEMMs. Numerically the same as the collectives up to the order of the sums.

Each ring is counted in ``comm.STATS`` as the collective it replaces, with comm's byte rule for that kind (the
gathered bytes for an all-gather, the unscattered bytes for a reduce-scatter): a ring of t − 1 steps moves
(t − 1)/t of those bytes per rank, exactly what the ring all-gather / reduce-scatter it replaces moves, so
``tessera.traffic.tensor_1d_comm`` holds unchanged with the overlap on.

Shapes in comments for ``dim`` = 1 (the sequence): b batch, s sequence, n = s/t, h input features, o output
features of this rank (o/t of the layer's for a column-parallel linear).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera import comm

__all__ = ["ring_gathered_linears", "ring_row_parallel"]

GATHER_TAG, REDUCE_TAG = 0, 1
"""Point-to-point tags of the two rings (both in flight at once in the entry's backward)."""

_Pending = tuple[torch.Tensor, list[dist.Work]]  # a sent tensor kept alive with the works of its ring step


def _count(kind: str, group: dist.ProcessGroup, nbytes: int) -> None:
    """Record a ring as the collective it replaces (see the module docstring)."""
    comm.STATS.record(kind, comm.group_name(group), nbytes)


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _rows(x: torch.Tensor, dim: int, chunk: int, n: int) -> torch.Tensor:
    """Chunk ``chunk`` of x along ``dim``: x[:, chunk·n:(chunk+1)·n] for dim 1 (a view)."""
    return x.narrow(dim, chunk * n, n)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # [b, n, f] -> [b·n, f]


def _ring_step(held: torch.Tensor, group: dist.ProcessGroup, tag: int, last: bool) -> _Pending:
    """Start passing ``held`` on (nothing on the last step): (the buffer that will hold r − 1's, works)."""
    return (held, []) if last else comm.ring_shift(held, group, tag)


class _RingGatheredLinears(torch.autograd.Function):
    """All-gather of x along ``dim`` fused, chunk by chunk, with the column-parallel linears reading it."""

    @staticmethod
    def forward(
        ctx, x, dim, group, *params
    ):  # x: [b, n, h]; params: w0, b0, w1, b1, ... (a bias may be None)
        t, r, n = comm.group_size(group), dist.get_rank(group), x.shape[dim]
        _count("all_gather", group, t * x.numel() * x.element_size())
        held, outs = x.contiguous(), None
        for k in range(t):
            chunk = (r - k) % t  # the shard held now: rank chunk's
            nxt, works = _ring_step(held, group, GATHER_TAG, k == t - 1)
            ys = [
                F.linear(held, params[i], params[i + 1]) for i in range(0, len(params), 2)
            ]  # each [b, n, o_i]
            if outs is None:
                outs = [y.new_empty((*y.shape[:dim], t * n, *y.shape[dim + 1 :])) for y in ys]  # [b, s, o_i]
            for out, y in zip(outs, ys, strict=True):
                _rows(out, dim, chunk, n).copy_(y)
            _wait(works)
            held = nxt
        ctx.save_for_backward(x, *params)  # the shard only, never the gathered [b, s, h]
        ctx.dim, ctx.group = dim, group
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *params = ctx.saved_tensors
        dim, group = ctx.dim, ctx.group
        t, r, n = comm.group_size(group), dist.get_rank(group), x.shape[dim]
        live = [
            (i, g.contiguous(), w)  # g: [b, s, o_i]
            for i, (g, w) in enumerate(zip(grads, params[0::2], strict=True))
            if g is not None  # an output that did not reach the loss
        ]
        dtype = live[0][1].dtype if live else x.dtype
        _count("all_gather", group, t * x.numel() * x.element_size())
        _count("reduce_scatter", group, t * x.numel() * dtype.itemsize)
        gws: dict[int, torch.Tensor] = {}
        held, pending = x.contiguous(), None
        for k in range(t):
            chunk, dest = (r - k) % t, (r - 1 - k) % t
            nxt, gathering = _ring_step(held, group, GATHER_TAG, k == t - 1)
            part = _input_grad(live, dim, dest, n, x)  # part: [b, n, h], this rank's share of chunk dest's
            if pending is not None:
                _wait(pending[1])
                part += pending[0]  # the running sum of ranks r − k .. r − 1
            pending = _ring_step(part, group, REDUCE_TAG, k == t - 1)
            for i, g, w in live:  # weight gradient of this chunk, under both rings
                gw = (
                    _flat(_rows(g, dim, chunk, n)).t().matmul(_flat(held).to(g.dtype)).to(w.dtype)
                )  # [o_i, h]
                gws[i] = gw if i not in gws else gws[i] + gw
            _wait(gathering)
            held = nxt
        gparams: list[torch.Tensor | None] = []
        for i, b in enumerate(params[1::2]):
            g = grads[i]
            gparams += [gws.get(i), None if g is None or b is None else _flat(g).sum(0).to(b.dtype)]
        return part.to(x.dtype), None, None, *gparams


def _input_grad(
    live: Sequence[tuple[int, torch.Tensor, torch.Tensor]], dim: int, chunk: int, n: int, x: torch.Tensor
) -> torch.Tensor:
    """Σ_i g_i[chunk] W_i: this rank's partial input gradient of one chunk ([b, n, h]; zeros if nothing is live)."""
    part = None
    for _, g, w in live:
        term = _rows(g, dim, chunk, n).matmul(w.to(g.dtype))  # [b, n, o_i] @ [o_i, h] -> [b, n, h]
        part = term if part is None else part + term
    return torch.zeros_like(x) if part is None else part


class _RingRowParallel(torch.autograd.Function):
    """A row-parallel linear (no bias) fused, chunk by chunk, with the reduce-scatter of its output along ``dim``."""

    @staticmethod
    def forward(
        ctx, x, weight, dim, group
    ):  # x: [b, s, h/t] (h/t: the rank's input features), weight: [o, h/t]
        t, r = comm.group_size(group), dist.get_rank(group)
        if x.shape[dim] % t:
            raise ValueError(
                f"ring reduce-scatter: dim {dim} of size {x.shape[dim]} is not divisible by t = {t}"
            )
        n = x.shape[dim] // t
        pending = None
        for k in range(t):
            dest = (r - 1 - k) % t
            part = F.linear(
                _rows(x, dim, dest, n), weight
            )  # part: [b, n, o], this rank's share of chunk dest's
            if pending is not None:
                _wait(pending[1])
                part += pending[0]  # the running sum of ranks r − k .. r − 1
            pending = _ring_step(part, group, REDUCE_TAG, k == t - 1)
        _count("reduce_scatter", group, t * part.numel() * part.element_size())
        ctx.save_for_backward(x, weight)  # what F.linear saves too
        ctx.dim, ctx.group = dim, group
        return part  # [b, n, o]: chunk r, summed over the group

    @staticmethod
    def backward(ctx, g):  # g: [b, n, o]
        x, weight = ctx.saved_tensors
        dim, group = ctx.dim, ctx.group
        t, r, n = comm.group_size(group), dist.get_rank(group), g.shape[dim]
        _count("all_gather", group, t * g.numel() * g.element_size())
        gx = g.new_empty(x.shape)  # gx: [b, s, h/t]
        gw, held = None, g.contiguous()
        for k in range(t):
            chunk = (r - k) % t  # the output-gradient shard held now: rank chunk's
            nxt, works = _ring_step(held, group, GATHER_TAG, k == t - 1)
            _rows(gx, dim, chunk, n).copy_(held.matmul(weight.to(held.dtype)))  # [b, n, o] @ [o, h/t]
            part = _flat(held).t().matmul(_flat(_rows(x, dim, chunk, n)).to(held.dtype)).to(weight.dtype)
            gw = part if gw is None else gw + part  # gw: [o, h/t]
            _wait(works)
            held = nxt
        return gx.to(x.dtype), gw, None, None


def ring_gathered_linears(
    x: torch.Tensor, dim: int, group: dist.ProcessGroup, params: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, ...]:
    """Linears (``params`` = w0, b0, w1, b1, ...; a bias may be None) applied to x all-gathered along ``dim``,
    the gather run as a ring under the per-chunk GEMMs. x: [b, s/t, h] → outputs [b, s, o_i]."""
    return _RingGatheredLinears.apply(x, dim, group, *params)


def ring_row_parallel(
    x: torch.Tensor, weight: torch.Tensor, dim: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """x Wᵀ summed over ``group`` and scattered along ``dim``, the reduce-scatter run as a ring under the per-chunk
    GEMMs. x: [b, s, h/t], weight: [o, h/t] → [b, s/t, o]."""
    return _RingRowParallel.apply(x, weight, dim, group)
