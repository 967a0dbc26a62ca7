"""Cost model formulas against hand-computed cases and the published closed forms they must reduce to."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tessera.planner.cost import (
    CommVolume,
    ModelShape,
    Plan,
    activation_bytes_per_layer,
    all_gather_time,
    all_reduce_time,
    broadcast_time,
    dp_time,
    dp_volume,
    gemm_time,
    group_bandwidth,
    hardware_flops_per_token,
    head_transient_bytes,
    layer_forward_flops,
    layer_time,
    memory_per_rank,
    model_flops_per_token,
    model_state_bytes,
    narayanan_flops_per_iteration,
    narayanan_params,
    p2p_time,
    p2p_time_per_microbatch,
    pp_p2p_volume,
    recompute_working_bytes,
    reduce_scatter_time,
    replay_exit_backward_bytes,
    replay_forward_bytes,
    replay_gradient_bytes,
    stage_time,
    tp1d_layer_volume,
    tp2d_layer_volume,
    tp_comm_time_per_layer,
)
from tessera.planner.hardware import Hardware, load_hardware

REL = 1e-9  # closed-form identities: exact up to float rounding
PUBLISHED_REL = 0.01  # published tables rounded to 3 significant digits
IDEAL_REL = 1e-6  # ideal device: only the elementwise bytes / 1e30 B/s term separates time from FLOPs/peak


def gpt(L=24, h=2304, a=None, s=2048, V=51200, dropout=True) -> ModelShape:
    a = a or (24 if h % 24 == 0 else 8)
    return ModelShape(
        n_layers=L,
        d_model=h,
        n_heads=a,
        n_kv_heads=a,
        ffn_hidden=4 * h,
        vocab_size=V,
        seq_len=s,
        dropout=dropout,
    )


def llama() -> ModelShape:
    return ModelShape(
        n_layers=32,
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        vocab_size=128256,
        seq_len=8192,
        swiglu=True,
        tied=False,
    )


def flat_hw(efficiency: float = 0.5) -> Hardware:
    """Idealised device: constant GEMM efficiency, effectively infinite HBM bandwidth."""
    return Hardware(
        name="flat",
        peak_flops={"bf16": 100e12, "fp16": 100e12, "fp32": 10e12},
        memory_bytes=80e9,
        hbm_bandwidth=1e30,
        gpus_per_node=8,
        intra_node_bandwidth=100e9,
        intra_node_latency=1e-6,
        inter_node_bandwidth=10e9,
        inter_node_latency=1e-5,
        gemm_efficiency=[(1.0, efficiency)],
    )


# ------------------------------------------------------------------------------------------------ params & FLOPs


def test_gpt_params_match_narayanan_eq2_plus_final_norm() -> None:
    shape = gpt()
    L, h, V, s = 24, 2304, 51200, 2048
    assert shape.n_params() == 12 * L * h * h + 13 * L * h + (V + s) * h + 2 * h
    assert shape.n_params() == pytest.approx(narayanan_params(s, L, h, V) + 2 * h, rel=REL)


def test_llama_8b_param_count() -> None:
    # Llama 3 8B: 8.03e9 parameters (untied head, GQA 8 KV heads, SwiGLU 14336)
    assert llama().n_params() == pytest.approx(8.03e9, rel=PUBLISHED_REL)


def test_gpt_model_and_hardware_flops_match_published_forms() -> None:
    shape = gpt()
    L, h, V, s = 24, 2304, 51200, 2048
    korthikanti_eq7 = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    selective = korthikanti_eq7 + L * 4 * s * h  # replayed QKᵀ and A·V forward (see docstring vs eq. 8)
    narayanan_eq3 = 96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert model_flops_per_token(shape) == pytest.approx(korthikanti_eq7, rel=REL)
    assert hardware_flops_per_token(shape, "none") == pytest.approx(korthikanti_eq7, rel=REL)
    assert hardware_flops_per_token(shape, "selective") == pytest.approx(selective, rel=REL)
    assert hardware_flops_per_token(shape, "full") == pytest.approx(narayanan_eq3, rel=REL)
    assert narayanan_flops_per_iteration(512, s, L, h, V) == pytest.approx(512 * s * narayanan_eq3, rel=REL)


def test_gqa_swiglu_flops_match_megatron_core() -> None:
    shape = llama()
    L, h, a, g, f, V, s = 32, 4096, 32, 8, 14336, 128256, 8192
    megatron_core = 12 * L * h * h * ((1 + g / a + s / h) + (f / h) * 1.5 + V / (2 * L * h))
    assert model_flops_per_token(shape) == pytest.approx(megatron_core, rel=REL)


def test_layer_forward_flops_per_microbatch() -> None:
    shape = gpt(h=64, a=4, s=16)
    tokens = 2 * 16
    assert layer_forward_flops(shape, tokens) == 24 * tokens * 64**2 + 4 * tokens * 16 * 64


def test_from_config_duck_typed() -> None:
    cfg = SimpleNamespace(
        family="llama",
        n_layers=2,
        d_model=96,
        n_heads=4,
        n_kv_heads=None,
        ffn_hidden=None,
        vocab_size=256,
        seq_len=32,
        tie_embeddings=False,
    )
    shape = ModelShape.from_config(cfg)
    assert shape.swiglu and not shape.tied and shape.n_kv_heads == 4
    assert shape.ffn_hidden == 256  # 8·96/3 = 256, already a multiple of 64
    gpt_cfg = SimpleNamespace(n_layers=2, d_model=64, n_heads=4, vocab_size=100, seq_len=8)
    g = ModelShape.from_config(gpt_cfg)
    assert (g.swiglu, g.tied, g.ffn_hidden, g.n_kv_heads) == (False, True, 256, 4)


def test_from_config_accepts_tessera_model_config() -> None:
    from tessera.config import ModelConfig

    cfg = ModelConfig(
        family="llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, vocab_size=512, seq_len=64
    )
    shape = ModelShape.from_config(cfg)
    assert (shape.swiglu, shape.n_kv_heads, shape.ffn_hidden) == (True, 2, cfg.ffn)


# ------------------------------------------------------------------------------------------------ compute time


def test_gemm_time_compute_and_memory_bound() -> None:
    hw = load_hardware("a100-80gb")
    flops = 2 * 8192**3
    assert gemm_time(hw, 8192, 8192, 8192) == pytest.approx(flops / (312e12 * hw.efficiency(flops)), rel=REL)
    # matrix-vector: 2·1·8192·8192 FLOPs, ≈ 8192² · 2 bytes moved → bandwidth bound
    gemv_bytes = (8192 + 8192 * 8192 + 8192) * 2
    assert gemm_time(hw, 1, 8192, 8192) == pytest.approx(gemv_bytes / hw.hbm_bandwidth, rel=REL)


@pytest.mark.parametrize(("tp", "kind"), [(1, "1d"), (4, "1d"), (4, "2d"), (16, "2d")])
def test_layer_time_equals_flops_over_effective_peak_on_ideal_device(tp: int, kind: str) -> None:
    shape, hw = gpt(L=2, h=1024, a=16, s=512), flat_hw(0.5)
    plan = Plan(tp=tp, tp_kind=kind, micro_batch=2, recompute="full")
    lt = layer_time(shape, hw, plan)
    expected = layer_forward_flops(shape, 2 * 512) / tp / (100e12 * 0.5)
    assert lt.forward == pytest.approx(expected, rel=IDEAL_REL)
    assert lt.backward == pytest.approx(2 * lt.forward, rel=REL)
    # the replay stops before the MLP's output GEMM (2·b·s·4h·h FLOPs), torch's early-stopping checkpoint;
    # Megatron's (replays_last_exit) re-runs the whole forward
    exit_gemm = 2 * (2 * 512) * 4 * 1024 * 1024 / tp / (100e12 * 0.5)
    assert lt.recompute == pytest.approx(lt.forward - exit_gemm, rel=IDEAL_REL)
    assert layer_time(shape, hw, replace(plan, replays_last_exit=True)).recompute == pytest.approx(
        lt.forward, rel=REL
    )
    assert layer_time(shape, hw, replace(plan, recompute="none")).recompute == 0.0


# ------------------------------------------------------------------------------------------------ collectives


def test_collective_times_hand_computed() -> None:
    nbytes, bw, lat = 1e9, 1e11, 1e-5
    assert all_reduce_time(nbytes, 4, bw, lat) == pytest.approx(2 * 3 / 4 * 1e-2 + 6 * lat, rel=REL)
    assert reduce_scatter_time(nbytes, 4, bw, lat) == pytest.approx(3 / 4 * 1e-2 + 3 * lat, rel=REL)
    assert all_gather_time(nbytes, 4, bw, lat) == reduce_scatter_time(nbytes, 4, bw, lat)
    assert broadcast_time(nbytes, 4, bw, lat) == pytest.approx(1e-2 + 3 * lat, rel=REL)
    assert p2p_time(nbytes, bw, lat) == pytest.approx(1e-2 + lat, rel=REL)
    for fn in (all_reduce_time, reduce_scatter_time, all_gather_time, broadcast_time):
        assert fn(nbytes, 1, bw, lat) == 0.0


def test_group_bandwidth_by_topology() -> None:
    hw = load_hardware("a100-80gb")
    intra = (hw.intra_node_bandwidth, hw.intra_node_latency)
    inter = (hw.inter_node_bandwidth, hw.inter_node_latency)
    assert group_bandwidth(hw, 8, 1) == intra
    assert group_bandwidth(hw, 4, 2) == intra
    assert group_bandwidth(hw, 2, 8) == inter
    assert group_bandwidth(hw, 4, 16) == inter
    # spanning nodes with 8 (4) members per node: the node's 8 (4) NICs carry the ring
    assert group_bandwidth(hw, 16, 1) == (8 * hw.inter_node_bandwidth, hw.inter_node_latency)
    assert group_bandwidth(hw, 16, 2) == (4 * hw.inter_node_bandwidth, hw.inter_node_latency)


# ------------------------------------------------------------------------------------------------ volumes


def test_tp1d_volume_per_layer() -> None:
    shape = gpt(h=16, s=8)
    plan = Plan(tp=4, micro_batch=2, dtype="bf16")
    sbh_bytes = 8 * 2 * 16 * 2
    vol = tp1d_layer_volume(shape, plan)
    assert (vol.all_reduce, vol.calls) == (4 * sbh_bytes, 4)
    # Narayanan §3.2: 8·b·s·h·(t−1)/t elements on the wire per layer
    assert vol.wire_bytes(4) == pytest.approx(8 * 8 * 2 * 16 * 3 / 4 * 2, rel=REL)
    assert tp1d_layer_volume(shape, replace(plan, recompute="full")).all_reduce == 6 * sbh_bytes
    sp = tp1d_layer_volume(shape, replace(plan, sequence_parallel=True))
    assert (sp.all_gather, sp.reduce_scatter, sp.all_reduce) == (4 * sbh_bytes, 4 * sbh_bytes, 0.0)
    assert sp.wire_bytes(4) == vol.wire_bytes(4)  # same bandwidth cost (Korthikanti §4.2.2)
    assert tp1d_layer_volume(shape, replace(plan, tp=1)) == CommVolume()


@pytest.mark.parametrize(
    ("b", "s", "h", "q", "optimus_m", "megatron_m"),
    [(96, 512, 2048, 2, 566, 604), (96, 512, 2048, 8, 248, 793), (16, 2048, 8192, 4, 1510, 2013)],
)
def test_tp2d_volume_matches_optimus_table(
    b: int, s: int, h: int, q: int, optimus_m: int, megatron_m: int
) -> None:
    shape = gpt(h=h, a=32, s=s)
    plan = Plan(tp=q * q, tp_kind="2d", micro_batch=b, dtype="bf16")
    vol = tp2d_layer_volume(shape, plan)
    summa = replace(vol, all_reduce=0.0)  # drop the LayerNorm statistics term
    M = b * s
    assert summa.wire_bytes(q) / 2 == pytest.approx((q - 1) / q**2 * (21 * M * h + 36 * h * h), rel=REL)
    assert summa.wire_bytes(q) / 2 / 1e6 == pytest.approx(optimus_m, rel=PUBLISHED_REL)
    mega = tp1d_layer_volume(shape, Plan(tp=q * q, micro_batch=b))
    assert mega.wire_bytes(q * q) / 2 / 1e6 == pytest.approx(megatron_m, rel=PUBLISHED_REL)


def test_pp_p2p_volume_counts_boundaries() -> None:
    shape = gpt(h=16, s=8)
    nbytes = 8 * 1 * 16 * 2
    plan = Plan(pp=4, n_microbatches=3)
    assert pp_p2p_volume(shape, plan, 0).send == 3 * nbytes  # forward only
    assert pp_p2p_volume(shape, plan, 1).send == 6 * nbytes  # forward + backward
    assert pp_p2p_volume(shape, plan, 3).recv == 3 * nbytes
    looped = replace(plan, virtual_stages=2)
    assert pp_p2p_volume(shape, looped, 0).send == 9 * nbytes  # chunks 0 and 4: 2 fwd + 1 bwd per micro-batch
    assert pp_p2p_volume(shape, replace(plan, tp=2, sequence_parallel=True), 1).send == 3 * nbytes
    assert pp_p2p_volume(shape, replace(plan, pp=1), 0) == CommVolume()


@pytest.mark.parametrize(
    ("zero", "accumulation", "wire_psi"),
    [(0, "layered", 2), (1, "layered", 2), (2, "layered", 2), (3, "layered", 3), (3, "depth_first", 3 * 5)],
)
def test_dp_volume_zero_stages(zero: int, accumulation: str, wire_psi: int) -> None:
    psi, d = 1000.0, 4
    plan = Plan(dp=d, zero_stage=zero, accumulation=accumulation, n_microbatches=5)
    vol = dp_volume(psi, plan, grad_bytes=2, param_bytes=2)
    assert vol.wire_bytes(d) == pytest.approx(wire_psi * psi * 2 * (d - 1) / d, rel=REL)


def test_depth_first_zero2_reduces_every_microbatch() -> None:
    plan = Plan(dp=4, zero_stage=2, accumulation="depth_first", n_microbatches=5)
    assert dp_volume(10.0, plan).reduce_scatter == 5 * 10.0 * 2


# ------------------------------------------------------------------------------------------------ step pieces


def test_tp_comm_time_1d_is_two_all_reduces_per_pass() -> None:
    shape, hw = gpt(h=1024, s=512), load_hardware("a100-80gb")
    plan = Plan(tp=8, micro_batch=1, recompute="full", replays_last_exit=True)  # Megatron replays both
    one = all_reduce_time(512 * 1024 * 2, 8, hw.intra_node_bandwidth, hw.intra_node_latency)
    tp = tp_comm_time_per_layer(shape, hw, plan)
    assert (tp.forward, tp.backward, tp.recompute) == pytest.approx((2 * one, 2 * one, 2 * one), rel=REL)
    # tessera's runtime replays the attention exit only (traffic.replayed_1d: nothing saves the MLP exit)
    runtime = tp_comm_time_per_layer(shape, hw, replace(plan, replays_last_exit=False))
    assert (runtime.forward, runtime.backward, runtime.recompute) == pytest.approx(
        (2 * one, 2 * one, one), rel=REL
    )


@pytest.mark.parametrize("sp", [False, True])
def test_post_norms_replay_the_mlp_exit(sp: bool) -> None:
    """Gemma 2's mlp_post_norm saves the MLP exit's output, so full recomputation replays that exit: its GEMM
    and its collective (traffic.replays_mlp_exit). Hand-computed on 1D t = 8, b = 1, s = 512, h = 1024, bf16:
    without SP each exit is one all-reduce of b·s·h·2 bytes, with SP one reduce-scatter of it; the replay
    issues both exits, as the forward does, where a Llama block's replay issues the attention exit only."""
    hw = load_hardware("a100-80gb")
    gemma = replace(gpt(h=1024, a=8, s=512), family="gemma2", dropout=False)
    llama = replace(gemma, family="llama")
    plan = Plan(tp=8, micro_batch=1, recompute="full", sequence_parallel=sp)
    x, bw, lat = 512 * 1024 * 2, hw.intra_node_bandwidth, hw.intra_node_latency
    one = reduce_scatter_time(x, 8, bw, lat) if sp else all_reduce_time(x, 8, bw, lat)
    # the replayed collectives (besides the entries' all-gathers under SP, the same for both families)
    entries = 2 * all_gather_time(x, 8, bw, lat) if sp else 0.0
    assert tp_comm_time_per_layer(shape=gemma, hw=hw, plan=plan).recompute == pytest.approx(
        entries + 2 * one, rel=REL
    )
    assert tp_comm_time_per_layer(shape=llama, hw=hw, plan=plan).recompute == pytest.approx(
        entries + one, rel=REL
    )
    # the compute: the whole forward replayed (on an ideal device), where Llama's replay stops before the
    # MLP's output GEMM (2·b·s·f·h FLOPs / t)
    ideal = flat_hw(0.5)
    lt = layer_time(gemma, ideal, plan)
    assert lt.recompute == pytest.approx(lt.forward, rel=REL)
    exit_gemm = 2 * 512 * gemma.ffn_hidden * 1024 / 8 / (100e12 * 0.5)
    llama_lt = layer_time(llama, ideal, plan)
    assert llama_lt.recompute == pytest.approx(llama_lt.forward - exit_gemm, rel=IDEAL_REL)


