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

Lanes. On CUDA every chunk GEMM is issued round robin on min(``RING_GEMM_LANES``, t) side streams (`_Lanes`),
as Transformer Engine's userbuffers overlap does (``CommOverlapP2PBase::split_overlap_ag``, cited in
docs/tensor-1d.md): a chunk GEMM alone on one stream ends with a partly empty wave of thread blocks that the next
chunk cannot fill, on another stream it can. A gather ring's lane waits for the current stream before each chunk
(the data received so far); a reduce ring's chunks read only inputs that were ready when the lanes forked
(`_Lanes.fork`), so they wait for nothing more and consecutive partials overlap. The current stream waits for a
lane where it consumes a chunk's result (a reduce ring's partial) and for every lane at the end; sums across
chunks (weight gradients) are kept per lane and added on the current stream after that join. CPU runs one lane,
the current stream itself: the same arithmetic in the same order as without lanes, bit for bit. The CUDA path
follows PyTorch's multi-stream rules but has not run on a GPU yet.

Shapes in comments for ``dim`` = 1 (the sequence): b batch, s sequence, n = s/t, h input features, o output
features of this rank (o/t of the layer's for a column-parallel linear).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera import comm
from tessera.parallel.checkpointing import save_early, saved_early
from tessera.traffic import ring_gemm_lanes

__all__ = ["device_lanes", "ring_gathered_linears", "ring_row_parallel"]

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


_T = TypeVar("_T")


class _Stream(Protocol):
    """What `_Lanes` needs of a stream (a CUDA stream, `_CudaStream`; tests pass synchronous fakes)."""

    def wait(self, other: _Stream) -> None:
        """Work issued on this stream from now on starts after the work queued on ``other`` so far."""

    def keep(self, t: torch.Tensor) -> None:
        """``t``'s memory is not reused before the work queued on this stream when it is freed is done."""

    def active(self) -> AbstractContextManager[object]:
        """Work issued inside the context runs on this stream (tensors allocated inside belong to it)."""


class _CudaStream:
    """A CUDA stream as a `_Stream`: wait_stream, record_stream, torch.cuda.stream (PyTorch's CUDA semantics
    notes, "CUDA streams")."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def wait(self, other: _CudaStream) -> None:
        self.stream.wait_stream(other.stream)

    def keep(self, t: torch.Tensor) -> None:
        t.record_stream(self.stream)

    def active(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self.stream)


@functools.cache
def _side_streams(device: torch.device, count: int) -> tuple[_CudaStream, ...]:
    """``count`` side streams of a CUDA device, made once per process (a stream per ring call would cost a
    driver call each)."""
    return tuple(_CudaStream(torch.cuda.Stream(device)) for _ in range(count))


def _streams(like: torch.Tensor, count: int) -> tuple[_Stream, Sequence[_Stream]] | None:
    """(the current stream, ``count`` side streams) of ``like``'s device; None off CUDA (one lane: the current
    stream). Tests replace it to run the lanes' bookkeeping on CPU."""
    if not like.is_cuda:
        return None
    return _CudaStream(torch.cuda.current_stream(like.device)), _side_streams(like.device, count)


