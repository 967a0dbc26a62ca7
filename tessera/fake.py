"""Run one rank of an N-rank job in this process at the real shapes, allocating nothing: the dry run's machinery.

Three pieces of PyTorch do the work; this module is the only place that touches them:

- the ``"fake"`` process-group backend (``torch.testing._internal.distributed.fake_pg``): every collective returns
  at once without moving data, so one process can be rank ``r`` of a world of any size and build that rank's real
  DeviceMesh and groups;
- ``FakeTensorMode``: every tensor carries shape, dtype and device but no storage, so a 405B-parameter model costs
  no memory while every operator still runs its shape logic (and fails where the real one would);
- a ``TorchDispatchMode`` of our own (`FakeRank`) on top, which counts the bytes of every storage that comes into
  being and is freed, as the rank's allocator would, and keeps the peak.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it assumes each root module runs forward once per
iteration (it raises on a second call), but a pipeline runs every stage once per micro-batch; and its categories
come from module hooks, which cannot see ZeRO's flat buffers. What we need is only the allocator's view — live and
peak bytes — and the components come from the runtime's own objects (docs/dryrun.md).

Reading a fake scalar (``.item()``, ``float(t)``) has no answer; `FakeRank` answers 0 of the right type (a loss of 0,
a gradient norm of 0 so nothing is clipped, no fp16 overflow). Tensors whose value fake mode knows (a scalar made by
``torch.tensor(1.0)``) still read their true value.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

__all__ = ["FakeRank", "fake_process_group"]


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` in this process: collectives are accepted and move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; a dry run needs a process of its own")
    dist.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=world_size)
    batch_isend_irecv = dist.batch_isend_irecv
    dist.batch_isend_irecv = _completed_p2p(batch_isend_irecv)
    try:
        yield
    finally:
        dist.batch_isend_irecv = batch_isend_irecv
        dist.destroy_process_group()


class _Done:
    """A finished request: what a fake send or receive is as soon as it is issued."""

    @staticmethod
    def is_completed() -> bool:
        return True

    @staticmethod
    def wait() -> bool:
        return True


def _completed_p2p(batch_isend_irecv):
    """The fake backend's point-to-point requests never report completion, so a runtime that frees a sent
    buffer once its request completes (the pipeline's) would keep every one until the step ends; each fake
    request is complete as soon as it is issued, as a real one is once its peer has received it."""

    def issue(ops: list) -> list[_Done]:
        for work in batch_isend_irecv(ops):
            work.wait()
        return [_Done() for _ in ops]

    return issue


def _fake_mode() -> FakeTensorMode:
    """FakeTensorMode whose tensors made on the meta device can be moved with ``nn.Module.to_empty``.

    Fake mode remembers each fake tensor made from a meta result in a weak-value memo; that weak reference makes
    ``torch.utils.swap_tensors`` (which ``to_empty`` uses for fake parameters) refuse. A fresh meta result has
    nothing to be consistent with, so skipping the memo for it changes no result.
    """
    mode = FakeTensorMode()

    def from_meta_and_device(fake_mode, t, device, pytype=None, dispatch_keys=None):
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)

    mode.fake_tensor_converter.from_meta_and_device = from_meta_and_device  # type: ignore[method-assign]
    return mode


class FakeRank(TorchDispatchMode):
    """Fake tensors plus an allocator's count: ``live`` and ``peak`` bytes of distinct storages.

        with FakeRank() as fr:
            ...build and run...
            fr.reset_peak()    # start a new phase: its peak starts from what is live now
        print(fr.peak)

    Every storage an operator returns is counted once, when first seen, and uncounted when it is freed (a weak
    reference's callback); ``UntypedStorage.resize_`` (ZeRO-3 frees and refills its gathered buffers that way, and
    it bypasses dispatch) is followed too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}
        self._fake = _fake_mode()
        self._resize = torch.UntypedStorage.resize_

    def __enter__(self) -> FakeRank:
        self._fake.__enter__()
        tracker, original = self, self._resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            tracker._set(storage, size)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        self._fake.__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.live

    def count(self, tensors: Any) -> None:
        """Count tensors made before this mode was entered (or outside it) as live."""
        tree_map_only(torch.Tensor, self._track, tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._scalar(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out

    @staticmethod
    def _scalar(func, args: tuple, kwargs: dict) -> Any:
        try:
            return func(*args, **kwargs)  # a value fake mode knows (a constant)
        except DataDependentOutputException:
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0

    def _track(self, t: torch.Tensor) -> None:
        # a meta tensor allocates nothing, fake or not (sharded construction keeps a meta skeleton)
        if t.layout != torch.strided or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            self._set(storage, storage.nbytes())
            return
        self._sizes[key] = 0
        self._refs[key] = weakref.ref(storage, lambda _, k=key: self._drop(k))
        self._set(storage, storage.nbytes())

    def _set(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = id(storage)
        if key not in self._sizes:
            return
        self.live += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        self.peak = max(self.peak, self.live)

    def _drop(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)
