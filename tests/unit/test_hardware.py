"""Hardware descriptions: shipped files load with datasheet values, round-trip through TOML, clear errors."""

from __future__ import annotations

import math

import pytest

from tessera.errors import ConfigError
from tessera.planner.hardware import (
    DEFAULT_GEMM_EFFICIENCY,
    Hardware,
    list_hardware,
    load_hardware,
    save_hardware,
)

REL = 1e-12  # exact arithmetic on stored constants


def test_list_hardware_names_the_shipped_files() -> None:
    assert list_hardware() == ["a100-40gb", "a100-80gb", "h100", "h200"]


@pytest.mark.parametrize(
    ("name", "bf16", "memory", "hbm", "nvlink", "nic"),
    [
        ("a100-80gb", 312e12, 80e9, 2.039e12, 300e9, 25e9),
        ("a100-40gb", 312e12, 40e9, 1.555e12, 300e9, 25e9),
        ("h100", 989e12, 80e9, 3.35e12, 450e9, 50e9),
        ("h200", 989e12, 141e9, 4.8e12, 450e9, 50e9),
    ],
)
def test_shipped_values_match_datasheets(
    name: str, bf16: float, memory: float, hbm: float, nvlink: float, nic: float
) -> None:
    hw = load_hardware(name)
    assert hw.name == name
    assert hw.peak("bf16") == bf16 and hw.peak("fp16") == bf16
    assert set(hw.peak_flops) == {"bf16", "fp16", "tf32", "fp32"}
    assert (hw.memory_bytes, hw.hbm_bandwidth) == (memory, hbm)
    assert (hw.intra_node_bandwidth, hw.inter_node_bandwidth, hw.gpus_per_node) == (nvlink, nic, 8)


def test_efficiency_interpolates_in_log_space_and_clamps() -> None:
    hw = load_hardware("a100-80gb")
    # halfway between 1e9 (0.42) and 1e10 (0.56) in log10 space
    assert hw.efficiency(10**9.5) == pytest.approx(0.49, rel=REL)
    assert hw.efficiency(1e9) == pytest.approx(0.42, rel=REL)
    assert hw.efficiency(1.0) == DEFAULT_GEMM_EFFICIENCY[0][1]
    assert hw.efficiency(1e15) == DEFAULT_GEMM_EFFICIENCY[-1][1]


def test_save_and_load_round_trip(tmp_path) -> None:
    hw = load_hardware("h200")
    hw.gemm_efficiency = [(1e8, 0.3), (1e11, 0.8)]
    path = tmp_path / "mine.toml"
    save_hardware(hw, path)
    back = load_hardware(path)
    assert back == hw
    assert back.efficiency(1e8 * math.sqrt(1e3)) == pytest.approx(0.55, rel=REL)


def test_unknown_name_lists_available() -> None:
    with pytest.raises(ConfigError, match=r"unknown hardware 'tpu-v9'.*a100-80gb.*h200"):
        load_hardware("tpu-v9")


def test_missing_and_unknown_keys_are_named(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('name = "bad"\nmemory_bytes = 1e9\ncolour = "red"\n[peak_flops]\nbf16 = 1e12\n')
    with pytest.raises(ConfigError, match=r"unknown keys \['colour'\].*hbm_bandwidth"):
        load_hardware(path)


def test_invalid_values_rejected() -> None:
    with pytest.raises(ConfigError, match="hbm_bandwidth must be > 0"):
        Hardware(
            name="x",
            peak_flops={"bf16": 1e12},
            memory_bytes=1e9,
            hbm_bandwidth=0,
            gpus_per_node=1,
            intra_node_bandwidth=1e9,
            intra_node_latency=0,
            inter_node_bandwidth=1e9,
            inter_node_latency=0,
        )


def test_unknown_dtype_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="no peak FLOP/s for dtype 'fp8'"):
        load_hardware("h100").peak("fp8")