def test_stage_time_composes_layer_pieces() -> None:
    shape, hw = gpt(h=1024, s=512), load_hardware("h100")
    plan = Plan(tp=2, micro_batch=2, recompute="full")
    lt, tp = layer_time(shape, hw, plan), tp_comm_time_per_layer(shape, hw, plan)
    fwd, bwd = stage_time(shape, hw, plan, 3)
    assert fwd == pytest.approx(3 * (lt.forward + tp.forward), rel=REL)
    assert bwd == pytest.approx(3 * (lt.backward + lt.recompute + tp.backward + tp.recompute), rel=REL)
    assert stage_time(shape, hw, plan, 3, last=True)[0] > fwd


def test_p2p_and_dp_time_topology() -> None:
    shape, hw = gpt(h=1024, s=512), load_hardware("a100-80gb")
    nbytes = 512 * 1024 * 2
    plan = Plan(pp=2)  # neighbours one rank apart: same node
    assert p2p_time_per_microbatch(shape, hw, plan) == pytest.approx(
        nbytes / hw.intra_node_bandwidth + hw.intra_node_latency, rel=REL
    )
    far = Plan(pp=2, dp=8)  # neighbours 8 ranks apart: different nodes
    assert p2p_time_per_microbatch(shape, hw, far) == pytest.approx(
        nbytes / hw.inter_node_bandwidth + hw.inter_node_latency, rel=REL
    )
    dp = Plan(dp=16, tp=8)  # data group stride 8: one member per node
    assert dp_time(1e9, hw, dp) == pytest.approx(
        all_reduce_time(2e9, 16, hw.inter_node_bandwidth, hw.inter_node_latency), rel=REL
    )


