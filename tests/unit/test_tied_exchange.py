"""Stages sharing a parameter across pipeline ranks (a tied embedding and head) in the lowered IR: no REDUCE
where the other stages have theirs, an EXCHANGE of the shared gradient with the peer rank at the end of the
list, then the stage's one REDUCE; the validator holds the list to that order (tessera.pipeline.passes)."""

from __future__ import annotations

import itertools

import pytest

from tessera.config import from_dict
from tessera.execution import resolve
from tessera.pipeline import build_schedule, lower, tied_across, tied_stages
from tessera.pipeline.ir import Action, ActionKind, ScheduleError, parse_schedule
from tessera.pipeline.validate import validate

K = ActionKind
SCHEDULES = [  # (parallel.schedule, stages per rank)
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("breadth_first", 2),
]


def test_exchange_text_form_round_trips() -> None:
    action = Action(0, K.EXCHANGE_TIED, peer=1)
    assert str(action) == "0EXCHANGE<>r1"
    assert Action.parse("0EXCHANGE<>r1") == action
    with pytest.raises(ScheduleError, match="takes '<>rN'"):
        Action.parse("0EXCHANGE->r1")
    with pytest.raises(ScheduleError, match="peer rank"):
        Action(0, K.EXCHANGE_TIED)


def test_only_pairs_on_two_ranks_are_tied_across() -> None:
    assert tied_stages(True, 4) == ((0, 3),) and tied_stages(False, 4) == tied_stages(True, 1) == ()
    assert tied_across([(3, 0)], lambda s: s % 2) == ((0, 3),)
    assert tied_across([(0, 3)], lambda s: [0, 1, 1, 0][s]) == ()  # vshape: both ends on rank 0


@pytest.mark.parametrize(("schedule", "v"), SCHEDULES)
def test_tied_stages_reduce_once_after_their_exchange(schedule: str, v: int) -> None:
    """gpt2 (tied) on pp2 dp2, every accumulation and ZeRO stage: the execution plan's lists (the runtime's)
    hold exactly one REDUCE of stage 0 and of the last stage, each the last action of its rank, right after
    that rank's EXCHANGE with the other; every other stage keeps the reductions of the untied lowering."""
    for accumulation, zero in itertools.product(("layered", "depth_first"), range(4)):
        cfg = from_dict(
            {
                "model": {"size": "gpt2-tiny", "n_layers": 4},
                "parallel": {
                    "pipeline": 2,
                    "data": 2,
                    "schedule": schedule,
                    "stages_per_rank": v,
                    "accumulation": accumulation,
                    "zero": zero,
                },
                "train": {"global_batch": 16, "micro_batch": 2},
            }
        )
        plan = resolve(cfg, 4)
        last = plan.n_stages - 1
        assert plan.tied and plan.tied_across() == ((0, last),)
        lowered = plan.lowered()
        untied = lower(
            build_schedule(schedule, 2, plan.micro_batches, v, **_options(plan)),
            2,
            zero3=zero == 3,
            reduce_every_microbatch=any(a.kind is K.REDUCE_MICROBATCH for a in lowered[0]),
        )
        for rank, (stage, other) in enumerate(((0, 1), (last, 0))):
            actions = lowered[rank]
            case = (accumulation, zero, rank)
            reduces = [a for a in actions if a.kind.is_reduce and a.stage == stage]
            assert reduces == [Action(stage, K.REDUCE_GRAD)], case
            assert actions[-2:] == [Action(stage, K.EXCHANGE_TIED, peer=other), reduces[0]], case
            assert [a for a in actions if a.kind.is_exchange] == [actions[-2]], case
            assert plan.exchanged_stages(rank) == (stage,)
            # the rest is the untied lowering, less the stage's reductions
            rest = [a for a in untied[rank] if not (a.kind.is_reduce and a.stage == stage)]
            assert actions[:-2] == rest, case


def _options(plan) -> dict:
    return (
        {"consecutive": 1} if plan.schedule == "breadth_first" and plan.accumulation == "depth_first" else {}
    )


def test_tied_ends_on_one_rank_need_no_exchange() -> None:
    pairs = tied_stages(True, 4)
    compute = build_schedule("breadth_first", 2, 2, 2, placement="vshape")
    assert lower(compute, 2, "vshape", tied=pairs) == lower(compute, 2, "vshape")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        # the REDUCE before the EXCHANGE: the gradient it reduces is not complete yet
        (
            "r0: 0F0 0SEND_F0->r1 0RECV_B0<-r1 0B0 0REDUCE 0EXCHANGE<>r1\n"
            "r1: 1RECV_F0<-r0 1F0 1B0 1SEND_B0->r0 1EXCHANGE<>r0 1REDUCE",
            "EXCHANGE goes first",
        ),
        # an EXCHANGE before the stage's last backward
        (
            "r0: 0F0 0SEND_F0->r1 0EXCHANGE<>r1 0RECV_B0<-r1 0B0 0REDUCE\n"
            "r1: 1RECV_F0<-r0 1F0 1B0 1SEND_B0->r0 1EXCHANGE<>r0 1REDUCE",
            "before the last backward",
        ),
        # rank 1 never exchanges
        (
            "r0: 0F0 0SEND_F0->r1 0RECV_B0<-r1 0B0 0EXCHANGE<>r1 0REDUCE\n"
            "r1: 1RECV_F0<-r0 1F0 1B0 1SEND_B0->r0 1REDUCE",
            "never exchanges",
        ),
    ],
)
def test_validator_holds_the_exchange_to_its_place(text: str, why: str) -> None:
    with pytest.raises(ScheduleError, match=why):
        validate(parse_schedule(text), 2, microbatches=1)
