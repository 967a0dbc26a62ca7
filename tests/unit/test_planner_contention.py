"""Compute slowed under overlapped data-parallel collectives (`Hardware.overlap_slowdown`, `steptime.dp_cost`)
and FSDP's gather unit (`mosaic_table.fsdp_units`), against hand-computed cases."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.errors import ConfigError
from tessera.planner.cost import ModelShape, Plan, params_per_rank
from tessera.planner.hardware import load_hardware
from tessera.planner.mosaic_table import FSDP_SCHEDULE, FsdpRow, fsdp_plan, fsdp_units, mpt_shape
from tessera.planner.steptime import dp_cost, dp_parts, fast_step

A100 = load_hardware("a100-80gb")


def test_hidden_seconds_slow_the_compute_under_them() -> None:
    hw = dataclasses.replace(A100, overlap_slowdown=0.2)
    # both transfers finish by the end (0 → 1 → 2 ≤ 3): 2 s hidden, 0.4 s of slower compute
    assert dp_cost([(0.0, 1.0), (0.5, 1.0)], end=3.0, hw=hw) == pytest.approx(0.4)
    # 2 → 3 → 4: 1 s past the end, 1 s hidden
    assert dp_cost([(2.0, 1.0), (2.5, 1.0)], end=3.0, hw=hw) == pytest.approx(1.0 + 0.2)
    assert dp_cost([], end=1.0, hw=hw) == 0.0
    free = dataclasses.replace(A100, overlap_slowdown=0.0)
    assert dp_cost([(2.0, 1.0), (2.5, 1.0)], end=3.0, hw=free) == pytest.approx(1.0)


def test_step_pays_the_slowdown_on_the_hidden_reduction() -> None:
    """Plain data parallelism, one micro-batch, 8 layers: the all-reduce R is released in 8 per-layer pieces
    under the backward (each fits), so R/8 is exposed and the hidden 7R/8 adds 7R/8 × slowdown."""
    shape = ModelShape(
        n_layers=8, d_model=2048, n_heads=16, n_kv_heads=16, ffn_hidden=8192, vocab_size=32000, seq_len=2048
    )
    plan = Plan(dp=64, flash_attention=True, accumulation="depth_first")
    reduce, _ = dp_parts(params_per_rank(shape, plan, 0), A100, plan, buckets=8)
    free = fast_step(shape, dataclasses.replace(A100, overlap_slowdown=0.0), plan, "1f1b")
    slowed = fast_step(shape, A100, plan, "1f1b")
    assert free.dp_comm == pytest.approx(reduce / 8)
    assert slowed.dp_comm - free.dp_comm == pytest.approx(A100.overlap_slowdown * reduce * 7 / 8)


@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_overlap_slowdown_out_of_range_is_a_clear_error(value: float) -> None:
    with pytest.raises(ConfigError, match="overlap_slowdown"):
        dataclasses.replace(A100, overlap_slowdown=value)


def test_shipped_gpu_files_carry_the_published_slowdown() -> None:
    for name in ("a100-40gb", "a100-80gb", "h100", "h200"):
        assert load_hardware(name).overlap_slowdown == pytest.approx(0.189), name


def test_fsdp_exposes_one_blocks_first_gather() -> None:
    """FSDP gathers one block just before it runs: on a compute-bound row the step exposes the first block's
    gather, 1/(2·L·m) of the step's gathers (forward and backward, every micro-batch), not the whole model's,
    and the last block's reduce-scatter, 1/(L·m) of the step's (nothing computes after it)."""
    row = FsdpRow("a100-80gb", "70b", 2048, 64, 8, 4, True, 410, 53.33, 64862437376)
    shape, plan = mpt_shape(row), fsdp_units(mpt_shape(row), fsdp_plan(row))
    assert plan.virtual_stages == shape.n_layers
    hw = dataclasses.replace(A100, overlap_slowdown=0.0)
    reduce, gather = dp_parts(params_per_rank(shape, plan, 0), hw, plan, buckets=shape.n_layers)
    blocks = shape.n_layers * row.accumulation
    step = fast_step(shape, hw, plan, FSDP_SCHEDULE)
    assert step.dp_comm == pytest.approx(gather / (2 * blocks) + reduce / blocks, rel=1e-6)
