"""Data-parallel gradient synchronisation: bucketed all-reduce, launched from backward hooks so it overlaps.

Why our own instead of DistributedDataParallel: the same hooks must serve depth-first *and* layered accumulation
and the pipeline runtime, where "the last micro-batch" is known per layer, not per forward call. DDP ties
synchronisation to one forward/backward pair of the whole module, which the layered schedule breaks.

Buckets are filled in reverse registration order (roughly the order backward produces gradients). When every
parameter of a bucket has its final gradient of the step, the bucket is flattened and its all-reduce is launched
asynchronously while backward continues; ``finish()`` waits and writes the averaged gradients back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm

__all__ = ["GradBucket", "GradSync"]


class GradBucket:
    """Some parameters' gradients reduced as one flat tensor: the one data-parallel gradient all-reduce.

    ``launch`` flattens the gradients (zeros for a parameter without one) and starts an asynchronous all-reduce
    over ``group``; ``finish`` waits and writes the group average back as each gradient. Used by `GradSync`
    (buckets launched from backward hooks) and by the pipeline runtime's `DataParallelStageComm` (one per stage,
    launched at the schedule's REDUCE).

    Several launches per step (depth-first accumulation reduces after every micro-batch) are summed as they
    complete: each launch first waits for the previous one (it ran under this micro-batch's backward) and adds
    it into a running total, the first launch's buffer reused. So a bucket holds at most two flat copies, the
    total and the one in flight, whatever the number of micro-batches; the parts are added in launch order, as
    one sum at the end would add them, so the result is the same to the bit (docs/memory.md).
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, size: int) -> None:
        self.params, self.group, self.size = params, group, size
        self._total: torch.Tensor | None = None  # the reduced sum of the launches settled so far
        self._inflight: tuple[torch.Tensor, dist.Work | None] | None = None

    @property
    def launched(self) -> bool:
        return self._total is not None or self._inflight is not None

    @property
    def held_bytes(self) -> int:
        """Bytes of the flat buffers held now: the running total and the reduction in flight."""
        held = (self._total, self._inflight[0] if self._inflight is not None else None)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def launch(self, drop_grads: bool = False) -> None:
        """Start reducing the gradients as they are now; ``drop_grads``: free them (they accumulate afresh)."""
        self.settle()  # before flattening: the previous flat copy is added and freed first
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # a copy: dropping the gradients leaves it intact
        if drop_grads:
            for p in self.params:
                p.grad = None
        self._inflight = (flat, comm.all_reduce(flat, self.group, async_op=True))

    def settle(self) -> None:
        """Wait for the launch in flight and add it into the running total (the first one becomes it)."""
        if self._inflight is None:
            return
        (flat, work), self._inflight = self._inflight, None
        if work is not None:
            work.wait()
        self._total = flat if self._total is None else self._total.add_(flat)

    def finish(self) -> None:
        """Wait for the last launch and write the sum of the launches, divided by the group size, back."""
        self.settle()
        total, self._total = self._total, None
        if total is None:
            return
        total.div_(self.size)
        offset = 0
        for p in self.params:
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()


class GradSync:
    """Average gradients over ``group`` in buckets of about ``bucket_bytes``, overlapped with backward.

    Call ``arm()`` before the backward whose gradients are final for the step (the last micro-batch in
    depth-first accumulation); hooks then launch each bucket as soon as it is complete. ``finish()`` waits for
    every bucket, launching any that backward did not complete (unused parameters), and divides by the group
    size. On a group of size 1 every call is a no-op.
    """

    def __init__(
        self, params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, bucket_bytes: int = 25 * 2**20
    ) -> None:
        self.group = group
        self.size = comm.group_size(group) if dist.is_initialized() else 1
        unique = list({id(p): p for p in params if p.requires_grad}.values())
        self.buckets = [GradBucket(b, group, self.size) for b in _split(list(reversed(unique)), bucket_bytes)]
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._where = {
            id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)
        }
        self.armed = False
        self._handles = (
            [p.register_post_accumulate_grad_hook(self._on_grad) for p in unique] if self.size > 1 else []
        )

    def arm(self) -> None:
        """The next backward produces the step's final gradients: launch reductions as buckets complete."""
        self.armed = True

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        b, i = self._where[id(p)]
        self._ready[b].add(i)
        bucket = self.buckets[b]
        if len(self._ready[b]) == len(bucket.params) and not bucket.launched:
            bucket.launch()

    def finish(self) -> None:
        """Wait for every bucket and write the group-averaged gradients back."""
        if self.size == 1:
            return
        for bucket, ready in zip(self.buckets, self._ready, strict=True):
            if not bucket.launched:
                bucket.launch()
            bucket.finish()
            ready.clear()
        self.armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _split(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of about ``bucket_bytes`` (fp32) each; a larger parameter is a run alone."""
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if buckets[-1] and size + p.numel() * 4 > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * 4
    return [b for b in buckets if b]
