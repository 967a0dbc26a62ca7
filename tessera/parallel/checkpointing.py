"""Activation checkpointing applied from outside: none, full (every block) or selective (attention core only).

- ``full``: each block runs under ``torch.utils.checkpoint`` (non-reentrant); only its input is kept, the
  block's forward is replayed in backward (Korthikanti's 2·s·b·h bytes per layer, + one forward of FLOPs).
- ``selective``: only ``block.attn.core`` (softmax(QKᵀ)·V, parameter-free) is recomputed: drops the a·s²
  score tensors, the 5as/h term, for a few % extra FLOPs (Korthikanti §4.3).

The wrappers own no parameters, so parameter names and ZeRO's flat buffers are unchanged. `apply_checkpointing` is
the one place a mode is applied: to every block of a model (the direct loop), and by each pipeline stage to its
own blocks (tessera/pipeline/stage.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tessera.errors import ConfigError
from tessera.modes import CHECKPOINTING

__all__ = ["MODES", "Checkpointed", "apply_checkpointing", "save_early", "saved_early"]

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
    parameter names are unchanged). selective: ``block.attn.core`` is wrapped in `Checkpointed`; a block without
    one is refused rather than silently left uncheckpointed. Raises ConfigError (an unknown mode, no core).
    Idempotent.
    """
    if mode not in MODES:
        raise ConfigError(f"unknown activation checkpointing {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return model_or_blocks
    blocks = _blocks(model_or_blocks)
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        if mode == "full":
            _checkpoint_forward(block)
        else:
            _checkpoint_core(block, mode)
    return model_or_blocks


def _checkpoint_core(block: nn.Module, mode: str) -> None:
    attn = getattr(block, "attn", None)
    core = getattr(attn, "core", None)
    if core is None:
        raise ConfigError(
            f"parallel.checkpointing = {mode!r}: selective checkpointing needs block.attn.core (the attention "
            f"core); {type(block).__name__} has none. Use checkpointing = 'full'"
        )
    if not isinstance(core, Checkpointed):
        attn.core = Checkpointed(core)


def _checkpoint_forward(block: nn.Module) -> None:
    if getattr(block, "_tessera_checkpointed", False):
        return
    plain = block.forward

    def forward(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return checkpoint(plain, *args, use_reentrant=False, **kwargs)  # kwargs: the documents, if masking

    block.forward = forward  # type: ignore[method-assign]
    block._tessera_checkpointed = True  # type: ignore[attr-defined]


class _SavedEarly(torch.autograd.Function):
    """Saves tensors for a later Function's backward in a node of its own that runs before that Function.

    Why: autograd packs a Function's saved tensors only after its forward returns, and full checkpointing's replay
    (torch.utils.checkpoint, non-reentrant) stops at the pack of the block's last saved tensor. A Function that
    runs collectives and GEMMs before saving (the 1D ring exit, a 2D SUMMA product) made each block's replay run
    them whole and throw the output away; saved here, before them, the replay stops first."""

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        ctx.count = len(
            tensors
        )  # backward must not unpack them: the later Function reads them, and only once
        # a token: the later Function takes it as an input, so this node, the saved tensors' home, is in its graph
        return tensors[0].new_empty(0)

    @staticmethod
    def backward(ctx, _token: torch.Tensor) -> tuple[None, ...]:
        return (None,) * ctx.count  # the later Function's backward returns their gradients


def save_early(*tensors: torch.Tensor) -> torch.Tensor:
    """A token holding ``tensors`` for backward, saved now (`_SavedEarly`): pass it to the Function whose
    backward reads them, which keeps ``token.grad_fn`` in its ctx and reads them with `saved_early`."""
    return _SavedEarly.apply(*tensors)


def saved_early(node: torch.autograd.graph.Node) -> tuple[torch.Tensor, ...]:
    """The tensors `save_early` saved in ``node`` (a token's ``grad_fn``); read once: a checkpoint's recomputed
    tensors unpack once."""
    return node.saved_tensors
