"""tessera's trainer at dp = 1, 2, 4 against the single-device reference: loss and every gradient, every step.

Also: a run interrupted after a checkpoint and resumed reproduces the uninterrupted losses bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tessera.config import from_dict
from tessera.errors import ConfigError
from tessera.train.trainer import train
from tests.distributed.conftest import interrupted_then_resumed, train_recording, trainer_config
from tests.harness import run_distributed

# fp32 on CPU; data-parallel runs sum the same per-sample gradients in a different order (micro-batches vs ranks),
# so they agree to rounding, not bit for bit.
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
STEPS = 3


def _config(
    token_file: Path, run_dir: Path, family: str, dp: int, accumulation: str = "layered", **train: object
) -> dict:
    model = {"size": "gpt2-tiny" if family == "gpt" else "llama-tiny"}
    parallel = {"data": dp, "accumulation": accumulation}
    return trainer_config(token_file, run_dir, model, parallel, **{"steps": STEPS, **train})


LAYOUTS = {  # name: (family, dp, accumulation); layered with several micro-batches runs the schedule runtime
    "gpt_dp2_layered": ("gpt", 2, "layered"),
    "gpt_dp2_depth_first": ("gpt", 2, "depth_first"),
    "gpt_dp4": ("gpt", 4, "layered"),
    "llama_dp2_layered": ("llama", 2, "layered"),
}


Recorded = tuple[dict[int, float], list[dict[str, torch.Tensor]]]


@pytest.fixture(scope="module")
def reference(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Recorded]:
    """The reference run of a model family, trained once for the module (three gpt layouts each trained the same
    one): the plain model, micro-batches one after another, no schedule runtime; its losses and gradients."""
    runs: dict[str, Recorded] = {}

    def of(family: str) -> Recorded:
        if family not in runs:
            run_dir = tmp_path_factory.mktemp(f"ref_{family}")
            ref = _config(token_file, run_dir, family, dp=1, accumulation="depth_first")
            runs[family] = train_recording(0, 1, ref)
        return runs[family]

    return of


@pytest.mark.parametrize("name", LAYOUTS)
def test_data_parallel_matches_single_device(
    token_file: Path, tmp_path: Path, name: str, reference: Callable[[str], Recorded]
) -> None:
    family, dp, accumulation = LAYOUTS[name]
    ref_losses, ref_grads = reference(family)
    raw = _config(token_file, tmp_path / "dp", family, dp=dp, accumulation=accumulation)
    results = run_distributed(train_recording, dp, raw, timeout=240)
    for losses, grads in results:  # every rank holds the same averaged gradients
        for step in range(STEPS):
            torch.testing.assert_close(losses[step], ref_losses[step], rtol=LOSS_RTOL, atol=LOSS_ATOL)
            assert grads[step].keys() == ref_grads[step].keys()
            for name, g in grads[step].items():
                torch.testing.assert_close(g, ref_grads[step][name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)
    assert ref_losses[STEPS - 1] < ref_losses[0]


@pytest.mark.parametrize("dp", [1, 2], ids=["dp1", "dp2"])
def test_resume_reproduces_losses_exactly(token_file: Path, tmp_path: Path, dp: int) -> None:
    ckpt = {"every": 2, "resume": True}
    full = _config(token_file, tmp_path / "full", "gpt", dp=dp, steps=6)
    cut = _config(token_file, tmp_path / "cut", "gpt", dp=dp, steps=6)
    full["checkpoint"] = cut["checkpoint"] = ckpt
    if dp == 1:
        expected = train(from_dict(full)).losses
        resumed = interrupted_then_resumed(0, 1, cut, 4)
    else:
        expected = run_distributed(train_recording, dp, full, timeout=240)[0][0]
        resumed = run_distributed(interrupted_then_resumed, dp, cut, 4, timeout=240)[0]
    assert sorted(resumed) == [4, 5]  # steps 0-3 came from the checkpoint written after step 3
    for step in (4, 5):
        assert resumed[step] == expected[step]  # bit for bit


def test_vocab_too_small_is_a_clear_error(token_file: Path, tmp_path: Path) -> None:
    raw = _config(token_file, tmp_path / "v", "gpt", dp=1)
    raw["model"]["vocab_size"] = 100
    # The execution plan reads the token file's vocabulary, so this is refused before any rank starts (issue #13:
    # what validate can know moves into validate), with the same fix as the old train-time DataError.
    with pytest.raises(ConfigError, match=r"\[data\.vocab\].*\n.*fix: set model\.vocab_size >= 256"):
        train(from_dict(raw))