# ------------------------------------------------------------------------------------------------ memory


@pytest.mark.parametrize(
    ("psi", "d", "os_gb", "osg_gb", "osgp_gb"),
    [
        (7.5e9, 64, 31.4, 16.6, 1.88),
        (7.5e9, 4, 52.5, 41.3, 30.0),
        (128e9, 16, 608, 368, 128),
        (1e12, 1024, 4011, 2013, 15.6),
    ],
)
def test_model_state_matches_zero_table1(
    psi: float, d: int, os_gb: float, osg_gb: float, osgp_gb: float
) -> None:
    for stage, gb in ((1, os_gb), (2, osg_gb), (3, osgp_gb)):
        assert sum(model_state_bytes(psi, d, stage)) / 1e9 == pytest.approx(gb, rel=PUBLISHED_REL)
    assert sum(model_state_bytes(psi, d, 0)) == 16 * psi
    assert model_state_bytes(psi, d, 0, "fp32") == (4 * psi, 4 * psi, 8 * psi)


def test_activation_memory_korthikanti_table2() -> None:
    shape = gpt(h=2048, a=32, s=512)
    s, h, a, b, t = 512, 2048, 32, 2, 4
    sbh = s * b * h
    base = Plan(micro_batch=b, dtype="bf16")
    tp = replace(base, tp=t)
    sp = replace(tp, sequence_parallel=True)
    cases = [
        (base, 34 + 5 * a * s / h),
        (tp, 10 + 24 / t + 5 * a * s / (h * t)),
        (sp, 34 / t + 5 * a * s / (h * t)),
        (replace(tp, recompute="selective"), 10 + 24 / t),
        (replace(sp, recompute="selective"), 34 / t),
        (replace(tp, recompute="full"), 2),
        (replace(sp, recompute="full"), 2 / t),
        (Plan(micro_batch=b, tp=t, tp_kind="2d"), (34 + 5 * a * s / h) / t),
    ]
    for plan, factor in cases:
        assert activation_bytes_per_layer(shape, plan) == pytest.approx(sbh * factor, rel=REL), plan


