"""The only module that creates torch.distributed process groups: one DeviceMesh built from the Layout, one mesh
axis per `tessera.axes.Axis` the layout uses (a new dimension needs nothing here: ``group(axis)`` reaches it)."""

from __future__ import annotations

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

    def group(self, axis: Axis) -> dist.ProcessGroup:
        """The group of ranks that differ from this one only along ``axis``."""
        return self.mesh.get_group(axis.value)

    def coord(self, axis: Axis) -> int:
        return self.layout.coords(self.rank)[axis]

    @property
    def dp(self) -> dist.ProcessGroup:
        return self.group(Axis.DATA)

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


def build_groups(layout: Layout, device_type: str = "cpu") -> Groups:
    """Create the DeviceMesh for ``layout`` (collective: every rank must call it)."""
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
    return Groups(layout=layout, mesh=mesh, rank=dist.get_rank())
