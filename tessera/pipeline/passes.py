"""Lowering passes: compute schedule → the exact per-rank lists the runtime executes and the simulator times.

Order (``lower``): ``add_communication`` → ``add_grad_reduction`` → ``add_param_gather`` (optional, ZeRO-3).

Placement rules (all relative to compute actions, so each pass is independent of the others):

- RECV right before the compute that consumes it; SEND right after the compute that produces it. Sends are
  treated as buffered (non-blocking) and receives as blocking — the validator checks under exactly these rules.
- REDUCE after the stage's last backward (B or W) on its rank, after that backward's SEND, so the gradient for
  the previous stage leaves first. With ``reduce_every_microbatch`` (depth-first accumulation except ZeRO-1,
  `tessera.modes.reduces_every_microbatch`) a ``REDUCE_MB j`` follows *every* backward of micro-batch j instead:
  the runtime reduce-scatters each micro-batch's gradient, and the simulator prices each one where it runs.
- GATHER before the first compute of a *phase*, ahead of that compute's RECV so the gather can overlap the
  wait; FREE after the last compute of the phase and its SEND. A phase is a maximal run of one stage's
  compute actions on a rank (other stages' computes end it); with ``split_directions`` a forward run and a
  backward run are separate phases even when adjacent (weights released between the last forward and the first
  backward of the turn-around stage, the accounting of "one gather per forward and per backward sweep").
"""

from __future__ import annotations

from tessera.pipeline.ir import Action, ActionKind, Schedule, ScheduleError, infer_stage_ranks, stage_to_rank

__all__ = ["add_communication", "add_grad_reduction", "add_param_gather", "lower"]

_K = ActionKind


def _stage_ranks(schedule: Schedule, p: int, placement: str) -> tuple[dict[int, int], int]:
    """Stage → rank from the schedule, checked against ``placement``; also return the stage count S."""
    if len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists but p = {p}; give one list per rank")
    owner = infer_stage_ranks(schedule)
    stages = len(owner)
    if sorted(owner) != list(range(stages)):
        raise ScheduleError(f"stages must be 0..S-1 with no gap, got {sorted(owner)}")
    for stage, rank in owner.items():
        expected = stage_to_rank(stage, p, placement)
        if rank != expected:
            raise ScheduleError(
                f"stage {stage} is on rank {rank} but placement {placement!r} puts it on rank {expected}; "
                "lower with the placement the schedule was built with"
            )
    return owner, stages


def add_communication(schedule: Schedule, p: int, placement: str = "loop") -> Schedule:
    """Insert SEND/RECV pairs wherever consecutive stages live on different ranks.

    F(s, j) receives its input from rank(s-1) and sends its output to rank(s+1); B or I (s, j) receives the
    output gradient from rank(s+1) and sends the input gradient to rank(s-1). Same-rank neighbours exchange
    nothing (the runtime passes the tensor in memory).
    """
    owner, stages = _stage_ranks(schedule, p, placement)
    lowered: Schedule = []
    for rank, actions in enumerate(schedule):
        out: list[Action] = []
        for action in actions:
            s, j = action.stage, action.microbatch
            if action.kind is _K.FORWARD:
                prev, nxt, recv, send = s - 1, s + 1, _K.RECV_F, _K.SEND_F
            elif action.kind in (_K.BACKWARD, _K.BACKWARD_INPUT):
                prev, nxt, recv, send = s + 1, s - 1, _K.RECV_B, _K.SEND_B
            else:
                out.append(action)
                continue
            if 0 <= prev < stages and owner[prev] != rank:
                out.append(Action(s, recv, j, owner[prev]))
            out.append(action)
            if 0 <= nxt < stages and owner[nxt] != rank:
                out.append(Action(s, send, j, owner[nxt]))
        lowered.append(out)
    return lowered


def _after_block(actions: list[Action], index: int) -> int:
    """Index just past ``actions[index]`` and the SENDs of the same stage/micro-batch that follow it."""
    anchor = actions[index]
    index += 1
    while (
        index < len(actions)
        and actions[index].kind.is_send
        and (actions[index].stage, actions[index].microbatch) == (anchor.stage, anchor.microbatch)
    ):
        index += 1
    return index


