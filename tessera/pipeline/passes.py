"""Lowering passes: compute schedule → the exact per-rank lists the runtime executes and the simulator times.

Order (``lower``): ``add_communication`` → ``add_grad_reduction`` → ``add_param_gather`` (optional, ZeRO-3) →
``add_tied_exchange`` (stages sharing a parameter across pipeline ranks, ``tied``).

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
- A stage holding a parameter tied to a stage of another rank (`tied_across`: a tied model's embedding, stage 0,
  and head, the last stage) has no REDUCE / REDUCE_MB where the rule above puts them: its copy of the shared
  gradient is only complete once the other rank's is added. Its rank's list ends with ``EXCHANGE`` (swap and sum
  the shared gradient with the peer rank) and then the stage's one ``REDUCE`` of the step, whatever the
  accumulation (several such stages on one rank: every EXCHANGE, then the REDUCEs, highest stage first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tessera.pipeline.ir import Action, ActionKind, Schedule, ScheduleError, infer_stage_ranks, stage_to_rank

__all__ = [
    "add_communication",
    "add_grad_reduction",
    "add_param_gather",
    "add_tied_exchange",
    "lower",
    "tied_across",
    "tied_stages",
]

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


def tied_stages(tied: bool, n_stages: int) -> tuple[tuple[int, int], ...]:
    """The pairs of stages sharing a parameter in a model of ``n_stages`` stages: a tied model's token
    embedding (stage 0) is its head's output projection (the last stage)."""
    return ((0, n_stages - 1),) if tied and n_stages > 1 else ()


def tied_across(
    pairs: Iterable[tuple[int, int]], rank_of: Callable[[int], int]
) -> tuple[tuple[int, int], ...]:
    """The pairs (lower stage, higher stage) of ``pairs`` whose two stages live on different pipeline ranks
    (``rank_of(stage)``): each such stage's gradient is only complete after the EXCHANGE with the other rank,
    so it is reduced once, after it (module docstring). The one rule the lowering, the runtime, the memory
    walk, the simulator and the traffic formulas follow."""
    across = {(min(a, b), max(a, b)) for a, b in pairs if a != b and rank_of(a) != rank_of(b)}
    return tuple(sorted(across))


def add_tied_exchange(schedule: Schedule, pairs: Iterable[tuple[int, int]]) -> Schedule:
    """For each pair of `tied_across` (stages on different ranks): drop the two stages' REDUCE / REDUCE_MB and
    end each rank's list with an EXCHANGE of every such stage with its partner's rank, then the REDUCEs of
    those stages (highest first), if the list reduced them. A list that already exchanges a stage is kept."""
    owner = infer_stage_ranks(schedule)
    pairs = tuple(pairs)
    lowered: Schedule = []
    for rank, actions in enumerate(schedule):
        peers: dict[tuple[int, int], None] = {}  # (local stage, peer rank), in the order of the pairs
        for a, b in pairs:
            for mine, other in ((a, b), (b, a)):
                if owner.get(mine) == rank and owner.get(other) != rank:
                    peers[(mine, owner[other])] = None
        exchanged = {a.stage for a in actions if a.kind.is_exchange}
        stages = {s for s, _ in peers} - exchanged
        if not stages:
            lowered.append(list(actions))
            continue
        reduced = {a.stage for a in actions if a.kind.is_reduce and a.stage in stages}
        out = [a for a in actions if not (a.kind.is_reduce and a.stage in stages)]
        out += [Action(s, _K.EXCHANGE_TIED, peer=peer) for s, peer in peers if s in stages]
        out += [Action(s, _K.REDUCE_GRAD) for s in sorted(reduced, reverse=True)]
        lowered.append(out)
    return lowered


def lower(
    schedule: Schedule,
    p: int,
    placement: str = "loop",
    *,
    zero3: bool = False,
    reduce_grads: bool = True,
    reduce_every_microbatch: bool = False,
    tied: Iterable[tuple[int, int]] = (),
) -> Schedule:
    """Apply the passes in order: communication, gradient reduction (unless disabled; per micro-batch with
    ``reduce_every_microbatch``), ZeRO-3 gather/free, the exchange of the ``tied`` pairs of stages that live
    on different ranks (`tied_across`; pairs on one rank need nothing)."""
    lowered = add_communication(schedule, p, placement)
    if reduce_grads:
        lowered = add_grad_reduction(lowered, p, every_microbatch=reduce_every_microbatch)
    if zero3:
        lowered = add_param_gather(lowered, p)
    across = tied_across(tied, lambda s: stage_to_rank(s, p, placement))
    return add_tied_exchange(lowered, across) if across else lowered
