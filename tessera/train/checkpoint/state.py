"""The layout-free checkpoint format: every tensor under its global name, as this rank's blocks of it.

A rank's training state is a set of `Region`s: a parameter's local tensor (or the part of it a ZeRO flat shard
holds) with its optimizer moments laid out alike. `pieces` turns them into `Piece`s: rectangular blocks of the
single-device model's tensors (``model.blocks.0.attn.wq.weight``, ``optim.state.blocks.0.attn.wq.weight.exp_avg``)
with their global shape and offsets, each a view of the live tensor (`ShardSpec.boxes` knows the geometry, the
same mapping sharded construction and the Hugging Face import read slices with). DCP's planners then write the
blocks (replicated copies once: equal blocks of different ranks are deduplicated) and, at load, read the
overlap of every saved block with every requested one (`create_read_items_for_chunk_list`), so any layout loads
any other's checkpoint without a full tensor on any rank. ZeRO's flat buffers are a runtime detail: they never
appear in the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import (
    TensorWriteData,
    create_read_items_for_chunk_list,
)

from tessera.errors import CheckpointError
from tessera.model.materialize import Box, ShardSpec, replicated_specs
from tessera.train.checkpoint.safe_read import SafeLoadPlanner

if TYPE_CHECKING:
    from tessera.parallel.zero import FlatStage
    from tessera.pipeline.stage_comm import ZeroStageComm

__all__ = [
    "MOMENTS",
    "GlobalLoadPlanner",
    "GlobalSavePlanner",
    "Piece",
    "RankState",
    "Region",
    "check_shapes",
    "ensure_adam_state",
    "pieces",
    "specs_by_param",
    "whole_regions",
    "zero_regions",
]

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-element state; "step" is one number per parameter


@dataclass(frozen=True, slots=True)
class Region:
    """Where this rank keeps part of a parameter: elements ``[start, start + len(values))`` of its local tensor
    (row-major) in the 1-D ``values``; ``state()`` gives the optimizer's state of them alike (1-D moments, the
    0-d ``step``), or {} before the first update."""

    param: nn.Parameter
    start: int
    values: torch.Tensor
    state: Callable[[], dict[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Piece:
    """A block of the global tensor ``fqn`` (shape ``size``) at ``offsets``; ``view`` is where this rank holds
    it, in the global orientation (written from, read into)."""

    fqn: str
    size: torch.Size
    offsets: torch.Size
    view: torch.Tensor

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.view.shape)


@dataclass
class RankState:
    """This rank's share of the run's state in the layout-free format: its ``regions``, each parameter's specs
    under every name (`specs_by_param`), the parameters whose copy another rank writes (``skip``), the
    optimizer whose state the regions hold and what must follow a load (ZeRO's full copies)."""

    regions: list[Region]
    specs: dict[int, list[ShardSpec]]
    optimizer: torch.optim.Optimizer
    skip: frozenset[int] | set[int] = frozenset()
    after_load: Callable[[], None] | None = None

    @classmethod
    def of_module(cls, module: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
        """A plain module every rank holds whole (any ``nn.Module``, e.g. in tests)."""
        regions = whole_regions(module.parameters(), optimizer)
        return cls(regions, specs_by_param(module, replicated_specs(module)), optimizer)

    def to_save(self) -> list[Piece]:
        return pieces(self.regions, self.specs, skip=self.skip)

    def to_load(self, with_moments: bool) -> list[Piece]:
        """The pieces to read into; the optimizer's state is created first when the checkpoint has moments."""
        if with_moments:
            ensure_adam_state(self.optimizer)
        return pieces(self.regions, self.specs)


def whole_regions(params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer) -> list[Region]:
    """Each parameter whole, with its state in a torch optimizer (not ZeRO): the direct loop, ZeRO-0 stages."""

    def state_of(p: nn.Parameter) -> Callable[[], dict[str, torch.Tensor]]:
        def flat() -> dict[str, torch.Tensor]:
            st = optimizer.state.get(p) or {}
            return {k: v if k == "step" else v.view(-1) for k, v in st.items() if k in (*MOMENTS, "step")}

        return flat

    return [Region(p, 0, p.data.view(-1), state_of(p)) for p in params if p.numel() > 0]


def zero_regions(zero: ZeroStageComm, optimizer: torch.optim.Optimizer) -> list[Region]:
    """ZeRO: each parameter's part of this rank's flat shards (`FlatStage.owned`), its moments the same part of
    `ShardedAdamW`'s flat moments and its step the shard's."""
    out = []
    for flat in zero.flats.values():

        def state(flat: FlatStage = flat) -> dict[str, torch.Tensor]:
            return optimizer.state.get(flat.shard_param) or {}

        for p, a, b, first in flat.owned():

            def part(state: Callable = state, a: int = a, b: int = b) -> dict[str, torch.Tensor]:
                return {
                    k: v if k == "step" else v[a:b] for k, v in state().items() if k in (*MOMENTS, "step")
                }

            out.append(Region(p, first, flat.shard[a:b], part))
    return out


def specs_by_param(module: nn.Module, specs: dict[str, ShardSpec]) -> dict[int, list[ShardSpec]]:
    """``id(param)`` → its spec under each of its names in ``module`` (``specs`` holds the first name of a tied
    Parameter; the others are the same block under another name, as the single-device state dict lists them)."""
    out: dict[int, list[ShardSpec]] = {}
    first: dict[int, ShardSpec] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if name in specs:
            first.setdefault(id(p), specs[name])
    for name, p in module.named_parameters(remove_duplicate=False):
        spec = specs.get(name) or first.get(id(p))
        if spec is not None:
            out.setdefault(id(p), []).append(ShardSpec(name, spec.shape, spec.index, spec.transpose))
    return out


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyper-parameters per parameter group (lr, betas, a scheduler's initial_lr, ...) as JSON
    values; kept in meta.json."""
    return [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


def restore_group_settings(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]] | None) -> None:
    """Put back `group_settings` when the groups are the same ones (same count and keys). Another layout may
    group parameters differently (ZeRO's one group of flat shards); the trainer sets every hyper-parameter from
    its config and the learning rate from the step anyway, so nothing is lost there."""
    groups = optimizer.param_groups
    if not saved or len(saved) != len(groups):
        return
    if any(set(s) != set(g) - {"params"} for s, g in zip(saved, groups, strict=True)):
        return
    for s, g in zip(saved, groups, strict=True):
        g.update({k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of an AdamW-style optimizer zero state (as its first step would) so a checkpoint's
    moments can be read into it; state already there is kept."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state.get(p):
                optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    **{k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in MOMENTS},
                }


def pieces(
    regions: list[Region],
    specs: dict[int, list[ShardSpec]],
    *,
    skip: frozenset[int] | set[int] = frozenset(),
) -> list[Piece]:
    """Every block of every global tensor the ``regions`` hold: ``model.NAME`` and, where the optimizer has
    state, ``optim.state.NAME.{exp_avg,exp_avg_sq,step}``. ``skip``: ids of parameters whose copy another rank
    writes (a tied weight's copy on a later pipeline rank); loading still fills them."""
    out: list[Piece] = []
    for region in regions:
        if id(region.param) in skip:
            continue
        state = region.state()
        for spec in specs[id(region.param)]:
            for box in spec.boxes(region.start, region.start + region.values.numel()):
                out.append(_block(f"model.{spec.name}", spec, box, region.values, region.start))
                for k in MOMENTS:
                    if k in state:
                        out.append(_block(f"optim.state.{spec.name}.{k}", spec, box, state[k], region.start))
            if "step" in state:
                out.append(Piece(f"optim.state.{spec.name}.step", torch.Size(), torch.Size(), state["step"]))
    return out


def _block(fqn: str, spec: ShardSpec, box: Box, flat: torch.Tensor, start: int) -> Piece:
    """The view of ``box`` inside ``flat`` (which holds local elements from ``start`` on), globally oriented."""
    n = 1
    for z in box.local_sizes:
        n *= z
    view = flat[box.flat - start : box.flat - start + n].view(box.local_sizes)
    if spec.transpose:
        view = view.t()
    for d, kept in enumerate(box.sizes):
        view = view.narrow(d, 0, kept)  # padding rows of a vocabulary are never written
    return Piece(fqn, torch.Size(spec.shape), torch.Size(box.offsets), view)


def extra_pieces(tensors: dict[str, torch.Tensor]) -> list[Piece]:
    """``extra``'s tensors (the same on every rank): whole, under ``extra.{i}``."""
    return [Piece(f"extra.{k}", t.shape, torch.Size([0] * t.dim()), t.detach()) for k, t in tensors.items()]


# --- DCP planners over pieces ---------------------------------------------------------------------------------


def _key(fqn: str, offsets: torch.Size) -> str:
    return f"{fqn}@{','.join(map(str, offsets))}"


def state_dict_of(parts: list[Piece]) -> dict[str, torch.Tensor]:
    """The flat state dict DCP moves (and `checkpoint.async` copies): one tensor per piece."""
    return {_key(p.fqn, p.offsets): p.view for p in parts}


class GlobalSavePlanner(DefaultSavePlanner):
    """DCP's default planner, writing each piece as a block (SHARD) of its global tensor; DCP's global plan
    then deduplicates equal blocks of different ranks and checks that the blocks tile every tensor."""

    def __init__(self, parts: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.parts = {_key(p.fqn, p.offsets): p for p in parts}

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(p.fqn, p.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=p.chunk, properties=TensorProperties.create_from_tensor(p.view), size=p.size
                ),
            )
            for p in self.parts.values()
        ]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        # the state dict DCP hands over (a CPU copy under checkpoint.async), by the piece's key
        return self.state_dict[_key(index.fqn, index.offset)].contiguous()


class GlobalLoadPlanner(SafeLoadPlanner):
    """Reads, for every piece this rank needs, the overlap with every block the checkpoint holds of that
    tensor (DCP's resharding by chunk overlap), straight into the live views."""

    def __init__(self, parts: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.parts = parts
        self.by_index = {_key(p.fqn, p.offsets): p.view for p in parts}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        requests = []
        for p in self.parts:
            saved = self.metadata.state_dict_metadata[p.fqn]
            requests += create_read_items_for_chunk_list(p.fqn, saved, [p.chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.by_index[_key(index.fqn, index.offset)]


def check_shapes(path: object, shapes: dict[str, tuple[int, ...]], metadata: Metadata) -> None:
    """Name the first tensor (by its checkpoint name) that the checkpoint lacks or holds at another shape, before
    DCP reads anything."""
    saved = metadata.state_dict_metadata
    for name, shape in shapes.items():
        entry = saved.get(name)
        if entry is None:
            raise CheckpointError(
                f"checkpoint {path} has no entry {name!r} that this model/optimizer needs\n    fix: build the "
                "model with the saved run's model settings (same config), or start a fresh run"
            )
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path}: {name!r} is stored as bytes, expected a tensor")
        if tuple(entry.size) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {path}: {name} has shape {tuple(entry.size)} in the checkpoint but "
                f"{tuple(shape)} in this model\n    fix: use the model config of the saved run (model size "
                "changed?), or start a fresh run in a new checkpoint directory"
            )


def has_optimizer_state(metadata: Metadata) -> bool:
    """Whether the checkpoint holds moments (none if every step before it was skipped)."""
    return any(k.startswith("optim.state.") for k in metadata.state_dict_metadata)