def _before_block(actions: list[Action], index: int) -> int:
    """Index of the first RECV of the same stage/micro-batch that directly precedes ``actions[index]``."""
    anchor = actions[index]
    while (
        index > 0
        and actions[index - 1].kind.is_recv
        and (actions[index - 1].stage, actions[index - 1].microbatch) == (anchor.stage, anchor.microbatch)
    ):
        index -= 1
    return index


def _insert_all(actions: list[Action], inserts: list[tuple[int, Action]]) -> list[Action]:
    """Insert (position, action) pairs before ``actions[position]``; equal positions keep their given order."""
    by_position: dict[int, list[Action]] = {}
    for position, action in inserts:
        by_position.setdefault(position, []).append(action)
    out: list[Action] = []
    for index in range(len(actions) + 1):
        out += by_position.get(index, [])
        if index < len(actions):
            out.append(actions[index])
    return out


def add_grad_reduction(
    schedule: Schedule, p: int | None = None, *, every_microbatch: bool = False
) -> Schedule:
    """Insert REDUCE(s) after the last action producing stage s's weight gradient (B, or W when split); with
    ``every_microbatch`` a REDUCE_MB(s, j) after every such action (micro-batch j) instead."""
    if p is not None and len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists but p = {p}")
    lowered: Schedule = []
    for actions in schedule:
        weight = [(i, a) for i, a in enumerate(actions) if a.kind in (_K.BACKWARD, _K.BACKWARD_WEIGHT)]
        if every_microbatch:
            inserts = [
                (_after_block(actions, i), Action(a.stage, _K.REDUCE_MICROBATCH, a.microbatch))
                for i, a in weight
            ]
        else:
            last = {a.stage: i for i, a in weight}
            inserts = [(_after_block(actions, i), Action(s, _K.REDUCE_GRAD)) for s, i in last.items()]
        lowered.append(_insert_all(actions, inserts))
    return lowered


def _phases(actions: list[Action], split_directions: bool) -> list[tuple[int, int, int]]:
    """(stage, first index, last index) of each maximal run of one stage's compute actions."""
    phases: list[tuple[int, int, int]] = []
    for index, action in enumerate(actions):
        if not action.kind.is_compute:
            continue
        backward = action.kind is not _K.FORWARD
        if phases and phases[-1][0] == action.stage:
            stage, first, last = phases[-1]
            same_direction = (actions[last].kind is not _K.FORWARD) == backward
            if same_direction or not split_directions:
                phases[-1] = (stage, first, index)
                continue
        phases.append((action.stage, index, index))
    return phases


def add_param_gather(schedule: Schedule, p: int | None = None, *, split_directions: bool = False) -> Schedule:
    """ZeRO-3: insert GATHER(s) before and FREE(s) after each compute phase of stage s (see module doc)."""
    if p is not None and len(schedule) != p:
        raise ScheduleError(f"schedule has {len(schedule)} rank lists but p = {p}")
    lowered: Schedule = []
    for actions in schedule:
        inserts: list[tuple[int, Action]] = []
        for stage, first, last in _phases(actions, split_directions):
            inserts.append((_before_block(actions, first), Action(stage, _K.GATHER_PARAMS)))
            inserts.append((_after_block(actions, last), Action(stage, _K.FREE_PARAMS)))
        lowered.append(_insert_all(actions, _order_frees_first(inserts)))
    return lowered


def _order_frees_first(inserts: list[tuple[int, Action]]) -> list[tuple[int, Action]]:
    """At one position a FREE (end of a phase) must come before a GATHER (start of the next)."""
    return sorted(inserts, key=lambda item: (item[0], item[1].kind is _K.GATHER_PARAMS))


def lower(
    schedule: Schedule,
    p: int,
    placement: str = "loop",
    *,
    zero3: bool = False,
    reduce_grads: bool = True,
    reduce_every_microbatch: bool = False,
) -> Schedule:
    """Apply the passes in order: communication, gradient reduction (unless disabled; per micro-batch with
    ``reduce_every_microbatch``), ZeRO-3 gather/free."""
    lowered = add_communication(schedule, p, placement)
    if reduce_grads:
        lowered = add_grad_reduction(lowered, p, every_microbatch=reduce_every_microbatch)
    if zero3:
        lowered = add_param_gather(lowered, p)
    return lowered
