"""The bytes the step-time model prices count each tensor in its own dtype, by hand on a small Llama-shaped
block: the memory-bound work (`elementwise_bytes_per_layer`, `weight_cast_bytes_per_layer`, the embedding and
the loss) — under tessera's autocast the norms and residual adds move the fp32 stream and every Linear reading a
norm casts it — and the data-parallel collectives and the optimizer step, on fp32 parameters and gradients
under autocast; the published 2-byte accounting (autocast off) is unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.planner.cost import (
    ModelShape,
    Plan,
    dp_collective_times,
    elementwise_bytes_per_layer,
    embedding_time,
    layer_time,
    logit_bytes,
    weight_cast_bytes_per_layer,
)
from tessera.planner.cost.compute import attention_core_time
from tessera.planner.hardware import load_hardware
from tessera.planner.steptime import clip_norm_time, dp_parts, optimizer_time

REL = 1e-12  # sums of exact binary fractions

SHAPE = ModelShape(  # Llama style: RMSNorm, SwiGLU, rotary, wq/wk/wv and w_gate/w_up read the norms
    n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256, seq_len=8, swiglu=True
)
SBH = 8 * 2 * 64  # s·b·h with micro-batch 2
WEIGHTS = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128  # wq, wk+wv (kv 32), wo, gate/up/down: 36,864
AUTOCAST = Plan(micro_batch=2, dtype="bf16", autocast=True, flash_attention=True)

# bytes per s·b·h element (c = 2, r = 4): norms 2·(2r) = 16, residual adds 2·(2r + c) = 20; SwiGLU 3c·f/h = 12,
# rotary 2c·(h + kv)/h = 6; casts of the norms' outputs for wq, wk, wv, w_gate, w_up: 5·(r + c) = 30
REPLICATED, SHARDED, CASTS = 36, 18, 30


def test_autocast_counts_the_fp32_stream_and_the_casts() -> None:
    assert elementwise_bytes_per_layer(SHAPE, AUTOCAST) == pytest.approx(SBH * 84, rel=REL)
    # published accounting: norms 4 each, adds 6 each, SwiGLU 6f/h = 12, rotary 4(h+kv)/h = 6, no casts
    published = replace(AUTOCAST, autocast=False)
    assert elementwise_bytes_per_layer(SHAPE, published) == pytest.approx(SBH * 38, rel=REL)


def test_sequence_parallel_casts_the_gathered_input() -> None:
    """Norms and adds run on the s/t shard; each Linear casts the all-gathered norm output, not divided by t."""
    plan = replace(AUTOCAST, tp=2, sequence_parallel=True)
    expected = SBH * ((REPLICATED + SHARDED) / 2 + CASTS)
    assert elementwise_bytes_per_layer(SHAPE, plan) == pytest.approx(expected, rel=REL)


def test_2d_casts_its_weight_blocks_once_per_step() -> None:
    """2D (q = 2): every activation term ÷ q²; its weight blocks, like 1D's weights, are cast once per step (no
    forward cast per micro-batch); backward casts each weight gradient back to fp32 and accumulates it (c + 4r)
    in every layout."""
    plan = replace(AUTOCAST, tp=4, tp_kind="2d")
    backward_cast = 18 * WEIGHTS / 4
    assert weight_cast_bytes_per_layer(SHAPE, plan) == pytest.approx((0.0, backward_cast), rel=REL)
    expected = SBH * (REPLICATED + SHARDED + CASTS) / 4
    assert elementwise_bytes_per_layer(SHAPE, plan) == pytest.approx(expected, rel=REL)
    # 1D keeps autocast's copy for the step too: the same rule, the same backward
    assert weight_cast_bytes_per_layer(SHAPE, replace(AUTOCAST, tp=2)) == pytest.approx(
        (0.0, 18 * WEIGHTS / 2)
    )
    assert weight_cast_bytes_per_layer(SHAPE, replace(plan, autocast=False)) == (0.0, 0.0)


@pytest.mark.parametrize("plan", [AUTOCAST, replace(AUTOCAST, tp=4, tp_kind="2d")], ids=["1d", "2d"])
def test_backward_prices_the_weight_casts_once(plan: Plan) -> None:
    """Backward = 2 × forward for everything but the weight casts, whose backward bytes are their own, and the
    fused attention core (its own backward, `attention_core_time`)."""
    hw = load_hardware("h100")
    lt = layer_time(SHAPE, hw, plan)
    attn_fwd, attn_bwd = attention_core_time(SHAPE, hw, plan)
    forward_cast, backward_cast = weight_cast_bytes_per_layer(SHAPE, plan)
    expected = (
        2 * (lt.forward - attn_fwd - forward_cast / hw.hbm_bandwidth)
        + attn_bwd
        + backward_cast / hw.hbm_bandwidth
    )
    assert lt.backward == pytest.approx(expected, rel=1e-12)
    assert backward_cast > 2 * forward_cast  # so the backward differs from twice the forward
    published = layer_time(SHAPE, hw, replace(plan, autocast=False))
    assert published.backward == pytest.approx(2 * (published.forward - attn_fwd) + attn_bwd, rel=1e-12)


def test_embedding_and_loss_bytes_follow_the_dtypes() -> None:
    """The embedding's table and output are fp32 under autocast (twice the published bf16 bytes); the logits
    are a matmul output (bf16 either way), upcast to fp32 by the loss: 2 + 8 bytes per logit."""
    hw = load_hardware("h100")
    published = replace(AUTOCAST, autocast=False)
    auto_fwd = embedding_time(SHAPE, hw, AUTOCAST)[0].forward
    assert auto_fwd == pytest.approx(2 * embedding_time(SHAPE, hw, published)[0].forward, rel=REL)
    assert auto_fwd == pytest.approx(2 * SBH * 4 / hw.hbm_bandwidth, rel=REL)
    assert logit_bytes(AUTOCAST) == logit_bytes(published) == 10
    assert logit_bytes(replace(AUTOCAST, dtype="fp32")) == 12


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_data_parallel_bytes_are_the_parameters_width(zero: int) -> None:
    """Under autocast the gradients reduced and the parameters gathered are fp32 (what tessera's dry run counts
    with the default fp32 reduction); the published runs move bf16."""
    hw, psi = load_hardware("h100"), 1e9
    plan = replace(AUTOCAST, dp=16, zero_stage=zero)
    assert dp_parts(psi, hw, plan) == dp_collective_times(psi, hw, plan, grad_bytes=4, param_bytes=4)
    published = replace(plan, autocast=False)
    assert dp_parts(psi, hw, published) == dp_collective_times(
        psi, hw, published, grad_bytes=2, param_bytes=2
    )


@pytest.mark.parametrize(("zero", "gathers"), [(2, 1), (3, 2)])
def test_bf16_gradient_reduction_halves_the_reduce_scatter_bytes(zero: int, gathers: int) -> None:
    """`Plan.grad_reduce_bytes` = 2 (a bf16 ZeRO reduce-scatter, `train.grad_reduce_dtype`) halves the
    reduce-scatter's bandwidth term; its latency and the parameters' fp32 all-gathers are unchanged. By hand:
    dp 8 inside one H100 node, a ring over n = 8 ranks moves (n − 1)/n of the buffer per rank in n − 1 steps."""
    hw, psi, n = load_hardware("h100"), 1e9, 8
    plan = replace(AUTOCAST, dp=n, zero_stage=zero)
    bf16 = replace(plan, grad_reduce_bytes=2)
    assert (plan.grad_reduce_width, bf16.grad_reduce_width, bf16.param_bytes) == (4, 2, 4)
    latency = (n - 1) * hw.intra_node_latency
    ring = (n - 1) / n * psi / hw.intra_node_bandwidth  # seconds per byte of width
    reduce4, gather4 = dp_parts(psi, hw, plan)
    reduce2, gather2 = dp_parts(psi, hw, bf16)
    assert reduce4 == pytest.approx(4 * ring + latency, rel=REL)
    assert reduce2 == pytest.approx(2 * ring + latency, rel=REL)
    assert gather2 == gather4 == pytest.approx(gathers * (4 * ring + latency), rel=REL)


def test_optimizer_step_updates_fp32_parameters_under_autocast() -> None:
    """AdamW on fp32 parameters reads param, grad, m, v and writes param, m, v: 28 bytes each, without the
    published mixed-precision step's bf16 gradient read and parameter copy (32)."""
    hw = load_hardware("h100")
    psi = SHAPE.n_params()  # one rank holds the whole model
    assert optimizer_time(SHAPE, hw, AUTOCAST) == pytest.approx(
        psi * 28 / hw.hbm_bandwidth + clip_norm_time(hw, AUTOCAST), rel=REL
    )
    published = replace(AUTOCAST, autocast=False)
    assert optimizer_time(SHAPE, hw, published) == pytest.approx(
        psi * 32 / hw.hbm_bandwidth + clip_norm_time(hw, published), rel=REL
    )
