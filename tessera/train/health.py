"""Is this step's result fit to apply, and this state fit to save? Non-finite losses and gradients, fp16 overflow.

The loss (all-reduced over data-parallel replicas and broadcast along the pipeline) and the clipped global
gradient norm (reduced over every group that holds gradients) are already host floats equal on every rank,
so the decision costs no collective and every rank takes the same one. Saving checks the weights themselves
(one all-reduce per checkpoint), so a non-finite state is never written whatever produced it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import TrainConfig
from tessera.errors import NonFiniteError

__all__ = ["StepHealth", "check_state_finite", "nonfinite_parameters"]


class StepHealth:
    """The train.nonfinite policy and fp16's overflow limit, counted over consecutive steps."""

    def __init__(self, tr: TrainConfig) -> None:
        self.policy, self.max_skips, self.max_overflows = tr.nonfinite, tr.max_skips, tr.fp16_max_overflows
        self.skips_in_a_row = 0
        self.overflows_in_a_row = 0
        self.skipped = 0

    def state_dict(self) -> dict[str, int]:
        """The counts a checkpoint keeps: a resumed run goes on counting (the metric ``nonfinite_skipped``, and the
        consecutive limits), where it restarted from 0 and allowed max_skips more skips in a row."""
        return {
            "skipped": self.skipped,
            "skips_in_a_row": self.skips_in_a_row,
            "overflows_in_a_row": self.overflows_in_a_row,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.skips_in_a_row = int(state.get("skips_in_a_row", 0))
        self.overflows_in_a_row = int(state.get("overflows_in_a_row", 0))

    def apply_update(
        self, step: int, loss: float, norm: float, fp16_overflow: bool, model: nn.Module
    ) -> bool:
        """Whether to apply this step's update; raises NonFiniteError when the run should stop."""
        if fp16_overflow and math.isfinite(loss):  # the loss scaler's business: it backs off and retries
            self.overflows_in_a_row += 1
            if self.overflows_in_a_row >= self.max_overflows:
                raise NonFiniteError(
                    f"step {step}: fp16 gradients overflowed in {self.overflows_in_a_row} consecutive steps "
                    f"(loss {loss:.4g}); the dynamic loss scale cannot recover\n    fix: use train.dtype = "
                    "'bf16', lower train.lr or train.fp16_init_scale, or raise train.fp16_max_overflows"
                )
            return False
        self.overflows_in_a_row = 0
        if math.isfinite(loss) and math.isfinite(norm):
            self.skips_in_a_row = 0
            return True
        where = _describe(nonfinite_parameters(model))
        if self.policy == "skip" and self.skips_in_a_row < self.max_skips:
            self.skips_in_a_row += 1
            self.skipped += 1
            return False
        tried = f" after {self.skips_in_a_row} skipped step(s)" if self.policy == "skip" else ""
        raise NonFiniteError(
            f"step {step}: loss {loss:.4g}, gradient norm {norm:.4g}{tried}; {where}. Stopped without saving: "
            "the newest checkpoint holds the last healthy state\n    fix: lower train.lr, raise "
            "train.warmup_steps or set train.grad_clip, then resume; or set train.nonfinite = 'skip'"
        )


def nonfinite_parameters(model: nn.Module) -> list[tuple[str, int, str]]:
    """(name, element count, "weights"|"gradient") of this rank's parameters holding NaN/inf, largest first."""
    bad = []
    for name, p in model.named_parameters():
        if p.numel() and not bool(torch.isfinite(p.detach()).all()):
            bad.append((name, p.numel(), "weights"))
        elif p.grad is not None and p.grad.numel() and not bool(torch.isfinite(p.grad).all()):
            bad.append((name, p.numel(), "gradient"))
    return sorted(bad, key=lambda b: (-b[1], b[0]))


def _describe(bad: list[tuple[str, int, str]]) -> str:
    if not bad:
        return "no local parameter holds NaN/inf (the loss itself, or another rank's shard)"
    names = ", ".join(f"{n} ({kind}, {count:,} values)" for n, count, kind in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return f"non-finite on this rank, largest first: {names}{more}"


def check_state_finite(model: nn.Module, step: int) -> None:
    """Refuse to save weights holding NaN/inf on any rank (collective: one all-reduce of a flag)."""
    bad = [n for n, p in model.named_parameters() if p.numel() and not bool(torch.isfinite(p.detach()).all())]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    flag = torch.tensor([float(len(bad))], device=device)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank refuses, or none: no rank waits in the save
    if flag.item():
        raise NonFiniteError(
            f"step {step}: refusing to checkpoint non-finite weights ({', '.join(bad[:3]) or 'on another rank'}); "
            "the newest checkpoint holds the last healthy state\n    fix: resume from it with a lower train.lr"
        )
