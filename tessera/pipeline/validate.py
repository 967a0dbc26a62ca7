"""Prove a lowered schedule complete, correctly ordered and deadlock-free before anything runs.

``validate`` executes the per-rank lists symbolically in lock-step *steps*: in each step every rank that is
not blocked runs its next action. SENDs are buffered (never block); a RECV blocks until its matching SEND ran
in an earlier step. Every action's data dependencies are checked when it runs (F(s, j) needs F(s-1, j) on the
same rank or a received activation, B(s, j) needs its own F and the gradient of stage s+1, ...). An EXCHANGE
is a rendezvous: it completes once the peer rank has reached its matching EXCHANGE (the n-th EXCHANGE of rank
a with rank b matches the n-th of b with a) in an earlier step. A step in which no rank moves and after which
none can is a deadlock (two ranks that reach matching EXCHANGEs in one step both move in the next). Failures
raise ``ScheduleError`` whose message shows the rank × step grid with the failing action marked ``>2B0<`` and a
``^`` line under its step, plus a one-line explanation.

The work is linear in the number of actions: a step tries only the ranks that can move (a rank waiting at a
RECV or EXCHANGE is tried again only in the step after the SEND or the peer's EXCHANGE it waits for), and the
grid keeps only the actions that ran, filled in with idle steps only for a failure's message. Trying every
rank in every step made ``tessera schedule show --pp 2000`` (p × steps tries) take minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.pipeline.ir import Action, ActionKind, Schedule, ScheduleError

__all__ = ["ScheduleError", "render_grid", "validate"]

_K = ActionKind
_MAX_COLUMNS = 40  # grids wider than this show only the last steps (the failure is at the end)
_BACKWARD = (_K.BACKWARD, _K.BACKWARD_INPUT)  # actions that produce the gradient w.r.t. the stage input


def render_grid(rows: list[list[str]], marks: set[tuple[int, int]] | frozenset = frozenset()) -> str:
    """Rank × step text grid; ``marks`` holds (rank, step) cells drawn as ``>label<`` with a ``^`` line."""
    steps = max((len(row) for row in rows), default=0)
    first = max(0, steps - _MAX_COLUMNS)
    width = max([3] + [len(cell) + 2 for row in rows for cell in row[first:]])
    lines = [f"(steps 0..{first - 1} omitted)"] if first else []
    lines.append("     " + " ".join(f"{t:^{width}}" for t in range(first, steps)))
    for rank, row in enumerate(rows):
        cells = []
        for t in range(first, steps):
            label = row[t] if t < len(row) and row[t] else "."
            cells.append(f"{'>' + label + '<' if (rank, t) in marks else label:^{width}}")
        lines.append(f"r{rank:<3} " + " ".join(cells))
    if marks:
        step = min(t for _, t in marks)
        lines.append(" " * (5 + (step - first) * (width + 1) + width // 2) + f"^ step {step}")
    return "\n".join(lines)


@dataclass
class _Run:
    """Symbolic execution state."""

    lowered: Schedule
    owner: dict[int, int]
    stages: int
    microbatches: int
    pc: list[int]
    moved_at: list[list[int]]
    """The step in which each rank ran each action of its list so far (the first ``len(moved_at[r])`` of rank
    r's); `text_grid` spreads the actions over the steps (idle "") only for a failure's message, since a valid
    schedule (up to hundreds of thousands of actions) never shows it and a dense grid is ranks × steps."""
    step: int = 0
    tries: int = 0  # actions tried (run or found waiting): at most two per action
    done: set[tuple[ActionKind, int, int]] = field(default_factory=set)
    sent: dict[tuple, tuple[int, int, Action]] = field(default_factory=dict)  # message -> (rank, step, send)
    received: set[tuple] = field(default_factory=set)
    gathered: set[int] = field(default_factory=set)
    reduced: set[int] = field(default_factory=set)
    reduced_microbatches: dict[int, set[int]] = field(default_factory=dict)  # stage -> its REDUCE j so far
    # stage -> the micro-batches whose last backward (B, or W) ran and that no REDUCE_MB has reduced yet
    unreduced: dict[int, set[int]] = field(default_factory=dict)
    zero3: set[int] = field(default_factory=set)
    exchanging: set[int] = field(default_factory=set)  # stages with an EXCHANGE in their rank's list
    exchanged: set[int] = field(default_factory=set)
    exchanges: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, peer) -> EXCHANGEs completed
    posted: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (rank, peer, n) -> step reached
    waiting: dict[tuple, int] = field(default_factory=dict)  # a message or `posted` key -> the rank waiting
    woken: list[int] = field(default_factory=list)  # ranks to try again next step

    def fail(self, rank: int, action: Action, why: str) -> ScheduleError:
        return ScheduleError(
            f"step {self.step}, rank {rank}, {action}: {why}\n"
            f"{render_grid(self.text_grid(self.step + 1, {rank: action}), {(rank, self.step)})}"
        )

    def text_grid(self, steps: int, stuck: dict[int, Action] | None = None) -> list[list[str]]:
        """The actions run as `render_grid` draws them: ``steps`` columns, "" where a rank did not move, and
        ``stuck[rank]`` (the action a failure names) in the current step."""
        rows = []
        for rank, (actions, moved_at) in enumerate(zip(self.lowered, self.moved_at, strict=True)):
            row = [""] * steps
            for step, action in zip(moved_at, actions, strict=False):  # the actions run so far
                row[step] = str(action)
            if stuck and rank in stuck:
                row[self.step] = str(stuck[rank])
            rows.append(row)
        return rows

    def wait(self, rank: int, key: tuple) -> None:
        """``rank`` cannot move until ``key`` (a message, or a peer's `posted` key) happens: try it again in
        the step after that one; if it happened in this step already, in the next step."""
        if key in self.sent or key in self.posted:
            self.woken.append(rank)
        else:
            self.waiting[key] = rank

    def happened(self, key: tuple) -> None:
        """``key`` happened in this step: the rank waiting for it (if any) can move in the next step."""
        rank = self.waiting.pop(key, None)
        if rank is not None:
            self.woken.append(rank)


def validate(lowered: Schedule, p: int, *, microbatches: int | None = None) -> None:
    """Raise ``ScheduleError`` unless ``lowered`` (one list per rank) runs to completion without deadlock,
    with exactly one F and one B (or one I and one W) per stage and micro-batch, every SEND received once,
    and REDUCE/GATHER/FREE consistent. ``microbatches`` defaults to the largest index seen plus one."""
    _run(_prepare(lowered, p, microbatches))


def _run(run: _Run) -> _Run:
    """Execute ``run`` in lock-step steps to its end (see the module docstring); return it for its counts."""
    lowered, pc, moved_at = run.lowered, run.pc, run.moved_at
    lengths = [len(actions) for actions in lowered]
    ready = [rank for rank, length in enumerate(lengths) if length]  # ranks to try in this step, ascending
    unfinished, tries = len(ready), 0
    while unfinished:
        step, movers, before = run.step, [], unfinished
        for rank in ready:
            tries += 1
            if _try_step(run, rank, lowered[rank][pc[rank]]):
                moved_at[rank].append(step)
                pc[rank] += 1
                if pc[rank] < lengths[rank]:
                    movers.append(rank)
                else:
                    unfinished -= 1
        # nobody moved and nobody can move next step: a deadlock. Two ranks that reach matching EXCHANGEs in
        # the same step move in the next (both are woken), though nobody moved in this one
        if not movers and unfinished == before and not run.woken:
            raise _deadlock(run)
        # a rank that did not move is woken by what it waits for; the order within a step only decides which
        # of two failing ranks is named, so keep it ascending as when every rank was tried
        ready = movers
        if run.woken:
            ready, run.woken = sorted(movers + run.woken), []
        run.step += 1
    run.tries = tries
    _check_complete(run)
    return run


def _prepare(lowered: Schedule, p: int, microbatches: int | None) -> _Run:
    if len(lowered) != p:
        raise ScheduleError(f"schedule has {len(lowered)} rank lists but p = {p}; give one list per rank")
    owner: dict[int, int] = {}
    for rank, actions in enumerate(lowered):
        for index, action in enumerate(actions):
            if not isinstance(action, Action):
                raise ScheduleError(f"rank {rank} item {index} is {action!r}, not an Action")
            previous = owner.setdefault(action.stage, rank)
            if previous != rank:
                raise ScheduleError(
                    f"rank {rank}, position {index}, {action}: stage {action.stage} already lives on rank "
                    f"{previous}; each stage must live on exactly one rank\n{_static_grid(lowered, rank, index)}"
                )
    stages = max(owner, default=-1) + 1
    missing = sorted(set(range(stages)) - set(owner))
    if missing:
        raise ScheduleError(f"stages {missing} have no actions; stages must be 0..{stages - 1}")
    seen = [a.microbatch for actions in lowered for a in actions if a.microbatch is not None]
    m = microbatches if microbatches is not None else max(seen, default=-1) + 1
    run = _Run(lowered, owner, stages, m, [0] * p, [[] for _ in range(p)])
    run.zero3 = {a.stage for actions in lowered for a in actions if a.kind is _K.GATHER_PARAMS}
    run.exchanging = {a.stage for actions in lowered for a in actions if a.kind.is_exchange}
    return run


def _static_grid(lowered: Schedule, rank: int, index: int) -> str:
    """The lists as written (position, not step, per column) with ``lowered[rank][index]`` marked."""
    return render_grid([[str(a) for a in actions] for actions in lowered], {(rank, index)})


def _try_step(run: _Run, rank: int, action: Action) -> bool:
    """Run ``action`` if it can; False if it is a RECV still waiting; raise if it is wrong."""
    if action.microbatch is not None and action.microbatch >= run.microbatches:
        raise run.fail(rank, action, f"micro-batch {action.microbatch} >= m = {run.microbatches}")
    if action.kind.is_recv:
        return _recv(run, rank, action)
    if action.kind.is_exchange:
        return _exchange(run, rank, action)
    why = _CHECKS[action.kind](run, rank, action)
    if why:
        raise run.fail(rank, action, why)
    return True


def _input_ready(run: _Run, rank: int, neighbour: int, local_kinds: tuple, message: tuple) -> str:
    """'' if the neighbour stage's result is available on ``rank`` (local compute or received message)."""
    if run.owner[neighbour] == rank:
        if any((kind, neighbour, message[2]) in run.done for kind in local_kinds):
            return ""
        return f"needs {neighbour}{local_kinds[0].value}{message[2]} first, on the same rank, earlier in its list"
    if message in run.received:
        return ""
    recv = _K.RECV_F if message[0] == "act" else _K.RECV_B
    return f"needs a {recv.value} from rank {run.owner[neighbour]} (stage {neighbour}) before it"


def _params_ready(run: _Run, action: Action) -> str:
    if action.stage in run.zero3 and action.stage not in run.gathered:
        return f"stage {action.stage} parameters are not gathered (missing {action.stage}GATHER before it)"
    return ""


def _forward(run: _Run, rank: int, a: Action) -> str:
    s, j = a.stage, a.microbatch
    if (_K.FORWARD, s, j) in run.done:
        return f"duplicate forward of stage {s} micro-batch {j}"
    run.done.add((_K.FORWARD, s, j))
    why = "" if s == 0 else _input_ready(run, rank, s - 1, (_K.FORWARD,), ("act", s - 1, j))
    return why or _params_ready(run, a)


def _backward(run: _Run, rank: int, a: Action) -> str:
    s, j = a.stage, a.microbatch
    if any((kind, s, j) in run.done for kind in _BACKWARD):
        return f"duplicate backward of stage {s} micro-batch {j}"
    if (_K.FORWARD, s, j) not in run.done:
        return f"backward before its forward {s}F{j}"
    if s in run.reduced:
        return f"backward after stage {s}'s gradients were already reduced ({s}REDUCE)"
    run.done.add((a.kind, s, j))
    if a.kind is _K.BACKWARD:
        run.unreduced.setdefault(s, set()).add(j)
    why = "" if s == run.stages - 1 else _input_ready(run, rank, s + 1, _BACKWARD, ("grad", s + 1, j))
    return why or _params_ready(run, a)


def _weight(run: _Run, rank: int, a: Action) -> str:
    s, j = a.stage, a.microbatch
    if (_K.BACKWARD_WEIGHT, s, j) in run.done:
        return f"duplicate weight-gradient of stage {s} micro-batch {j}"
    if (_K.BACKWARD_INPUT, s, j) not in run.done:
        return f"weight-gradient before its input-gradient {s}I{j}"
    run.done.add((_K.BACKWARD_WEIGHT, s, j))
    run.unreduced.setdefault(s, set()).add(j)
    return _params_ready(run, a)


def _send(run: _Run, rank: int, a: Action) -> str:
    s, j = a.stage, a.microbatch
    forward = a.kind is _K.SEND_F
    target = s + 1 if forward else s - 1
    if not 0 <= target < run.stages:
        return f"stage {s} has no {'next' if forward else 'previous'} stage to send to"
    if run.owner[target] == rank or a.peer != run.owner[target]:
        return f"peer r{a.peer} is wrong: stage {target} lives on rank {run.owner[target]}"
    produced = (_K.FORWARD,) if forward else _BACKWARD
    if not any((kind, s, j) in run.done for kind in produced):
        return f"sends before computing it ({s}{produced[0].value}{j} has not run on this rank yet)"
    message = a.message  # a property that builds a tuple: once per check
    if message in run.sent:
        return "duplicate send of the same message"
    run.sent[message] = (rank, run.step, a)
    run.happened(message)
    return ""


def _recv(run: _Run, rank: int, a: Action) -> bool:
    s = a.stage
    source = s - 1 if a.kind is _K.RECV_F else s + 1
    if not 0 <= source < run.stages:
        raise run.fail(rank, a, f"stage {s} has no stage {source} to receive from")
    if run.owner[source] == rank or a.peer != run.owner[source]:
        raise run.fail(rank, a, f"peer r{a.peer} is wrong: stage {source} lives on rank {run.owner[source]}")
    message = a.message
    if message in run.received:
        raise run.fail(rank, a, "duplicate receive of the same message")
    sent = run.sent.get(message)
    if sent is None or sent[1] >= run.step:
        run.wait(rank, message)
        return False
    run.received.add(message)
    return True


def _exchange(run: _Run, rank: int, a: Action) -> bool:
    """EXCHANGE(s) with rank ``a.peer``: after every backward of s and before its REDUCE; it completes when
    the peer's matching EXCHANGE was reached in an earlier step (both sides wait for each other)."""
    s = a.stage
    if a.peer == rank or not 0 <= a.peer < len(run.lowered):
        raise run.fail(rank, a, f"peer r{a.peer} is not another pipeline rank")
    if s in run.exchanged:
        raise run.fail(rank, a, f"stage {s} exchanges its tied gradients twice")
    if s in run.reduced or s in run.reduced_microbatches:
        raise run.fail(rank, a, f"exchanges after stage {s}'s gradients were reduced; EXCHANGE goes first")
    pending = [j for j in range(run.microbatches) if not _weight_grad_done(run, s, j)]
    if pending:
        raise run.fail(rank, a, f"exchanges before the last backward: micro-batches {pending} of stage {s}")
    n = run.exchanges.get((rank, a.peer), 0)  # this is the n-th EXCHANGE of rank with a.peer
    if (rank, a.peer, n) not in run.posted:
        run.posted[rank, a.peer, n] = run.step
        run.happened((rank, a.peer, n))
    theirs = run.posted.get((a.peer, rank, n))
    if theirs is None or theirs >= run.step:
        run.wait(rank, (a.peer, rank, n))
        return False
    run.exchanges[rank, a.peer] = n + 1
    run.exchanged.add(s)
    return True


def _reduce(run: _Run, rank: int, a: Action) -> str:
    s = a.stage
    if s in run.reduced:
        return f"stage {s} gradients reduced twice"
    if s in run.exchanging and s not in run.exchanged:
        return f"reduces stage {s} before its tied gradients are exchanged ({s}EXCHANGE goes first)"
    if a.kind is _K.REDUCE_MICROBATCH:
        return _reduce_microbatch(run, s, a.microbatch)
    if s in run.reduced_microbatches:
        return f"a whole-step {s}REDUCE after per-micro-batch reductions of stage {s}; use one kind per stage"
    pending = [j for j in range(run.microbatches) if not _weight_grad_done(run, s, j)]
    if pending:
        return f"reduces before the last backward: micro-batches {pending} of stage {s} not done yet"
    run.reduced.add(s)
    return ""


def _reduce_microbatch(run: _Run, s: int, j: int) -> str:
    """REDUCE_MB(s, j) reduces what stage s accumulated since its previous reduction, which must be micro-batch
    j's gradient exactly: j's backward done, no other unreduced backward of s."""
    done = run.reduced_microbatches.setdefault(s, set())
    if j in done:
        return f"stage {s} micro-batch {j} gradients reduced twice"
    # kept as backwards run (set by `_backward` and `_weight`, emptied here): recounting them over all
    # micro-batches at every REDUCE_MB made depth-first validation quadratic in m
    unreduced = run.unreduced.get(s, set())
    if unreduced != {j}:
        return (
            f"{s}REDUCE_MB{j} must follow micro-batch {j}'s backward and nothing else unreduced; "
            f"unreduced backwards of stage {s}: {sorted(unreduced)}"
        )
    unreduced.clear()
    done.add(j)
    if len(done) == run.microbatches:
        run.reduced.add(s)
    return ""


def _weight_grad_done(run: _Run, s: int, j: int) -> bool:
    return (_K.BACKWARD, s, j) in run.done or (_K.BACKWARD_WEIGHT, s, j) in run.done


def _gather(run: _Run, rank: int, a: Action) -> str:
    if a.stage in run.gathered:
        return f"stage {a.stage} parameters gathered twice without a {a.stage}FREE in between"
    run.gathered.add(a.stage)
    return ""


def _free(run: _Run, rank: int, a: Action) -> str:
    if a.stage not in run.gathered:
        return f"frees stage {a.stage} parameters that are not gathered"
    run.gathered.discard(a.stage)
    return ""


_CHECKS: dict[ActionKind, Callable[[_Run, int, Action], str]] = {
    _K.FORWARD: _forward,
    _K.BACKWARD: _backward,
    _K.BACKWARD_INPUT: _backward,
    _K.BACKWARD_WEIGHT: _weight,
    _K.SEND_F: _send,
    _K.SEND_B: _send,
    _K.REDUCE_GRAD: _reduce,
    _K.REDUCE_MICROBATCH: _reduce,
    _K.GATHER_PARAMS: _gather,
    _K.FREE_PARAMS: _free,
}
"""The check of every kind `_try_step` runs (RECV and EXCHANGE, which may wait, are handled before it)."""


def _expected_send(run: _Run, rank: int, recv: Action) -> Action:
    if recv.kind is _K.RECV_F:
        return Action(recv.stage - 1, _K.SEND_F, recv.microbatch, rank)
    return Action(recv.stage + 1, _K.SEND_B, recv.microbatch, rank)


def _deadlock(run: _Run) -> ScheduleError:
    reasons, marks, stuck = [], set(), {}
    for rank, actions in enumerate(run.lowered):
        if run.pc[rank] >= len(actions):
            continue
        recv = actions[run.pc[rank]]
        if recv.kind.is_exchange:
            peer = recv.peer or 0
            at = run.lowered[peer][run.pc[peer]] if run.pc[peer] < len(run.lowered[peer]) else None
            where = f"blocked at {at}" if at is not None else "done, and never exchanges with it"
            reasons.append(f"rank {rank} waits at {recv} for rank {peer}'s EXCHANGE; rank {peer} is {where}")
            stuck[rank] = recv
            marks.add((rank, run.step))
            continue
        send, sender = _expected_send(run, rank, recv), recv.peer or 0  # a RECV always has a peer
        rest = run.lowered[sender][run.pc[sender] :]
        if send in rest:
            blocker = run.lowered[sender][run.pc[sender]]
            where = f"which rank {sender} has not reached (it is blocked at {blocker})"
        else:
            where = f"which rank {sender} never sends"
        reasons.append(f"rank {rank} waits at {recv} for {send}, {where}")
        stuck[rank] = recv
        marks.add((rank, run.step))
    reasons.sort(key=lambda reason: "never sends" not in reason)  # the root cause first
    detail = "\n".join(f"  {reason}" for reason in reasons[1:])
    headline = f"deadlock at step {run.step}: {reasons[0]}" + (f"\n{detail}" if detail else "")
    return ScheduleError(f"{headline}\n{render_grid(run.text_grid(run.step + 1, stuck), marks)}")


def _check_complete(run: _Run) -> None:
    problems = []
    for s in range(run.stages):
        for j in range(run.microbatches):
            if (_K.FORWARD, s, j) not in run.done:
                problems.append(f"{s}F{j} missing")
            split = (_K.BACKWARD_INPUT, s, j) in run.done and (_K.BACKWARD_WEIGHT, s, j) in run.done
            if (_K.BACKWARD, s, j) not in run.done and not split:
                problems.append(f"{s}B{j} (or {s}I{j} + {s}W{j}) missing")
    for message, (rank, step, send) in run.sent.items():
        if message not in run.received:
            problems.append(f"rank {rank} sends {send} at step {step} but rank {send.peer} never receives it")
    if (run.reduced or run.reduced_microbatches) and len(run.reduced) != run.stages:
        problems.append(f"REDUCE missing for stages {sorted(set(range(run.stages)) - run.reduced)}")
    if run.gathered:
        problems.append(
            f"parameters of stages {sorted(run.gathered)} still gathered at the end (missing FREE)"
        )
    if problems:
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ScheduleError(
            f"incomplete schedule: {'; '.join(problems[:5])}{more}\n{render_grid(run.text_grid(run.step))}"
        )
