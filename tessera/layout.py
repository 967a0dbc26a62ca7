"""The parallel layout as pure arithmetic: named axes, rank ↔ coordinates, and each group's members.

Rank order, outermost to innermost: data, pipe, then the tensor axes. Tensor is innermost so that a tensor group
(the chattiest) sits on adjacent ranks, i.e. inside one node. For 2D tensor parallelism the q×q grid has two axes,
``TENSOR_ROW`` (coordinate i) and ``TENSOR_COL`` (coordinate j), with j innermost: device P_ij has rank offset i·q + j.

No torch here: the whole layout of any world size is computed and tested in one process, and the planner uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Axis", "Layout"]


class Axis(StrEnum):
    """A mesh axis. "axis" always means a mesh axis; "dim" means a tensor dimension."""

    DATA = "data"
    PIPE = "pipe"
    TENSOR = "tensor"  # Megatron 1D
    TENSOR_ROW = "tensor_row"  # Optimus 2D: the grid row index i
    TENSOR_COL = "tensor_col"  # Optimus 2D: the grid column index j


@dataclass(frozen=True, slots=True)
class Layout:
    """Sizes of the parallel axes. Exactly one of ``tp`` (1D) and ``q`` (2D grid side) may exceed 1."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    q: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "q"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} = {getattr(self, name)} must be at least 1")
        if self.tp > 1 and self.q > 1:
            raise ValueError(
                f"Layout cannot combine 1D tensor size {self.tp} with a 2D grid {self.q}x{self.q}"
            )

    @classmethod
    def from_config(cls, parallel: object, world_size: int) -> Layout:
        """Build from a ``ParallelConfig`` (duck-typed) for this world size."""
        t, q = parallel.tensor_shape()  # type: ignore[attr-defined]
        return cls(dp=parallel.data_size(world_size), pp=parallel.pipeline, tp=t, q=q)  # type: ignore[attr-defined]

    @property
    def is_2d(self) -> bool:
        return self.q > 1

    @property
    def tensor_size(self) -> int:
        """Ranks in one tensor-parallel group: t for 1D, q² for 2D."""
        return self.tp * self.q * self.q

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tensor_size

    @property
    def axes(self) -> tuple[Axis, ...]:
        """All axes, outermost first (size-1 axes included, so code never branches on which exist)."""
        tensor = (Axis.TENSOR_ROW, Axis.TENSOR_COL) if self.is_2d else (Axis.TENSOR,)
        return (Axis.DATA, Axis.PIPE, *tensor)

    def size(self, axis: Axis) -> int:
        """The number of coordinates along ``axis`` (1 for an axis this layout does not use)."""
        return {
            Axis.DATA: self.dp,
            Axis.PIPE: self.pp,
            Axis.TENSOR: self.tp,
            Axis.TENSOR_ROW: self.q,
            Axis.TENSOR_COL: self.q,
        }[axis]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.size(a) for a in self.axes)

    def coords(self, rank: int) -> dict[Axis, int]:
        """Coordinates of ``rank`` along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        out: dict[Axis, int] = {}
        for axis in reversed(self.axes):
            rank, out[axis] = divmod(rank, self.size(axis))
        return {a: out[a] for a in self.axes}

    def rank(self, coords: dict[Axis, int]) -> int:
        """The rank at ``coords``; missing axes count as coordinate 0."""
        r = 0
        for axis in self.axes:
            c = coords.get(axis, 0)
            if not 0 <= c < self.size(axis):
                raise ValueError(f"coordinate {axis}={c} is outside its size {self.size(axis)}")
            r = r * self.size(axis) + c
        return r

    def group_members(self, rank: int, *axes: Axis) -> list[int]:
        """Ranks that share every coordinate of ``rank`` except along ``axes`` (rank order).

        With two axes, e.g. ``(TENSOR_ROW, TENSOR_COL)``, this is the whole 2D tensor group. In Optimus terms the
        *row group* of P_ij (same i, every j) is ``group_members(rank, Axis.TENSOR_COL)`` and its *column group*
        (same j, every i) is ``group_members(rank, Axis.TENSOR_ROW)``.
        """
        base = self.coords(rank)
        members = [base]
        for axis in axes:
            members = [{**c, axis: k} for c in members for k in range(self.size(axis))]
        return sorted(self.rank(c) for c in members)

    def all_groups(self, *axes: Axis) -> list[list[int]]:
        """Every group along ``axes``, each listed once, ordered by its smallest rank."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(tuple(self.group_members(r, *axes)), None)
        return [list(g) for g in seen]

    def describe(self) -> str:
        tensor = f"tensor 2D {self.q}x{self.q}" if self.is_2d else f"tensor {self.tp}"
        return f"data {self.dp} × pipeline {self.pp} × {tensor} = {self.world_size} ranks"
