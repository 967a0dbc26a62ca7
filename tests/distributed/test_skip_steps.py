"""Training with ``train.skip_steps`` (docs/data.md, "Skipping batches after a loss spike"): a skipped step runs no
forward, backward or update, its samples are passed over and the learning rate moves on, so the run is exactly the
other steps of the run without the key, each on its own samples at its own learning rate; a resume inside the
range at another data-parallel size, or one that adds the range, trains the same. The checks of the key:
tests/unit/test_skip_steps.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessera.config import from_dict
from tessera.errors import CheckpointError
from tessera.model.build import build_model
from tessera.train import checkpoint as ckpt
from tessera.train.metrics import read_metrics
from tessera.train.trainer import TrainingRun, train
from tests.distributed.conftest import train_until, trainer_config
from tests.distributed.test_reshard_resume import (  # a resume at another data-parallel size: its tolerances
    LOSS_ATOL,
    LOSS_RTOL,
    WEIGHT_ATOL,
    WEIGHT_RTOL,
)
from tests.harness import run_distributed

TINY = {"family": "gpt", "n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 16}
STEPS, SKIP = 6, [[2, 3]]
LR = 1e-3


def _raw(token_file: Path, run_dir: Path, parallel: dict | None = None, **train_section: object) -> dict:
    raw = trainer_config(token_file, run_dir, TINY, parallel or {}, steps=STEPS, lr=LR, **train_section)
    raw["checkpoint"] = {"every": 0, "resume": True}
    return raw


def _weights(raw: dict) -> dict[str, torch.Tensor]:
    """The plain model's weights in the run's newest checkpoint."""
    model = build_model(from_dict(raw).model)
    ckpt.load_model_weights(ckpt.latest_checkpoint(Path(raw["log"]["run_dir"]) / "checkpoints"), model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _until(rank: int, world: int, raw: dict, step: int) -> None:
    """`train_until` as a `run_distributed` target."""
    train_until(raw, step)


def test_a_skip_range_trains_the_other_steps_on_their_own_samples(
    token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Steps 2-3 skipped: the losses of steps 0, 1, 4, 5 and the final weights are bit for bit those of stepping
    the run without the key through steps 0, 1, 4, 5 by hand (step k draws step k's samples at lr_at(k)). Training
    steps 2-3 anyway, shifting later steps onto their samples, or counting the schedule by updates all differ."""
    raw = _raw(token_file, tmp_path / "skip", skip_steps=SKIP)
    losses = train(from_dict(raw)).losses
    assert "steps 2-3 are not trained on: their samples 16-31 are passed over" in capsys.readouterr().err

    run = TrainingRun(from_dict(_raw(token_file, tmp_path / "reference")), 0, 1)
    expected = {k: run.step(k, None)[0] for k in (0, 1, 4, 5)}
    assert losses == expected
    by_hand = dict(run.model.named_parameters())
    for name, value in _weights(raw).items():
        assert torch.equal(value, by_hand[name].detach()), name

    records = {m["step"]: m for m in read_metrics(tmp_path / "skip")}
    assert sorted(records) == list(range(STEPS))
    assert [k for k, m in records.items() if "skipped_samples" in m] == [2, 3]
    assert records[2]["skipped_samples"] == 8 and "loss" not in records[2] and "loss" in records[4]


def test_a_resume_inside_the_range_at_another_data_parallel_size_trains_the_same(
    token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Checkpointed at step 3 (inside 2-3) by a dp2 run and resumed on one process: it skips step 3 and trains
    steps 4-5 as the uninterrupted one-process run does (within the tolerances of a changed summation order)."""
    whole = _raw(token_file, tmp_path / "whole", skip_steps=SKIP)
    expected = train(from_dict(whole)).losses
    cut = _raw(token_file, tmp_path / "cut", {"data": 2}, skip_steps=SKIP)
    cut["checkpoint"]["every"] = 3
    run_distributed(_until, 2, cut, 4, timeout=120)  # saves step 3 (steps 0-1 trained, 2 skipped), dies in 4
    one = dict(cut, parallel={})
    capsys.readouterr()
    result = train(from_dict(one))
    assert result.resumed_from == 3 and sorted(result.losses) == [4, 5]
    assert "step 3 is not trained on: its samples 24-31 are passed over" in capsys.readouterr().err
    for k in (4, 5):
        assert result.losses[k] == pytest.approx(expected[k], rel=LOSS_RTOL, abs=LOSS_ATOL), k
    reference = _weights(whole)
    for name, value in _weights(one).items():
        torch.testing.assert_close(value, reference[name], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=name)


def test_a_range_added_on_resume_skips_from_there_and_one_reaching_back_is_refused(
    token_file: Path, tmp_path: Path
) -> None:
    """The loss-spike recovery: a run without the key checkpointed at step 2 is resumed with skip_steps = [[2, 3]]
    and trains steps 4-5 bit for bit as a run that had the key from the start. [[1, 3]] would claim that step 1,
    trained, was skipped: refused before anything is loaded."""
    plain = _raw(token_file, tmp_path / "run")
    plain["checkpoint"]["every"] = 2
    train_until(plain, 3)  # checkpoint of step 2
    back = _raw(token_file, tmp_path / "run", skip_steps=[[1, 3]])
    with pytest.raises(CheckpointError, match="skipped steps none of its steps 0-1, the new value says 1"):
        TrainingRun(from_dict(back), 0, 1)
    added = train(from_dict(_raw(token_file, tmp_path / "run", skip_steps=SKIP)))
    assert added.resumed_from == 2 and sorted(added.losses) == [4, 5]
    expected = train(from_dict(_raw(token_file, tmp_path / "whole", skip_steps=SKIP))).losses
    assert {k: expected[k] for k in (4, 5)} == added.losses
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000006" / "meta.json").read_text())
    assert meta["extra"]["settings"]["train.skip_steps"] == SKIP and meta["extra"]["samples"] == STEPS * 8
