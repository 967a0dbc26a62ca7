"""Collectives, counted, and their conjugate autograd pairs.

Every collective tessera issues goes through this module so that it is counted per step by kind, group and bytes
(``STATS``). The byte count of one call is the size of the buffer the rank hands to the collective, defined per
kind so the analytical traffic formulas of docs/cost-model.md §5 can be compared exactly:

- all_reduce, reduce, broadcast, send, recv: the tensor's bytes;
- all_gather: the gathered (output) bytes; reduce_scatter: the input (unscattered) bytes.

Autograd pairs are named by meaning (Megatron's vocabulary): the forward of one is the backward of the other.
All of them are no-ops on a group of size 1, so single-device code runs through the same path.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "STATS",
    "CommStats",
    "all_gather",
    "all_gather_to_region",
    "all_reduce",
    "all_reduce_max",
    "batch_p2p",
    "broadcast",
    "copy_to_region",
    "gather_from_region",
    "group_name",
    "group_size",
    "name_group",
    "recv",
    "reduce",
    "reduce_from_region",
    "reduce_scatter",
    "reduce_scatter_to_region",
    "ring_shift",
    "scatter_to_region",
    "send",
]


@dataclass(slots=True)
class CommStats:
    """Per-kind, per-group call and byte counters; reset by the trainer at each step."""

    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    enabled: bool = True

    def record(self, kind: str, group: str, nbytes: int) -> None:
        if self.enabled:
            self.calls[(kind, group)] += 1
            self.bytes[(kind, group)] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def total(self, kind: str | None = None, group: str | None = None) -> int:
        """Bytes summed over every (kind, group) matching the filters."""
        return sum(b for (k, g), b in self.bytes.items() if kind in (None, k) and group in (None, g))

    def as_metrics(self) -> dict[str, int]:
        """Flat ``comm/<kind>/<group>_bytes`` entries for the metrics file."""
        return {f"comm/{k}/{g}_bytes": b for (k, g), b in sorted(self.bytes.items())}


STATS = CommStats()

# torch 2.13 renamed the flat collectives (the old names warn); keep working on the older releases we support.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_NAMES: dict[int, str] = {}


def group_name(group: dist.ProcessGroup | None) -> str:
    """A readable name for counters: the DeviceMesh axis name when the group has one."""
    if group is None:
        return "world"
    return _NAMES.get(id(group), "group")


def name_group(group: dist.ProcessGroup, name: str) -> None:
    """Attach the axis name used in counters to ``group`` (groups.py calls this)."""
    _NAMES[id(group)] = name


def group_size(group: dist.ProcessGroup | None) -> int:
    if group is None:
        return dist.get_world_size() if dist.is_initialized() else 1
    return dist.get_world_size(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False) -> dist.Work | None:
    """Sum ``t`` in place over ``group``."""
    if group_size(group) == 1:
        return None
    STATS.record("all_reduce", group_name(group), _nbytes(t))
    return dist.all_reduce(t, group=group, async_op=async_op)


def all_reduce_max(t: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Element-wise maximum of ``t`` in place over ``group``; counted as an all_reduce (same traffic as a sum).

    Needed by the vocabulary-parallel cross-entropy (Megatron's max trick for a stable softmax over shards).
    """
    if group_size(group) == 1:
        return
    STATS.record("all_reduce", group_name(group), _nbytes(t))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def broadcast(t: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup, async_op: bool = False):
    """Broadcast ``t`` in place from the member with group rank ``src_group_rank``."""
    if group_size(group) == 1:
        return None
    STATS.record("broadcast", group_name(group), _nbytes(t))
    return dist.broadcast(t, group_src=src_group_rank, group=group, async_op=async_op)


def reduce(t: torch.Tensor, dst_group_rank: int, group: dist.ProcessGroup, async_op: bool = False):
    """Sum ``t`` over ``group`` onto the member with group rank ``dst_group_rank`` (counted like all_reduce).

    Only the destination's ``t`` holds the sum afterwards; other members' ``t`` is scratch. SUMMA's backward
    (tessera/parallel/tensor_2d.py) reduces each partial product onto the rank that owns that output block.
    """
    if group_size(group) == 1:
        return None
    STATS.record("reduce", group_name(group), _nbytes(t))
    return dist.reduce(t, group_dst=dst_group_rank, group=group, async_op=async_op)