def test_replay_backward_is_the_larger_of_its_moments() -> None:
    """1D + SP under full recomputation: the MLP's moment (its input Linears' output gradients) or the entry's
    backward (those gradients, every MLP tensor of the "none" count freed, the entry's [N, h] buffers and the
    input Linears' weight gradients), not their sum; named tensor by tensor as read off the dry run (docs/memory.md,
    "Full recomputation's moments")."""
    t, b = 2, 2
    shape = replace(llama(), seq_len=256, d_model=256, ffn_hidden=704)
    plan = Plan(tp=t, sequence_parallel=True, micro_batch=b, dtype="bf16", autocast=True, recompute="full")
    n, h, f, c, r = 256 * b, 256, 704 / t, 2, 4  # tokens, hidden, the rank's ffn, bf16, the fp32 stream
    w = f * h  # one input Linear's weight gradient, [f/t, h]
    mlp = 2 * c * n * f  # d(gate), d(up); d(product) stands for the freed product
    # entry, at the last (up's) turn of its loop: d(gate), d(up), gate's fp32 weight gradient (4w); gate, up,
    # silu(gate) and product freed
    held = 2 * c * n * f - 4 * c * n * f + 4 * w
    # the gathered input's cast: gathered input, its contiguous copy (r), the copy's cast, the part and the sum
    input_cast = (2 * r + 3 * c) * n * h
    product = (r + 3 * c) * n * h + c * w  # the copy freed once cast; up's weight gradient [f/t, h] in c
    product_cast = (r + 2 * c) * n * h + (c + 4) * w  # ... and its fp32 cast
    scatter = (r + 3 * c + c / t) * n * h + 4 * w  # gathered, part, sum, contiguous sum, slice; up's fp32
    assert input_cast > max(product, product_cast, scatter) and held + input_cast > mlp
    assert replay_gradient_bytes(shape, plan) == pytest.approx(held + input_cast, rel=REL)
    # the MLP's moment is larger when the ffn is (no sum of the two)
    wide = replace(shape, ffn_hidden=4096)
    assert replay_gradient_bytes(wide, plan) == pytest.approx(2 * c * n * 4096 / t, rel=REL)
    # one sequence: the gathered buffer is contiguous when flattened, so the reduce-scatter's moment is larger:
    # gathered input, part, sum, the sum made contiguous and the rank's slice (f/t = 256 here) beside both fp32
    # weight gradients
    one, narrow, n1, f1 = replace(plan, micro_batch=1), replace(shape, ffn_hidden=512), 256, 256
    w1 = f1 * h
    held1 = 2 * c * n1 * f1 - 4 * c * n1 * f1 + 4 * w1
    scatter = (r + 3 * c + c / t) * n1 * h + 4 * w1
    others = ((r + 3 * c) * n1 * h, (r + 3 * c) * n1 * h + c * w1, (r + 2 * c) * n1 * h + (c + 4) * w1)
    assert scatter > max(others)
    assert replay_gradient_bytes(narrow, one) == pytest.approx(held1 + scatter, rel=REL)
    # fp32 (c = r = 4): no cast of the gathered input, nor of the product, which is the fp32 gradient itself;
    # the reduce-scatter (input, part, sum, contiguous sum, slice: 18 bytes a token and feature, both gradients)
    # is above the product (input, copy kept as the operand, part, sum: 16, one gradient and the product)
    fp32 = replace(plan, dtype="fp32")
    held32 = -2 * 4 * n * f1 + 4 * w1
    assert replay_gradient_bytes(narrow, fp32) == pytest.approx(held32 + 18 * n * h + 4 * w1, rel=REL)
    # GPT at a megatron-1t-like proportion (f/t several times N): the product's fp32 cast binds, the weight
    # gradient in bf16 and fp32 beside the gathered input, the part and the GELU's output gradient
    g, nt = gpt(h=512, a=8, s=64), 64 * b
    wg = 4 * 512 / t * 512
    gelu = replay_gradient_bytes(g, plan)
    saved = (c + c) * nt * 4 * 512 / t  # fc's output and the output Linear's input, freed
    cast = (r + c) * nt * 512 + (c + 4) * wg
    assert cast > max(
        (2 * r + 2 * c) * nt * 512, (r + 2 * c) * nt * 512 + c * wg, (r + 2 * c + c / t) * nt * 512 + 4 * wg
    )
    assert gelu == pytest.approx(c * nt * 4 * 512 / t - saved + cast, rel=REL)
    # without SP only the MLP's moment
    no_sp = replace(plan, sequence_parallel=False)
    assert replay_gradient_bytes(shape, no_sp) == pytest.approx(mlp, rel=REL)


