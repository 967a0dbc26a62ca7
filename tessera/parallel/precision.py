"""Mixed precision: autocast compute over fp32 master weights, and dynamic loss scaling for fp16.

Design: the parameters themselves stay fp32 and are the master weights (ZeRO shards them like any fp32 tensor);
``torch.autocast`` casts them to bf16/fp16 per operation. Gradients therefore arrive in fp32 and are reduced in
``reduce_dtype`` (fp32 by default; bf16 halves data-parallel traffic at some accuracy cost). Model state per
parameter is 4 (param) + 4 (grad) + 8 (Adam moments) = 16 bytes, the same total as the ZeRO paper's 2 + 2 + 12
mixed-precision accounting, split differently (docs/memory.md).

fp16 needs loss scaling: its 5-bit exponent flushes small gradients to zero. ``DynamicLossScaler`` multiplies the
loss by ``scale``; after backward it unscales the (sharded) gradients, checks every rank for inf/nan, skips the
step and halves the scale on overflow, and doubles it after ``growth_interval`` clean steps.

Weight casts, one per region. torch's autocast casts a weight (a leaf fp32 tensor that requires grad) once per
autocast region and hands every later call in the region the cached copy, so the micro-batches of a step share one
bf16 copy of each weight; ZeRO-3 clears that cache when it frees a stage. tessera's own matmuls (2D's SUMMA) cast
their operands themselves, and torch exposes no op that returns autocast's cached cast (its cache is reached only
from inside the C++ kernels of linear, mm, ...; `torch.library.register_autocast` casts without it), so
`cast_operand` keeps the same cache for them with the same lifetime: filled inside an `autocast` region, emptied
when the region exits and by `clear_weight_casts`, which clears autocast's own cache with it (the one call the
runtime makes at FREE). The memory estimate counts both alike (`autocast_weight_bytes`, docs/memory.md).
The 1D Linears take their weights through `cast_weight` (the same cache) rather than leaving the cast to autocast:
autocast's cached copy comes with one autograd node for the whole region, which held each stage's bf16 weight
gradients until its backward ended; `cast_operand` gives every call a node of its own over the shared copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tessera import comm

__all__ = [
    "DTYPES",
    "DynamicLossScaler",
    "autocast",
    "cast_operand",
    "cast_weight",
    "clear_weight_casts",
    "compute_dtype",
    "reduce_dtype",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(name: str) -> torch.dtype:
    """torch dtype of a config dtype name (fp32, bf16, fp16)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def reduce_dtype(name: str = "fp32") -> torch.dtype:
    """dtype of the gradient reduction: fp32 (default, exact accumulation) or bf16 (half the traffic)."""
    if name not in ("fp32", "bf16"):
        raise ValueError(f"gradient reduction dtype must be fp32 or bf16, got {name!r}")
    return DTYPES[name]


class _WeightCasts:
    """The compute-dtype copies of the weights cast in the open `autocast` region (None: no region open).

    Keyed by the weight's id; each entry keeps the weight itself (so the id cannot be reused while the entry
    lives), its version counter when cast (an in-place update, such as an optimizer step, makes the entry stale)
    and the copy. Not the data pointer: fake tensors (the dry run) have none, and ZeRO-3 re-gathers into the
    same storage anyway, which is why its FREE clears the cache. Process-wide rather than thread-local: a
    recomputing backward thread (CUDA) reuses the copies.
    """

    casts: dict[int, tuple[torch.Tensor, int, torch.Tensor]] | None = None


@contextmanager
def autocast(dtype: str, device: torch.device) -> Iterator[None]:
    """Autocast region: disabled for fp32, else bf16/fp16 compute on fp32 weights, each weight cast once in it
    (by torch's autocast or by `cast_operand`); the copies are dropped when the region exits. tessera opens one
    region per step in the schedule runtime and one per micro-batch's forward in the direct loop."""
    if dtype == "fp32":
        with torch.autocast(device.type, enabled=False):
            yield
        return
    outer = _WeightCasts.casts
    _WeightCasts.casts = {} if outer is None else outer  # a nested region shares the outer one's copies
    try:
        with torch.autocast(device.type, dtype=compute_dtype(dtype)):
            yield
    finally:
        _WeightCasts.casts = outer


def clear_weight_casts() -> None:
    """Drop every cached compute-dtype weight copy, torch autocast's and `cast_operand`'s (ZeRO-3's FREE: the
    stage's parameters are released; copies still saved for backward live on in the graphs that saved them)."""
    torch.clear_autocast_cache()
    if _WeightCasts.casts is not None:
        _WeightCasts.casts.clear()


