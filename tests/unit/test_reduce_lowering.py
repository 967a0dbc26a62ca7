"""Per-micro-batch gradient reduction in the IR (depth-first accumulation, except ZeRO-1): the lowering pass puts
a REDUCE_MB after every backward, the validator holds it to "exactly that micro-batch's gradient", the execution
plan lowers it from the same rule the planner uses, and the planner's simulator prices it from the IR."""

from __future__ import annotations

import pytest

from tessera.modes import reduces_every_microbatch
from tessera.pipeline import build_schedule, lower
from tessera.pipeline.ir import Action, ActionKind, ScheduleError
from tessera.pipeline.validate import validate
from tessera.planner.cost import (
    ModelShape,
    Plan,
    dp_volume,
    params_per_rank,
    per_microbatch_reduction,
    tied_exchange_time,
)
from tessera.planner.hardware import load_hardware
from tessera.planner.steptime import dp_parts, pipeline_costs, simulate_step

K = ActionKind


def test_reduce_mb_text_form_round_trips_and_takes_no_peer() -> None:
    assert str(Action(2, K.REDUCE_MICROBATCH, 1)) == "2REDUCE_MB1"
    assert Action.parse("2REDUCE_MB1") == Action(2, K.REDUCE_MICROBATCH, 1)
    assert Action.parse("2REDUCE") == Action(2, K.REDUCE_GRAD)  # the whole-step form is unchanged
    with pytest.raises(ScheduleError, match="takes no peer"):
        Action(2, K.REDUCE_MICROBATCH, 1, 0)
    with pytest.raises(ScheduleError, match="micro-batch"):
        Action(2, K.REDUCE_MICROBATCH)


def test_rule_depth_first_except_zero1() -> None:
    assert [reduces_every_microbatch("depth_first", z) for z in range(4)] == [True, False, True, True]
    assert not any(reduces_every_microbatch("layered", z) for z in range(4))
    # the planner: plain data parallelism without a pipeline is the trainer's direct loop (one all-reduce)
    flat = Plan(dp=8, accumulation="depth_first", n_microbatches=4)
    assert not per_microbatch_reduction(flat)
    assert per_microbatch_reduction(Plan(dp=8, pp=2, accumulation="depth_first", n_microbatches=4))
    assert (
        dp_volume(10.0, Plan(dp=8, pp=2, accumulation="depth_first", n_microbatches=4)).all_reduce == 4 * 20.0
    )
    assert dp_volume(10.0, flat).all_reduce == 20.0


def test_stages_tied_across_ranks_are_reduced_once_in_the_volume() -> None:
    """10 parameters of which 4 are a stage tied to another rank's (reduced once, after its EXCHANGE), 2 bytes
    each, m = 4: ZeRO-0 all-reduces 4 × 12 + 8 bytes in 5 calls; ZeRO-2 reduce-scatters the same."""
    plan = Plan(dp=8, pp=2, accumulation="depth_first", n_microbatches=4)
    plain = dp_volume(10.0, plan, reduced_once=4.0)
    assert (plain.all_reduce, plain.calls) == (4 * 12.0 + 8.0, 5)
    assert dp_volume(4.0, plan, reduced_once=4.0).calls == 1
    z2 = dp_volume(
        10.0, Plan(dp=8, pp=2, zero_stage=2, accumulation="depth_first", n_microbatches=4), reduced_once=4
    )
    assert (z2.reduce_scatter, z2.all_gather, z2.calls) == (4 * 12.0 + 8.0, 20.0, 6)


def test_lowering_puts_one_reduce_after_every_backward_and_its_send() -> None:
    p, m = 2, 3
    lowered = lower(build_schedule("1f1b", p, m), p, reduce_every_microbatch=True)
    validate(lowered, p, microbatches=m)
    for rank, actions in enumerate(lowered):
        assert not [a for a in actions if a.kind is K.REDUCE_GRAD]
        for i, a in enumerate(actions):
            if a.kind is K.BACKWARD:
                after = actions[i + 1 : i + 3]
                expected = [Action(a.stage, K.REDUCE_MICROBATCH, a.microbatch)]
                if rank == 1:  # stage 1 sends its input gradient to rank 0 first
                    expected = [Action(1, K.SEND_B, a.microbatch, 0), *expected]
                assert after[: len(expected)] == expected, (rank, i)
    text = " ".join(str(a) for a in lowered[0])
    assert text.endswith("0B2 0REDUCE_MB2")


def _one_stage(actions: str) -> list[list[Action]]:
    return [[Action.parse(t) for t in actions.split()]]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0F0 0F1 0B0 0B1 0REDUCE_MB0 0REDUCE_MB1", "nothing else unreduced"),  # two backwards, one reduction
        ("0F0 0F1 0REDUCE_MB0 0B0 0B1 0REDUCE_MB1", "must follow micro-batch 0's backward"),
        ("0F0 0B0 0REDUCE_MB0 0REDUCE_MB0 0F1 0B1 0REDUCE_MB1", "reduced twice"),
        ("0F0 0B0 0REDUCE_MB0 0F1 0B1 0REDUCE", "one kind per stage"),
        ("0F0 0B0 0REDUCE_MB0 0F1 0B1", "REDUCE missing"),
    ],
)
def test_validator_holds_each_reduction_to_its_micro_batch(text: str, why: str) -> None:
    with pytest.raises(ScheduleError, match=why):
        validate(_one_stage(text), 1, microbatches=2)


