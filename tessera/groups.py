"""The only module that creates torch.distributed process groups: one DeviceMesh built from the Layout, one mesh
axis per `tessera.axes.Axis` the layout uses (a new dimension needs nothing here: ``group(axis)`` reaches it).

Hybrid sharding (`parallel.zero_shard_size` s < data-parallel size) adds two subgroups of the data axis, whose
members `Layout.data_shard_groups` / `data_replica_groups` compute: ZeRO's shard group (s consecutive data ranks,
counted as "data_shard" in comm.STATS) and its replica group ("data_replicate"). The data axis's own group stays
what data sampling uses.

Context parallelism (`parallel.context` c > 1) adds the data × context group ("data_context" in comm.STATS):
the ranks that split one global batch's tokens, so the ones that average gradients and losses and that ZeRO
shards over (`Groups.batch`; docs/context-parallel.md). With c = 1 it is the data group itself."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.comm import name_group
from tessera.layout import Axis, Layout

__all__ = ["Groups", "build_groups"]


@dataclass(slots=True)
class Groups:
    """Process groups of one rank, by axis name. Passed explicitly to whatever communicates."""

    layout: Layout
    mesh: DeviceMesh
    rank: int
    shard: dist.ProcessGroup | None = None
    """Hybrid sharding's shard group; None: ZeRO shards over the whole data group."""
    replica: dist.ProcessGroup | None = None
    """Hybrid sharding's replica group (the ranks holding the same shard); None without hybrid sharding."""
    data_context: dist.ProcessGroup | None = None
    """The data × context group when context parallelism is on; None otherwise (`batch` is then the data group)."""

    def group(self, axis: Axis) -> dist.ProcessGroup:
        """The group of ranks that differ from this one only along ``axis``."""
        return self.mesh.get_group(axis.value)

    def coord(self, axis: Axis) -> int:
        return self.layout.coords(self.rank)[axis]

    @property
    def dp(self) -> dist.ProcessGroup:
        return self.group(Axis.DATA)

    @property
    def batch(self) -> dist.ProcessGroup:
        """The ranks that split one global batch's tokens: data × context. The one group gradients are averaged
        over (the bucketed all-reduce, ZeRO's reduce-scatter) and losses summed over; the data group without
        context parallelism."""
        return self.data_context if self.data_context is not None else self.dp

    @property
    def cp(self) -> dist.ProcessGroup:
        """The context-parallel group: the ranks holding the other chunks of this rank's sequences."""
        return self.group(Axis.CONTEXT)

    @property
    def zero_shard(self) -> dist.ProcessGroup:
        """The group ZeRO shards its state over: the shard group, or the whole `batch` group (data × context)."""
        return self.shard if self.shard is not None else self.batch

    @property
    def pp(self) -> dist.ProcessGroup:
        return self.group(Axis.PIPE)

    @property
    def tp(self) -> dist.ProcessGroup:
        return self.group(Axis.TENSOR)

    @property
    def same_row(self) -> dist.ProcessGroup:
        """The ranks of P_ij's grid row: same row i, every column j (Optimus's row group; the group along
        TENSOR_COL, whose coordinate j is this rank's index in it)."""
        return self.group(Axis.TENSOR_COL)

    @property
    def same_col(self) -> dist.ProcessGroup:
        """The ranks of P_ij's grid column: same column j, every row i (Optimus's column group; the group along
        TENSOR_ROW, whose coordinate i is this rank's index in it)."""
        return self.group(Axis.TENSOR_ROW)


def build_groups(layout: Layout, device_type: str = "cpu", zero_shard: int | None = None) -> Groups:
    """Create the DeviceMesh for ``layout`` (collective: every rank must call it); with ``zero_shard`` below the
    data-parallel size also hybrid sharding's shard and replica groups (`ExecutionPlan.zero_shard`)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "build_groups needs torch.distributed initialised; run under torchrun or tessera train"
        )
    world = dist.get_world_size()
    if world != layout.world_size:
        raise RuntimeError(
            f"layout {layout.describe()} needs {layout.world_size} ranks, but world size is {world}"
        )
    names = tuple(a.value for a in layout.axes)
    with unset_fake_temporarily():  # the mesh's rank table holds real ranks even inside a dry run's fake mode
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=names)
    for name in names:
        name_group(mesh.get_group(name), name)
    groups = Groups(layout=layout, mesh=mesh, rank=dist.get_rank())
    if layout.cp > 1:
        groups.data_context = _subgroup(layout.all_groups(Axis.DATA, Axis.CONTEXT), "data_context")
    if zero_shard is not None and zero_shard < layout.dp:
        members = layout.data_shard_groups(zero_shard)
        if groups.rank == 0:
            _warn_if_straddling(layout, zero_shard, members)
        groups.shard = _subgroup(members, "data_shard")
        groups.replica = _subgroup(layout.data_replica_groups(zero_shard), "data_replicate")
    return groups


def _warn_if_straddling(layout: Layout, zero_shard: int, members: list[list[int]]) -> None:
    """Warn (rank 0, once per run: groups are built once) when hybrid sharding's shard groups straddle nodes of
    LOCAL_WORLD_SIZE ranks (torchrun's and `tessera train --nproc`'s ranks per node; unset: nothing is known).
    A warning, not a refusal: the run is correct, only its gathers are slower than the size suggests, and a
    group over several whole nodes (MiCS's partition group) is a legitimate choice that passes."""
    per_node = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not per_node.isdigit() or int(per_node) < 1:
        return
    message = layout.shard_placement_warning(zero_shard, int(per_node), members)
    if message:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _subgroup(members: list[list[int]], name: str) -> dist.ProcessGroup:
    """Create every group of ``members`` (each rank creates all of them, in the same order: torch requires it)
    and return the one holding this rank, named ``name`` for comm.STATS."""
    with unset_fake_temporarily():
        mine, _ = dist.new_subgroups_by_enumeration(members)
    assert mine is not None  # the groups tile the world: every rank is in one
    name_group(mine, name)
    return mine
