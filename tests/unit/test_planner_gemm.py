"""GEMM time by shape (tessera/planner/gemm.py): hand-computed tile/wave quantization and roofline cases, the
kernel fraction fitted on the table, the dispatch, and the shipped A100 constants being the Table 1 fit."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.errors import ConfigError
from tessera.planner.gemm import (
    gemm_call_time,
    gemm_efficiency,
    kernel_fraction,
    lanes_call_time,
    plateau_time,
    quantization,
    shape_fraction,
    shape_time,
)
from tessera.planner.hardware import GemmRow, Hardware, load_hardware, save_hardware
from tessera.planner.megatron_table import fit_gemm_constants
from tessera.planner.mosaic_table import fit_hopper_share

REL = 1e-12  # exact arithmetic on hand-computed cases


def toy(sms: int = 4, share: float = 0.5, hbm: float = 1e30) -> Hardware:
    """100 TFLOP/s, `sms` SMs, 128×128 tiles; the table row fills one wave exactly at 80 TFLOP/s (0.8)."""
    return Hardware(
        name="toy",
        peak_flops={"bf16": 100e12},
        memory_bytes=1e9,
        hbm_bandwidth=hbm,
        gpus_per_node=8,
        intra_node_bandwidth=1e11,
        intra_node_latency=1e-6,
        inter_node_bandwidth=1e10,
        inter_node_latency=1e-5,
        sm_count=sms,
        gemm_tile=(128, 128),
        gemm_framework_share=share,
        gemm_table=[GemmRow(256, 256, 1024, "bf16", 80e12, "toy")],  # 2×2 tiles = one full wave of 4 SMs
    )


def test_quantization_hand_cases() -> None:
    # 2048×2304 in 128×256 tiles: 16 × 9 = 144 tiles on 108 SMs → 2 waves of 108 slots, 2048·2304 useful
    assert quantization(2048, 2304, 1, (128, 256), 108) == pytest.approx(
        2048 * 2304 / (2 * 108 * 128 * 256), rel=REL
    )
    assert quantization(2048, 2304, 1, (128, 256), 108) == pytest.approx(2 / 3, rel=REL)
    # tile quantization alone: a 100×100 output in one 128×128 tile on one SM
    assert quantization(100, 100, 1, (128, 128), 1) == pytest.approx(10_000 / 16_384, rel=REL)
    # a batch of 8 one-tile GEMMs on 4 SMs: exactly 2 full waves
    assert quantization(128, 128, 8, (128, 128), 4) == pytest.approx(1.0, rel=REL)
    # 5 tiles on 4 SMs: the second wave runs 1 of 4 → 5/8
    assert quantization(5 * 128, 128, 1, (128, 128), 4) == pytest.approx(5 / 8, rel=REL)


def test_kernel_fraction_takes_out_the_rows_own_quantization() -> None:
    hw = toy()
    assert kernel_fraction(hw.gemm_table, hw.peak_flops, hw.gemm_tile, hw.sm_count) == pytest.approx(0.8)
    # the same 80 TFLOP/s measured on a shape that fills half a wave (2 tiles on 4 SMs) means a 1.6× better
    # kernel, capped at 1
    half = [GemmRow(256, 128, 1024, "bf16", 40e12)]
    assert kernel_fraction(half, hw.peak_flops, (128, 128), 4) == pytest.approx(0.8)
    assert kernel_fraction([GemmRow(256, 128, 1024, "bf16", 80e12)], hw.peak_flops, (128, 128), 4) == 1.0
    # the median over rows
    rows = [GemmRow(256, 256, 64, "bf16", r * 1e12) for r in (50, 60, 90)]
    assert kernel_fraction(rows, hw.peak_flops, (128, 128), 4) == pytest.approx(0.6)
    assert shape_fraction(hw) == pytest.approx(0.8 * 0.5)


def test_shape_time_compute_bound_full_and_partial_waves() -> None:
    hw = toy()
    flops = 2.0 * 256 * 256 * 4096
    # one full wave: F / (peak · 0.8 · 0.5)
    assert shape_time(hw, 256, 256, 4096) == pytest.approx(flops / (100e12 * 0.4), rel=REL)
    # 5 tiles: two waves for 5/4 of the work → the time of 8 tiles
    five = shape_time(hw, 5 * 128, 128, 4096)
    assert five == pytest.approx(2 * 128 * 128 * 4096 * 8 / (100e12 * 0.4), rel=REL)
    assert gemm_efficiency(hw, 5 * 128, 128, 4096) == pytest.approx(0.4 * 5 / 8, rel=REL)


def test_shape_time_memory_bound() -> None:
    hw = toy(hbm=1e10)
    # a matrix-vector product: (1·k + k·n + 1·n)·2 bytes over 10 GB/s (3.4 ms) beats the compute side, which
    # pays 127/128 of every tile row (32 tiles, 8 waves: F / (peak · 0.4 / 128) = 0.11 ms)
    nbytes = (4096 + 4096 * 4096 + 4096) * 2
    assert shape_time(hw, 1, 4096, 4096) == pytest.approx(nbytes / 1e10, rel=REL)


def test_dispatch_by_sm_count() -> None:
    hw = toy()
    assert gemm_call_time(hw, 256, 256, 4096) == shape_time(hw, 256, 256, 4096)
    curve = dataclasses.replace(hw, sm_count=0, gemm_efficiency=[(1.0, 0.5)])
    assert gemm_call_time(curve, 256, 256, 4096) == plateau_time(curve, 256, 256, 4096)
    assert plateau_time(curve, 256, 256, 4096) == pytest.approx(2.0 * 256 * 256 * 4096 / 50e12, rel=REL)


def test_sm_count_without_table_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="sm_count > 0 needs gemm_table rows"):
        dataclasses.replace(toy(), gemm_table=[])
    with pytest.raises(ConfigError, match="gemm_framework_share must be in"):
        dataclasses.replace(toy(), gemm_framework_share=1.5)


def test_table_round_trips_through_toml(tmp_path) -> None:
    hw = load_hardware("h100")
    path = tmp_path / "mine.toml"
    save_hardware(hw, path)
    back = load_hardware(path)
    assert back == hw
    assert back.gemm_table[0] == GemmRow(
        6144, 17920, 2816, "bf16", 792.1e12, "ml-engineering MAMF table, H100 SXM, CUDA 12.1"
    )


def test_shipped_a100_constants_are_the_table1_fit() -> None:
    tile, share, median = fit_gemm_constants()
    for name in ("a100-80gb", "a100-40gb"):
        hw = load_hardware(name)
        assert (hw.sm_count, hw.gemm_tile, hw.gemm_framework_share) == (108, tile, share)
    assert median <= 0.05
    # Hopper: its own measured kernel fraction, A100's tile, its framework share fitted on MosaicML's one-node H100
    # runs (the H200 is the same chip)
    hopper_share, hopper_median = fit_hopper_share()
    assert hopper_median <= 0.06
    for name in ("h100", "h200"):
        hw = load_hardware(name)
        assert (hw.gemm_tile, hw.gemm_framework_share) == (tile, hopper_share)


# --- chunk GEMMs on concurrent lanes (a tensor-parallel ring's, gemm.lanes_call_time) ------------------------------


def test_lanes_that_hold_a_full_wave_pack_the_calls_into_one_stream_of_tiles() -> None:
    hw = toy()  # 4 SMs at 0.8 × 0.5 of 100 TFLOP/s = 40 TFLOP/s per full wave
    flops = 2 * 384 * 128 * 1024  # one call: 3 × 1 tiles, alone 3 of 4 SMs busy
    alone = gemm_call_time(hw, 384, 128, 1024)
    assert alone == pytest.approx(flops / (40e12 * 0.75), rel=REL)
    # 2 lanes hold 6 ≥ 4 tiles: the 4 calls' 12 tiles run as 3 full waves
    packed = lanes_call_time(hw, 384, 128, 1024, calls=4, lanes=2)
    assert packed == pytest.approx(4 * flops / 40e12, rel=REL)
    assert lanes_call_time(hw, 384, 128, 1024, calls=4, lanes=1) == pytest.approx(4 * alone, rel=REL)


def test_lanes_that_cannot_fill_the_sms_run_in_rounds() -> None:
    hw = toy()
    flops = 2 * 128 * 128 * 1024  # one tile per call
    # 3 lanes hold 3 < 4 tiles: 7 calls run as rounds of 3, 3 and 1 calls, one wave each
    wave = flops / (40e12 * 0.25)  # one tile's time: a wave with one of 4 SMs busy
    assert gemm_call_time(hw, 128, 128, 1024) == pytest.approx(wave, rel=REL)
    assert lanes_call_time(hw, 128, 128, 1024, calls=7, lanes=3) == pytest.approx(3 * wave, rel=REL)


def test_without_an_sm_count_the_chunks_run_one_after_the_other() -> None:
    hw = dataclasses.replace(load_hardware("a100-80gb"), sm_count=0)
    one = gemm_call_time(hw, 512, 4608, 12288)
    assert lanes_call_time(hw, 512, 4608, 12288, calls=8, lanes=3) == pytest.approx(8 * one, rel=REL)
