"""The levelled network model against hand-computed cases: inside a node, across 2 nodes, across 1024 nodes."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.layout import Axis, Layout
from tessera.planner.cost import Plan, dp_time, group_placement
from tessera.planner.network import (
    TESSERA_ORDER,
    Placement,
    axis_stride,
    bus_bandwidth,
    collective_time,
    placement,
)
from tests.planner_hardware import LEVELS as HW

REL = 1e-9


def test_placement_counts_nodes_and_members_per_node() -> None:
    assert placement(8, 1, 8) == Placement(ranks=8, nodes=1, per_node=8)
    assert placement(16, 1, 8) == Placement(ranks=16, nodes=2, per_node=8)
    assert placement(4, 2, 8) == Placement(ranks=4, nodes=1, per_node=4)
    assert placement(16, 2, 8) == Placement(ranks=16, nodes=4, per_node=4)
    assert placement(1024, 8, 8) == Placement(ranks=1024, nodes=1024, per_node=1)


def test_all_reduce_inside_one_node_is_the_nvlink_ring() -> None:
    # 2·7/8·1e8 B / 100 GB/s + 14 hops × 1 µs
    assert collective_time(HW, "all_reduce", 1e8, placement(8, 1, 8)) == pytest.approx(
        1.75e-3 + 14e-6, rel=REL
    )


def test_all_reduce_over_two_full_nodes() -> None:
    pl = placement(16, 1, 8)
    assert bus_bandwidth(HW, pl) == 80e9  # 8 NIC shares of 10 GB/s, below NVLink
    # ring: 2·15/16·1e8 / 80e9 + (30 − 2) intra hops × 1 µs + 2 node crossings × 10 µs = 2.34375e-3 + 48e-6
    # tree: 2·1e8 / (0.9·80e9) + 2·(7 × 1 µs + 1 × 10 µs) = 2.7778e-3 + 34e-6 → the ring wins
    assert collective_time(HW, "all_reduce", 1e8, pl) == pytest.approx(2.34375e-3 + 48e-6, rel=REL)


def test_all_reduce_over_1024_nodes_picks_the_tree_when_small_and_the_ring_when_large() -> None:
    pl = placement(8192, 1, 8)
    ring_latency = (2 * 8191 - 2 * 1023) * 1e-6 + 2 * 1023 * 1e-5  # 34.796 ms of hops
    tree_latency = 2 * (7 * 1e-6 + 10 * 1e-5)  # ⌈log2 1024⌉ = 10 levels across nodes
    small, large = 1e6, 1e11
    assert collective_time(HW, "all_reduce", small, pl) == pytest.approx(
        2 * small / (0.9 * 80e9) + tree_latency, rel=REL
    )
    assert collective_time(HW, "all_reduce", large, pl) == pytest.approx(
        2 * 8191 / 8192 * large / 80e9 + ring_latency, rel=REL
    )


def test_reduce_scatter_with_one_rank_per_node_runs_at_the_nic_share() -> None:
    pl = placement(1024, 8, 8)  # a data group of stride 8 over 1024 nodes
    assert collective_time(HW, "reduce_scatter", 1e9, pl) == pytest.approx(
        1023 / 1024 * 1e9 / 10e9 + 1023 * 1e-5, rel=REL
    )
    assert collective_time(HW, "all_gather", 1e9, pl) == collective_time(HW, "reduce_scatter", 1e9, pl)


def test_oversubscribed_fabric_divides_the_nic_share_beyond_one_pod() -> None:
    hw = dataclasses.replace(HW, pod_gpus=64, oversubscription=4.0)
    assert bus_bandwidth(hw, placement(8, 8, 8)) == 10e9  # 8 nodes = 64 GPUs: inside the pod
    assert bus_bandwidth(hw, placement(16, 8, 8)) == 10e9 / 4


def test_plan_placement_follows_the_layout_rank_order() -> None:
    layout = Layout(dp=4, pp=2, tp=8)
    plan = Plan(dp=4, pp=2, tp=8, rank_order=TESSERA_ORDER)
    data = layout.group_members(0, Axis.DATA)
    pipe = layout.group_members(0, Axis.PIPE)
    sizes = {"data": 4, "pipe": 2, "tensor": 8}
    assert axis_stride(TESSERA_ORDER, sizes, "data") == data[1] - data[0] == 16
    assert axis_stride(TESSERA_ORDER, sizes, "pipe") == pipe[1] - pipe[0] == 8
    assert group_placement(HW, plan, "data") == Placement(ranks=4, nodes=4, per_node=1)
    assert group_placement(HW, plan, "tensor") == Placement(ranks=8, nodes=1, per_node=8)
    # Megatron's order (the default) puts data inside pipeline: the data group strides t = 8.
    assert group_placement(HW, Plan(dp=4, pp=2, tp=2), "data") == Placement(ranks=4, nodes=1, per_node=4)


def test_unknown_collective_and_axis_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time(HW, "all_to_all", 1.0, placement(2, 1, 8))
    with pytest.raises(ValueError, match="axis must be"):
        group_placement(HW, Plan(dp=2), "expert")


def test_data_parallel_all_reduce_over_1024_nodes_uses_the_tree() -> None:
    # d = 1024 with t = 8 in tessera's order: the data group strides 8, one rank per node on 1024 nodes.
    plan = Plan(dp=1024, tp=8, rank_order=TESSERA_ORDER)
    grads = 1e6 * 2  # 1M bf16 gradients
    ring = 2 * 1023 / 1024 * grads / 10e9 + 2 * 1023 * 1e-5  # 20.5 ms of network hops
    tree = 2 * grads / (0.9 * 10e9) + 2 * (0 * 1e-6 + 10 * 1e-5)
    assert tree < ring
    assert dp_time(1e6, HW, plan) == pytest.approx(tree, rel=REL)
