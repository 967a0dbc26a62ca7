"""The schedule tools do work linear in the schedule: the validator tries each action at most twice, depth-first
reductions are checked without recounting every micro-batch, the simulator looks a message up at most twice
per SEND/RECV, and `schedule show` prints a huge text timeline only when asked. Counted, not timed: each count
grew as p × steps (or stages × m²) before, which is what made `tessera schedule show --pp 2000` take minutes.
Also the outputs these changes must keep: failure messages with their grids, the text timeline cell by cell.
"""

from __future__ import annotations

import importlib
import math

import pytest

from tessera.cli import main
from tessera.pipeline import Action, ActionKind, ScheduleError, build_schedule, lower, validate
from tessera.pipeline.ir import parse_schedule
from tessera.sim import render as render_module
from tessera.sim import render_text, show_schedule, simulate
from tessera.sim.render import text_size
from tessera.sim.simulator import timeline

K = ActionKind
# the module, which its function `validate` hides as an attribute of the package
validate_module = importlib.import_module("tessera.pipeline.validate")


def _tries(lowered: list[list[Action]], p: int) -> int:
    return validate_module._run(validate_module._prepare(lowered, p, None)).tries


@pytest.mark.parametrize(
    ("name", "p", "m", "v"), [("1f1b", 64, 8, 1), ("1f1b", 256, 4, 1), ("interleaved", 16, 32, 2)]
)
def test_the_validator_tries_each_action_at_most_twice(name: str, p: int, m: int, v: int) -> None:
    """Once, and once more after the SEND it waits for: trying every rank in every step was p × steps tries
    (1f1b, p = 256, m = 4: 298,879 tries for 6,384 actions; now 7,658)."""
    lowered = lower(build_schedule(name, p, m, v), p)
    actions = sum(map(len, lowered))
    assert actions <= _tries(lowered, p) <= 2 * actions


def test_depth_first_reductions_are_checked_without_recounting_the_micro_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each REDUCE_MB used to ask every micro-batch whether its backward was done: stages × m² questions,
    11.6 s for p = 8, m = 1000."""
    p, m = 4, 64
    lowered = lower(build_schedule("1f1b", p, m), p, reduce_every_microbatch=True)
    asked = []
    done = validate_module._weight_grad_done
    monkeypatch.setattr(validate_module, "_weight_grad_done", lambda *a: asked.append(a) or done(*a))
    validate(lowered, p)
    assert len(asked) <= p * m


def test_a_depth_first_reduction_with_another_backward_unreduced_is_refused() -> None:
    schedule = parse_schedule("r0: 0F0 0F1 0B0 0B1 0REDUCE_MB0 0REDUCE_MB1")
    with pytest.raises(ScheduleError, match=r"unreduced backwards of stage 0: \[0, 1\]"):
        validate(schedule, 1)
    validate(parse_schedule("r0: 0F0 0F1 0B0 0REDUCE_MB0 0B1 0REDUCE_MB1"), 1)
    split = parse_schedule("r0: 0F0 0I0 0REDUCE_MB0 0W0")  # I alone leaves the weight gradient undone
    with pytest.raises(ScheduleError, match=r"unreduced backwards of stage 0: \[\]"):
        validate(split, 1)


# the tied pair's lists of test_simulator's EXCHANGE example, padded so that both ranks reach their EXCHANGE in
# step 14 (rank 1's extra GATHER/FREE), after which no rank has anything else to do
SAME_STEP_EXCHANGE = """
r0: 0GATHER 0F0 0SEND_F0->r1 0F1 0SEND_F1->r1 0RECV_B0<-r1 0B0 0RECV_B1<-r1 0B1 0FREE 0EXCHANGE<>r1
r1: 1GATHER 1RECV_F0<-r0 1F0 1B0 1SEND_B0->r0 1RECV_F1<-r0 1F1 1B1 1SEND_B1->r0 1FREE 1GATHER 1FREE 1EXCHANGE<>r0
"""


def test_two_ranks_reaching_their_exchange_in_the_same_step_are_no_deadlock() -> None:
    """Nobody moves in the step where both reach it, and both complete in the next: counting only completed
    actions called this a deadlock at step 14, though the simulator runs it."""
    schedule = parse_schedule(SAME_STEP_EXCHANGE)
    validate(schedule, 2)
    assert simulate(schedule, 2).step_time == 9
    alone = parse_schedule(SAME_STEP_EXCHANGE.replace(" 0EXCHANGE<>r1", ""))
    with pytest.raises(
        ScheduleError, match="deadlock at step 14: rank 1 waits at 1EXCHANGE<>r0 for rank 0's"
    ):
        validate(alone, 2)


FAILURES = [  # (lists, the whole message): the grid spreads the actions over the steps, idle steps as "."
    (
        "r0: 0F0 0SEND_F0->r1 0RECV_B0<-r1 0B0\nr1: 1RECV_F0<-r0 1F0 1B0 1F0",
        "step 5, rank 1, 1F0: duplicate forward of stage 1 micro-batch 0\n"
        "           0              1              2              3              4              5       \n"
        "r0        0F0        0SEND_F0->r1        .              .              .              .       \n"
        "r1         .              .         1RECV_F0<-r0       1F0            1B0           >1F0<     \n"
        "                                                                                       ^ step 5",
    ),
    (
        "r0: 0F0 0RECV_B0<-r1 0SEND_F0->r1 0B0\nr1: 1RECV_F0<-r0 1F0 1B0 1SEND_B0->r0",
        "deadlock at step 1: rank 0 waits at 0RECV_B0<-r1 for 1SEND_B0->r0, which rank 1 has not reached (it is "
        "blocked at 1RECV_F0<-r0)\n"
        "  rank 1 waits at 1RECV_F0<-r0 for 0SEND_F0->r1, which rank 0 has not reached (it is blocked at "
        "0RECV_B0<-r1)\n"
        "           0              1       \n"
        "r0        0F0       >0RECV_B0<-r1<\n"
        "r1         .        >1RECV_F0<-r0<\n"
        "                           ^ step 1",
    ),
]


@pytest.mark.parametrize(("lists", "message"), FAILURES)
def test_failure_messages_keep_their_grids(lists: str, message: str) -> None:
    with pytest.raises(ScheduleError) as info:
        validate(parse_schedule(lists), 2)
    assert str(info.value) == message


@pytest.mark.parametrize("p", [16, 64])
def test_the_simulator_looks_each_message_up_at_most_twice(p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SEND once, a RECV once when it waits and once when it runs: visiting every rank every round looked a
    waiting RECV's message up once per round (1f1b, p = 2000, m = 8: 2,074,968 look-ups for 97,968 actions;
    now 77,967)."""
    lowered = lower(build_schedule("1f1b", p, 8), p)
    expected = timeline(lowered, p)
    looked_up = []
    message = Action.message
    monkeypatch.setattr(Action, "message", property(lambda a: looked_up.append(a) or message.fget(a)))
    assert timeline(lowered, p) == expected
    comm = sum(1 for actions in lowered for a in actions if a.kind.is_comm)
    assert len(looked_up) <= 2 * comm


