"""`tessera.pipeline.run_order` reads the same positions and channel orders off a lowered list as the
straightforward rescans it replaced (kept here as the oracles), on many lowered schedules."""

from __future__ import annotations

import itertools

import pytest

from tessera.pipeline.ir import Action, ActionKind, Schedule, ScheduleError
from tessera.pipeline.passes import lower
from tessera.pipeline.run_order import check_p2p_order, forward_only, recv_post_positions
from tessera.pipeline.schedules import build_schedule

_K = ActionKind

# (schedule, p, m, v, options, lowering): every named schedule, one and several ranks, ZeRO-3's GATHER/FREE,
# per-micro-batch reductions, a tied pair across ranks (EXCHANGE), m below and above p
LOWERED = [
    ("gpipe", 1, 3, 1, {}, {}),
    ("gpipe", 4, 6, 1, {}, {"zero3": True}),
    ("1f1b", 2, 1, 1, {}, {}),
    ("1f1b", 4, 8, 1, {}, {"tied": [(0, 3)]}),
    ("1f1b", 3, 5, 1, {}, {"reduce_every_microbatch": True}),
    ("interleaved_1f1b", 2, 4, 2, {}, {"zero3": True, "tied": [(0, 3)]}),
    ("interleaved_1f1b", 4, 8, 2, {}, {}),
    ("breadth_first", 1, 4, 3, {}, {"zero3": True}),
    ("breadth_first", 4, 3, 2, {"placement": "vshape"}, {"placement": "vshape"}),
    ("breadth_first", 2, 6, 2, {"consecutive": 1}, {"reduce_every_microbatch": True}),
]
AHEAD = [0, 1, 2, 3, 7, 10_000]  # 10,000: more computes than any list holds, every RECV posted at 0


def _lowered(case: tuple) -> Schedule:
    name, p, m, v, options, lowering = case
    return lower(build_schedule(name, p, m, v, **options), p, **lowering)


def _old_recv_post_positions(actions: list[Action], ahead: int) -> dict[int, list[Action]]:
    """The rescan of every earlier action per RECV (quadratic), as it was."""
    computes = [i for i, a in enumerate(actions) if a.kind.is_compute]
    post: dict[int, list[Action]] = {}
    for index, action in enumerate(actions):
        if not action.kind.is_recv:
            continue
        before = [c for c in computes if c < index]
        at = before[-ahead] if ahead and len(before) >= ahead else (0 if ahead else index)
        post.setdefault(at, []).append(action)
    return post


def _old_check_p2p_order(lowered: Schedule) -> None:
    """Every (sender, receiver) pair's messages gathered by scanning both whole lists, as it was."""
    for a, actions in enumerate(lowered):
        for b in range(len(lowered)):
            sends = [x.message for x in actions if x.kind.is_send and x.peer == b]
            recvs = [x.message for x in lowered[b] if x.kind.is_recv and x.peer == a]
            if sends != recvs:
                raise ScheduleError(f"rank {a} sends to rank {b} in a different order than rank {b} receives")


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}-v{c[3]}")
def test_recv_post_positions_equal_the_rescan(case: tuple) -> None:
    lists = _lowered(case)
    lists += [forward_only(actions) for actions in lists]  # evaluate's lists too
    lists += [actions[::-1] for actions in lists]  # RECVs before any compute, computes before the first RECV
    for actions, ahead in itertools.product(lists, AHEAD):
        expected = _old_recv_post_positions(actions, ahead)
        got = recv_post_positions(actions, ahead)
        assert got == expected and list(got) == list(expected), (case, ahead)  # same lists, same key order


def test_recv_post_positions_edge_cases() -> None:
    f0, f1 = Action(1, _K.FORWARD, 0), Action(1, _K.FORWARD, 1)
    r0, r1 = Action(1, _K.RECV_F, 0, peer=0), Action(1, _K.RECV_F, 1, peer=0)
    actions = [r0, f0, Action(1, _K.SEND_F, 0, peer=2), r1, f1]
    assert recv_post_positions(actions, 0) == {0: [r0], 3: [r1]}  # each at itself
    assert recv_post_positions(actions, 1) == {0: [r0], 1: [r1]}  # r0: no compute before it
    assert recv_post_positions(actions, 2) == {0: [r0, r1]}  # fewer than 2 computes before either
    assert recv_post_positions([], 2) == {}
    with pytest.raises(ValueError, match="recv_ahead"):
        recv_post_positions(actions, -1)


def _swapped(lowered: Schedule) -> Schedule:
    """``lowered`` with the first two RECVs from one peer swapped, on the first rank that has them: one channel
    out of order (the list need not run; the check reads only the orders)."""
    out = [list(actions) for actions in lowered]
    for actions in out:
        first: dict[int, int] = {}  # peer -> position of its first RECV
        for j, a in enumerate(actions):
            if a.kind.is_recv and a.peer in first:
                i = first[a.peer]
                actions[i], actions[j] = actions[j], actions[i]
                return out
            if a.kind.is_recv:
                first[a.peer] = j
    raise AssertionError("no rank receives twice from one peer")


@pytest.mark.parametrize(
    "case", [c for c in LOWERED if c[1] > 1 and c[2] > 1], ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}"
)
def test_check_p2p_order_agrees_with_the_pairwise_scan(case: tuple) -> None:
    lowered = _lowered(case)
    _old_check_p2p_order(lowered)
    check_p2p_order(lowered)  # in order: neither raises
    bad = _swapped(lowered)
    with pytest.raises(ScheduleError) as old:
        _old_check_p2p_order(bad)
    with pytest.raises(ScheduleError, match="different order") as new:
        check_p2p_order(bad)
    assert str(new.value).split(";")[0] == str(old.value)  # the same pair reported first


def test_recv_post_positions_on_a_long_list() -> None:
    """A middle rank's list at 5,000 micro-batches: the first receives (fewer computes before them) and the
    last. That the pass stays linear is measured, not timed here: benchmarks/pipeline_scale.py."""
    n = 5_000
    actions = [
        a
        for j in range(n)
        for a in (Action(1, _K.RECV_F, j, peer=0), Action(1, _K.FORWARD, j), Action(1, _K.SEND_F, j, peer=2))
    ]
    post = recv_post_positions(actions, 2)
    assert post[0] == actions[0:6:3]  # RECV 0 and 1: fewer than 2 computes before them
    assert post[3 * n - 8] == [actions[3 * n - 3]]  # the last RECV: at F(n - 3), 2 computes before it
