"""Activation checkpointing applied from outside: none, full (every block) or selective (attention core only).

- ``full``: each block runs under ``torch.utils.checkpoint`` (non-reentrant); only its input is kept, the
  block's forward is replayed in backward (Korthikanti's 2·s·b·h bytes per layer, + one forward of FLOPs).
- ``selective``: only ``block.attn.core`` (softmax(QKᵀ)·V, parameter-free) is recomputed: drops the a·s²
  score tensors, the 5as/h term, for a few % extra FLOPs (Korthikanti §4.3).

The wrappers own no parameters, so parameter names and ZeRO's flat buffers are unchanged. Pipeline stages
(tessera/pipeline/stage.py) apply the same modes per stage.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.modes import CHECKPOINTING

__all__ = ["MODES", "Checkpointed", "apply_checkpointing"]

MODES = CHECKPOINTING  # the names live in tessera.modes


class Checkpointed(nn.Module):
    """Recompute ``inner`` in backward (non-reentrant); registers nothing, so parameter names are unchanged."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, *args, use_reentrant=False)


def _blocks(model_or_blocks: nn.Module) -> nn.ModuleDict | nn.ModuleList:
    blocks = getattr(model_or_blocks, "blocks", model_or_blocks)
    if not isinstance(blocks, (nn.ModuleDict, nn.ModuleList)):
        raise TypeError(
            "apply_checkpointing expects a model with a .blocks ModuleDict/ModuleList, or the blocks container "
            f"itself; got {type(model_or_blocks).__name__}"
        )
    return blocks


def apply_checkpointing(model_or_blocks: nn.Module, mode: str) -> nn.Module:
    """Apply checkpointing ``mode`` in place to every block of ``model_or_blocks``; returns it.

    full: each block's ``forward`` is routed through ``torch.utils.checkpoint`` (the module object and its
    parameter names are unchanged). selective: ``block.attn.core`` is wrapped. Idempotent.
    """
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return model_or_blocks
    blocks = _blocks(model_or_blocks)
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        if mode == "full":
            _checkpoint_forward(block)
        else:
            attn = getattr(block, "attn", None)
            core = getattr(attn, "core", None)
            if core is None:
                raise TypeError(
                    f"selective checkpointing needs block.attn.core (the attention core); {type(block).__name__} "
                    "has none. Use checkpointing = 'full'"
                )
            if not isinstance(core, Checkpointed):
                attn.core = Checkpointed(core)
    return model_or_blocks


def _checkpoint_forward(block: nn.Module) -> None:
    if getattr(block, "_tessera_checkpointed", False):
        return
    plain = block.forward

    def forward(*args: torch.Tensor) -> torch.Tensor:
        return checkpoint(plain, *args, use_reentrant=False)

    block.forward = forward  # type: ignore[method-assign]
    block._tessera_checkpointed = True  # type: ignore[attr-defined]
