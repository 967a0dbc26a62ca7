"""Run one rank of an N-rank job in this process at the real shapes, allocating nothing: the dry run's machinery.

Three pieces of PyTorch do the work; this module is the only place that touches them:

- the ``"fake"`` process-group backend (``torch.testing._internal.distributed.fake_pg``): every collective returns
  at once without moving data, so one process can be rank ``r`` of a world of any size and build that rank's real
  DeviceMesh and groups (its point-to-point requests complete at once, and its asynchronous collectives hold
  their tensors until waited for, as a GPU rank's do: `fake_process_group`);
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

import os
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

__all__ = ["FakeRank", "LiveTensor", "fake_process_group"]


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` in this process: collectives are accepted and move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; a dry run needs a process of its own")
    dist.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=world_size)
    batch_isend_irecv = dist.batch_isend_irecv
    dist.batch_isend_irecv = _completed_p2p(batch_isend_irecv)
    held = {(owner, name): getattr(owner, name) for owner, name in _async_collectives()}
    for (owner, name), collective in held.items():
        setattr(owner, name, _holding(collective))
    try:
        yield
    finally:
        dist.batch_isend_irecv = batch_isend_irecv
        for (owner, name), collective in held.items():
            setattr(owner, name, collective)
        dist.destroy_process_group()


def _async_collectives() -> list[tuple[Any, str]]:
    """The collectives tessera issues with ``async_op=True``, where they are looked up when called
    (`tessera.comm` binds its all-gather and reduce-scatter at import)."""
    from tessera import comm

    return [
        (dist, "all_reduce"),
        (dist, "reduce"),
        (dist, "broadcast"),
        (comm, "all_gather_into"),
        (comm, "reduce_scatter_into"),
    ]


class _HeldWork:
    """An asynchronous collective's request that holds its tensors until waited for, as NCCL's does (its work
    stashes them for the allocator's safety until ``wait``): the fake backend's requests hold none, so a buffer
    the caller drops once the collective is issued (2D SUMMA's partial products) would leave the dry run's live
    bytes before a GPU rank frees it."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        done = self._work.wait(*args, **kwargs)
        self._tensors = []
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _holding(collective):
    """``collective`` whose ``async_op=True`` requests hold their tensor arguments until waited for."""

    def issue(*args: Any, **kwargs: Any) -> Any:
        work = collective(*args, **kwargs)
        if not kwargs.get("async_op") or work is None:
            return work
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        return _HeldWork(work, tensors)

    return issue


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


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TESSERA_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ROOT = os.path.dirname(_TESSERA_DIR.rstrip(os.sep)) + os.sep  # a line is shown relative to tessera's parent
_THIS = os.path.abspath(__file__)


@dataclass(frozen=True, slots=True)
class LiveTensor:
    """One storage alive at a recorded moment, as it was made: the shape and dtype of the operator's output that
    brought it into being (a view made later shares it and is not listed again)."""

    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    op: str
    """The operator that made it (``aten.mm``), or ``counted`` for a tensor made outside the mode."""
    node: str
    """The autograd node running when it was made (``MmBackward0``), ``forward`` outside a backward."""
    line: str
    """The innermost source line of tessera that made it (else the innermost one outside torch)."""
    phase: str
    """The tracker's ``phase`` when it was made (`tessera.dryrun`: ``build`` or ``step``)."""


def _where(frame: Any) -> str:
    """``path:line (function)`` of the innermost frame in tessera, else of the innermost frame outside torch and
    this module: the code that asked for the tensor, not the library code that made it."""
    first = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _THIS and not name.startswith(_TORCH_DIR):
            if name.startswith(_TESSERA_DIR):
                first = frame
                break
            first = first or frame
        frame = frame.f_back
    if first is None:
        return "?"
    name = first.f_code.co_filename
    name = name[len(_ROOT) :] if name.startswith(_ROOT) else name
    return f"{name}:{first.f_lineno} ({first.f_code.co_name})"


class FakeRank(TorchDispatchMode):
    """Fake tensors plus an allocator's count: ``live`` and ``peak`` bytes of distinct storages.

        with FakeRank() as fr:
            ...build and run...
            fr.reset_peak()    # start a new phase: its peak starts from what is live now
        print(fr.peak)

    Every storage an operator returns is counted once, when first seen, and uncounted when it is freed (a weak
    reference's callback); ``UntypedStorage.resize_`` (ZeRO-3 frees and refills its gathered buffers that way, and
    it bypasses dispatch) is followed too.

    ``record=True`` also keeps where each storage was made (`LiveTensor`) and a log of every change of a
    storage's size, so that `live_at` can list what was alive at any moment afterwards, the peak's
    (`peak_moment`) among them (`tessera dryrun --peak-tensors`). The log costs a tuple per allocation and free
    and the frame walk a few microseconds per allocation; without ``record`` nothing is kept.
    """

    def __init__(self, *, record: bool = False) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.record = record
        self.phase = ""
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}
        self._fake = _fake_mode()
        self._resize = torch.UntypedStorage.resize_
        # record: a serial per storage (ids are reused once one is freed), how each was made, its size changes
        self._serial: dict[int, int] = {}
        self._made: dict[int, tuple[tuple[int, ...], str, str, str, str, str]] = {}
        self._log: list[tuple[int, int]] = []  # (serial, bytes from now on): 0 when freed
        self._peak_at = 0  # len(self._log) when the peak was last reached
        self._op = "counted"

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
        self._peak_at = len(self._log)

    def peak_moment(self) -> int:
        """The moment (a position in the log) the peak since the last `reset_peak` was reached; with ``record``."""
        return self._peak_at

    def live_at(self, moment: int) -> list[LiveTensor]:
        """Every storage alive at ``moment`` (`peak_moment`), largest first; needs ``record=True``."""
        if not self.record:
            raise RuntimeError(
                "FakeRank(record=True) keeps what was alive when; this one was made without it"
            )
        sizes: dict[int, int] = {}
        for serial, nbytes in self._log[:moment]:
            if nbytes:
                sizes[serial] = nbytes
            else:
                sizes.pop(serial, None)
        out = [LiveTensor(n, *self._made[s]) for s, n in sizes.items()]
        return sorted(out, key=lambda t: -t.nbytes)

    def count(self, tensors: Any) -> None:
        """Count tensors made before this mode was entered (or outside it) as live."""
        self._op = "counted"
        tree_map_only(torch.Tensor, self._track, tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._scalar(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        self._op = str(func.overloadpacket)
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
        if self.record:
            self._remember(key, t)
        self._set(storage, storage.nbytes())

    def _remember(self, key: int, t: torch.Tensor) -> None:
        """Note how the storage behind ``t`` came to be: its first tensor's shape and dtype, the operator, the
        autograd node running (backward) and the code line that asked for it."""
        serial = len(self._made)
        self._serial[key] = serial
        node = torch._C._current_autograd_node()
        where = _where(sys._getframe(1))
        dtype = str(t.dtype).removeprefix("torch.")
        self._made[serial] = (
            tuple(t.shape),
            dtype,
            self._op,
            node.name() if node else "forward",
            where,
            self.phase,
        )

    def _set(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = id(storage)
        if key not in self._sizes:
            return
        if self.record and nbytes != self._sizes[key]:
            self._log.append((self._serial[key], nbytes))
        self.live += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        if self.live > self.peak:
            self.peak = self.live
            self._peak_at = len(self._log)

    def _drop(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)
        serial = self._serial.pop(key, None)
        if serial is not None:
            self._log.append((serial, 0))
