"""Pipeline stages: cut a plain model (or its tensor-parallel version) into contiguous groups of blocks.

Global stage ``s`` of ``S = p·v`` holds a contiguous run of blocks (an even split, or explicit ``stage_layers``
counts, which may be 0); stage 0 also holds ``model.embed`` and stage ``S-1`` holds ``model.head`` and computes
the loss. Parameter names inside a stage are the plain model's (``embed.wte.weight``, ``blocks.3.attn.wq.weight``,
``head.out.weight``), so gradients and checkpoints line up with the single-device model.

The embedding and the head run through the model itself with its blocks removed (a "front" part with only
``embed``, a "tail" part with only ``head``), so any model following the ``TransformerLM`` convention — optional
``embed`` / ``head``, ``forward(x, targets)`` — works unchanged, including the 1D and 2D tensor-parallel models
whose loss is vocabulary-parallel.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tessera.config import even_split
from tessera.errors import ConfigError
from tessera.model.documents import AttentionMasks, Documents
from tessera.model.layers import TransformerLM
from tessera.modes import CHECKPOINTING
from tessera.parallel.checkpointing import apply_checkpointing

__all__ = [
    "CHECKPOINT_MODES",
    "Stage",
    "TiedParameter",
    "boundary_shape",
    "even_split",
    "split_stages",
    "tied_parameters",
]

CHECKPOINT_MODES = CHECKPOINTING  # the names live in tessera.modes
"""none; full = recompute every block in backward; selective = recompute only the attention core."""


def boundary_shape(model: nn.Module) -> Callable[[torch.Size], tuple[int, ...]] | None:
    """Shape of the tensor between two stages for a micro-batch of tokens [b, s]: (b, s, h) for a plain model,
    the rank's block (b/q, s, h/q) for the Optimus 2D model (it has a ``grid``), (b, s/t, h) for the 1D model
    with sequence parallelism; None if the model has no ``cfg.d_model`` (then give the engine
    ``activation_shape``)."""
    cfg = getattr(model, "plain_config", None) or getattr(model, "cfg", None)
    hidden = getattr(cfg, "d_model", None)
    if hidden is None:
        return None
    grid = getattr(model, "grid", None)
    q = grid.q if grid is not None else 1
    t = getattr(model, "tp", 1) if getattr(model, "sequence_parallel", False) else 1

    def shape(tokens: torch.Size) -> tuple[int, ...]:
        return (tokens[0] // q, tokens[1] // t, hidden // q)  # [b/q, s/t, h/q]

    return shape


def _model_part(model: nn.Module, keep_embed: bool, keep_head: bool) -> nn.Module:
    """A shallow copy of ``model`` with no blocks and only the embed and/or head asked for (shared modules)."""
    part = copy.copy(model)
    part._modules = dict(model._modules)  # type: ignore[attr-defined]  # copy.copy shares the dict itself
    part._parameters = dict(model._parameters)  # type: ignore[attr-defined]
    part._buffers = dict(model._buffers)  # type: ignore[attr-defined]
    part.blocks = nn.ModuleDict()
    part.embed = model.embed if keep_embed else None
    part.head = model.head if keep_head else None
    return part


class Stage(nn.Module):
    """One global pipeline stage: ``forward(x, targets=None)``.

    ``x`` is tokens [b, s] for stage 0, otherwise the hidden state [b, s, h] (or the rank's tensor-parallel
    shard of it). Returns the hidden state, or on the last stage the mean loss of the micro-batch when
    ``targets`` is given (the logits when it is not, as ``torch.distributed.pipelining`` expects).
    """

    def __init__(
        self,
        model: nn.Module,
        index: int,
        n_stages: int,
        block_names: list[str],
        checkpointing: str = "none",
    ) -> None:
        super().__init__()
        self.index, self.n_stages, self.checkpointing = index, n_stages, checkpointing
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.embed = model.embed if self.is_first else None
        self.blocks = nn.ModuleDict({name: model.blocks[name] for name in block_names})
        self.head = model.head if self.is_last else None
        # Not registered as submodules: they share embed/head with this stage and must not rename parameters.
        object.__setattr__(self, "_front", _model_part(model, True, False) if self.is_first else None)
        object.__setattr__(self, "_tail", _model_part(model, False, True) if self.is_last else None)
        # the model's view of a micro-batch's documents (a 2D model keeps its grid row's sequences)
        object.__setattr__(self, "_documents", getattr(model, "documents", None))
        apply_checkpointing(
            self.blocks, checkpointing
        )  # in place, as the direct loop does to the whole model
        self.boundary_shape = boundary_shape(model)
        """tokens shape [b, s] → shape of this stage's input/output hidden tensor (None if unknown)."""

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        reduction: str = "mean",
        docs: AttentionMasks | None = None,
    ) -> torch.Tensor:
        """``positions`` [b, s]: the micro-batch's positions per document (document masking), which every stage
        is given alongside its input, as the last stage is given the targets. ``reduction``: the last stage's
        loss (`tessera.model.targets`); a loss mask's ignored targets come in ``targets``. ``docs``: the
        micro-batch's `masks`, shared with this rank's other stages (`PipelineEngine`, which releases them);
        None: this stage makes its own and releases it after its blocks."""
        tail = {} if reduction == "mean" else {"reduction": reduction}
        own = docs is None
        docs = self.masks(positions) if docs is None else docs
        if self._front is not None:
            x = self._front(x, positions=positions)  # tokens [b, s] -> x: [b, s, h]
        for block in self.blocks.values():
            x = block(x, docs=docs)  # x: [b, s, h]
        if own:
            docs.release()  # the masks live on in what the layers saved (full recomputation: rebuilt once)
        if self._tail is None:
            return x
        return self._tail(x, targets, **tail)  # loss (scalar), or logits [b, s, V] when targets is None

    def documents(self, positions: torch.Tensor) -> Documents:
        """The model's view of a micro-batch's documents (a 2D model keeps its grid row's sequences)."""
        if self._documents is None:
            raise ValueError(
                "the pipelined model has no documents(positions) method, so its stages cannot mask documents; "
                "turn data.document_mask off"
            )
        return self._documents(positions)

    masks = TransformerLM.masks

    def extra_repr(self) -> str:
        blocks = ",".join(self.blocks) or "-"
        return f"index={self.index}/{self.n_stages}, blocks=[{blocks}], checkpointing={self.checkpointing}"


