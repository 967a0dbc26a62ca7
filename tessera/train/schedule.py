"""The learning-rate schedule: a pure function of the step and four settings, so a resume recomputes it."""

from __future__ import annotations

import math
from typing import Protocol

__all__ = ["SCHEDULE_KEYS", "Schedule", "lr_at"]

SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "steps")
"""The `train` settings the learning rate of a step depends on."""


class Schedule(Protocol):
    lr: float
    min_lr: float
    warmup_steps: int
    steps: int


def lr_at(step: int, tr: Schedule) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``steps``."""
    if step < tr.warmup_steps:
        return tr.lr * (step + 1) / tr.warmup_steps
    progress = (step - tr.warmup_steps) / max(1, tr.steps - tr.warmup_steps)
    return tr.min_lr + 0.5 * (tr.lr - tr.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
