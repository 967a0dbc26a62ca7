"""The parallel layout as pure arithmetic: named axes, rank ↔ coordinates, and each group's members.

The dimensions, their order and their mesh axes come from the registry `tessera.axes.DIMS`. Rank order, outermost
to innermost: data, pipe, context, then the tensor axes. Tensor is innermost so that a tensor group (the chattiest) sits on
adjacent ranks, i.e. inside one node. For 2D tensor parallelism the q×q grid has two axes, ``TENSOR_ROW``
(coordinate i) and ``TENSOR_COL`` (coordinate j), with j innermost: device P_ij has rank offset i·q + j.

No torch here: the whole layout of any world size is computed and tested in one process, and the planner uses it."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.axes import DIMS, LAYOUT_FIELDS, Axis, dim_of, world_size

__all__ = ["Axis", "Layout", "default_ranks", "parse_ranks", "straddling_group"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Sizes of the parallel axes, one field per shape of `tessera.axes.DIMS` (a dimension's alternative shapes,
    here 1D ``tp`` and the 2D grid side ``q``, may not both exceed 1)."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    """Context-parallel size c (`docs/context-parallel.md`): between pipe and tensor, in rank order too."""
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
    def batch_ranks(self) -> int:
        """Ranks that split one global batch's tokens and average its gradients: data × context (each context
        rank holds 1/c of every sequence of its data rank's samples; docs/context-parallel.md)."""
        return self.dp * self.cp

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
        """Every group along ``axes``, each listed once, ordered by its smallest rank.

        One pass over the ranks, keyed by the coordinates off ``axes`` (a group is the ranks sharing them): linear
        in the world size. Listing each rank's `group_members` was world × group size (105 s for the data groups
        of 2048 data-parallel ranks, paid by `tessera.groups.build_groups` at every hybrid-sharded start-up)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        # ranks ascending: each group in rank order, and first seen at its smallest rank
        for r in range(self.world_size):
            key = tuple(c for a, c in self.coords(r).items() if a not in axes)
            groups.setdefault(key, []).append(r)
        return list(groups.values())

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

    def shard_groups_straddling(self, shard: int, gpus_per_node: int) -> list[int] | None:
        """The first of hybrid sharding's shard groups (`data_shard_groups`) that straddles a node boundary on
        nodes of ``gpus_per_node`` consecutive ranks, or None when they tile nodes (`straddling_group`)."""
        return straddling_group(self.data_shard_groups(shard), gpus_per_node)

    def node_tiling_shard_sizes(self, gpus_per_node: int) -> list[int]:
        """The shard sizes s ≥ 2 that divide the data-parallel size and whose shard groups tile nodes: what to
        suggest instead of one that straddles."""
        return [
            s
            for s in range(2, self.dp + 1)
            if self.dp % s == 0 and self.shard_groups_straddling(s, gpus_per_node) is None
        ]

    def shard_placement_warning(
        self, shard: int, gpus_per_node: int, groups: list[list[int]] | None = None
    ) -> str | None:
        """What is wrong with hybrid sharding's shard size ``shard`` on nodes of ``gpus_per_node`` ranks, and the
        fix, or None when its shard groups tile nodes. ``groups``: `data_shard_groups(shard)`, when computed."""
        group = straddling_group(groups or self.data_shard_groups(shard), gpus_per_node)
        if group is None:
            return None
        nodes = sorted({r // gpus_per_node for r in group})
        held = ", ".join(f"{sum(r // gpus_per_node == n for r in group)} on node {n}" for n in nodes)
        fits = self.node_tiling_shard_sizes(gpus_per_node)
        return (
            f"parallel.zero_shard_size = {shard} straddles nodes of {gpus_per_node} GPUs ({self.describe()}): "
            f"the shard group of ranks {_ranks_text(group)} holds {held}, sharing a node with another shard "
            "group, so its ZeRO all-gathers and reduce-scatters run at inter-node speed on NICs the other group "
            "also uses. "
            + (
                f"Set parallel.zero_shard_size to a size whose shard groups tile whole nodes: one of {fits}"
                if fits
                else f"No shard size tiles these nodes: use a world size of whole {gpus_per_node}-GPU nodes"
            )
        )

    def describe(self) -> str:
        parts = []
        for d in DIMS:
            field, axes = d.shape(self.sizes)
            n = getattr(self, field)
            if d.quiet and n == 1:
                continue
            parts.append(f"{d.key} {'2D ' + 'x'.join([str(n)] * len(axes)) if len(axes) > 1 else n}")
        return f"{' × '.join(parts)} = {self.world_size} ranks"


def straddling_group(groups: list[list[int]], gpus_per_node: int) -> list[int] | None:
    """The first group of ``groups`` (disjoint rank lists) that straddles a node boundary on nodes of
    ``gpus_per_node`` consecutive ranks, or None when they tile nodes.

    Groups tile nodes when every node a group touches is touched only by groups spanning the same nodes: inside
    one node (collectives on NVLink), or over whole nodes that no group with other nodes overlaps (16 data ranks
    on two 8-GPU nodes; one rank per node when tensor × pipeline fill a node). A group of 12 on 8-GPU nodes
    covers one node and half of the next, which it shares with the next group: its ring crosses the network where
    a group within the node would not, on NICs another group also loads."""
    span_of_node: dict[int, frozenset[int]] = {}
    for g in groups:
        span = frozenset(r // gpus_per_node for r in g)
        for node in span:
            if span_of_node.setdefault(node, span) != span:
                return g
    return None


def _ranks_text(ranks: list[int]) -> str:
    """``0-11`` for a run of consecutive ranks, else the list (its first 8 and the count)."""
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks[:8])) + (f", … ({len(ranks)} ranks)" if len(ranks) > 8 else "")


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