def send(t: torch.Tensor, group_peer: int, group: dist.ProcessGroup | None, tag: int = 0) -> dist.P2POp:
    """A counted non-blocking send of ``t`` to group rank ``group_peer``, to issue with ``batch_p2p``."""
    STATS.record("send", group_name(group), _nbytes(t))
    return dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=group_peer)


def recv(t: torch.Tensor, group_peer: int, group: dist.ProcessGroup | None, tag: int = 0) -> dist.P2POp:
    """A counted non-blocking receive into ``t`` from group rank ``group_peer``, to issue with ``batch_p2p``."""
    STATS.record("recv", group_name(group), _nbytes(t))
    return dist.P2POp(dist.irecv, t, group=group, tag=tag, group_peer=group_peer)


def batch_p2p(ops: list[dist.P2POp]) -> list[dist.Work]:
    """Issue point-to-point ops together (coalesced on NCCL, one by one on gloo); one Work per op on gloo.

    Gloo matches messages by tag, NCCL by issue order per pair of ranks: callers keep both ends' orders equal.
    """
    return dist.batch_isend_irecv(ops) if ops else []


def ring_shift(t: torch.Tensor, group: dist.ProcessGroup, tag: int) -> tuple[torch.Tensor, list[dist.Work]]:
    """Start one step of a ring over ``group``: send ``t`` to the next member (group rank r + 1), receive the
    previous member's tensor (same shape) into the returned buffer; wait on the returned works before reading it.

    Not counted here: t − 1 such steps move what one all-gather or reduce-scatter moves, and the caller records
    its ring as that collective (``STATS.record``), so the traffic formulas hold with or without the ring. Two rings
    in flight at once on one group need different ``tag``s (gloo matches by tag; NCCL by issue order, the same on
    every member because every member runs the same loop).
    """
    n, r = group_size(group), dist.get_rank(group)
    t = t.contiguous()
    out = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=(r + 1) % n),
        dist.P2POp(dist.irecv, out, group=group, tag=tag, group_peer=(r - 1) % n),
    ]
    return out, batch_p2p(ops)


def all_gather(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every member's ``t`` along ``dim`` (group-rank order)."""
    n = group_size(group)
    if n == 1:
        return t
    moved = t.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=t.dtype, device=t.device)
    STATS.record("all_gather", group_name(group), _nbytes(out))
    all_gather_into(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over members, then keep this member's 1/n slice along ``dim``."""
    n = group_size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter: dim {dim} of size {t.shape[dim]} is not divisible by group size {n}"
        )
    moved = t.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=t.dtype, device=t.device)
    STATS.record("reduce_scatter", group_name(group), _nbytes(moved))
    reduce_scatter_into(out, moved, group=group)
    return out.movedim(0, dim)


def _split(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {t.shape[dim]} over {n} ranks")
    return t.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    """Forward identity, backward all-reduce: enter a tensor-parallel region with a replicated input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous()
        all_reduce(g, ctx.group)
        return g, None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward all-reduce, backward identity: leave a region whose partial sums must be added."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class _GatherFromRegion(torch.autograd.Function):
    """Forward all-gather along dim, backward keep own slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _split(g, ctx.dim, ctx.group), None, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward keep own slice along dim, backward all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    """Forward reduce-scatter along dim, backward all-gather (sequence parallelism's exit)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return all_gather(g, ctx.dim, ctx.group), None, None


class _AllGatherToRegion(torch.autograd.Function):
    """Forward all-gather along dim, backward reduce-scatter (sequence parallelism's entry)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return reduce_scatter(g, ctx.dim, ctx.group), None, None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, dim, group)


def scatter_to_region(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, dim, group)


def reduce_scatter_to_region(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceScatterToRegion.apply(x, dim, group)


def all_gather_to_region(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return x if group_size(group) == 1 else _AllGatherToRegion.apply(x, dim, group)