def test_memory_per_rank_components() -> None:
    shape = gpt(L=8, h=256, a=8, s=128, V=1000)
    plan = Plan(dp=2, pp=2, tp=2, zero_stage=1, micro_batch=1, n_microbatches=4, recompute="full")
    mem = memory_per_rank(shape, plan, inflight_microbatches=2, stage=0)
    psi = (4 * shape.layer_params() + 1000 * 256 + 128 * 256) / 2
    assert (mem.params, mem.grads, mem.optimizer) == pytest.approx((2 * psi, 2 * psi, 12 * psi / 2), rel=REL)
    assert mem.activations == pytest.approx(2 * 128 * 256 * 4 * 2, rel=REL)  # 2sbh × 4 layers × 2 in flight
    # the replayed block's un-checkpointed activations and the gradients its backward holds beside them
    replay = activation_bytes_per_layer(shape, replace(plan, recompute="none")) + replay_gradient_bytes(
        shape, plan
    )
    assert mem.working == pytest.approx(replay, rel=REL)
    assert replay_gradient_bytes(shape, plan) == 1 * 2 * 128 * 1 * shape.ffn_hidden / 2  # GELU: one [N, f/t]
    assert mem.comm_buffers == 2 * 128 * 256 * 2
    parts = mem.params + mem.grads + mem.optimizer + mem.activations + mem.working + mem.comm_buffers
    assert mem.total == pytest.approx(parts, rel=REL)
    # the last stage: the head's moment or the recomputed block, whichever is larger (never alive together)
    last = memory_per_rank(shape, plan, inflight_microbatches=1, stage=1)
    assert last.working == max(mem.working, head_transient_bytes(shape, plan))
    plain = replace(plan, recompute="none")
    assert memory_per_rank(shape, plain, inflight_microbatches=1, stage=1).working == head_transient_bytes(
        shape, plain
    )
    assert head_transient_bytes(shape, plain) > 0


