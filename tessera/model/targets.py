"""Targets that are not trained on (loss masks), and the two ways a model part reduces its loss.

Fine-tuning on prompt/completion records trains only on the completion: `tessera prepare --prompt-key/
--completion-key` writes a per-token loss mask next to the token file, and with ``data.loss_mask`` the trainer
sets every target the mask leaves out to `IGNORE_INDEX`, the value PyTorch's ``F.cross_entropy`` (its
``ignore_index`` default) and Hugging Face's labels use for "not a target". Every loss of tessera then has two
reductions:

- ``"mean"``: the mean cross-entropy over every position of the micro-batch, as before loss masks (the trainer
  asks for it only on data without a mask, so it holds no `IGNORE_INDEX`);
- ``"sum"``: the cross-entropy summed over the targets that are not `IGNORE_INDEX`. The trainer divides it by
  the number of targets of the whole global batch, counted once from the data (docs/data.md, "Fine-tuning: loss
  masks"), so every layout and every micro-batch split computes the same gradient.
"""

from __future__ import annotations

import torch

__all__ = ["IGNORE_INDEX", "check_reduction", "kept"]

IGNORE_INDEX = -100
"""A target that is not trained on (``F.cross_entropy``'s default ``ignore_index``)."""

_REDUCTIONS = ("mean", "sum")


def check_reduction(reduction: str) -> None:
    """ValueError unless ``reduction`` is "mean" or "sum"."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"loss reduction {reduction!r} is not one of {_REDUCTIONS}")


def kept(targets: torch.Tensor) -> torch.Tensor:
    """Which targets are trained on: a bool tensor of their shape, False at `IGNORE_INDEX`."""
    return targets != IGNORE_INDEX
