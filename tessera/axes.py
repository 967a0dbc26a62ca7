"""The registry of parallel dimensions: each is named once here, and everything generic about it follows.

A *dimension* is one way the ranks are split (data, pipeline, context, tensor). It has a name (used in a cost model rank
order, for group placement and in traffic tables), a `[parallel]` config key, and one or more *shapes*: a size
field of `tessera.layout.Layout` and the mesh axes (`Axis`) that field spans, each of that size. The tensor
dimension has two shapes, Megatron 1D (field ``tp``, one axis) and the Optimus 2D grid (field ``q``, two axes of
size q); at most one of a dimension's shapes exceeds 1, and a dimension whose sizes are all 1 takes its first.
Its rank count is size^(number of axes): t for 1D, q² for 2D.

`DIMS` lists the dimensions in rank order, outermost first (tensor innermost, so the chattiest group sits on
adjacent ranks, inside one node). From it, and nowhere else: the Layout's axes, sizes, world size and
description, the DeviceMesh (`tessera.groups`), the config's data size and world-size rule, the cost model's
rank order, per-dimension sizes and group placement, and the dry run's traffic tables. docs/architecture.md
lists the places a new dimension touches. (torchtitan's ``ParallelDims`` keeps its degrees and mesh names
together in the same spirit.)

No imports beyond the standard library: config, layout, planner and sim all read it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["DIMS", "LAYOUT_FIELDS", "RANK_ORDER", "Axis", "Dim", "dim_of", "world_size"]


class Axis(StrEnum):
    """A mesh axis. "axis" always means a mesh axis; "dim" means a tensor dimension."""

    DATA = "data"
    PIPE = "pipe"
    CONTEXT = "context"  # context parallelism: the sequence of each micro-batch split over its ranks
    TENSOR = "tensor"  # Megatron 1D
    TENSOR_ROW = "tensor_row"  # Optimus 2D: the grid row index i (its group: one grid column, same j)
    TENSOR_COL = "tensor_col"  # Optimus 2D: the grid column index j (its group: one grid row, same i)


@dataclass(frozen=True, slots=True)
class Dim:
    """One parallel dimension (see the module docstring)."""

    name: str
    """Its name in a rank order, in the cost model's group placement and in traffic tables."""
    key: str
    """Its `[parallel]` config key, also the word for it in messages ("pipeline")."""
    shapes: tuple[tuple[str, tuple[Axis, ...]], ...]
    """(Layout size field, the mesh axes it spans) per alternative shape; the first is the default. The first
    field is also the cost model `Plan`'s attribute for the dimension's rank count."""
    quiet: bool = False
    """Left out of layout descriptions and messages at size 1 (context: most runs never use it, and every
    message naming a layout would otherwise grow "context 1")."""

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f for f, _ in self.shapes)

    @property
    def plan_field(self) -> str:
        """The cost model `Plan` attribute holding this dimension's rank count."""
        return self.shapes[0][0]

    def shape(self, sizes: Mapping[str, int]) -> tuple[str, tuple[Axis, ...]]:
        """The shape in use: the one whose size exceeds 1, else the first. ``sizes``: Layout field → size."""
        used = [s for s in self.shapes if sizes.get(s[0], 1) > 1]
        if len(used) > 1:
            raise ValueError(
                f"Layout cannot combine {' and '.join(f'{f} = {sizes[f]}' for f, _ in used)}: the {self.key} "
                f"dimension takes one shape of {', '.join(self.fields)}"
            )
        return used[0] if used else self.shapes[0]

    def axes(self, sizes: Mapping[str, int]) -> tuple[Axis, ...]:
        return self.shape(sizes)[1]

    def ranks(self, sizes: Mapping[str, int]) -> int:
        """Ranks in one group of this dimension: size^(axes spanned)."""
        field, axes = self.shape(sizes)
        return sizes.get(field, 1) ** len(axes)


DIMS: tuple[Dim, ...] = (
    Dim(name="data", key="data", shapes=(("dp", (Axis.DATA,)),)),
    Dim(name="pipe", key="pipeline", shapes=(("pp", (Axis.PIPE,)),)),
    Dim(name="context", key="context", shapes=(("cp", (Axis.CONTEXT,)),), quiet=True),
    Dim(
        name="tensor",
        key="tensor",
        shapes=(("tp", (Axis.TENSOR,)), ("q", (Axis.TENSOR_ROW, Axis.TENSOR_COL))),
    ),
)
"""Every parallel dimension, in rank order (outermost first)."""

LAYOUT_FIELDS: tuple[str, ...] = tuple(f for d in DIMS for f in d.fields)
"""The size fields of `tessera.layout.Layout`, in registry order."""

RANK_ORDER: tuple[str, ...] = tuple(d.name for d in DIMS)
"""Dimension names outermost first as tessera lays out ranks (the cost model's `TESSERA_ORDER`)."""


def dim_of(axis: Axis) -> Dim:
    """The dimension a mesh axis belongs to (e.g. TENSOR_COL → tensor)."""
    for d in DIMS:
        if any(axis in axes for _, axes in d.shapes):
            return d
    raise ValueError(f"mesh axis {axis!r} belongs to no dimension of tessera.axes.DIMS")


def world_size(sizes: Mapping[str, int]) -> int:
    """Ranks of a layout with these field sizes: the product of every dimension's rank count."""
    return math.prod(d.ranks(sizes) for d in DIMS)
