"""Resuming with changed settings does what docs/checkpoints.md ("What a resume may change") says, where the
trainer decides it (single process): a changed global batch continues at the checkpoint's sample, a changed
weight decay takes effect, and a run restarted at an earlier step supersedes the checkpoints after it. The refusals
are decided by functions: tests/unit/test_resume_settings.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.config import from_dict
from tessera.errors import CheckpointError
from tessera.train.trainer import TrainingRun, train
from tests.distributed.conftest import train_until, trainer_config

TINY = {"family": "gpt", "n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 16}


def _raw(token_file: Path, run_dir: Path, **train_section: object) -> dict:
    raw = trainer_config(token_file, run_dir, TINY, {}, steps=4, **train_section)
    raw["checkpoint"] = {"every": 2, "resume": True}
    return raw


def test_a_changed_global_batch_continues_at_the_checkpoints_sample(
    token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Step 2 of a run resumed at global batch 4 from a global-batch-8 checkpoint took samples 8..11, trained at
    step 1 already (a larger batch left samples out); it now takes 16..19, and its checkpoints count on from there."""
    train_until(_raw(token_file, tmp_path), 2)  # samples 0..15 trained
    smaller = _raw(token_file, tmp_path, global_batch=4)
    run = TrainingRun(from_dict(smaller), 0, 1)
    assert run.resume() == 2
    assert "continues at sample 16, where step 2 of the checkpoint's run left off" in capsys.readouterr().err
    x = torch.cat([b[0] for b in run.batches(2)])
    expected = np.stack([run.data.sample(i, TINY["seq_len"], 1234)[0] for i in range(16, 20)])
    assert torch.equal(x, torch.from_numpy(expected))
    assert sorted(train(from_dict(smaller)).losses) == [2, 3]
    meta = json.loads((tmp_path / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["extra"]["samples"] == 16 + 2 * 4  # what the next resume continues from


def test_a_changed_weight_decay_takes_effect(token_file: Path, tmp_path: Path) -> None:
    """The load put the checkpoint's weight decay back over the config's (same layout, same groups): a resume
    with train.weight_decay = 0.5 trained with 0.1."""
    train_until(_raw(token_file, tmp_path), 2)
    run = TrainingRun(from_dict(_raw(token_file, tmp_path, weight_decay=0.5)), 0, 1)
    run.resume()
    assert [g["weight_decay"] for g in run.optimizer.param_groups] == [0.5, 0.0]


def test_a_run_restarted_at_an_earlier_step_supersedes_the_later_checkpoints(
    token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Restarted from step 2 of a finished 4-step run (checkpoint.load_step), saving every step and stopped after
    step 3: pruning kept the replaced run's step 4 over the new step 2, and the next resume took step 4."""
    train(from_dict(_raw(token_file, tmp_path)))  # step_2, step_4
    again = _raw(token_file, tmp_path)
    again["checkpoint"] |= {"load_step": 2, "every": 1}
    train_until(again, 3)  # saves step 3, then stops
    assert "moved them to" in capsys.readouterr().err
    ckpts = tmp_path / "checkpoints"
    (aside,) = ckpts.glob("superseded_*_from_step_00000002")
    assert [p.name for p in aside.iterdir()] == ["step_00000004"]
    assert train(from_dict(_raw(token_file, tmp_path))).resumed_from == 3


def test_a_changed_checkpoint_dir_without_its_checkpoints_is_refused(
    token_file: Path, tmp_path: Path
) -> None:
    """checkpoint.dir changed to an empty folder: the run started over at step 0 and replaced its metrics."""
    train_until(_raw(token_file, tmp_path), 2)
    moved = _raw(token_file, tmp_path)
    moved["checkpoint"]["dir"] = str(tmp_path / "elsewhere")
    with pytest.raises(
        CheckpointError,
        match=r"(?s)elsewhere holds no checkpoint, but the last run .* saved its "
        r"checkpoints in .*checkpoints \(newest step_00000002\).*fix: set checkpoint.dir = ",
    ):
        TrainingRun(from_dict(moved), 0, 1)
    moved["checkpoint"]["resume"] = False  # starting over, asked for
    assert TrainingRun(from_dict(moved), 0, 1).resume() == 0


def test_the_skipped_step_counts_survive_a_resume(token_file: Path, tmp_path: Path) -> None:
    """train.nonfinite = "skip": the metric nonfinite_skipped restarted at 0 after a resume, and so did the count of
    consecutive skips that train.max_skips limits (a checkpoint after 2 of 3 allowed skips allowed 3 more)."""
    raw = _raw(token_file, tmp_path, nonfinite="skip")
    run = TrainingRun(from_dict(raw), 0, 1)
    run.resume()
    run.health.skipped, run.health.skips_in_a_row = 5, 2
    run.save(2)
    again = TrainingRun(from_dict(raw), 0, 1)
    assert again.resume() == 2
    assert (again.health.skipped, again.health.skips_in_a_row) == (5, 2)


def test_a_changed_data_order_resumes_only_when_asked_for(token_file: Path, tmp_path: Path) -> None:
    """train.seed changed on resume is refused naming the opt-in; with checkpoint.new_data_order the run goes on
    from the checkpoint with the new seed's samples (e.g. past the data around a loss spike)."""
    train_until(_raw(token_file, tmp_path), 2)
    reseeded = _raw(token_file, tmp_path, seed=7)
    with pytest.raises(CheckpointError, match=r"checkpoint\.new_data_order = true"):
        train(from_dict(reseeded))
    reseeded["checkpoint"]["new_data_order"] = True
    run = TrainingRun(from_dict(reseeded), 0, 1)
    assert run.resume() == 2
    kept = TrainingRun(from_dict(_raw(token_file, tmp_path)), 0, 1)
    assert not torch.equal(run.batches(2)[0][0], kept.batches(2)[0][0])  # the new seed's samples
    result = train(from_dict(reseeded))
    assert result.resumed_from == 2 and sorted(result.losses) == [2, 3]
