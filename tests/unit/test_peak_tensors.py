"""`tessera dryrun --peak-tensors N`: the storages alive at a rank's peak, each with where it was made.

`FakeRank(record=True)` logs every storage's birth (shape, dtype, operator, the autograd node running, the code
line) and every change of its size, so the live set of any moment can be read back afterwards; the dry run reads
it at the step's peak. Checked on cases whose peak contents are known by construction, then on a dry run whose
listed storages must add up to its reported peak.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tessera.cli import main
from tessera.config import from_dict
from tessera.dryrun import dry_run, format_peak_tensors
from tessera.fake import FakeRank, LiveTensor

HERE = "tests/unit/test_peak_tensors.py"


def _line() -> int:
    """The caller's line number: where the tensor on that line was made."""
    return inspect.currentframe().f_back.f_lineno  # type: ignore[union-attr]


def test_the_peak_holds_what_was_alive_then_views_once() -> None:
    """A 4 MB tensor and its view (one storage), a 1 MB one freed before the peak, a 2 MB one alive at the peak
    and freed after it, then a 1 MB one: the peak's moment holds the 4 MB and the 2 MB storage, nothing else."""
    with FakeRank(record=True) as fr:
        early = torch.empty(250_000)  # 1 MB, freed before the peak
        del early
        big = torch.empty(1000, 1000)  # 4 MB
        big_line = _line() - 1
        view = big.view(500, 2000)  # the same storage: counted once
        mid = torch.ones(1_000_000, dtype=torch.bfloat16)  # 2 MB: the peak is reached here
        mid_line = _line() - 1
        del mid
        late = torch.empty(250_000)  # 1 MB: after the peak
        assert fr.peak == 6_000_000 and fr.live == 5_000_000
        at_peak = fr.live_at(fr.peak_moment())
    assert view.untyped_storage().nbytes() == 4_000_000 and late.numel() == 250_000
    assert at_peak == [
        LiveTensor(
            4_000_000, (1000, 1000), "float32", "aten.empty", "forward", _where(big_line, "the_peak"), ""
        ),
        LiveTensor(
            2_000_000, (1_000_000,), "bfloat16", "aten.ones", "forward", _where(mid_line, "the_peak"), ""
        ),
    ]


def _where(line: int, test: str) -> str:
    name = next(n for n in globals() if n.startswith(f"test_{test}"))
    return f"{HERE}:{line} ({name})"


def test_a_backward_tensor_names_its_autograd_node() -> None:
    """exp's backward multiplies the upstream gradient by the saved result: at that moment the input, the saved
    result and the product (4 MB each, the peak) are alive, the product made by ExpBackward0."""
    with FakeRank(record=True) as fr:
        x = torch.empty(1_000_000, requires_grad=True)
        y = x.exp()
        y.sum().backward()
        at_peak = fr.live_at(fr.peak_moment())
    assert x.grad is not None and y.shape == x.shape
    big = [(t.op, t.node) for t in at_peak if t.nbytes == 4_000_000]
    assert sorted(big) == [("aten.empty", "forward"), ("aten.exp", "forward"), ("aten.mul", "ExpBackward0")]
    assert sum(t.nbytes for t in at_peak) == fr.peak


def test_a_tracker_without_record_refuses_to_list() -> None:
    with FakeRank() as fr, pytest.raises(RuntimeError, match="record=True"):
        fr.live_at(0)


RAW = {  # a vocabulary-dominated GPT on one rank: the head's [N, V] fp32 tensors fill the peak
    "model": {"family": "gpt", "n_heads": 2, "d_model": 32, "vocab_size": 8192, "seq_len": 64, "n_layers": 1},
    "train": {"micro_batch": 4, "global_batch": 4},
}


def test_the_dry_runs_peak_tensors_add_up_to_its_peak() -> None:
    """Every storage alive at the peak's moment is listed: with the optimizer state the step's update makes (the
    peak counts it, as every later step holds it) they are the reported peak to the byte; the largest are the
    loss's [N, V] fp32 tensors (N = 4 · 64 tokens, V = 8192: 8 MiB each, beside 2 MiB of parameters)."""
    result = dry_run(from_dict(RAW), 1, 0, peak_tensors=True)
    assert result.peak_phase == "backward"
    assert sum(t.nbytes for t in result.peak_tensors) + result.optimizer == result.peak
    largest = result.peak_tensors[0]
    assert largest.nbytes == 4 * 256 * 8192 and largest.dtype == "float32" and largest.phase == "step"
    text = format_peak_tensors(result, 2)
    assert "the 2 largest of" in text and "optimizer state" in text


def test_the_cli_lists_each_ranks_peak_tensors(capsys: pytest.CaptureFixture) -> None:
    overrides = [f"--{section}.{k}={v}" for section, keys in RAW.items() for k, v in keys.items()]
    assert main(["dryrun", "--world-size", "1", "--peak-tensors", "3", *overrides]) == 0
    out = capsys.readouterr().out
    table = out[out.index("peak tensors:") :].splitlines()
    assert "the 3 largest of" in table[0] and "made by" in table[1]
    assert len(table) == 2 + 3 + 2  # header, 3 groups, the rest, the optimizer state
    assert main(["dryrun", "--world-size", "1", "--peak-tensors", "-1"]) != 0
    assert "--peak-tensors -1" in capsys.readouterr().err
