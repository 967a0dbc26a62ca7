"""Mixed precision: autocast compute over fp32 master weights, and dynamic loss scaling for fp16.

Design: the parameters themselves stay fp32 and are the master weights (ZeRO shards them like any fp32 tensor);
``torch.autocast`` casts them to bf16/fp16 per operation. Gradients therefore arrive in fp32 and are reduced in
``reduce_dtype`` (fp32 by default; bf16 halves data-parallel traffic at some accuracy cost). Model state per
parameter is 4 (param) + 4 (grad) + 8 (Adam moments) = 16 bytes, the same total as the ZeRO paper's 2 + 2 + 12
mixed-precision accounting, split differently (docs/memory.md).

fp16 needs loss scaling: its 5-bit exponent flushes small gradients to zero. ``DynamicLossScaler`` multiplies the
loss by ``scale``; after backward it unscales the (sharded) gradients, checks every rank for inf/nan, skips the
step and halves the scale on overflow, and doubles it after ``growth_interval`` clean steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist

from tessera import comm

__all__ = ["DTYPES", "DynamicLossScaler", "autocast", "compute_dtype", "reduce_dtype"]

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


def autocast(dtype: str, device: torch.device) -> AbstractContextManager:
    """Autocast region for the forward: disabled for fp32, else bf16/fp16 compute on fp32 weights."""
    if dtype == "fp32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=compute_dtype(dtype))


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