def test_a_2d_replays_moments_are_its_forward_and_its_mlp_exits_backward() -> None:
    # full recomputation on a 2x2 grid under bf16 autocast (Llama, h 256, f 704, s 256, b 2), in [N/q, .] blocks
    # (N/q = 256 tokens): the replay stops before the MLP output Linear's SUMMA (checkpointing.save_early), so its
    # forward holds, beyond what it saves, only the block's locals and the upstream gradient ...
    shape = ModelShape(
        family="llama",
        n_layers=4,
        d_model=256,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=704,
        vocab_size=512,
        seq_len=256,
        swiglu=True,
    )
    plan = Plan(tp=4, tp_kind="2d", micro_batch=2, recompute="full", dtype="bf16", autocast=True)
    rows, h, f = 256, 128, 352
    local = (
        (4 + 2 + 4 + 4) * rows * h
    )  # attention norm's output, wo's bf16 output, the residual, MLP norm's output
    upstream = (4 + 2) * rows * h  # the block's fp32 gradient and its bf16 cast for w_down's backward
    assert replay_forward_bytes(shape, plan) == local + upstream
    # ... and the exit's backward is the fullest moment: dA (ABᵀ), AᵀB's two slots of the product, its q = 2
    # partial weight gradients, beside the upstream gradient and its cast
    exit_backward = 2 * (3 * rows * f + 2 * f * h) + upstream
    assert replay_exit_backward_bytes(shape, plan) == exit_backward
    backward = replay_gradient_bytes(shape, plan) + 4 * rows * h  # the MLP's gradients, the upstream gradient
    assert max(backward, local + upstream) < exit_backward
    none = activation_bytes_per_layer(shape, replace(plan, recompute="none"))
    assert recompute_working_bytes(shape, plan) == none + exit_backward
    # Gemma 2's post-norm saves the exit's output: its replay runs that SUMMA whole (its output, two slots of
    # the product and of the weight); a post-norm's attention output is fp32
    gemma = replace(shape, family="gemma2")
    summa = 2 * (rows * h + 2 * rows * f + 2 * f * h)
    assert replay_forward_bytes(gemma, plan) == (3 * 4 + 4) * rows * h + summa + upstream
    assert replay_forward_bytes(shape, replace(plan, tp=2, tp_kind="1d", sequence_parallel=True)) == 0.0
    assert replay_exit_backward_bytes(shape, replace(plan, tp=2, tp_kind="1d")) == 0.0
    assert replay_forward_bytes(shape, replace(plan, recompute="selective")) == 0.0
    assert replay_exit_backward_bytes(shape, replace(plan, recompute="selective")) == 0.0


