"""IR text forms, placement, lowering passes, CSV round trips, and the validator's error messages."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.errors import TesseraError
from tessera.pipeline import (
    Action,
    ActionKind,
    ScheduleError,
    build_schedule,
    format_schedule,
    from_csv,
    lower,
    parse_schedule,
    stage_to_rank,
    to_csv,
    validate,
)

K = ActionKind


def test_compact_text_forms() -> None:
    assert str(Action(2, K.FORWARD, 0)) == "2F0"
    assert str(Action(2, K.SEND_F, 0, 1)) == "2SEND_F0->r1"
    assert str(Action(3, K.RECV_B, 5, 0)) == "3RECV_B5<-r0"
    assert str(Action(1, K.REDUCE_GRAD)) == "1REDUCE"
    assert str(Action(1, K.GATHER_PARAMS)) == "1GATHER"
    assert Action.parse(" 12W3 ") == Action(12, K.BACKWARD_WEIGHT, 3)


_ACTIONS = st.one_of(
    st.builds(
        Action,
        st.integers(0, 99),
        st.sampled_from([K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT]),
        st.integers(0, 99),
    ),
    st.builds(
        Action,
        st.integers(0, 99),
        st.sampled_from([K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B]),
        st.integers(0, 99),
        st.integers(0, 9),
    ),
    st.builds(Action, st.integers(0, 99), st.sampled_from([K.REDUCE_GRAD, K.GATHER_PARAMS, K.FREE_PARAMS])),
)


@given(_ACTIONS)
def test_parse_round_trips_str(action: Action) -> None:
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["2X0", "F0", "2SEND_F0", "2F0->r1", "2RECV_F0->r1", "2REDUCE3", ""])
def test_parse_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ScheduleError, match="cannot parse action"):
        Action.parse(text)


def test_action_constructor_rejects_inconsistent_fields() -> None:
    with pytest.raises(ScheduleError, match="peer"):
        Action(0, K.SEND_F, 0)
    with pytest.raises(ScheduleError, match="micro-batch"):
        Action(0, K.FORWARD)
    with pytest.raises(ScheduleError, match="whole stage"):
        Action(0, K.REDUCE_GRAD, 1)
    assert issubclass(ScheduleError, TesseraError)


def test_send_and_recv_name_the_same_message() -> None:
    assert Action(2, K.SEND_F, 4, 3).message == Action(3, K.RECV_F, 4, 2).message == ("act", 2, 4)
    assert Action(3, K.SEND_B, 4, 2).message == Action(2, K.RECV_B, 4, 3).message == ("grad", 3, 4)


def test_stage_placement() -> None:
    assert [stage_to_rank(s, 4, "loop") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_to_rank(s, 4, "vshape") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ScheduleError, match="loop, vshape"):
        stage_to_rank(0, 2, "zigzag")


def test_format_and_parse_schedule_round_trip() -> None:
    lowered = lower(build_schedule("interleaved_1f1b", 2, 4, 2), 2, zero3=True)
    assert parse_schedule(format_schedule(lowered)) == lowered


def test_communication_pass_pairs_every_transfer() -> None:
    lowered = lower(build_schedule("1f1b", 2, 2), 2)
    assert [str(a) for a in lowered[0]] == [
        "0F0", "0SEND_F0->r1", "0F1", "0SEND_F1->r1",
        "0RECV_B0<-r1", "0B0", "0RECV_B1<-r1", "0B1", "0REDUCE",
    ]  # fmt: skip
    assert [str(a) for a in lowered[1]] == [
        "1RECV_F0<-r0", "1F0", "1B0", "1SEND_B0->r0",
        "1RECV_F1<-r0", "1F1", "1B1", "1SEND_B1->r0", "1REDUCE",
    ]  # fmt: skip


def test_same_rank_neighbours_exchange_nothing() -> None:
    # vshape p=2 v=2: stages 1 and 2 both live on rank 1.
    lowered = lower(build_schedule("breadth_first", 2, 2, 2, placement="vshape"), 2, "vshape")
    texts = [str(a) for a in lowered[1]]
    assert not any(t.startswith(("2RECV_F", "1SEND_F", "1RECV_B", "2SEND_B")) for t in texts)
    validate(lowered, 2)


def test_lower_rejects_the_wrong_placement() -> None:
    with pytest.raises(ScheduleError, match="placement"):
        lower(build_schedule("breadth_first", 2, 2, 2, placement="vshape"), 2, "loop")


def test_zero3_gathers_once_per_phase_in_breadth_first() -> None:
    lowered = lower(build_schedule("breadth_first", 2, 4, 2), 2, zero3=True)
    rank0 = [str(a) for a in lowered[0]]
    # stage 0: one forward phase and one backward phase; stage 2 (turn-around): one phase for F and B.
    assert rank0.count("0GATHER") == 2 and rank0.count("0FREE") == 2
    assert rank0.count("2GATHER") == 1 and rank0.count("2FREE") == 1
    assert rank0[0] == "0GATHER" and rank0[-2:] == ["0FREE", "0REDUCE"]
    validate(lowered, 2)


def test_reduce_follows_the_stage_last_backward() -> None:
    lowered = lower(build_schedule("breadth_first", 2, 2, 2), 2)
    rank1 = [str(a) for a in lowered[1]]
    assert rank1.index("3REDUCE") == rank1.index("3SEND_B1->r0") + 1
    assert rank1.index("3REDUCE") < rank1.index("1B0")


def test_csv_round_trip() -> None:
    lowered = lower(build_schedule("breadth_first", 4, 4, 2), 4, zero3=True)
    text = to_csv(lowered)
    assert text.splitlines()[:2] == ["rank,step,action", "0,0,0GATHER"]
    assert from_csv(text) == lowered


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("r,s,a\n0,0,0F0\n", "header"),
        ("rank,step,action\n0,0\n", "line 2: expected 3 columns"),
        ("rank,step,action\n0,x,0F0\n", "line 2: rank and step must be integers"),
        ("rank,step,action\n0,0,0Q0\n", "line 2: cannot parse action"),
        ("rank,step,action\n0,0,0F0\n0,0,0B0\n", "line 3: rank 0 step 0 appears twice"),
        ("rank,step,action\n0,0,0F0\n0,2,0B0\n", "rank 0 has no step 1"),
    ],
)
def test_csv_errors_name_the_line(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        from_csv(text)


def test_user_csv_is_validated_for_deadlock() -> None:
    # Hand-written 2-rank schedule where rank 0 waits for a gradient before sending the activation.
    text = "rank,step,action\n0,0,0F0\n0,1,0RECV_B0<-r1\n0,2,0SEND_F0->r1\n0,3,0B0\n1,0,1RECV_F0<-r0\n1,1,1F0\n1,2,1B0\n1,3,1SEND_B0->r0\n"
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(from_csv(text), 2)


def _broken(rank: int, drop: str | None = None, swap: tuple[str, str] | None = None) -> list[list[Action]]:
    lowered = lower(build_schedule("1f1b", 2, 4), 2)
    texts = [str(a) for a in lowered[rank]]
    if drop is not None:
        del lowered[rank][texts.index(drop)]
    if swap is not None:
        i, j = texts.index(swap[0]), texts.index(swap[1])
        lowered[rank][i], lowered[rank][j] = lowered[rank][j], lowered[rank][i]
    return lowered


def test_validator_reports_deadlock_with_marked_grid() -> None:
    with pytest.raises(ScheduleError) as info:
        validate(_broken(0, drop="0SEND_F1->r1"), 2)
    message = str(info.value)
    headline, grid = message.splitlines()[0], message.splitlines()[1:]
    assert headline.startswith("deadlock at step")
    assert "rank 1 waits at 1RECV_F1<-r0 for 0SEND_F1->r1, which rank 0 never sends" in message
    assert any(line.startswith("r1") and ">1RECV_F1<-r0<" in line for line in grid)
    assert grid[-1].strip().startswith("^ step")


def test_validator_marks_a_swapped_receive() -> None:
    with pytest.raises(ScheduleError) as info:
        validate(_broken(1, swap=("1RECV_F0<-r0", "1RECV_F1<-r0")), 2)
    message = str(info.value)
    assert "1F0: needs a RECV_F from rank 0" in message.splitlines()[0]
    assert any(line.startswith("r1") and ">1F0<" in line for line in message.splitlines())


@pytest.mark.parametrize(
    ("lowered", "message"),
    [
        ([[Action(0, K.FORWARD, 0), Action(0, K.FORWARD, 0), Action(0, K.BACKWARD, 0)]], "duplicate forward"),
        ([[Action(0, K.FORWARD, 0)]], "0B0 .* missing"),
        ([[Action(0, K.BACKWARD, 0), Action(0, K.FORWARD, 0)]], "backward before its forward"),
        (
            [[Action(0, K.FORWARD, 0), Action(0, K.REDUCE_GRAD), Action(0, K.BACKWARD, 0)]],
            "before the last backward",
        ),
        ([[Action(0, K.GATHER_PARAMS), Action(0, K.FORWARD, 0), Action(0, K.BACKWARD, 0)]], "missing FREE"),
        ([[Action(1, K.FORWARD, 0), Action(1, K.BACKWARD, 0)]], r"stages \[0\] have no actions"),
    ],
)
def test_validator_rejects_incomplete_or_misordered(lowered: list[list[Action]], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate(lowered, 1)


def test_validator_rejects_unreceived_send_and_stage_on_two_ranks() -> None:
    lowered = lower(build_schedule("gpipe", 2, 1), 2)
    lowered[1] = [a for a in lowered[1] if a.kind is not K.RECV_F]
    lowered[1].insert(0, Action(0, K.FORWARD, 0))
    with pytest.raises(ScheduleError, match="stage 0 already lives on rank 0"):
        validate(lowered, 2)
    lowered = lower(build_schedule("gpipe", 2, 1), 2)
    lowered[0].insert(1, Action(0, K.SEND_F, 0, 1))
    with pytest.raises(ScheduleError, match="duplicate send"):
        validate(lowered, 2)


def test_validating_a_valid_schedule_writes_no_action_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid is text only in a failure's message: `tessera validate` checks schedules of up to 200k compute
    actions, where writing every action as text took about a third of the check."""
    lowered = lower(build_schedule("breadth_first", 2, 8, 2), 2, zero3=True)
    written: list[Action] = []
    text = Action.__str__
    monkeypatch.setattr(Action, "__str__", lambda a: written.append(a) or text(a))
    validate(lowered, 2)
    assert written == []
    lowered[1].remove(next(a for a in lowered[1] if a.kind is K.RECV_F))
    with pytest.raises(ScheduleError) as info:
        validate(lowered, 2)
    message = str(info.value)
    assert message.startswith("step 1, rank 1, 1F0: needs a RECV_F from rank 0")
    assert any(line.startswith("r1") and ">1F0<" in line for line in message.splitlines())


def test_a_stage_on_two_ranks_is_marked_in_the_lists_as_written() -> None:
    lowered = lower(build_schedule("gpipe", 2, 1), 2)
    lowered[1].insert(0, Action(0, K.FORWARD, 0))
    with pytest.raises(ScheduleError, match="stage 0 already lives on rank 0") as info:
        validate(lowered, 2)
    assert any(line.startswith("r1") and ">0F0<" in line for line in str(info.value).splitlines())


def test_split_backward_is_valid() -> None:
    schedule = [[Action(0, K.FORWARD, 0), Action(0, K.BACKWARD_INPUT, 0), Action(0, K.BACKWARD_WEIGHT, 0)]]
    validate(lower(schedule, 1), 1)
    with pytest.raises(ScheduleError, match="before its input-gradient"):
        validate([[Action(0, K.FORWARD, 0), Action(0, K.BACKWARD_WEIGHT, 0)]], 1)


def test_pipeline_package_imports_without_torch() -> None:
    code = "import sys, tessera.pipeline, tessera.sim; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
