"""The execution plan (tessera.execution): what a config runs, decided once; validate and train agree on it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tessera.cli import main
from tessera.config import Config, ModelConfig, ParallelConfig, TrainConfig, load_config
from tessera.errors import ConfigError
from tessera.execution import DIRECT, SCHEDULE_RUNTIME, resolve, violations

DEMO = "configs/demo.toml"


def test_execution_imports_without_torch() -> None:
    code = "import sys, tessera.execution, tessera.memory; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_single_pipeline_rank_switches_to_breadth_first_one_stage_per_block() -> None:
    plan = resolve(load_config(DEMO), 2)  # dp 2, layered accumulation of 2 micro-batches
    assert plan.runner == SCHEDULE_RUNTIME and plan.switched_to_breadth_first
    assert (plan.schedule, plan.stages_per_rank, plan.stage_layers) == ("breadth_first", 4, (1, 1, 1, 1))
    assert [s.rank for s in plan.stages()] == [0, 0, 0, 0]
    assert plan.stages()[0].embedding and plan.stages()[-1].head


def test_direct_loop_without_pipeline_zero_or_layered_accumulation() -> None:
    plan = resolve(load_config(DEMO, ["parallel.accumulation=depth_first"]), 2)
    assert plan.runner == DIRECT and plan.schedule is None and plan.stage_layers == (4,)
    assert not plan.switched_to_breadth_first


def test_pipeline_keeps_its_schedule_and_places_stages_looped() -> None:
    cfg = load_config(
        DEMO,
        [
            "parallel.data=1",
            "parallel.pipeline=2",
            'parallel.schedule="interleaved"',
            "parallel.stages_per_rank=2",
        ],
    )
    plan = resolve(cfg, 2)
    assert (plan.schedule, plan.stages_per_rank, plan.micro_batches) == ("interleaved", 2, 4)
    assert [plan.rank_stages(r) for r in range(2)] == [[0, 2], [1, 3]]
    assert plan.schedule_checked


def test_validate_prints_the_plan_and_the_switch(capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", DEMO, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "schedule: breadth_first, 4 stage(s) per pipeline rank" in out
    assert "switched from '1f1b'" in out
    assert "pipeline rank 0: stage 0 (block 0, embedding); stage 1 (block 1)" in out
    assert "micro-batches: 2 of 8" in out


# --- the user-reported cases: validate said ok, train failed -------------------------------------------------

INTERLEAVED_M3 = [
    "parallel.data=1",
    "parallel.pipeline=2",
    'parallel.schedule="interleaved"',
    "train.global_batch=24",
]
"""pipeline 2, interleaved, 24 / 8 = 3 micro-batches: the schedule builder refuses m % p != 0."""
ONE_RANK_1F1B_V2 = ["parallel.data=1", "parallel.zero=1", "parallel.stages_per_rank=2"]
"""pipeline 1, ZeRO-1, two stages per rank with the default 1F1B (one stage per rank)."""


@pytest.mark.parametrize(("overrides", "world"), [(INTERLEAVED_M3, 2), (ONE_RANK_1F1B_V2, 1)])
def test_validate_rejects_what_train_would_refuse(
    overrides: list[str], world: int, capsys: pytest.CaptureFixture
) -> None:
    problems = violations(load_config(DEMO, overrides), world)
    assert [v.rule for v in problems] == ["pipeline.schedule"]
    assert main(["validate", DEMO, "--world-size", str(world), *overrides]) == 1
    assert str(problems[0]) in capsys.readouterr().out
    # train refuses before starting any rank, with the same message
    assert main(["train", DEMO, "--nproc", str(world), *(f"--{o}" for o in overrides)]) == 2
    assert str(problems[0]) in capsys.readouterr().err


BF16_REDUCE = ['train.grad_reduce_dtype="bf16"']
"""The demo's plain data parallelism (parallel.zero = 0) with a bf16 gradient reduction, which only ZeRO has."""


def test_bf16_gradient_reduction_without_zero_is_refused_by_validate_and_train(
    capsys: pytest.CaptureFixture,
) -> None:
    (v,) = violations(load_config(DEMO, BF16_REDUCE), 2)
    assert v.rule == "train.grad_reduce_dtype" and "parallel.zero = 0" in v.problem
    assert "parallel.zero >= 1" in v.fix and "train.grad_reduce_dtype = 'fp32'" in v.fix
    assert main(["validate", DEMO, "--world-size", "2", *BF16_REDUCE]) == 1
    assert str(v) in capsys.readouterr().out
    assert main(["train", DEMO, "--nproc", "2", *(f"--{o}" for o in BF16_REDUCE)]) == 2
    assert str(v) in capsys.readouterr().err


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_the_plan_carries_the_gradient_reduction_dtype(zero: int) -> None:
    """ZeRO reduce-scatters in the configured dtype (the stepper and the cost model read it from the plan)."""
    assert resolve(load_config(DEMO), 2).grad_reduce_dtype == "fp32"
    plan = resolve(load_config(DEMO, [*BF16_REDUCE, f"parallel.zero={zero}"]), 2)
    assert plan.grad_reduce_dtype == "bf16"
    assert "gradient reduce-scatter: bf16" in plan.describe()
    one = resolve(load_config(DEMO, [*BF16_REDUCE, f"parallel.zero={zero}", "parallel.data=1"]), 1)
    assert one.grad_reduce_dtype == "fp32"  # one data rank reduces nothing: no rounding to bf16