def test_validator_accepts_per_microbatch_reductions() -> None:
    validate(_one_stage("0F0 0B0 0REDUCE_MB0 0F1 0B1 0REDUCE_MB1"), 1, microbatches=2)


def _gpt() -> ModelShape:
    return ModelShape(
        n_layers=8, d_model=2048, n_heads=16, n_kv_heads=16, ffn_hidden=8192, vocab_size=32000, seq_len=2048
    )


def test_simulator_prices_each_reduce_mb_where_it_runs() -> None:
    """Depth-first ZeRO-2 on one pipeline rank, m = 4: the IR has 4 REDUCE_MB; each releases 1/m of the step's
    reduce-scatter time R in 8 per-layer pieces during its own backward. Each share fits under its backward, so
    only the last piece, R/(4·8), outlives the step, plus ZeRO-2's parameter all-gather G in the optimizer step;
    the hidden rest, R − R/(4·8), slows the compute under it by the file's `overlap_slowdown`."""
    hw, shape = load_hardware("a100-80gb"), _gpt()
    plan = Plan(dp=64, zero_stage=2, n_microbatches=4, accumulation="depth_first", flash_attention=True)
    step, sim = simulate_step(shape, hw, plan, "1f1b")
    reduces = [e for e in sim.timeline if e.action.kind is K.REDUCE_MICROBATCH]
    assert [e.action.microbatch for e in reduces] == [0, 1, 2, 3]
    assert not [e for e in sim.timeline if e.action.kind is K.REDUCE_GRAD]
    R, G = dp_parts(params_per_rank(shape, plan, 0), hw, plan, buckets=8)
    backward = pipeline_costs(shape, hw, plan).backward(0)
    assert backward > R / 4  # the precondition of the hand computation
    exposed = R / (4 * 8)
    assert step.dp_comm == pytest.approx(exposed + G + hw.overlap_slowdown * (R - exposed), rel=1e-9)


def test_simulator_prices_the_tied_exchange_and_the_one_reduce_after_it() -> None:
    """A tied model on pp2 × dp8, plain data parallelism, depth-first, m = 4: each rank's only stage is tied
    to the other's, so instead of 4 all-reduces under the backwards the IR has one EXCHANGE then one REDUCE per
    rank. Both ranks end with the EXCHANGE (`tied_exchange_time`, at the step's end) and then release their one
    all-reduce, R_r / 4 of the step's m all-reduces `dp_parts` prices, whole: nothing hides it, so the exposed
    DP time is the larger of the two."""
    hw, shape = load_hardware("a100-80gb"), _gpt()
    plan = Plan(dp=8, pp=2, n_microbatches=4, accumulation="depth_first", flash_attention=True)
    assert shape.tied and per_microbatch_reduction(plan)
    step, sim = simulate_step(shape, hw, plan, "1f1b")
    kinds = [(e.rank, e.action.kind) for e in sim.timeline if not e.action.kind.is_compute]
    assert [k for r, k in kinds if k.is_reduce or k.is_exchange] == [K.EXCHANGE_TIED] * 2 + [
        K.REDUCE_GRAD
    ] * 2
    exchange = tied_exchange_time(shape, hw, plan)
    for e in (e for e in sim.timeline if e.action.kind.is_exchange):
        assert (e.end - e.start, e.end) == pytest.approx((exchange, sim.step_time), rel=1e-12)
    blocks = shape.n_layers // 2
    one = [dp_parts(params_per_rank(shape, plan, r), hw, plan, buckets=blocks)[0] / 4 for r in (0, 1)]
    assert step.dp_comm == pytest.approx(max(one), rel=1e-9)


def test_execution_plan_lowers_the_reductions_the_runtime_runs() -> None:
    """configs/demo.toml on dp 2 with ZeRO-2 depth-first: one REDUCE_MB per stage and micro-batch; with ZeRO-1
    (full gradients accumulate) one REDUCE per stage."""
    from tessera.config import load_config
    from tessera.execution import resolve

    z2 = resolve(
        load_config("configs/demo.toml", ["parallel.accumulation=depth_first", "parallel.zero=2"]), 2
    )
    kinds = [a.kind for a in z2.lowered()[0]]
    assert kinds.count(K.REDUCE_MICROBATCH) == z2.micro_batches * len(z2.stages()) > len(z2.stages())
    assert K.REDUCE_GRAD not in kinds
    z1 = resolve(
        load_config("configs/demo.toml", ["parallel.accumulation=depth_first", "parallel.zero=1"]), 2
    )
    kinds = [a.kind for a in z1.lowered()[0]]
    assert kinds.count(K.REDUCE_GRAD) == len(z1.stages()) and K.REDUCE_MICROBATCH not in kinds
