"""Activation checkpointing applied from outside: none, full (every block), selective (attention core only) or op.

- ``full``: each block runs under ``torch.utils.checkpoint`` (non-reentrant); only its input is kept, the
  block's forward is replayed in backward (Korthikanti's 2·s·b·h bytes per layer, + one forward of FLOPs).
- ``selective``: only ``block.attn.core`` (softmax(QKᵀ)·V, parameter-free) is recomputed: drops the a·s²
  score tensors, the 5as/h term, for a few % extra FLOPs (Korthikanti §4.3).
- ``op``: torchtitan's "selective op" policy (pytorch/torchtitan, `torchtitan/distributed/activation_checkpoint.py`,
  `_save_list`): each block runs under torch's non-reentrant checkpoint with two dispatch modes of our own as its
  ``context_fn`` (`op_contexts`; torch's `create_selective_checkpoint_contexts` cannot replay tessera's blocks:
  `_ReuseOps`), which save the outputs of the block's odd-numbered matmuls (aten.mm / addmm, counted in forward
  order: wq, wv, w1, w2 of a Llama block's wq wk wv wo w1 w3 w2) and of SDPA (its output and log-sum-exp);
  everything else (wk, wo, w3, norms, RoPE, the activation, residual adds, casts) is replayed in backward. The
  attention core is not replayed.

The wrappers own no parameters, so parameter names and ZeRO's flat buffers are unchanged. `apply_checkpointing` is
the one place a mode is applied: to every block of a model (the direct loop), and by each pipeline stage to its
own blocks (tessera/pipeline/stage.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from tessera.errors import ConfigError
from tessera.modes import CHECKPOINTING

__all__ = [
    "MATMUL_OPS",
    "MODES",
    "SAVED_ATTENTION_OPS",
    "Checkpointed",
    "apply_checkpointing",
    "op_contexts",
    "save_early",
    "saved_early",
]

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
    parameter names are unchanged); op: the same, keeping what `op_contexts` keeps. selective:
    ``block.attn.core`` is wrapped in `Checkpointed`; a block without one is refused rather than silently left
    uncheckpointed. Raises ConfigError (an unknown mode, no core). Idempotent.
    """
    if mode not in MODES:
        raise ConfigError(f"unknown activation checkpointing {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return model_or_blocks
    blocks = _blocks(model_or_blocks)
    for block in blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks:
        if mode in ("full", "op"):
            _checkpoint_forward(block, op_contexts if mode == "op" else None)
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


MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})
"""The matmuls op mode counts: a Linear on a [b, s, in] input reaches the dispatcher as one of these (addmm with a
bias), whatever the dtype; torchtitan counts aten.mm (its Llama has no biases)."""
SAVED_ATTENTION_OPS = frozenset(
    {
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    }
)
"""SDPA's fused kernels: op mode saves their outputs (the attention output and log-sum-exp), so the attention
core is never replayed. SDPA's math fallback decomposes into bmm/softmax, which are replayed (as torchtitan)."""


def _saves(op: Any, matmuls: int) -> bool:
    """Whether op mode keeps the output of ``op``, the block's ``matmuls``-th matmul so far if it is one."""
    return op in SAVED_ATTENTION_OPS or (op in MATMUL_OPS and matmuls % 2 == 1)  # wq, wv, w1, w2: kept


def _shapes(args: tuple) -> list[tuple[int, ...]]:
    """The shapes of an op's tensor arguments: what a kept output is checked against in the replay."""
    return [tuple(t.shape) for t in tree_leaves(args) if isinstance(t, torch.Tensor)]


class _SaveOps(TorchDispatchMode):
    """Op mode's forward: runs every op and keeps, in order, the outputs `_saves` names (detached, with their
    version counters: a kept tensor changed in place before the replay would be handed back wrong)."""

    def __init__(self, kept: deque) -> None:
        super().__init__()
        self.kept, self.matmuls = kept, 0

    def __torch_dispatch__(self, op: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = op(*args, **(kwargs or {}))
        self.matmuls += op in MATMUL_OPS
        if _saves(op, self.matmuls):
            detached = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            versions = [t._version for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.kept.append((op, _shapes(args), detached, versions))
        return out


class _ReuseOps(TorchDispatchMode):
    """Op mode's replay: hands back the kept outputs in the order the forward kept them and runs every other op.

    Why not torch's `create_selective_checkpoint_contexts`: its replay must run every op the forward ran, as often
    (each op's calls are numbered), and the attention masks and autocast's weight copies are built on first use
    and shared by the blocks (`AttentionMasks`, `precision.cast_operand`): the first block to run builds them, in
    the forward and in the replay, which replays the blocks in reverse order, so torch's replay met an op call
    the forward of that block never made and stopped ("not found in storage"). Only the kept ops need an order,
    and the matmuls and attention kernels of a block run in the same order in its forward and its replay."""

    def __init__(self, kept: deque) -> None:
        super().__init__()
        self.kept, self.matmuls = kept, 0

    def __torch_dispatch__(self, op: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.matmuls += op in MATMUL_OPS
        if not _saves(op, self.matmuls):
            return op(*args, **(kwargs or {}))
        kept_op, shapes, out, versions = self.kept.popleft() if self.kept else (None, None, None, None)
        now = [t._version for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if kept_op is not op or shapes != _shapes(args) or now != versions:
            raise RuntimeError(
                f"checkpointing = 'op': the replay of a block reached {op} on {_shapes(args)} where its forward kept "
                f"{kept_op} on {shapes} (or a kept output was changed in place since); a block's forward must run its matmuls "
                "and attention kernels in the same order every time. Use checkpointing = 'full' for this model"
            )
        return out


def op_contexts() -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """torch.utils.checkpoint's ``context_fn`` for op mode (torchtitan's `_save_list` rule): the forward keeps the
    outputs of SDPA's fused kernels and of the block's 1st, 3rd, 5th, ... matmul; the replay hands those back and
    recomputes everything else. Called once per checkpointed call, so each call counts its own matmuls from 1."""
    kept: deque = deque()
    return _SaveOps(kept), _ReuseOps(kept)


def _checkpoint_forward(block: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None = None) -> None:
    if getattr(block, "_tessera_checkpointed", False):
        return
    plain = block.forward
    extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}

    def forward(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        # kwargs: the documents, if masking
        return checkpoint(plain, *args, use_reentrant=False, **extra, **kwargs)

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