def _render_per_cell(entries: list, p: int) -> str:
    """The text timeline drawn one cell at a time (the drawing before cells were padded once per action)."""
    drawn = [e for e in entries if e.end - e.start > 1e-9]
    unit = min(e.end - e.start for e in drawn)
    columns = math.ceil(max(e.end for e in drawn) / unit - 1e-9)
    width = max(len(e.action.short()) for e in drawn)
    rows = [["."] * columns for _ in range(p)]
    for e in drawn:
        first, last = round(e.start / unit), max(round(e.start / unit) + 1, round(e.end / unit))
        rows[e.rank][first] = e.action.short()
        for column in range(first + 1, min(last, columns)):
            rows[e.rank][column] = "-" * width
    return "\n".join(f"r{r:<3} " + " ".join(f"{c:<{width}}" for c in row) for r, row in enumerate(rows))


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "zero3"),
    [
        ("gpipe", 2, 2, 1, False),
        ("1f1b", 12, 5, 1, False),
        ("breadth_first", 4, 8, 2, True),
        ("interleaved", 3, 6, 2, False),
    ],
)
def test_text_timeline_and_its_size(name: str, p: int, m: int, v: int, zero3: bool) -> None:
    result = simulate(lower(build_schedule(name, p, m, v), p, zero3=zero3), p)
    text = render_text(result.timeline, p)
    assert text == _render_per_cell(result.timeline, p)
    assert text_size(result.timeline, p) == (len(text.splitlines()[0][5:].split()), len(text))
    assert text_size([], 3) == (0, len(render_text([], 3)))


def test_a_timeline_over_the_limit_is_described_not_printed() -> None:
    full = show_schedule("1f1b", 4, 4)
    header, _, body = full.partition("\n")
    assert show_schedule("1f1b", 4, 4, max_text=len(body)) == full  # at the limit: unchanged
    short = show_schedule("1f1b", 4, 4, max_text=len(body) - 1)
    assert short == (
        f"{header}\n(the text timeline is not shown: 4 rank rows × 21 time columns, {len(body):,} characters, "
        f"over {len(body) - 1:,}; `tessera schedule show --full-text` prints it)"
    )


def test_schedule_show_prints_a_long_timeline_only_with_full_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["schedule", "show", "1f1b", "--pp", "4", "--microbatches", "4"]
    assert main(command) == 0
    assert capsys.readouterr().out == show_schedule("1f1b", 4, 4) + "\n"  # under the default limit
    monkeypatch.setattr(render_module, "TEXT_LIMIT", 100)
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "the text timeline is not shown" in out and len(out.splitlines()) == 2
    assert main([*command, "--full-text"]) == 0
    assert capsys.readouterr().out == show_schedule("1f1b", 4, 4) + "\n"
