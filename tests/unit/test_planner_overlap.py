"""What the step-time model leaves exposed: ZeRO-1/2's parameter all-gather inside the optimizer step, ZeRO-3's
first gather, clipping's norm all-reduce."""

from __future__ import annotations

import pytest

from tessera.planner.cost import ModelShape, Plan
from tessera.planner.network import TESSERA_ORDER
from tessera.planner.steptime import clip_norm_time, dp_parts, fast_step, simulate_step
from tests.planner_hardware import LEVELS as HW

REL = 1e-9
GPT = ModelShape(
    n_layers=8, d_model=2048, n_heads=16, n_kv_heads=16, ffn_hidden=8192, vocab_size=32000, seq_len=2048
)


def test_clipping_norm_is_one_small_all_reduce_over_the_world() -> None:
    # 16 ranks on 2 nodes, 4 bytes: the tree wins: 2·4 B / (0.9 × 80 GB/s) + 2·(7 × 1 µs + 1 × 10 µs)
    plan = Plan(dp=2, tp=8)
    assert clip_norm_time(HW, plan) == pytest.approx(8 / (0.9 * 80e9) + 2 * (7e-6 + 1e-5), rel=REL)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_2_parameter_gather_is_exposed_after_the_update(zero: int) -> None:
    plan = Plan(dp=8, tp=8, zero_stage=zero, n_microbatches=4, rank_order=TESSERA_ORDER, flash_attention=True)
    _, gather = dp_parts(GPT.n_layers * GPT.layer_params() / 8, HW, plan, buckets=GPT.n_layers)
    assert gather > 0
    for bd in (fast_step(GPT, HW, plan, "1f1b"), simulate_step(GPT, HW, plan, "1f1b")[0]):
        assert bd.dp_comm >= gather * (1 - REL)


def test_zero_3_first_gather_is_exposed() -> None:
    plan = Plan(
        dp=8,
        tp=8,
        zero_stage=3,
        n_microbatches=4,
        virtual_stages=8,
        accumulation="layered",
        rank_order=TESSERA_ORDER,
        flash_attention=True,
    )
    _, gather = dp_parts(GPT.n_layers * GPT.layer_params() / 8, HW, plan, buckets=GPT.n_layers)
    first = gather / (2 * plan.virtual_stages)  # one chunk's gather of the 2·v per step
    assert fast_step(GPT, HW, plan, "breadth_first").dp_comm >= first * (1 - REL)


@pytest.mark.parametrize("zero", [2, 3])
def test_depth_first_per_microbatch_reduction_fast_matches_simulator(zero: int) -> None:
    """FSDP-style ZeRO-2/3 with depth-first accumulation: every micro-batch reduce-scatters under its own
    backward; the closed form (earlier micro-batches as one item each) agrees with the simulated queue."""
    plan = Plan(
        dp=64,
        zero_stage=zero,
        n_microbatches=6,
        accumulation="depth_first",
        rank_order=TESSERA_ORDER,
        flash_attention=True,
    )
    fast, (simulated, _) = fast_step(GPT, HW, plan, "1f1b"), simulate_step(GPT, HW, plan, "1f1b")
    assert fast.step_time == pytest.approx(simulated.step_time, rel=0.01)
    reduce, _ = dp_parts(GPT.n_layers * GPT.layer_params(), HW, plan, buckets=GPT.n_layers)
    assert fast.dp_comm < reduce  # most of the m reductions hide under the backward passes
