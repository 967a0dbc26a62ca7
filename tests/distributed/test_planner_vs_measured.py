"""Planner vs measured: calibrate this machine, then compare predicted and measured step times of real tessera
runs (a fast subset of benchmarks/planner_validation.py, which holds the full report): single process, data
parallel and ZeRO-1 with layered accumulation, measured in CPU time so a loaded machine does not inflate them."""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import pytest

from tessera.config import from_dict
from tessera.planner.calibrate import calibrate, predict_trainer_step, trainer_plan
from tests.harness import run_distributed

ACCEPT_ERROR = 0.20
"""Each prediction within ±20 % of the measured median CPU seconds per step (the acceptance criterion)."""
ACCEPT_FRACTION = 0.80
"""... for at least 80 % of the layouts (here: all four)."""
STEPS, WARMUP = 5, 2
LAYOUTS = ((1, 8, 1, 0), (1, 4, 2, 0), (2, 8, 1, 0), (2, 4, 2, 1))
"""(data-parallel size, micro-batch, micro-batches, ZeRO stage) on a 4-layer GPT, d_model 256, s = 128; m = 2
runs layered accumulation (the default) through the schedule runtime."""


def _config(dp: int, b: int, m: int, zero: int, data: Path, run_dir: Path) -> dict:
    return {
        "model": {
            "family": "gpt",
            "n_layers": 4,
            "d_model": 256,
            "n_heads": 4,
            "vocab_size": 256,
            "seq_len": 128,
        },
        "parallel": {"data": dp, "zero": zero},
        "train": {
            "steps": STEPS,
            "global_batch": dp * b * m,
            "micro_batch": b,
            "warmup_steps": 1,
            "device": "cpu",
        },
        "data": {"path": str(data)},
        "checkpoint": {"dir": str(run_dir / "ckpt"), "every": 10_000},
        "log": {"run_dir": str(run_dir), "progress": False, "tensorboard": False},
    }


def _train_cpu_marks(rank: int, world: int, raw: dict) -> list[float]:
    """Train and return this process's CPU time at every step hook (steps include the optimizer update)."""
    from tessera.train.trainer import train

    marks: list[float] = []
    train(from_dict(raw), lambda step, model: marks.append(time.process_time()))
    return marks


def test_predicted_step_time_matches_measured(tmp_path: Path) -> None:
    from tessera.train.data import prepare

    data = tmp_path / "tokens.bin"
    prepare([Path(statistics.__file__)], data, "byte")
    hw, _ = calibrate("test-cpu", quick=True)
    errors = []
    for i, (dp, b, m, zero) in enumerate(LAYOUTS):
        raw = _config(dp, b, m, zero, data, tmp_path / f"run{i}")
        marks = run_distributed(_train_cpu_marks, dp, raw, timeout=120)[0]
        steps = [after - before for before, after in itertools.pairwise(marks)]
        measured = statistics.median(steps[WARMUP - 1 :])
        predicted = predict_trainer_step(from_dict(raw), dp, hw).step_time
        errors.append(predicted / measured - 1)
    accurate = [e for e in errors if abs(e) <= ACCEPT_ERROR]
    assert len(accurate) >= ACCEPT_FRACTION * len(errors), f"relative errors per layout: {errors}"


def _plan_of(parallel: dict, m: int = 4, world: int = 2):
    raw = _config(1, 2, m, 0, Path("unused.bin"), Path("unused"))
    raw["parallel"] = parallel
    raw["train"]["global_batch"] = 2 * m * (parallel.get("data") or 1)
    return trainer_plan(from_dict(raw), world)


def test_trainer_plan_follows_the_stepper_the_trainer_picks() -> None:
    plan, schedule = _plan_of({"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2})
    assert (plan.pp, plan.virtual_stages, plan.dp, schedule) == (2, 2, 1, "breadth_first")
    # layered accumulation without a pipeline: breadth-first over one stage per block
    plan, schedule = _plan_of({"data": 2, "zero": 3}, world=2)
    assert (plan.pp, plan.virtual_stages, plan.zero_stage, schedule) == (1, 4, 3, "breadth_first")
    plan, schedule = _plan_of({"accumulation": "depth_first"}, world=1)
    assert (plan.virtual_stages, plan.accumulation) == (1, "depth_first")
    with pytest.raises(ValueError, match="stage_layers"):
        _plan_of({"pipeline": 2, "stage_layers": [1, 3]})
