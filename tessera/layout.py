"""The parallel layout as pure arithmetic: named axes, rank ↔ coordinates, and each group's members.

The dimensions, their order and their mesh axes come from the registry `tessera.axes.DIMS`. Rank order, outermost
to innermost: data, pipe, then the tensor axes. Tensor is innermost so that a tensor group (the chattiest) sits on
adjacent ranks, i.e. inside one node. For 2D tensor parallelism the q×q grid has two axes, ``TENSOR_ROW``
(coordinate i) and ``TENSOR_COL`` (coordinate j), with j innermost: device P_ij has rank offset i·q + j.

No torch here: the whole layout of any world size is computed and tested in one process, and the planner uses it."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.axes import DIMS, LAYOUT_FIELDS, Axis, dim_of, world_size

__all__ = ["Axis", "Layout", "default_ranks", "parse_ranks"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Sizes of the parallel axes, one field per shape of `tessera.axes.DIMS` (a dimension's alternative shapes,
    here 1D ``tp`` and the 2D grid side ``q``, may not both exceed 1)."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    q: int = 1

    def __post_init__(self) -> None:
        for name in LAYOUT_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} = {getattr(self, name)} must be at least 1")
        sizes = self.sizes
        for d in DIMS:
            d.shape(sizes)  # raises when two alternative shapes (1D tp and a 2D grid q) both exceed 1

    @classmethod
    def from_config(cls, parallel: object, world_size: int) -> Layout:
        """Build from a ``ParallelConfig`` (duck-typed) for this world size."""
        return cls(**parallel.layout_sizes(world_size))  # type: ignore[attr-defined]

    @property
    def sizes(self) -> dict[str, int]:
        """Field → size, for the registry's arithmetic."""
        return {f: getattr(self, f) for f in LAYOUT_FIELDS}

    @property
    def is_2d(self) -> bool:
        return self.q > 1

    def ranks(self, name: str) -> int:
        """Ranks in one group of the dimension ``name`` ("data", "pipe", "tensor": t for 1D, q² for 2D)."""
        return next(d for d in DIMS if d.name == name).ranks(self.sizes)

    def plan_sizes(self) -> dict[str, int]:
        """The cost model `Plan`'s size fields: each dimension's rank count (``tp`` = t or q²)."""
        sizes = self.sizes  # once: the planner's search asks for every layout it prices
        return {d.plan_field: d.ranks(sizes) for d in DIMS}

    @property
    def tensor_size(self) -> int:
        """Ranks in one tensor-parallel group: t for 1D, q² for 2D."""
        return self.ranks("tensor")

    @property
    def world_size(self) -> int:
        return world_size(self.sizes)

    @property
    def axes(self) -> tuple[Axis, ...]:
        """All axes, outermost first (size-1 axes included, so code never branches on which exist)."""
        return tuple(a for d in DIMS for a in d.axes(self.sizes))

    def size(self, axis: Axis) -> int:
        """The number of coordinates along ``axis`` (1 for an axis this layout does not use)."""
        for field, axes in dim_of(axis).shapes:
            if axis in axes:
                return getattr(self, field)
        raise AssertionError(axis)  # dim_of found the axis in one of these shapes

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

    def data_shard_groups(self, shard: int) -> list[list[int]]:
        """Hybrid sharding's shard groups: each data-parallel group cut into runs of ``shard`` consecutive data
        coordinates (the inner part of the data axis; with data outermost in rank order, e.g. the ranks of one
        node when ``shard`` data ranks fill it). Every group once, ordered by its smallest rank."""
        return sorted(g[i : i + shard] for g in self._data_groups(shard) for i in range(0, len(g), shard))

    def data_replica_groups(self, shard: int) -> list[list[int]]:
        """Hybrid sharding's replica groups: the ranks at the same position of every shard group of one
        data-parallel group (data coordinates equal modulo ``shard``), which hold the same ZeRO shard. Every group
        once, ordered by its smallest rank."""
        return sorted(g[i::shard] for g in self._data_groups(shard) for i in range(shard))

    def _data_groups(self, shard: int) -> list[list[int]]:
        if shard < 1 or self.dp % shard:
            raise ValueError(f"a ZeRO shard size of {shard} does not divide the data-parallel size {self.dp}")
        return self.all_groups(Axis.DATA)  # each in rank order, which is data-coordinate order

    def describe(self) -> str:
        parts = []
        for d in DIMS:
            field, axes = d.shape(self.sizes)
            n = getattr(self, field)
            parts.append(f"{d.key} {'2D ' + 'x'.join([str(n)] * len(axes)) if len(axes) > 1 else n}")
        return f"{' × '.join(parts)} = {self.world_size} ranks"


# The ranks `tessera dryrun` builds; here, without torch, so that a wrong --ranks is named before the dry run's
# imports (tessera/dryrun.py: torch, seconds).


def default_ranks(layout: Layout) -> list[int]:
    """The first and the last pipeline rank of the first replica (tensor coordinates 0)."""
    return sorted({layout.rank({Axis.PIPE: 0}), layout.rank({Axis.PIPE: layout.pp - 1})})


def parse_ranks(text: str | None, layout: Layout) -> list[int]:
    """``"0,127"`` → [0, 127]; None → `default_ranks`. Raises ValueError naming a bad entry."""
    if not text:
        return default_ranks(layout)
    out = []
    for item in text.split(","):
        if not item.strip().isdigit() or not 0 <= int(item) < layout.world_size:
            raise ValueError(
                f"--ranks entry {item!r} is not a rank of {layout.describe()}; "
                f"give comma-separated integers in 0..{layout.world_size - 1}"
            )
        out.append(int(item))
    return out