def test_interleaved_fix_names_valid_batches() -> None:
    (v,) = violations(load_config(DEMO, INTERLEAVED_M3), 2)
    assert "train.global_batch = 16 or 32" in v.fix
    for batch in (16, 32):
        assert violations(load_config(DEMO, [*INTERLEAVED_M3, f"train.global_batch={batch}"]), 2) == []


def test_builder_is_the_backstop_for_hand_written_schedules(tmp_path) -> None:
    from tessera.pipeline.csvio import to_csv
    from tessera.pipeline.schedules import build_schedule

    csv = tmp_path / "mine.csv"
    csv.write_text(to_csv(build_schedule("1f1b", 2, 4)))  # 4 micro-batches; the config has 2
    cfg = load_config(
        DEMO,
        ["parallel.data=1", "parallel.pipeline=2", f'parallel.schedule="{csv}"', "train.global_batch=16"],
    )
    (v,) = violations(cfg, 2)
    assert v.rule == "pipeline.schedule" and "cannot be built" in v.problem and "4 micro-batches" not in v.fix
    with pytest.raises(ConfigError, match="cannot be built"):
        resolve(cfg, 2)


def test_every_violation_listed_with_the_schedule_rules_last() -> None:
    """Size rules first (the schedule check needs sane sizes); all of them at once."""
    cfg = Config(
        model=ModelConfig(n_layers=3, n_heads=3),
        parallel=ParallelConfig(pipeline=2, schedule="interleaved"),
        train=TrainConfig(global_batch=5, micro_batch=2),
    )
    rules = {v.rule for v in violations(cfg, 4)}
    assert {"model.heads", "pipeline.layers", "batch"} <= rules


def test_an_override_with_a_space_is_not_taken_for_the_config_file(capsys: pytest.CaptureFixture) -> None:
    """argparse treats `--parallel.stage_layers=[1, 3]` (one argument holding a space) as a positional one."""
    args = ["--model.n_layers=4", "--parallel.pipeline=2", "--parallel.stage_layers=[1, 3]"]
    assert main(["validate", *args, "--world-size", "2"]) == 0
    assert "stage 0 (block 0, embedding)" in capsys.readouterr().out


def test_mode_names_are_defined_once() -> None:
    """Checkpointing and accumulation names: tessera.modes, imported (not respelled) by every user."""
    from tessera import config, modes
    from tessera.parallel import checkpointing, zero
    from tessera.pipeline import stage
    from tessera.planner import cost

    assert checkpointing.MODES is stage.CHECKPOINT_MODES is cost.RECOMPUTE is modes.CHECKPOINTING
    assert zero.ACCUMULATION is config.ACCUMULATION is modes.ACCUMULATION
    assert config.SCHEDULES is modes.SCHEDULES


@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (["parallel.tensor=2", "parallel.data=1", "parallel.tp_comm_overlap=true"], "tensor.tp_comm_overlap"),
        (["parallel.tp_comm_overlap=true"], "tensor.tp_comm_overlap"),
        (["parallel.overlap_param_gather=true"], "zero.overlap_param_gather"),
        (["parallel.zero=3", "parallel.overlap_param_gather=true"], "zero.overlap_param_gather"),
    ],
)
def test_an_overlap_without_its_collectives_is_a_violation_naming_the_fix(
    overrides: list[str], rule: str
) -> None:
    found = [v for v in violations(load_config(DEMO, overrides), 2) if v.rule == rule]
    assert len(found) == 1 and "= false" in found[0].fix


def test_the_overlaps_reach_the_execution_plan_and_the_cost_model() -> None:
    from tessera.memory import cost_plan

    cfg = load_config(
        DEMO,
        [
            "parallel.tensor=2",
            "parallel.data=2",
            "parallel.sequence_parallel=true",
            "parallel.tp_comm_overlap=true",
            "parallel.zero=1",
            "parallel.overlap_param_gather=true",
        ],
    )
    plan = resolve(cfg, 4)
    assert plan.tp_comm_overlap and plan.overlap_param_gather
    assert "rings under their GEMM chunks" in plan.describe() and "under the next forward" in plan.describe()
    cost = cost_plan(plan)
    assert cost.tp_comm_overlap and cost.overlap_param_gather
    assert not resolve(load_config(DEMO), 2).tp_comm_overlap


