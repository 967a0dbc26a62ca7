"""`tessera compare` without processes: refusals of bad input (exit 2, naming the problem and the fix) and
`compare_records`' verdicts on records built here (tessera/parity.py, docs/parity.md)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tessera.cli import main
from tessera.config import from_dict
from tessera.parity import (
    BF16,
    FP32,
    Record,
    check_comparable,
    compare_records,
    tensor_ratio,
    tolerance_for,
)

CONFIG = """
[model]
size = "gpt2-tiny"
seq_len = 16
[train]
global_batch = 8
micro_batch = 2
"""


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "a.toml"
    path.write_text(CONFIG)
    return str(path)


def _compare(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = main(["compare", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_differences_beyond_the_layout_are_refused_naming_each_key(config: str, capsys) -> None:
    code, text = _compare(
        capsys,
        config,
        "--b.train.lr=1e-3",
        "--b.model.n_layers=3",
        "--b.train.seed=5",
        "--b.train.global_batch=16",
        "--b.data.document_mask=true",
    )
    assert code == 2, text
    for key in ("train.lr", "model.n_layers", "train.seed", "train.global_batch", "data.document_mask"):
        assert key in text, (key, text)
    assert "fix:" in text


def test_layout_micro_batch_and_dtype_may_differ() -> None:
    a = from_dict({"model": {"size": "gpt2-tiny"}, "train": {"micro_batch": 2}})
    b = from_dict(
        {
            "model": {"size": "gpt2-tiny"},
            "parallel": {"pipeline": 2, "zero": 3, "schedule": "gpipe"},
            "train": {"micro_batch": 1, "dtype": "bf16", "skip_steps": [[1, 1]]},
            "log": {"run_dir": "elsewhere"},
        }
    )
    check_comparable(a, b)
    assert tolerance_for(a, b) is BF16 and tolerance_for(a, a) is FP32


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--steps", "0"], "--steps 0"),
        (["--b.lr=1"], "--b.section.key=value"),
        (["--train.dtype=fp16"], "train.dtype = 'fp16'"),
        (["--scale-grad", "blocks.0.attn.wq.weight"], "NAME=FACTOR"),
        (["--scale-grad", "blocks.9.nothing=2"], "no parameter 'blocks.9.nothing'"),
        (["--nproc-b", "3", "--b.parallel.tensor=2"], "config B at 3 process(es)"),
        (["--nproc-a", "0"], "--nproc-a 0"),
    ],
)
def test_bad_usage_exits_2_naming_the_problem(config: str, capsys, argv: list[str], named: str) -> None:
    code, text = _compare(capsys, config, *argv)
    assert code == 2, text
    assert named in text, text
    assert "Traceback" not in text


def test_a_missing_config_file_exits_2(tmp_path: Path, capsys) -> None:
    code, text = _compare(capsys, str(tmp_path / "nope.toml"))
    assert code == 2 and "does not exist" in text, text


def _record(grad: torch.Tensor, param: torch.Tensor, loss: float = 2.0, norm: float = 1.0) -> Record:
    grads = {"lin.weight": grad, "lin.bias": torch.zeros(3)}
    params = {"lin.weight": param, "lin.bias": torch.zeros(3)}
    return Record("layout", 1, "fp32", [loss], [norm], [1e-2], [grads], [params])


G = torch.tensor([[0.5, -0.25, 1e-3], [2e-2, 0.0, -0.75]])
P = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])


def test_equal_records_agree_and_each_kind_of_difference_is_named() -> None:
    ref = _record(G, P)
    assert compare_records(_record(G.clone(), P.clone()), ref, FP32).ok
    within = G * (1 + 5e-5)  # half of rtol
    assert compare_records(_record(within, P), ref, FP32).ok
    for bad, what in (
        (_record(G * 1.001, P), "grad"),  # 10 × rtol in every element
        (_record(G, P + 1e-5), "param"),  # > 2·lr·rtol + atol = 2.1e-6 where |g| is large
        (_record(G, P, loss=2.001), "loss"),
        (_record(G, P, norm=1.01), "norm"),
    ):
        report = compare_records(bad, ref, FP32)
        assert not report.ok
        worst = report.worst()
        assert worst.what == what and worst.ratio > 1, report.table()
        assert "DIVERGED" in report.verdict() and what in report.verdict()


def test_parameter_bound_follows_the_gradients_tolerance() -> None:
    """Where the gradient is within its tolerance of 0 the update is Adam's noise: not bounded; elsewhere the
    bound is 2·lr·(gradient tolerance / |g|)."""
    ref = _record(G, P)
    moved = P.clone()
    moved[1, 1] += 1e-2  # g = 0 there: a full Adam step of rounding noise is allowed
    assert compare_records(_record(G, moved), ref, FP32).ok
    moved = P.clone()
    moved[0, 2] += 1e-3  # |g| = 1e-3: gradient tolerance 1.01e-5, bound 1e-7 + 2·lr·1.01e-5/1e-3 ≈ 2.0e-4
    report = compare_records(_record(G, moved), ref, FP32)
    assert not report.ok and report.worst().name == "lin.weight", report.table()


def test_bf16_bound_is_relative_to_the_tensors_scale_and_a_bias_uses_its_weights() -> None:
    ref = _record(G, P)
    signs = torch.sign(torch.randn(G.shape, generator=torch.Generator().manual_seed(0)))
    noisy = G + 6 * 2.0**-8 * G.abs().max() * signs  # 6u of the tensor's scale: bf16's bound is 8u
    assert not compare_records(_record(noisy, P), ref, FP32).ok
    assert compare_records(_record(noisy, P), ref, BF16).ok
    bias_noise = _record(G, P)
    # noise of 1e-3 on a bias whose weight's gradients reach 0.75: within 8u of the weight's scale
    bias_noise.grads[0]["lin.bias"] = torch.full((3,), 1e-3)
    assert compare_records(bias_noise, ref, BF16).ok
    assert not compare_records(bias_noise, ref, FP32).ok


def test_missing_tensor_and_non_finite_values_diverge() -> None:
    ref = _record(G, P)
    missing = _record(G, P)
    del missing.grads[0]["lin.bias"]
    assert not compare_records(missing, ref, FP32).ok
    nan = _record(G.clone(), P)
    nan.grads[0]["lin.weight"][0, 0] = math.nan
    report = compare_records(nan, ref, FP32)
    assert not report.ok and report.worst().name == "lin.weight"


def test_a_relative_error_in_a_tensor_of_small_gradients_is_caught() -> None:
    """The elementwise bound's atol (1e-5) exceeds 1% of every gradient below 1e-3: fp32's tensor check
    (‖A − B‖ ≤ 1e-4·‖B‖ + EPS_FP32·R·max|g|·√n) sees the error relative to the tensor itself."""
    small = G * 1e-4  # largest gradient 7.5e-5
    ref = _record(small, P)
    ref.tokens = 256  # R: global batch 16 × sequence 16
    wrong = _record(small * 1.01, P)
    report = compare_records(wrong, ref, FP32)
    assert not report.ok, report.table()
    worst = report.worst()
    assert (worst.what, worst.name) == ("grad", "lin.weight") and worst.ratio > 10, report.table()
    # rounding-sized differences still agree: 1e-6 relative (the search's fp32 maximum is 1.3e-6)
    assert compare_records(_record(small * (1 + 1e-6), P), ref, FP32).ok


def test_rounding_noise_of_a_zero_gradient_is_not_flagged() -> None:
    """A bias whose exact gradient is 0 (GPT's key bias) holds rounding noise that differs between summation
    orders: ‖A − B‖ ≈ √2·‖B‖, far over any relative bound, but under the floor of its weight's scale."""
    gen = torch.Generator().manual_seed(1)
    ref, got = _record(G, P), _record(G, P)
    ref.tokens = got.tokens = 256
    noise = 16 * 2.0**-23 * float(G.abs().max())  # 16 ε of the weight's largest gradient, per element
    ref.grads[0]["lin.bias"] = noise * torch.randn(3, generator=gen)
    got.grads[0]["lin.bias"] = noise * torch.randn(3, generator=gen)
    report = compare_records(got, ref, FP32)
    assert report.ok, report.table()
    bias = next(r for r in report.rows if r.what == "grad" and r.name == "lin.bias")
    assert bias.rel > 0.5, bias  # the difference is as large as the gradient itself: pure noise
    whole = tensor_ratio(got.grads[0]["lin.bias"], ref.grads[0]["lin.bias"], 0.75, ref.tokens, FP32)
    assert whole < 0.2, whole  # the floor is EPS_FP32·R·0.75·√3 (R = 256), ~10× the noise
    # without its weight's scale the bias's own noise would set the floor, and the check would flag it
    assert tensor_ratio(got.grads[0]["lin.bias"], ref.grads[0]["lin.bias"], noise, ref.tokens, FP32) > 1