class _HostStream:
    """A `_Stream` that orders nothing: the work runs at once, on the host. `device_lanes` runs the lanes' code
    with it where there is no CUDA stream."""

    def wait(self, other: _Stream) -> None:
        pass

    def keep(self, t: torch.Tensor) -> None:
        pass

    def active(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()


@contextlib.contextmanager
def device_lanes() -> Iterator[None]:
    """Inside, rings on a non-CUDA device run on the lanes a CUDA run would use (min(RING_GEMM_LANES, t), each a
    `_HostStream`), so they allocate as a CUDA run does: one weight-gradient partial sum per lane, not one in all.
    The dry run (`tessera.dryrun.dry_run`) runs inside it; the arithmetic is the same up to the order of the sums."""
    global _streams
    plain = _streams

    def streams(like: torch.Tensor, count: int) -> tuple[_Stream, Sequence[_Stream]] | None:
        found = plain(like, count)
        return found if found is not None else (_HostStream(), tuple(_HostStream() for _ in range(count)))

    _streams = streams
    try:
        yield
    finally:
        _streams = plain


def _open_lanes(like: torch.Tensor, t: int) -> _Lanes:
    """The lanes of one ring call of t chunks on ``like``'s device: min(RING_GEMM_LANES, t) side streams on CUDA,
    the pass-through elsewhere (`traffic.ring_gemm_lanes`)."""
    streams = _streams(like, ring_gemm_lanes(t))
    return _Lanes() if streams is None else _Lanes(streams[1], streams[0])


class _Lanes:
    """Chunk k's GEMMs on lane k mod S of S side streams, per-lane partial sums, and the join (module docstring).

    Without side streams (CPU) it is a pass-through: one lane, every call run at once on the current stream, one
    partial sum accumulated in call order, so the results are those of a plain loop bit for bit.
    """

    def __init__(self, lanes: Sequence[_Stream] = (), current: _Stream | None = None) -> None:
        if lanes and current is None:
            raise ValueError("side streams need the current stream they fork from and join")
        self._lanes, self._current = tuple(lanes), current
        self._sums: list[dict[object, torch.Tensor]] = [{} for _ in range(self.count)]
        self._used: set[int] = set()
        self._joined = False

    @property
    def count(self) -> int:
        """S: the number of lanes (1 for the pass-through)."""
        return max(1, len(self._lanes))

    def lane(self, k: int) -> int:
        """The lane of chunk step k: round robin."""
        return k % self.count

    def fork(self) -> None:
        """Every lane waits, once, for what the current stream has queued so far: the ring's inputs and the
        outputs allocated before the loop. A reduce ring's chunks read nothing else, so they `run` with
        ``follow=False`` after this."""
        for lane in self._lanes:
            lane.wait(self._current)

    def run(self, k: int, fn: Callable[..., _T], *used: torch.Tensor, follow: bool = True) -> _T:
        """``fn(*used)`` on lane k mod S. ``follow``: after everything queued on the current stream so far (a
        gather ring's chunk needs the chunk just received); without it only after `fork` (a reduce ring's chunk
        reads inputs that were ready then: waiting for the current stream would queue its GEMM behind the
        previous chunk's hand-over and send, one chunk after the other). ``used``: the tensors fn reads that the
        current stream may free before the join (a received ring buffer); their memory is kept until the lane
        is done with them."""
        if not self._lanes:
            return fn(*used)
        j = self.lane(k)
        lane = self._lanes[j]
        if follow:
            lane.wait(self._current)
        for t in used:
            lane.keep(t)
        self._used.add(j)
        with lane.active():
            return fn(*used)

    def hand_over(self, k: int, out: torch.Tensor) -> torch.Tensor:
        """``out``, made by `run` (k, ...), usable on the current stream: the current stream waits for lane k mod S
        so far, and out's memory (the lane's) is kept until the current stream's work on it is done."""
        if self._lanes:
            self._current.wait(self._lanes[self.lane(k)])
            self._current.keep(out)
        return out

    def accumulate(self, k: int, key: object, value: torch.Tensor) -> None:
        """Add ``value`` to lane k mod S's partial sum ``key``; call it inside `run` (k, ...), so the add runs on
        that lane and no two lanes write one sum."""
        sums = self._sums[self.lane(k)]
        sums[key] = value if key not in sums else sums[key] + value

    def join(self) -> None:
        """The current stream waits for every lane used."""
        for j in sorted(self._used):
            self._current.wait(self._lanes[j])
        self._joined = True

    def total(self, key: object) -> torch.Tensor | None:
        """Σ of the lanes' partial sums ``key``, lane 0 first, on the current stream (None if no lane has one);
        after `join`. One lane: its sum itself."""
        if not self._joined:
            raise RuntimeError("_Lanes.total before join: the lanes' partial sums may still be running")
        parts = [sums[key] for sums in self._sums if key in sums]
        if self._lanes:
            for part in parts:
                self._current.keep(part)
        return functools.reduce(torch.add, parts) if parts else None


class _RingGatheredLinears(torch.autograd.Function):
    """All-gather of x along ``dim`` fused, chunk by chunk, with the column-parallel linears reading it."""

    @staticmethod
    def forward(
        ctx, x, dim, group, *params
    ):  # x: [b, n, h]; params: w0, b0, w1, b1, ... (a bias may be None)
        t, r = comm.group_size(group), dist.get_rank(group)
        _count("all_gather", group, t * x.numel() * x.element_size())
        held = x.contiguous()
        outs = _gathered_outputs(held, dim, t, params)  # each [b, s, o_i]
        lanes = _open_lanes(held, t)
        for k in range(t):
            chunk = (r - k) % t  # the shard held now: rank chunk's
            nxt, works = _ring_step(held, group, GATHER_TAG, k == t - 1)
            lanes.run(k, functools.partial(_linears_into, outs, params, dim, chunk), held)
            _wait(works)
            held = nxt
        lanes.join()
        ctx.save_for_backward(x, *params)  # the shard only, never the gathered [b, s, h]
        ctx.dim, ctx.group = dim, group
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *params = ctx.saved_tensors
        dim, group = ctx.dim, ctx.group
        t, r, n = comm.group_size(group), dist.get_rank(group), x.shape[dim]
        live = [
            # g: [b, s, o_i]; the weight cast once, not per chunk
            _Live(i, g.contiguous(), w.to(g.dtype), w.dtype)
            for i, (g, w) in enumerate(zip(grads, params[0::2], strict=True))
            if g is not None  # an output that did not reach the loss
        ]
        dtype = live[0].grad.dtype if live else x.dtype
        _count("all_gather", group, t * x.numel() * x.element_size())
        _count("reduce_scatter", group, t * x.numel() * dtype.itemsize)
        held, pending = x.contiguous(), None
        lanes = _open_lanes(held, t)
        lanes.fork()  # the input-gradient partials read only g and the weights
        for k in range(t):
            chunk, dest = (r - k) % t, (r - 1 - k) % t
            nxt, gathering = _ring_step(held, group, GATHER_TAG, k == t - 1)
            part = lanes.hand_over(
                k, lanes.run(k, functools.partial(_input_grad, live, dim, dest, n, x), follow=False)
            )  # part: [b, n, h], this rank's share of chunk dest's
            if pending is not None:
                _wait(pending[1])
                part += pending[0]  # the running sum of ranks r − k .. r − 1
            pending = _ring_step(part, group, REDUCE_TAG, k == t - 1)
            # weight gradient of this chunk, under both rings
            lanes.run(k, functools.partial(_weight_grads, lanes, k, live, dim, chunk), held)
            _wait(gathering)
            held = nxt
        lanes.join()
        gparams: list[torch.Tensor | None] = []
        for i, b in enumerate(params[1::2]):
            g = grads[i]
            gparams += [lanes.total(i), None if g is None or b is None else _flat(g).sum(0).to(b.dtype)]
        return part.to(x.dtype), None, None, *gparams


def _gathered_outputs(
    x: torch.Tensor, dim: int, t: int, params: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """The linears' outputs for x gathered t-fold along ``dim``, allocated on the current stream before any lane
    writes a chunk of them: each [b, t·n, o_i] (o_i = params[2i].shape[0]).

    Shape and dtype are F.linear's on zero rows of x, autocast included. Under autocast that call also casts each
    weight here, on the current stream: autocast caches a parameter's cast, so the lanes then read a finished
    copy instead of one lane reading the copy another lane is still making (`_cast_weights_here`).
    """
    ys = _cast_weights_here(x, dim, params)  # each [b, 0, o_i]
    return [y.new_empty((*y.shape[:dim], t * x.shape[dim], *y.shape[dim + 1 :])) for y in ys]


def _cast_weights_here(
    x: torch.Tensor, dim: int, params: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """F.linear of zero rows of x with each weight (params: w0, b0, ...), on the current stream: under autocast
    it fills autocast's cache with the weights' casts before the chunk GEMMs on lanes use them."""
    empty = x.narrow(dim, 0, 0)
    return [F.linear(empty, params[i], params[i + 1]) for i in range(0, len(params), 2)]


def _linears_into(
    outs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor | None],
    dim: int,
    chunk: int,
    held: torch.Tensor,
) -> None:
    """The linears on one gathered chunk (held: [b, n, h]), written to that chunk's rows of each output."""
    n = held.shape[dim]
    for out, i in zip(outs, range(0, len(params), 2), strict=True):
        _rows(out, dim, chunk, n).copy_(F.linear(held, params[i], params[i + 1]))  # [b, n, o_i]


class _Live(NamedTuple):
    """A column-parallel linear whose output reached the loss, in the entry's backward."""

    index: int
    grad: torch.Tensor
    """Its output gradient, [b, s, o_i]."""
    weight_cast: torch.Tensor
    """Its weight in the gradient's dtype, cast once before the chunks (each lane reads it; a cast per chunk would
    re-read the weight t times)."""
    weight_dtype: torch.dtype
    """The weight's own dtype: its gradient's."""


def _weight_grads(
    lanes: _Lanes,
    k: int,
    live: Sequence[_Live],
    dim: int,
    chunk: int,
    held: torch.Tensor,
) -> None:
    """Each live linear's weight gradient from one chunk (held: x's chunk ``chunk``, [b, n, h]), added to lane
    k's partial sum of it."""
    n = held.shape[dim]
    for i, g, _, w_dtype in live:
        gw = _flat(_rows(g, dim, chunk, n)).t().matmul(_flat(held).to(g.dtype)).to(w_dtype)  # [o_i, h]
        lanes.accumulate(k, i, gw)


def _input_grad(live: Sequence[_Live], dim: int, chunk: int, n: int, x: torch.Tensor) -> torch.Tensor:
    """Σ_i g_i[chunk] W_i: this rank's partial input gradient of one chunk ([b, n, h]; zeros if nothing is live)."""
    part = None
    for _, g, w_cast, _ in live:
        term = _rows(g, dim, chunk, n).matmul(w_cast)  # [b, n, o_i] @ [o_i, h] -> [b, n, h]
        part = term if part is None else part + term
    return torch.zeros_like(x) if part is None else part


class _RingRowParallel(torch.autograd.Function):
    """A row-parallel linear (no bias) fused, chunk by chunk, with the reduce-scatter of its output along ``dim``;
    x and the weight are saved by ``token``'s node (`checkpointing.save_early`), not here: saved here, after the
    ring, full checkpointing's replay of each block ran the ring and threw its output away (one [b, s, h]
    reduce-scatter per block and micro-batch more than `traffic.replayed_1d`)."""

    @staticmethod
    def forward(
        ctx, x, weight, token, dim, group
    ):  # x: [b, s, h/t] (h/t: the rank's input features), weight: [o, h/t]
        t, r = comm.group_size(group), dist.get_rank(group)
        if x.shape[dim] % t:
            raise ValueError(
                f"ring reduce-scatter: dim {dim} of size {x.shape[dim]} is not divisible by t = {t}"
            )
        n = x.shape[dim] // t
        _cast_weights_here(x, dim, (weight, None))
        lanes = _open_lanes(x, t)
        lanes.fork()  # the partials read only x and the weight
        pending = None
        for k in range(t):
            dest = (r - 1 - k) % t
            part = lanes.hand_over(
                k, lanes.run(k, functools.partial(F.linear, _rows(x, dim, dest, n), weight), follow=False)
            )  # part: [b, n, o], this rank's share of chunk dest's
            if pending is not None:
                _wait(pending[1])
                part += pending[0]  # the running sum of ranks r − k .. r − 1
            pending = _ring_step(part, group, REDUCE_TAG, k == t - 1)
        lanes.join()
        _count("reduce_scatter", group, t * part.numel() * part.element_size())
        ctx.saved = token.grad_fn  # save_early's node (None without autograd): holds x and the weight
        ctx.dim, ctx.group = dim, group
        return part  # [b, n, o]: chunk r, summed over the group

    @staticmethod
    def backward(ctx, g):  # g: [b, n, o]
        x, weight = saved_early(ctx.saved)
        dim, group = ctx.dim, ctx.group
        t, r = comm.group_size(group), dist.get_rank(group)
        _count("all_gather", group, t * g.numel() * g.element_size())
        gx = g.new_empty(x.shape)  # gx: [b, s, h/t]
        held = g.contiguous()
        w_cast = weight.to(g.dtype)  # once, on the current stream, before the lanes read it
        lanes = _open_lanes(held, t)
        for k in range(t):
            chunk = (r - k) % t  # the output-gradient shard held now: rank chunk's
            nxt, works = _ring_step(held, group, GATHER_TAG, k == t - 1)
            lanes.run(
                k, functools.partial(_row_grads, lanes, k, x, weight.dtype, w_cast, gx, dim, chunk), held
            )
            _wait(works)
            held = nxt
        lanes.join()
        return gx.to(x.dtype), lanes.total(_WEIGHT), None, None, None


_WEIGHT = "weight"
"""`_Lanes` key of the row-parallel weight gradient's partial sums."""


def _row_grads(
    lanes: _Lanes,
    k: int,
    x: torch.Tensor,
    weight_dtype: torch.dtype,
    w_cast: torch.Tensor,
    gx: torch.Tensor,
    dim: int,
    chunk: int,
    held: torch.Tensor,
) -> None:
    """A row-parallel linear's gradients from one chunk of the output gradient (held: [b, n, o]): the input
    gradient's rows of that chunk into gx, the weight gradient (in the weight's own dtype) added to lane k's
    partial sum. w_cast: the weight in the gradient's dtype, cast once before the chunks."""
    n = held.shape[dim]
    _rows(gx, dim, chunk, n).copy_(held.matmul(w_cast))  # [b, n, o] @ [o, h/t]
    gw = _flat(held).t().matmul(_flat(_rows(x, dim, chunk, n)).to(held.dtype)).to(weight_dtype)  # [o, h/t]
    lanes.accumulate(k, _WEIGHT, gw)


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
    GEMMs. x: [b, s, h/t], weight: [o, h/t] → [b, s/t, o]. x and the weight are saved for backward before the
    ring runs (`checkpointing.save_early`), so full checkpointing's replay of a block stops before its MLP exit's ring."""
    return _RingRowParallel.apply(x, weight, save_early(x, weight), dim, group)
