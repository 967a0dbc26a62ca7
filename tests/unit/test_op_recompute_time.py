"""The planner's price of op checkpointing's replay (`cost.compute.layer_time` with recompute = "op"), computed
here by hand on small shapes from the hardware's own GEMM price and HBM bandwidth: what the runtime replays
(tests/unit/test_op_checkpointing.py counts it): wk, wo and SwiGLU's w3 at their 1D tensor-parallel sizes, the
forward's non-matmul ops by their HBM bytes, not the attention core."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.planner.cost import ModelShape, Plan
from tessera.planner.cost.comm_time import tp_comm_time_per_layer
from tessera.planner.cost.compute import attention_core_time, layer_time
from tessera.planner.gemm import gemm_call_time
from tessera.planner.hardware import load_hardware

HW = load_hardware("a100-80gb")
# h 1024, 16 heads of 64, 4 KV heads (kv 256), SwiGLU f 4096, s 1024
LLAMA = ModelShape(
    n_layers=2, d_model=1024, n_heads=16, n_kv_heads=4, ffn_hidden=4096, vocab_size=32000, seq_len=1024,
    swiglu=True, family="llama",
)  # fmt: skip
GPT = ModelShape(
    n_layers=2, d_model=1024, n_heads=16, n_kv_heads=16, ffn_hidden=4096, vocab_size=32000, seq_len=1024,
    family="gpt",
)  # fmt: skip
REL = 1e-12  # the same arithmetic in another order: rounding only


def test_llama_op_replay_by_hand() -> None:
    """tensor 2, no SP, b 1, bf16 in the published accounting (c = r = 2 bytes), flash attention.

    GEMMs (M = b·s = 1024 rows): wk column-parallel [1024×1024]·[1024×128], wo row-parallel [1024×512]·[512×1024],
    w3 column-parallel [1024×1024]·[1024×2048].
    Non-matmul bytes per token-hidden element (×s·b·h = 1024²), `elementwise_bytes_per_layer`'s terms: two norms
    2r = 4 each, two residual adds 2r + c = 6 each: 20, replicated (no SP: not divided by t); SwiGLU 3c·f/h = 24
    and RoPE 2c·(q + kv)/h = 2·2·1280/1024 = 5, split over t = 2: 14.5; 34.5 in all. Flash: no score bytes."""
    plan = Plan(tp=2, micro_batch=1, recompute="op", flash_attention=True)
    gemms = gemm_call_time(HW, 1024, 128, 1024) + gemm_call_time(HW, 1024, 1024, 512)
    gemms += gemm_call_time(HW, 1024, 2048, 1024)
    elementwise = 34.5 * 1024 * 1024 / HW.hbm_bandwidth
    assert layer_time(LLAMA, HW, plan).recompute == pytest.approx(gemms + elementwise, rel=REL)


def test_llama_op_replay_with_sequence_parallelism_and_autocast_by_hand() -> None:
    """tensor 2 + SP, b 2, tessera's bf16 autocast (c = 2, stream r = 4), flash attention: per token-hidden
    element (×s·b·h = 2·1024²) norms 2r = 8 each and residual adds 2r + c = 10 each, 36 replicated, split by t
    under SP: 18; SwiGLU 24 and RoPE 5 over t: 14.5; the casts of wq, wk, wv's and w1, w3's inputs (r + c = 6
    each, five Linears, the gathered input: not divided by t): 30. 62.5 in all. GEMMs at M = 2048 rows."""
    plan = Plan(
        tp=2, micro_batch=2, sequence_parallel=True, autocast=True, recompute="op", flash_attention=True
    )
    gemms = gemm_call_time(HW, 2048, 128, 1024) + gemm_call_time(HW, 2048, 1024, 512)
    gemms += gemm_call_time(HW, 2048, 2048, 1024)
    elementwise = 62.5 * 2 * 1024 * 1024 / HW.hbm_bandwidth
    assert layer_time(LLAMA, HW, plan).recompute == pytest.approx(gemms + elementwise, rel=REL)


def test_gpt_op_replay_stops_before_the_mlp_exit_by_hand() -> None:
    """GPT (no tensor split, b 1, bf16 published, unfused attention): wk [1024×1024]·[1024×1024] and wo
    [1024×1024]·[1024×1024]; fc2 is the 6th matmul but the early-stopping replay never reaches it. Non-matmul
    bytes per token-hidden element: norms 4 each, adds 6 each, GELU 2c·f/h = 16: 36; the softmax's scores
    (2c per score, a·s²·b = 16·1024²) are the attention core's, kept: not replayed."""
    plan = Plan(micro_batch=1, recompute="op")
    gemms = 2 * gemm_call_time(HW, 1024, 1024, 1024)
    elementwise = 36 * 1024 * 1024 / HW.hbm_bandwidth
    assert layer_time(GPT, HW, plan).recompute == pytest.approx(gemms + elementwise, rel=REL)


def test_op_sits_between_selective_and_full_on_these_shapes_and_replays_fulls_collectives() -> None:
    plan = Plan(tp=2, micro_batch=1, sequence_parallel=True, flash_attention=True)
    times = {
        mode: layer_time(LLAMA, HW, replace(plan, recompute=mode)).recompute
        for mode in ("selective", "op", "full")
    }
    assert times["selective"] == pytest.approx(attention_core_time(LLAMA, HW, plan)[0], rel=REL)
    assert times["selective"] < times["op"] < times["full"]
    comm = {
        mode: tp_comm_time_per_layer(LLAMA, HW, replace(plan, recompute=mode)).recompute
        for mode in ("op", "full")
    }
    assert comm["op"] == comm["full"] > 0
