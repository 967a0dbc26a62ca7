"""Every schedule builds valid, deadlock-free lowered lists over a grid of sizes; invalid sizes fail clearly."""

from __future__ import annotations

import itertools

import pytest

from tessera.pipeline import (
    SCHEDULES,
    Action,
    ActionKind,
    ScheduleError,
    build_schedule,
    infer_stage_ranks,
    lower,
    stage_to_rank,
    validate,
)

PS, MS = (1, 2, 4), (1, 2, 4, 8)
_VS = {"gpipe": (1,), "1f1b": (1,), "interleaved_1f1b": (1, 2, 3), "breadth_first": (1, 2, 3)}


def _admits(name: str, p: int, m: int) -> bool:
    return name != "interleaved_1f1b" or m % p == 0


CASES = [
    (name, p, m, v)
    for name in SCHEDULES
    for p, m, v in itertools.product(PS, MS, _VS[name])
    if _admits(name, p, m)
]


def _compute_order_is_topological(schedule: list[list[Action]], stages: int) -> None:
    """Within each rank: F(s, j) after local F(s-1, j); B(s, j) after its F and local B(s+1, j)."""
    for actions in schedule:
        position = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(actions)}
        for (kind, s, j), i in position.items():
            if kind is ActionKind.FORWARD and (kind, s - 1, j) in position:
                assert position[(kind, s - 1, j)] < i
            if kind is ActionKind.BACKWARD:
                assert position[(ActionKind.FORWARD, s, j)] < i
                if (kind, s + 1, j) in position:
                    assert position[(kind, s + 1, j)] < i


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_schedule_is_complete_and_valid(name: str, p: int, m: int, v: int) -> None:
    schedule = build_schedule(name, p, m, v)
    assert len(schedule) == p
    owner = infer_stage_ranks(schedule)
    assert sorted(owner) == list(range(p * v))
    assert all(owner[s] == stage_to_rank(s, p, "loop") for s in owner)
    assert sum(len(actions) for actions in schedule) == 2 * p * v * m  # one F and one B per stage × mb
    _compute_order_is_topological(schedule, p * v)
    validate(lower(schedule, p), p, microbatches=m)
    validate(lower(schedule, p, zero3=True), p, microbatches=m)


@pytest.mark.parametrize("consecutive", [1, 2, 4])
@pytest.mark.parametrize("placement", ["loop", "vshape"])
def test_breadth_first_groups_and_placements_are_valid(consecutive: int, placement: str) -> None:
    schedule = build_schedule("breadth_first", 4, 4, 2, consecutive=consecutive, placement=placement)
    validate(lower(schedule, 4, placement, zero3=True), 4, microbatches=4)


def test_breadth_first_runs_each_stage_for_all_microbatches_before_the_next() -> None:
    rank0 = [str(a) for a in build_schedule("breadth_first", 2, 3, 2)[0]]
    assert rank0 == ["0F0", "0F1", "0F2", "2F0", "2F1", "2F2", "2B0", "2B1", "2B2", "0B0", "0B1", "0B2"]
    grouped = [str(a) for a in build_schedule("breadth_first", 2, 4, 2, consecutive=2)[0]]
    assert grouped[:8] == ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"]


def test_one_f_one_b_warmup_and_steady_state() -> None:
    ranks = [[str(a) for a in actions] for actions in build_schedule("1f1b", 3, 4)]
    assert ranks[0] == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    assert ranks[2] == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]


def test_interleaved_uses_megatron_chunk_order() -> None:
    rank1 = [str(a) for a in build_schedule("interleaved_1f1b", 2, 4, 2)[1]]
    # warm-up 2·(p-1-r) + (v-1)·p = 2 forwards, then the last stage's B follows its F directly.
    assert rank1[:6] == ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1"]


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "options", "message"),
    [
        ("interleaved_1f1b", 4, 6, 2, {}, "multiple of p .* use m = 4 or 8"),
        ("interleaved_1f1b", 4, 2, 2, {}, "use m = 4,"),
        ("gpipe", 2, 4, 2, {}, "v = 1"),
        ("1f1b", 2, 4, 2, {}, "use 'interleaved_1f1b' or 'breadth_first'"),
        ("breadth_first", 2, 4, 2, {"consecutive": 3}, r"valid values: \[1, 2, 4\]"),
        ("breadth_first", 2, 4, 2, {"placement": "zigzag"}, "unknown stage placement"),
        ("gpipe", 0, 4, 1, {}, "p must be an integer >= 1"),
        ("1f1b", 2, 4, 1, {"consecutive": 2}, "no option"),
        ("1fb1", 2, 4, 1, {}, "Did you mean '1f1b'"),
    ],
)
def test_invalid_combinations_raise_clear_errors(
    name: str, p: int, m: int, v: int, options: dict, message: str
) -> None:
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, p, m, v, **options)


def test_aliases_resolve() -> None:
    assert build_schedule("one_f_one_b", 2, 2) == build_schedule("1f1b", 2, 2)
