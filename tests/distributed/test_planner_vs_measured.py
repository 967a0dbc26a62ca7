"""The step the planner predicts is the step the trainer runs: `trainer_plan` reads the execution plan.

Predicted against measured step *times* are wall-clock and belong to benchmarks/planner_validation.py (with the
layouts this file used to time: data parallel, ZeRO-1, layered accumulation), not to the suite that gates every
change: a loaded machine moved them past any fixed bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.config import from_dict
from tessera.planner.calibrate import trainer_plan

STEPS = 5


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


def _plan_of(parallel: dict, m: int = 4, world: int = 2):
    raw = _config(1, 2, m, 0, Path("unused.bin"), Path("unused"))
    raw["parallel"] = parallel
    raw["data"] = {}  # trainer_plan resolves the whole config: no token file needed to plan
    raw["train"]["global_batch"] = 2 * m * (parallel.get("data") or 1)
    return trainer_plan(from_dict(raw), world)


def test_trainer_plan_follows_the_stepper_the_trainer_picks(tmp_path: Path) -> None:
    plan, schedule = _plan_of({"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2})
    assert (plan.pp, plan.virtual_stages, plan.dp, schedule) == (2, 2, 1, "breadth_first")
    # layered accumulation without a pipeline: breadth-first over one stage per block
    plan, schedule = _plan_of({"data": 2, "zero": 3}, world=2)
    assert (plan.pp, plan.virtual_stages, plan.zero_stage, schedule) == (1, 4, 3, "breadth_first")
    plan, schedule = _plan_of({"accumulation": "depth_first"}, world=1)
    assert (plan.virtual_stages, plan.accumulation) == (1, "depth_first")
    plan, _ = _plan_of({"pipeline": 2, "stage_layers": [1, 3]})  # uneven stages are priced as they run
    assert plan.stage_layers == (1, 3)
    # context parallelism: priced as a context rank (s/c tokens, the K/V gathers), ZeRO over data × context even
    # with one data rank
    plan, schedule = _plan_of({"context": 2, "zero": 1}, world=2)
    assert (plan.cp, plan.dp, plan.batch_ranks, plan.zero_stage, plan.zero_dp) == (2, 1, 2, 1, 2)
    with pytest.raises(ValueError, match="closed-form"):
        _plan_of({"pipeline": 2, "schedule": str(_csv_1f1b(tmp_path))})


def test_predicted_step_of_a_context_run_prices_its_gathers() -> None:
    """`predict_trainer_step` (what `tessera calibrate`'s check compares with measured steps) on a context config:
    the context part is the cost model's per-block K/V collectives × blocks × micro-batches, on the CPU
    A100 file's network. Measured step times of context runs are not compared (module docstring: wall-clock
    comparisons live in benchmarks/planner_validation.py, which has no context layout yet)."""
    from tessera.planner.calibrate import predict_trainer_step
    from tessera.planner.cost import ModelShape, cp_comm_time_per_layer
    from tessera.planner.hardware import load_hardware

    raw = _config(1, 2, 4, 0, Path("unused.bin"), Path("unused"))
    raw["parallel"] = {"context": 2}
    raw["data"] = {}
    cfg = from_dict(raw)
    hw = load_hardware("a100-80gb")
    bd = predict_trainer_step(cfg, 2, hw)
    plan, _ = trainer_plan(cfg, 2)
    per_block = cp_comm_time_per_layer(ModelShape.from_config(cfg.model), hw, plan)
    assert bd.cp_comm > 0
    assert bd.cp_comm == pytest.approx(4 * 4 * (per_block.forward + per_block.backward), rel=1e-12)


def _csv_1f1b(directory: Path) -> Path:
    from tessera.pipeline.csvio import to_csv
    from tessera.pipeline.schedules import build_schedule

    path = directory / "mine.csv"
    path.write_text(to_csv(build_schedule("1f1b", 2, 4)))
    return path