def test_the_plan_says_when_the_parameter_all_gather_runs() -> None:
    on = ["parallel.zero=1", "parallel.overlap_param_gather=true"]
    assert "parameter all-gather: under the next forward" in resolve(load_config(DEMO, on), 2).describe()
    assert "parameter all-gather" not in resolve(load_config(DEMO, ["parallel.zero=1"]), 2).describe()


@pytest.mark.parametrize("zero", [0, 1])
def test_a_stage_split_is_checked_on_one_pipeline_rank_too(zero: int, capsys: pytest.CaptureFixture) -> None:
    """parallel.stage_layers with pipeline 1 and one stage per rank was accepted whatever it held, and ignored."""
    base = ["model.n_layers=2", f"parallel.zero={zero}"]
    (v,) = violations(load_config(None, [*base, "parallel.stage_layers=[5, 7]"]), 1)
    assert v.rule == "pipeline.stage_layers" and "e.g. [2]" in v.fix
    assert violations(load_config(None, [*base, "parallel.stage_layers=[2]"]), 1) == []
    assert main(["train", *(f"--{o}" for o in base), "--parallel.stage_layers=[5,7]"]) == 2
    assert str(v) in capsys.readouterr().err


def test_load_step_without_resuming_is_refused(tmp_path, capsys: pytest.CaptureFixture) -> None:
    """checkpoint.load_step with checkpoint.resume = false was accepted and ignored: the run started from step 0."""
    fresh = ["checkpoint.load_step=2", "checkpoint.resume=false", f'log.run_dir="{tmp_path / "run"}"']
    (v,) = violations(load_config(None, fresh), 1)
    assert v.rule == "checkpoint.load_step" and "checkpoint.resume = true" in v.fix
    assert violations(load_config(None, ["checkpoint.load_step=2"]), 1) == []  # resume is on by default
    assert main(["train", *(f"--{o}" for o in fresh)]) == 2
    assert str(v) in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


_BATCH_CASES = {  # name: (overrides, world size)
    "below_one_unit": (["train.global_batch=4"], 2),  # unit 8 × 2 = 16: the fix used to say "16 or 16"
    "below_one_unit_odd_share": (["train.global_batch=3"], 2),  # no micro_batch splits 3 over 2 ranks
    "between_units": (["train.global_batch=20"], 2),
    "below_one_unit_2d": (["train.global_batch=4", "train.micro_batch=4", "parallel.tensor=2x2"], 8),
    "below_one_unit_interleaved": (
        [
            *INTERLEAVED_M3,
            "train.global_batch=4",
            "train.micro_batch=8",
            "parallel.pipeline=4",
            "model.n_layers=8",
        ],
        4,
    ),
}


def _suggested(fix: str, key: str) -> list[int]:
    """The values a fix proposes for ``key`` ("set train.global_batch = 16 or 32 (...)", ", or key = 2 ...")."""
    import re

    found = re.search(rf"{re.escape(key)} = ((?:\d+)(?: or \d+)*)", fix)
    return [int(x) for x in found.group(1).split(" or ")] if found else []


@pytest.mark.parametrize("case", sorted(_BATCH_CASES))
def test_the_batch_fix_names_each_value_once_and_every_value_is_valid(case: str) -> None:
    """The fix printed "set train.global_batch = 16 or 16" for a global batch below micro_batch × data. Each
    proposed value must appear once and, applied alone, pass every rule; below one unit the micro_batch that
    keeps the global batch is proposed where one exists."""
    overrides, world = _BATCH_CASES[case]
    (v,) = violations(load_config(DEMO, overrides), world)
    assert v.rule == "batch", v
    batches, micro = _suggested(v.fix, "train.global_batch"), _suggested(v.fix, "train.micro_batch")
    assert batches and len(batches) == len(set(batches)), v.fix
    for batch in batches:
        assert violations(load_config(DEMO, [*overrides, f"train.global_batch={batch}"]), world) == [], batch
    for mb in micro:
        assert violations(load_config(DEMO, [*overrides, f"train.micro_batch={mb}"]), world) == [], (
            mb,
            v.fix,
        )
    expect_micro = {"below_one_unit": [2], "below_one_unit_odd_share": [], "between_units": []}
    expect_micro |= {"below_one_unit_2d": [2], "below_one_unit_interleaved": [1]}
    assert micro == expect_micro[case], v.fix