def split_stages(
    model: nn.Module, n_stages: int, stage_layers: list[int] | None = None, checkpointing: str = "none"
) -> list[Stage]:
    """Cut ``model`` into ``n_stages`` stages of contiguous blocks (even split unless ``stage_layers``).

    ``stage_layers[s]`` is the number of blocks of stage s (0 allowed, e.g. lighter first and last stages that
    carry the embedding and the head). Every stage shares its modules with ``model``: build the same model (same
    seed) on every rank and keep only the stages this rank runs.
    """
    names = list(model.blocks.keys())
    if n_stages < 1:
        raise ConfigError(f"a pipeline needs at least one stage, got n_stages = {n_stages}")
    if stage_layers is None:
        if len(names) < n_stages:
            raise ConfigError(
                f"the model has {len(names)} blocks, fewer than the {n_stages} stages; give explicit "
                f"stage_layers (0 allowed), e.g. {even_split(len(names), n_stages)}, or use fewer stages"
            )
        stage_layers = even_split(len(names), n_stages)
    if len(stage_layers) != n_stages or sum(stage_layers) != len(names) or min(stage_layers) < 0:
        raise ConfigError(
            f"stage_layers = {list(stage_layers)} must have {n_stages} non-negative entries summing to the "
            f"model's {len(names)} blocks, e.g. {even_split(len(names), n_stages)}"
        )
    stages, start = [], 0
    for index, count in enumerate(stage_layers):
        stages.append(Stage(model, index, n_stages, names[start : start + count], checkpointing))
        start += count
    return stages


@dataclass(frozen=True, slots=True)
class TiedParameter:
    """One Parameter held by two stages (tied embedding and output projection)."""

    stage_a: int
    name_a: str
    stage_b: int
    name_b: str


def tied_parameters(stages: list[Stage]) -> list[TiedParameter]:
    """Parameters shared by two different stages of ``stages`` (all stages, before keeping the local ones).

    When the two stages live on different pipeline ranks each rank holds its own copy; the runtime adds the two
    gradient contributions so both copies take the same optimizer step.
    """
    first: dict[int, tuple[int, str]] = {}
    tied = []
    for stage in stages:
        for name, param in stage.named_parameters():
            seen = first.setdefault(id(param), (stage.index, name))
            if seen[0] != stage.index:
                tied.append(TiedParameter(seen[0], seen[1], stage.index, name))
    return tied
