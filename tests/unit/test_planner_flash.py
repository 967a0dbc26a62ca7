"""Fused (flash) attention in the compute model: the kernel's measured rate, causal half, backward 2.5x forward
(cost.compute.attention_core_time), hand-computed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.errors import ConfigError
from tessera.planner.cost import ModelShape, Plan
from tessera.planner.cost.compute import FLASH_BACKWARD_FACTOR, attention_core_time, layer_time
from tessera.planner.gemm import gemm_call_time
from tessera.planner.hardware import load_hardware

SHAPE = ModelShape(
    n_layers=2, d_model=4096, n_heads=32, n_kv_heads=32, ffn_hidden=16384, vocab_size=50368, seq_len=2048
)


def test_flash_prices_the_causal_half_at_the_measured_rate() -> None:
    hw = load_hardware("h100")
    plan = Plan(tp=2, micro_batch=3, flash_attention=True)
    forward, backward = attention_core_time(SHAPE, hw, plan)
    heads = 32 * 3 / 2
    flops = 4 * 2048**2 * 128 * heads / 2  # QKᵀ and A·V, 2 FLOPs per multiply-add, the unmasked half
    assert forward == pytest.approx(flops / (265e12 * hw.gemm_framework_share), rel=1e-12)
    assert backward == pytest.approx(2.5 * forward, rel=1e-12)
    assert FLASH_BACKWARD_FACTOR == 2.5


@pytest.mark.parametrize(
    "plan, rate",
    [
        (Plan(micro_batch=2, flash_attention=False), 265e12),  # unfused: scores in HBM
        (Plan(micro_batch=2, flash_attention=True), 0.0),  # no measured kernel: the two GEMMs
        (
            Plan(micro_batch=2, flash_attention=True, dtype="fp32"),
            265e12,
        ),  # the measurement is bf16/fp16 only
    ],
)
def test_without_a_measured_fused_kernel_attention_is_two_gemms(plan: Plan, rate: float) -> None:
    hw = replace(load_hardware("h100"), flash_attention_flops=rate)
    forward, backward = attention_core_time(SHAPE, hw, plan)
    heads = 32 * 2
    gemms = gemm_call_time(hw, 2048, 2048, 128, batch=heads, dtype=plan.dtype) + gemm_call_time(
        hw, 2048, 128, 2048, batch=heads, dtype=plan.dtype
    )
    assert forward == pytest.approx(gemms, rel=1e-12)
    assert backward == pytest.approx(2 * gemms, rel=1e-12)


def test_layer_backward_takes_the_attention_core_backward() -> None:
    hw = load_hardware("a100-80gb")
    plan = Plan(micro_batch=4, flash_attention=True)
    attn_fwd, attn_bwd = attention_core_time(SHAPE, hw, plan)
    layer = layer_time(SHAPE, hw, plan)
    assert layer.backward == pytest.approx(2 * (layer.forward - attn_fwd) + attn_bwd, rel=1e-12)
    megatron = layer_time(SHAPE, hw, replace(plan, recompute="full", replays_last_exit=True))
    assert megatron.recompute == pytest.approx(layer.forward, rel=1e-12)  # the fused attention replayed too


def test_negative_flash_rate_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="flash_attention_flops"):
        replace(load_hardware("h100"), flash_attention_flops=-1.0)
