"""Layout arithmetic for many world sizes, in one process."""

from __future__ import annotations

import itertools

import pytest

from tessera.layout import Axis, Layout

LAYOUTS = [
    Layout(dp=d, pp=p, tp=t, q=q)
    for d, p in itertools.product([1, 2, 3, 4], [1, 2, 4])
    for t, q in [(1, 1), (2, 1), (4, 1), (1, 2), (1, 3)]
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_rank_coords_round_trip(layout: Layout) -> None:
    seen = set()
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert layout.rank(c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == layout.world_size


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_groups_partition_the_world(layout: Layout) -> None:
    for axes in [(a,) for a in layout.axes] + [tuple(a for a in layout.axes if a.value.startswith("tensor"))]:
        groups = layout.all_groups(*axes)
        size = 1
        for a in axes:
            size *= layout.size(a)
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_all_groups_lists_each_ranks_group_once_by_smallest_rank(layout: Layout) -> None:
    """`all_groups` (one pass keyed by the other coordinates) is, for every set of axes, each rank's
    `group_members` listed once in order of its smallest rank: the definition it replaced (world × group size)."""
    for n in range(len(layout.axes) + 1):
        for axes in itertools.combinations(layout.axes, n):
            by_rank: dict[tuple[int, ...], None] = {}
            for r in range(layout.world_size):
                by_rank.setdefault(tuple(layout.group_members(r, *axes)), None)
            assert layout.all_groups(*axes) == [list(g) for g in by_rank], axes


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_tensor_axes_are_innermost(layout: Layout) -> None:
    tensor_axes = [a for a in layout.axes if a.value.startswith("tensor")]
    for g in layout.all_groups(*tensor_axes):
        assert g == list(range(g[0], g[0] + layout.tensor_size))


def test_2d_row_and_column_groups() -> None:
    lay = Layout(dp=2, q=3)
    # rank 4 is P_11 of the first replica: rows are contiguous, columns strided by q
    assert lay.coords(4) == {
        Axis.DATA: 0,
        Axis.PIPE: 0,
        Axis.CONTEXT: 0,
        Axis.TENSOR_ROW: 1,
        Axis.TENSOR_COL: 1,
    }
    assert lay.group_members(4, Axis.TENSOR_COL) == [3, 4, 5]  # row group: same i
    assert lay.group_members(4, Axis.TENSOR_ROW) == [1, 4, 7]  # column group: same j
    assert lay.group_members(4, Axis.DATA) == [4, 13]


def test_data_is_outermost() -> None:
    lay = Layout(dp=2, pp=2, tp=2)
    assert lay.group_members(0, Axis.DATA) == [0, 4]
    assert lay.group_members(0, Axis.PIPE) == [0, 2]
    assert lay.group_members(0, Axis.TENSOR) == [0, 1]


def test_invalid_layouts() -> None:
    with pytest.raises(ValueError, match="cannot combine"):
        Layout(tp=2, q=2)
    with pytest.raises(ValueError, match="at least 1"):
        Layout(dp=0)
    with pytest.raises(ValueError, match="outside world size"):
        Layout(dp=2).coords(2)