def test_invalid_options_are_clear() -> None:
    with pytest.raises(ValueError, match="tp = q²"):
        _ = Plan(tp=8, tp_kind="2d").q
    with pytest.raises(ValueError, match="zero_stage"):
        model_state_bytes(1.0, 2, 4)
    with pytest.raises(ValueError, match="recompute"):
        hardware_flops_per_token(gpt(), "sometimes")


def test_planner_does_not_import_torch() -> None:
    code = (
        "import sys; import tessera.planner.cost, tessera.planner.hardware, tessera.planner.scaling, "
        "tessera.planner.megatron_table; assert 'torch' not in sys.modules, 'planner imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_selective_recompute_replays_only_attention_core() -> None:
    shape, hw = gpt(L=2, h=1024, a=16, s=512), flat_hw(0.5)
    plan = Plan(micro_batch=1, recompute="selective", flash_attention=True)
    attention_fwd_flops = 4 * 512 * 512 * 1024  # QKᵀ and A·V for one sequence
    assert layer_time(shape, hw, plan).recompute == pytest.approx(
        attention_fwd_flops / (100e12 * 0.5), rel=IDEAL_REL
    )
    full = layer_time(shape, hw, replace(plan, recompute="full")).recompute
    assert 0 < layer_time(shape, hw, plan).recompute < full
