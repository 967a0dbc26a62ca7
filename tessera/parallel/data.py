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

__all__ = ["GradSync"]


class _Bucket:
    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.ready: set[int] = set()
        self.work: dist.Work | None = None
        self.flat: torch.Tensor | None = None


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
        self.buckets = self._make_buckets(list(reversed(unique)), bucket_bytes)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.armed = False
        self._handles = (
            [p.register_post_accumulate_grad_hook(self._on_grad) for p in unique] if self.size > 1 else []
        )

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
        buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            if buckets[-1] and size + p.numel() * 4 > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel() * 4
        return [_Bucket(b) for b in buckets if b]

    def arm(self) -> None:
        """The next backward produces the step's final gradients: launch reductions as buckets complete."""
        self.armed = True

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        bucket, i = self._where[id(p)]
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params) and bucket.work is None:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        bucket.work = comm.all_reduce(bucket.flat, self.group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket and write the group-averaged gradients back."""
        if self.size == 1:
            return
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
            bucket.work.wait()  # type: ignore[union-attr]
            flat = bucket.flat.div_(self.size)  # type: ignore[union-attr]
            offset = 0
            for p in bucket.params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
            bucket.ready.clear()
            bucket.work, bucket.flat = None, None
        self.armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
