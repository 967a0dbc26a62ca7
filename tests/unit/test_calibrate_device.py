"""`tessera calibrate --device`: the GPU profile's assembly (base file + injected measurements), the device and
base choice, and the CLI's errors. No GPU here: the CUDA measurement functions are not run; everything else is."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tessera.cli import main
from tessera.config import ModelConfig
from tessera.errors import ConfigError, TesseraError
from tessera.planner import calibrate as cal
from tessera.planner.calibrate import (
    AttentionShape,
    CollectiveFit,
    GpuMeasurements,
    attention_flops,
    base_for_device,
    gpu_profile,
    resolve_device,
)
from tessera.planner.cost import ModelShape, Plan
from tessera.planner.cost.compute import attention_core_time
from tessera.planner.hardware import GemmRow, Hardware, load_hardware, save_hardware
from tessera.planner.steptime import fast_step

ROWS = (GemmRow(8192, 8192, 8192, "bf16", 701e12), GemmRow(2048, 12288, 4096, "bf16", 655e12))
"""Injected bf16 GEMM rows, below H100's peak × quantization and unlike the base's published row."""


def _measured(collectives: CollectiveFit | None = None, sms: int = 132) -> GpuMeasurements:
    return GpuMeasurements(
        device_name="NVIDIA H100 80GB HBM3",
        sm_count=sms,
        gemm_rows=ROWS,
        hbm_bandwidth=2.9e12,
        attention_seconds=4.2e-3,
        collectives=collectives,
    )


@pytest.mark.parametrize("collectives", [None, CollectiveFit(8, 310e9, 7.5e-6)])
def test_profile_replaces_exactly_the_measured_fields(collectives: CollectiveFit | None) -> None:
    base = load_hardware("h100")
    hw, lines = gpu_profile(base, _measured(collectives), "node7")
    expected = {
        "name": "node7",
        "sm_count": 132,
        "gemm_table": [r._replace(source="tessera calibrate, NVIDIA H100 80GB HBM3") for r in ROWS],
        "hbm_bandwidth": 2.9e12,
        "flash_attention_flops": attention_flops(cal.ATTENTION_SHAPE) / 4.2e-3,
    }
    if collectives:
        expected |= {"intra_node_bandwidth": 310e9, "intra_node_latency": 7.5e-6}
    for key in Hardware.__dataclass_fields__:
        want = expected.get(key, getattr(base, key))
        assert getattr(hw, key) == want, key
    # the injected values differ from the base's, so a field left unreplaced would fail above
    assert all(getattr(base, k) != v for k, v in expected.items() if k != "sm_count")
    # every field but the name is reported once, as measured or kept
    for key in set(Hardware.__dataclass_fields__) - {"name"}:
        tagged = [
            line for line in lines if line.split()[:2] in (["measured", f"{key}:"], ["kept", f"{key}:"])
        ]
        assert len(tagged) == 1, key
        assert tagged[0].split()[0] == ("measured" if key in expected else "kept"), key
    assert any("one node cannot measure the network between nodes" in line for line in lines)
    one_gpu = "one GPU visible: no NCCL sweep possible"
    assert any(one_gpu in line for line in lines) == (collectives is None)
    assert not any("WARNING" in line for line in lines)


def test_profile_keeps_the_peak_and_reads_measured_rows_as_kernel_fractions() -> None:
    from tessera.planner.gemm import kernel_fraction, quantization

    base = load_hardware("h100")
    hw, _ = gpu_profile(base, _measured(), "node7")
    assert hw.peak_flops == base.peak_flops
    ratios = sorted(r.flops_per_s / (989e12 * quantization(r.m, r.n, 1, (128, 128), 132)) for r in ROWS)
    assert kernel_fraction(hw.gemm_table, hw.peak_flops, hw.gemm_tile, hw.sm_count) == pytest.approx(
        (ratios[0] + ratios[1]) / 2
    )


def test_a_row_above_the_base_peak_names_the_wrong_base() -> None:
    too_fast = replace(_measured(), gemm_rows=(GemmRow(8192, 8192, 8192, "bf16", 700e12),))
    with pytest.raises(ConfigError, match=r"describes another GPU.*--base"):
        gpu_profile(load_hardware("a100-80gb"), too_fast, "x")  # 700 TFLOP/s on a 312 TFLOP/s part


def test_other_sm_count_is_flagged() -> None:
    hw, lines = gpu_profile(load_hardware("h100"), _measured(sms=114), "x")
    assert hw.sm_count == 114
    assert any("WARNING" in line and "114 SMs" in line for line in lines)


def test_written_profile_loads_back_and_prices_a_plan(tmp_path) -> None:
    base = load_hardware("h100")
    hw, _ = gpu_profile(base, _measured(CollectiveFit(8, 310e9, 7.5e-6)), "node7")
    path = tmp_path / "node7.toml"
    save_hardware(hw, path)
    loaded = load_hardware(path)
    assert loaded == hw
    shape = ModelShape.from_config(
        ModelConfig(family="gpt", n_layers=24, d_model=2048, n_heads=16, vocab_size=51200, seq_len=2048)
    )
    plan = Plan(tp=8, micro_batch=4, n_microbatches=8, flash_attention=True)
    measured, published = fast_step(shape, loaded, plan, "1f1b"), fast_step(shape, base, plan, "1f1b")
    assert math.isfinite(measured.step_time) and measured.step_time > 0
    assert measured.step_time != published.step_time  # the measured rates reach the price


def test_attention_rate_reproduces_the_measured_time() -> None:
    """FLOPs counted as attention_core_time charges them: measured rate × model = measured time."""
    a = AttentionShape(batch=4, heads=16, seq=4096, head_dim=128)
    seconds = 3.7e-3
    hw, _ = gpu_profile(load_hardware("h100"), replace(_measured(), attention_seconds=seconds), "x")
    shape = ModelShape(
        n_layers=1,
        d_model=16 * 128,
        n_heads=16,
        n_kv_heads=16,
        ffn_hidden=4 * 2048,
        vocab_size=8,
        seq_len=4096,
    )
    plan = Plan(micro_batch=4, dtype="bf16", flash_attention=True)
    forward, backward = attention_core_time(shape, hw, plan)
    # the model applies the framework share to a kernel rate, as to GEMMs; the kernel alone is the measurement
    assert (forward + backward) * hw.gemm_framework_share == pytest.approx(seconds, rel=1e-12)
    assert attention_flops(a) == pytest.approx(3.5 * 4 * 4096**2 * 128 * 64 / 2, rel=1e-15)


@pytest.mark.parametrize(
    ("device_name", "base"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ],
)
def test_base_from_device_name(device_name: str, base: str) -> None:
    assert base_for_device(device_name) == base


@pytest.mark.parametrize(
    "device_name",
    ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA GH200 480GB", "NVIDIA A100-PCIE-40GB", "Tesla V100"],
)
def test_unknown_device_name_asks_for_base(device_name: str) -> None:
    with pytest.raises(ConfigError, match="--base NAME"):
        base_for_device(device_name)


def test_resolve_device() -> None:
    assert resolve_device("auto", False) == "cpu"
    assert resolve_device("auto", True) == "cuda"
    assert resolve_device("cpu", True) == "cpu"
    with pytest.raises(TesseraError, match="--device cpu"):
        resolve_device("cuda", False)


def test_cli_cuda_without_cuda_is_a_clear_error(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.toml"
    assert main(["calibrate", "--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "torch.cuda.is_available() is False" in err and "--device cpu" in err
    assert "Traceback" not in err and not out.exists()


def test_cli_auto_without_cuda_takes_the_cpu_path(tmp_path, monkeypatch, capsys) -> None:
    calls = []

    def cpu(**kwargs):
        calls.append(kwargs)
        return load_hardware("a100-80gb"), "cpu report"

    def gpu(*args, **kwargs):
        raise AssertionError("the GPU path ran on a machine without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cal, "calibrate", cpu)
    monkeypatch.setattr(cal, "calibrate_gpu", gpu)
    out = tmp_path / "this.toml"
    assert main(["calibrate", "--out", str(out), "--quick"]) == 0
    assert calls == [{"name": "this", "quick": True, "world": 2}]
    assert "cpu report" in capsys.readouterr().out and out.is_file()


def test_cli_base_on_cpu_is_an_error(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["calibrate", "--device", "cpu", "--base", "h100", "--out", str(tmp_path / "x.toml")]) == 2
    assert "--base h100 applies to a GPU calibration" in capsys.readouterr().err


def test_cli_unknown_gpu_without_base_stops_before_measuring(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA RTX 4090")
    monkeypatch.setattr(cal, "measure_gpu", lambda **kw: pytest.fail("measured before choosing the base"))
    assert main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err
    assert "'NVIDIA RTX 4090'" in err and "--base NAME" in err and "Traceback" not in err


def test_calibrate_gpu_chooses_the_base_and_measures_its_published_shape(monkeypatch) -> None:
    """The glue without a device: base from the device name, its published row's shape measured too, and the
    report compares the two at that shape."""
    seen = {}

    def fake_measure(**kwargs):
        seen.update(kwargs)
        return replace(_measured(), gemm_rows=(*ROWS, GemmRow(6144, 17920, 2816, "bf16", 760e12)))

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cal, "measure_gpu", fake_measure)
    hw, report = cal.calibrate_gpu("node7", quick=True)
    assert seen["shapes"] == (*cal.GPU_GEMM_SHAPES, (6144, 17920, 2816))
    assert seen["quick"] is True and seen["world"] is None
    assert hw.name == "node7" and hw.peak_flops == load_hardware("h100").peak_flops
    assert "base file 'h100'" in report
    assert "at the base's published shape 6144x17920x2816 bf16: measured 760 TFLOP/s, published 792" in report


def test_base_without_per_shape_model_reports_the_measured_fraction_only() -> None:
    base = replace(load_hardware("h100"), sm_count=0, gemm_table=[])
    hw, lines = gpu_profile(base, _measured(), "x")
    assert hw.sm_count == 132 and len(hw.gemm_table) == len(ROWS)
    assert any("the base had no per-shape GEMM model" in line for line in lines)