def cast_operand(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, differentiably; a weight is cast once per `autocast` region and the copy reused.

    A weight is what autocast's own cache takes: a leaf fp32 tensor that requires grad, not a view, cast to a
    narrower dtype while autocast and its cache are enabled; and here also only with grad mode on (a copy made
    under no_grad has no grad_fn and must not serve a later differentiable call). Everything else (activations)
    is cast on every call. Each call gets its own node over the shared copy (`_CachedCast`), so each backward's
    gradient reaches the fp32 weight as soon as its matmul's backward has run, as with a cast per call.
    """
    cache = _WeightCasts.casts
    if cache is None or not _is_cached_weight(t, dtype):
        return t.to(dtype)
    hit = cache.get(id(t))
    if hit is None or hit[0] is not t or hit[1] != t._version or hit[2].dtype != dtype:
        hit = cache[id(t)] = (t, t._version, t.detach().to(dtype))
    return _CachedCast.apply(t, hit[2])


class _CachedCast(torch.autograd.Function):
    """This call's differentiable cast of ``weight``, served from the region's ``copy``: forward hands out a view
    of the copy (no new storage), backward casts the gradient to the weight's dtype, as ToCopyBackward does.

    A node per call rather than one shared by every micro-batch (as autocast's own cache does): the autograd
    engine runs ready nodes newest first, so a cast node made in the step's first forward would hold each later
    backward's compute-dtype weight gradients until that backward ends — with full recomputation, beside the
    last block's recomputed activations (measured on a 2D dry run: +0.6 MB transient on a 15 MB peak).
    """

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def cast_weight(w: torch.Tensor | None) -> torch.Tensor | None:
    """A weight (or bias) for F.linear inside an `autocast` region: its shared compute-dtype copy through a node of
    this call's own (`cast_operand`); anything else, or outside a region, unchanged (autocast casts it as before).

    Why not leave the cast to autocast: its cache hands every call of the region the same copy *and the same*
    ToCopyBackward node, made by the step's first forward. In the schedule runtime (one region per step) that node
    is older than every node of a later micro-batch's backward, and the engine runs ready nodes newest first, so
    each Linear's bf16 weight gradient waited for it until the stage's backward ended: the stage's bf16 weight
    gradients (2 bytes per parameter) were alive together. With a node per call each is cast to fp32 and
    accumulated as soon as its Linear's backward has run; the copy is still made once per region.
    """
    if w is None or _WeightCasts.casts is None or not torch.is_autocast_enabled(w.device.type):
        return w
    dtype = torch.get_autocast_dtype(w.device.type)
    return cast_operand(w, dtype) if _is_cached_weight(w, dtype) else w


def _is_cached_weight(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether autocast's rule caches ``t``'s cast to ``dtype`` (see `cast_operand`)."""
    return (
        t.dtype == torch.float32
        and dtype in (torch.bfloat16, torch.float16)
        and t.is_leaf
        and t.requires_grad
        and not t._is_view()
        and torch.is_grad_enabled()
        and torch.is_autocast_cache_enabled()
        and torch.is_autocast_enabled(t.device.type)
    )


class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018), usable with sharded gradients.

    Per step: ``loss * scaler.scale`` → backward → reduce → ``ok = scaler.unscale_and_check(grads, groups)`` →
    step only if ``ok`` → ``scaler.update(ok)``. ``groups`` are the process groups over which the gradients are
    spread (data parallel for ZeRO shards, pipeline, tensor): one rank's overflow skips the step everywhere.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1 and init_scale > 0):
            raise ValueError(
                "DynamicLossScaler needs growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1 and "
                f"init_scale > 0; got {growth_factor}, {backoff_factor}, {growth_interval}, {init_scale}"
            )
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        self.skipped = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(
        self, grads: Iterable[torch.Tensor], groups: Iterable[dist.ProcessGroup | None] = ()
    ) -> bool:
        """Divide ``grads`` in place by the scale; True when every rank's gradients are finite."""
        grads = list(grads)
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        for group in groups:
            if dist.is_initialized():
                comm.all_reduce_max(found, group)
        return not bool(found.item())

    def update(self, ok: bool) -> None:
        """Back off after an overflow (the step was skipped), grow after ``growth_interval`` good steps."""
        if not ok:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
