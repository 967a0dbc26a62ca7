"""``train.skip_steps`` (docs/data.md, "Skipping batches after a loss spike"): `tessera validate` refuses ranges
that are not ranges, naming the key and the fix, and a resume may add ranges from its step on but may not rewrite
which steps before it were skipped. Training with the key: tests/distributed/test_skip_steps.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tessera.cli import main
from tessera.config import from_dict
from tessera.errors import CheckpointError
from tessera.train.compat import check_compatible, run_settings
from tessera.train.metrics import format_metrics
from tessera.train.skips import is_skipped, skipped_before

CKPT = Path("run/checkpoints/step_00000010")


def _violations(skip_steps: Any, steps: int = 100) -> list[str]:
    cfg = from_dict({"train": {"steps": steps, "skip_steps": skip_steps}})
    return [str(v) for v in cfg.check(1) if v.rule == "train.skip_steps"]


@pytest.mark.parametrize(
    ("ranges", "problem", "fix"),
    [
        ([[5, 3]], "[5, 3] starts after it ends", "write it as [3, 5]"),
        ([[-1, 2]], "[-1, 2] names a negative step", "e.g. train.skip_steps = [[1200, 1499]]"),
        ([[10, 40], [30, 60]], "[10, 40] and [30, 60] overlap", "merge them into one range [10, 60]"),
        ([[30, 60], [10, 30]], "[10, 30] and [30, 60] overlap", "merge them into one range [10, 60]"),
        ([[7]], "[7] is not a range [first, last]", "e.g. train.skip_steps = [[1200, 1499]]"),
        ([[1, 2.5]], "[1, 2.5] is not a range", "[first step, last step]"),
        ([[True, 2]], "[True, 2] is not a range", "[first step, last step]"),
        (
            [[100, 120]],
            "[100, 120] starts at or after train.steps = 100, so it skips nothing",
            "name steps below 100",
        ),
    ],
)
def test_validate_refuses_bad_ranges_naming_the_key_and_the_fix(ranges: Any, problem: str, fix: str) -> None:
    (v,) = _violations(ranges)
    assert f"train.skip_steps: {problem}" in v and fix in v, v


@pytest.mark.parametrize("ranges", [[], [[0, 0]], [[3, 4], [5, 9]], [[90, 10**6]], [[50, 60], [10, 20]]])
def test_validate_accepts_ranges(ranges: list[list[int]]) -> None:
    """Touching ranges and one running past the last step (it skips to the end) are fine; order is free."""
    assert _violations(ranges) == []


def test_the_validate_command_refuses_and_exits_1(capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", "--world-size", "1", "--train.skip_steps=[[20, 10]]"]) == 1
    out = capsys.readouterr().out
    assert "train.skip_steps: [20, 10] starts after it ends" in out and "write it as [10, 20]" in out


def test_skipped_steps_are_those_of_the_ranges_ends_included() -> None:
    ranges = [[2, 3], [7, 7]]
    assert [k for k in range(10) if is_skipped(k, ranges)] == [2, 3, 7]
    # what a checkpoint of step 3 was trained without; spellings of the same steps agree
    assert skipped_before(ranges, 3) == [[2, 2]]
    assert skipped_before([[4, 5], [1, 3]], 10) == skipped_before([[1, 5]], 10) == [[1, 5]]


def test_the_progress_line_of_a_skipped_step_says_so() -> None:
    line = format_metrics({"step": 2, "lr": 1e-3, "skipped_samples": 8})
    assert line == "skipped (8 samples passed over: train.skip_steps)"


def _settings(skip_steps: list[list[int]] | None) -> dict[str, Any]:
    train = {"steps": 100} | ({} if skip_steps is None else {"skip_steps": skip_steps})
    return run_settings(from_dict({"train": train}), {"tokenizer": "byte", "vocab_size": 256})


def test_a_resume_may_add_ranges_from_its_step_on() -> None:
    """The use case: resumed at step 10 from a run that skipped nothing, skip 10-39 (and later ones); ranges
    entirely before the step that the checkpoint's run skipped may stay."""
    check_compatible(CKPT, _settings([]), _settings([[10, 39]]), 10)
    check_compatible(CKPT, _settings([]), _settings([[12, 39], [60, 70]]), 10)
    check_compatible(CKPT, _settings([[2, 3]]), _settings([[2, 3], [10, 39]]), 10)
    check_compatible(CKPT, _settings([[2, 3], [10, 39]]), _settings([[2, 3]]), 10)  # a future one dropped
    # resumed inside a range the checkpoint's run had already entered: its rest may change
    check_compatible(CKPT, _settings([[8, 20]]), _settings([[8, 30]]), 10)
    # a checkpoint of a tessera without the key skipped nothing
    old = _settings([])
    del old["train.skip_steps"]
    check_compatible(CKPT, old, _settings([[10, 20]]), 10)


@pytest.mark.parametrize(
    ("saved", "now", "before", "claimed"),
    [
        ([], [[5, 20]], "none", "5-9"),  # steps 5-9 were trained: the key cannot undo that
        ([[2, 3]], [], "2-3", "none"),  # steps 2-3 were skipped: dropping the range rewrites the record
        ([[2, 3]], [[2, 4]], "2-3", "2-4"),
        ([[8, 20]], [[9, 20]], "8-9", "9"),
        (None, [[0, 0]], "none", "0"),  # an older checkpoint (no key) skipped nothing either
    ],
)
def test_a_resume_may_not_rewrite_which_steps_before_it_were_skipped(
    saved: list[list[int]] | None, now: list[list[int]], before: str, claimed: str
) -> None:
    old = _settings(saved or [])
    if saved is None:
        del old["train.skip_steps"]
    with pytest.raises(CheckpointError) as e:
        check_compatible(CKPT, old, _settings(now), 10)
    msg = str(e.value)
    assert (
        f"train.skip_steps: the checkpoint's run skipped steps {before} of its steps 0-9, the new value says "
        f"{claimed}" in msg
    )
    assert "ranges starting at 10 or later" in msg and "checkpoint.load_step" in msg
