"""The registry of parallel dimensions (tessera.axes) agrees with every class that holds a dimension's size, so a
dimension added to the registry but not to one of them (or the reverse) fails here, not in a run."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.axes import DIMS, LAYOUT_FIELDS, RANK_ORDER, Axis, dim_of
from tessera.config import ParallelConfig
from tessera.dryrun import _AXIS_OF_GROUP
from tessera.layout import Layout
from tessera.planner.cost import Plan
from tessera.planner.network import TESSERA_ORDER


def test_every_size_holder_has_exactly_the_registry_dimensions() -> None:
    assert tuple(f.name for f in dataclasses.fields(Layout)) == LAYOUT_FIELDS
    plan_fields = {f.name for f in dataclasses.fields(Plan)}
    config_keys = {f.name for f in dataclasses.fields(ParallelConfig)}
    for d in DIMS:
        assert d.plan_field in plan_fields, f"cost Plan has no field {d.plan_field!r} for dimension {d.name}"
        assert d.key in config_keys, f"ParallelConfig has no key {d.key!r} for dimension {d.name}"


def test_every_mesh_axis_belongs_to_one_dimension() -> None:
    owners = {a: [d.name for d in DIMS for _, axes in d.shapes if a in axes] for a in Axis}
    assert all(len(names) == 1 for names in owners.values()), owners
    assert {a: dim_of(a).name for a in Axis} == {Axis(a): n for a, n in _AXIS_OF_GROUP.items()}
    assert TESSERA_ORDER == RANK_ORDER == ("data", "pipe", "context", "tensor")


@pytest.mark.parametrize(
    ("tensor", "world", "expected"),
    [(1, 8, Layout(dp=8)), (2, 8, Layout(dp=4, tp=2)), ("2x2", 8, Layout(dp=2, q=2)), (4, 4, Layout(tp=4))],
)
def test_config_sizes_through_the_registry(tensor: int | str, world: int, expected: Layout) -> None:
    parallel = ParallelConfig(tensor=tensor)
    layout = Layout.from_config(parallel, world)
    assert layout == expected
    assert layout.world_size == world
    assert parallel.data_size(world) == expected.dp


def test_plan_sizes_are_rank_counts() -> None:
    layout = Layout(dp=2, pp=3, q=2)
    plan = Plan(**layout.plan_sizes(), tp_kind="2d")
    assert layout.plan_sizes() == {"dp": 2, "pp": 3, "cp": 1, "tp": 4}
    assert plan.sizes() == {"data": 2, "pipe": 3, "context": 1, "tensor": 4}
    assert plan.world_size == layout.world_size == 24
    assert layout.describe() == "data 2 × pipeline 3 × tensor 2D 2x2 = 24 ranks"


def test_alternative_shapes_are_exclusive() -> None:
    with pytest.raises(ValueError, match=r"cannot combine tp = 2 and q = 2"):
        Layout(tp=2, q=2)
    with pytest.raises(ValueError, match="no dimension"):
        dim_of("expert")  # type: ignore[arg-type]
