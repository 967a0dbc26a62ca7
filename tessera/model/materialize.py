"""Materialise a meta-device model on a rank: allocate only the tensors it holds and fill them from a value source.

A model (plain, or its tensor-parallel version) is built on the meta device, so its parameters have their local
shapes and no storage. `declare` attaches to every meta parameter a `Pending`: its `ShardSpec` (which block of
which global parameter the local tensor is) and the `ValueSource` to read it from (tessera.model.init). Later,
whoever decides that the parameter lives on this rank calls `materialize` (the trainer for a whole model, the
pipeline builder for its local stages) or fills it straight into a flat ZeRO shard (`local_value`); parameters
another rank owns are `release_parameters`-ed to empty tensors without ever being allocated.

Meta tensors cannot take real ``.data``, so materialising replaces the Parameter objects inside their modules;
a Parameter held by several modules (tied embeddings) is replaced by one new Parameter everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tessera.model.init import ValueSource, block_rows

__all__ = [
    "Box",
    "Pending",
    "ShardSpec",
    "declare",
    "forget_pending",
    "local_value",
    "materialize",
    "pending",
    "read_flat",
    "read_local",
    "release_parameters",
    "replicated_specs",
]

_ATTR = "_tessera_pending"


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Which part of a global (plain-model) parameter a local tensor holds.

    ``index[d] = (start, stop)`` along global dim d, counted in the *padded* tensor: positions at or past
    ``shape[d]`` are zero padding (a vocabulary rounded up to a multiple of the tensor-parallel degree).
    ``transpose``: the local tensor is that block transposed (the Optimus 2D layout of Linear weights).
    """

    name: str
    shape: tuple[int, ...]
    index: tuple[tuple[int, int], ...]
    transpose: bool = False

    @classmethod
    def replicated(cls, name: str, shape: Iterable[int]) -> ShardSpec:
        shape = tuple(shape)
        return cls(name, shape, tuple((0, n) for n in shape))

    @classmethod
    def split(
        cls, name: str, shape: Iterable[int], parts: dict[int, tuple[int, int]], transpose: bool = False
    ) -> ShardSpec:
        """Block ``k`` of ``n`` along each global dim ``d`` in ``parts = {d: (n, k)}``, the dim padded to a
        multiple of n first; other dims whole."""
        shape = tuple(shape)
        index = []
        for d, size in enumerate(shape):
            n, k = parts.get(d, (1, 0))
            step = -(-size // n)
            index.append((k * step, (k + 1) * step))
        return cls(name, shape, tuple(index), transpose)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of the (padded) block in the global orientation."""
        return tuple(b - a for a, b in self.index)

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = self.block_shape
        return shape[::-1] if self.transpose else shape

    def rows(self, start: int, stop: int) -> ShardSpec:
        """The local rows ``[start, stop)`` of this block as a block of their own: the local tensor's first dim
        is the global first dim, or (transposed) the global last dim."""
        d = len(self.index) - 1 if self.transpose else 0
        a, b = self.index[d]
        if not 0 <= start <= stop <= b - a:
            raise ValueError(f"{self.name}: local rows [{start}, {stop}) outside the block's {b - a} rows")
        index = list(self.index)
        index[d] = (a + start, a + stop)
        return ShardSpec(self.name, self.shape, tuple(index), self.transpose)

    def boxes(self, start: int, stop: int) -> list[Box]:
        """The elements ``[start, stop)`` of the local tensor in row-major order (a ZeRO flat shard's part of
        it, or all of it) as rectangular blocks of the global tensor, padding cut off: what a checkpoint saves
        for this rank under the global name, and what it reads back at any layout."""
        out = []
        for local_offsets, local_sizes in _row_major_boxes(self.local_shape, start, stop):
            flat = _ravel(local_offsets, self.local_shape)
            offsets, sizes = local_offsets, local_sizes
            if self.transpose:  # the local tensor is the block transposed
                offsets, sizes = offsets[::-1], sizes[::-1]
            g_offsets = tuple(a + o for (a, _), o in zip(self.index, offsets, strict=True))
            kept = tuple(
                min(z, n - g) for g, z, n in zip(g_offsets, sizes, self.shape, strict=True)
            )  # rows past the real size are padding
            if all(k > 0 for k in kept):
                out.append(Box(flat, local_sizes, g_offsets, kept))
        return out


@dataclass(frozen=True, slots=True)
class Box:
    """A rectangular block of a global tensor held contiguously by a local one: ``local_sizes`` elements from
    the local flat index ``flat`` on (in the local orientation), of which the part ``sizes`` at ``offsets``
    of the global tensor (in the global orientation, padding cut off) is real."""

    flat: int
    local_sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _ravel(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for i, n in zip(index, shape, strict=True):
        flat = flat * n + i
    return flat


def _row_major_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``[start, stop)`` of a row-major tensor of ``shape`` as (offsets, sizes) blocks, each contiguous in
    memory: a partial first row, whole rows, a partial last row (recursively): at most 2·ndim − 1 blocks."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]  # a scalar
    inner = math.prod(shape[1:])
    out = []
    if start % inner:  # the tail of a first, partial row
        row = start // inner
        end = min(stop, (row + 1) * inner)
        for o, z in _row_major_boxes(shape[1:], start - row * inner, end - row * inner):
            out.append(((row, *o), (1, *z)))
        start = end
    whole = stop // inner
    if start < whole * inner:  # whole rows
        out.append(((start // inner, *(0 for _ in shape[1:])), (whole - start // inner, *shape[1:])))
        start = whole * inner
    if start < stop:  # the head of a last, partial row
        for o, z in _row_major_boxes(shape[1:], 0, stop - start):
            out.append(((whole, *o), (1, *z)))
    return out


@dataclass(frozen=True, slots=True)
class Pending:
    """What a meta parameter will be: ``spec``'s block read from ``source``, on ``device``."""

    spec: ShardSpec
    source: ValueSource
    device: torch.device


def replicated_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """Every parameter whole, under its own name (a plain model: each rank holds all of it)."""
    return {n: ShardSpec.replicated(n, p.shape) for n, p in module.named_parameters()}


def declare(
    module: nn.Module, specs: dict[str, ShardSpec], source: ValueSource, device: torch.device | str
) -> None:
    """Attach a `Pending` to every meta parameter of ``module`` (names as ``module.named_parameters()``)."""
    device = torch.device(device)
    for name, p in module.named_parameters():
        if not p.is_meta:
            continue
        spec = specs[name]
        if spec.local_shape != tuple(p.shape):
            raise RuntimeError(
                f"{name}: the shard declaration gives a local shape {spec.local_shape} but the module holds "
                f"{tuple(p.shape)}; the layout's declaration and its modules disagree"
            )
        setattr(p, _ATTR, Pending(spec, source, device))


def pending(p: torch.Tensor) -> Pending | None:
    """The declared origin of a not yet materialised parameter (None for an ordinary tensor)."""
    return getattr(p, _ATTR, None)


def forget_pending(p: torch.Tensor) -> None:
    """Mark a parameter as holding its value now (its storage was filled elsewhere, e.g. a ZeRO flat buffer)."""
    if hasattr(p, _ATTR):
        delattr(p, _ATTR)


def read_local(spec: ShardSpec, source: ValueSource, out: torch.Tensor | None = None) -> torch.Tensor:
    """The local tensor of ``spec`` (CPU fp32): the real part read from ``source``, padding zero, transposed
    if the layout says so. The tensor is allocated once (or is ``out``, of the local shape, zeroed first: a view
    of a ZeRO flat buffer) and filled a row block at a time (`block_rows` rows of the global parameter per
    read), so reading adds at most one block to memory — and leaves no holes in the allocator's heap that the
    model's own tensors would then sit between.

    A source without values (``source.values`` False: `InitSource`'s in a dry run) is still read block by block,
    for the memory its reads take, but nothing is copied: the tensor comes back allocated and unwritten."""
    copy = getattr(source, "values", True)
    if out is None:
        out = torch.zeros(spec.local_shape, dtype=torch.float32)
    elif tuple(out.shape) != spec.local_shape:
        raise ValueError(f"{spec.name}: out has shape {tuple(out.shape)}, the local block {spec.local_shape}")
    elif copy:
        out.zero_()  # the padding
    view = out.t() if spec.transpose else out  # the block in the global orientation
    real = [(a, min(b, n)) for (a, b), n in zip(spec.index, spec.shape, strict=True)]
    if any(b <= a for a, b in real):
        return out  # all padding
    (lo, hi), rest = real[0], tuple(slice(a, b) for a, b in real[1:])
    local_rest = tuple(slice(0, b - a) for a, b in real[1:])
    step = block_rows(spec.shape)
    start = lo
    while start < hi:
        stop = min(hi, (start // step + 1) * step)  # one row block of the source at a time
        block = source(spec.name, (slice(start, stop), *rest))
        if copy:
            view[(slice(start - lo, stop - lo), *local_rest)] = block
        del block  # before the next read: at most one block in memory
        start = stop
    return out


def read_flat(spec: ShardSpec, source: ValueSource, out: torch.Tensor, first: int) -> None:
    """Write the local tensor's row-major elements ``[first, first + out.numel())`` into the 1-D ``out`` (a
    ZeRO flat buffer's part for this parameter), the same values `read_local` gives, without making the local
    tensor whole: whole local rows are read straight into ``out``, a partial first or last row through a
    one-row tensor. What this adds to memory is one local row and one read's row block (docs/memory.md,
    "Start-up memory"), where reading the whole parameter first added the parameter."""
    shape = spec.local_shape
    width = math.prod(shape[1:])
    last = first + out.numel()
    if not shape or last > math.prod(shape) or first < 0:
        raise ValueError(f"{spec.name}: elements [{first}, {last}) outside the local block {shape}")
    copy = getattr(source, "values", True)
    pos = first
    while pos < last:
        row = pos // width
        if pos == row * width and last >= (row + 1) * width:  # whole rows from here on
            end = last // width
            rows = out[pos - first : end * width - first].view(end - row, *shape[1:])
            read_local(spec.rows(row, end), source, out=rows)
            pos = end * width
        else:  # part of one row: read the row, keep the part
            stop = min(last, (row + 1) * width)
            part = read_local(spec.rows(row, row + 1), source).reshape(-1)
            if copy:
                out[pos - first : stop - first].copy_(part[pos - row * width : stop - row * width])
            del part
            pos = stop


def local_value(p: torch.Tensor) -> torch.Tensor:
    """The value a parameter holds on this rank: its declared block if pending, else its own data."""
    origin = pending(p)
    if origin is None:
        return p.detach()
    return read_local(origin.spec, origin.source).to(device=origin.device, dtype=p.dtype)


def _device_of(module: nn.Module) -> torch.device | None:
    for p in module.parameters():
        origin = pending(p)
        if origin is not None:
            return origin.device
    return None


def materialize(
    module: nn.Module,
    *,
    only: set[int] | None = None,
    defer: bool = False,
    device: torch.device | str | None = None,
) -> None:
    """Allocate and fill the meta parameters of ``module`` from their `Pending` (only those whose id is in
    ``only``, if given: this rank's pipeline stages), and its meta buffers (RoPE tables are recomputed).
    Parameters already real are left alone, so this is safe on any model. A Parameter held by several modules
    (a tied embedding) becomes one new Parameter in all of them.

    ``defer``: allocate no parameter storage yet — each becomes a real-device tensor of its shape with an empty
    storage that keeps its `Pending` (ZeRO-3 fills only this rank's flat shard from it, tessera.parallel.zero).
    """
    from tessera.model.layers import Rope

    dev = torch.device(device) if device is not None else _device_of(module)
    memo: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if p is None or not p.is_meta or (only is not None and id(p) not in only):
                continue
            if id(p) not in memo:
                memo[id(p)] = _real_parameter(p, defer)
            m._parameters[key] = memo[id(p)]
        metas = [k for k, b in m._buffers.items() if b is not None and b.is_meta]
        for key in metas:
            if dev is None:
                raise RuntimeError(f"cannot place buffer {key}: no device declared; pass device=")
            m._buffers[key] = torch.empty_like(m._buffers[key], device=dev)
        if metas and isinstance(m, Rope):
            m.reset()


def _real_parameter(p: nn.Parameter, defer: bool) -> nn.Parameter:
    origin = pending(p)
    if origin is None:
        raise RuntimeError(
            f"a meta parameter of shape {tuple(p.shape)} has no declared value source; call "
            "tessera.model.materialize.declare on the model before materialising it"
        )
    if not defer:
        return nn.Parameter(local_value(p), requires_grad=p.requires_grad)
    new = nn.Parameter(
        torch.empty(p.shape, dtype=p.dtype, device=origin.device), requires_grad=p.requires_grad
    )
    # shape only; ZeRO allocates and fills its flat buffers. Freed on the Parameter itself: under fake tensors
    # wrapping a tensor in a Parameter gives it a storage of its own, full-sized
    new.untyped_storage().resize_(0)
    setattr(new, _ATTR, origin)
    return new


def release_parameters(module: nn.Module, keep: set[int], device: torch.device | None = None) -> None:
    """Make every parameter of ``module`` whose id is not in ``keep`` an empty tensor (stages another pipeline
    rank owns): a meta parameter is replaced without ever being allocated, a real one drops its data."""
    memo: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for key, p in list(m._parameters.items()):
            if p is None or id(p) in keep:
                continue
            if not p.is_meta:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                continue
            if id(p) not in memo:
                origin = pending(p)
                dev = origin.device if origin is not None else (device or torch.device("cpu"))
                memo[id(p)] = nn.Parameter(
                    torch.empty(0, dtype=p.dtype, device=dev), requires_grad=p.requires_grad
                )
            m._parameters[key] = memo[id(p)]
