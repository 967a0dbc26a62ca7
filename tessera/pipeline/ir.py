"""Pipeline schedule IR: actions, their compact text form, and stage placement.

A schedule is data: ``list[list[Action]]``, one list per pipeline rank, executed in order by that rank. Stages
are *global virtual* stage indices ``0..S-1`` with ``S = p * v`` (``v`` stages per rank); ``stage_to_rank`` says
which rank holds a stage. Compute schedules contain only F/B/I/W; lowering passes (``passes.py``) add the
communication and ZeRO actions, and the validator (``validate.py``) proves the lowered lists deadlock-free.

Text forms (``Action.parse(str(a)) == a``)::

    2F0              stage 2, forward, micro-batch 0           (also B, I = backward-input, W = backward-weight)
    2SEND_F0->r1     stage 2 sends its output activation of micro-batch 0 to rank 1 (the rank of stage 3)
    3RECV_F0<-r0     stage 3 receives its input activation of micro-batch 0 from rank 0 (the rank of stage 2)
    3SEND_B0->r0     stage 3 sends the gradient w.r.t. its input of micro-batch 0 to rank 0 (stage 2)
    2RECV_B0<-r1     stage 2 receives the gradient w.r.t. its output of micro-batch 0 from rank 1 (stage 3)
    2REDUCE          data-parallel reduction of stage 2's accumulated gradients (once per step)
    2REDUCE_MB1      reduction of stage 2's gradient of micro-batch 1 alone, right after its backward
                     (depth-first accumulation, except ZeRO-1: `tessera.modes.reduces_every_microbatch`)
    2GATHER / 2FREE  ZeRO-3: all-gather / release stage 2's sharded parameters
    0EXCHANGE<>r1    stage 0 swaps the gradient of a parameter it shares with a stage of rank 1 (the embedding
                     table a tied head uses) and sums the two: both ranks then hold the same total. Once per
                     step, after the stage's last backward and before its (single) REDUCE

The stage of a communication action is always the *local* stage on the rank that executes it, so a runtime can
find the buffer without looking anything up; ``Action.message`` names the message both ends agree on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from tessera.errors import TesseraError

__all__ = [
    "PLACEMENTS",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "format_schedule",
    "infer_stage_ranks",
    "parse_schedule",
    "rank_stages",
    "stage_to_rank",
]


class ScheduleError(TesseraError):
    """A pipeline schedule is invalid (incomplete, out of order, deadlocking) or cannot be built as asked."""


class ActionKind(StrEnum):
    """What an action does; the value is its spelling in the compact text form."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE_GRAD = "REDUCE"
    REDUCE_MICROBATCH = "REDUCE_MB"
    GATHER_PARAMS = "GATHER"
    FREE_PARAMS = "FREE"
    EXCHANGE_TIED = "EXCHANGE"

    # the groups are module tuples of members: looking a member up on its class costs a descriptor call, and
    # the simulator and the lowering passes ask these of every action

    @property
    def is_compute(self) -> bool:
        """F, B, I or W: runs the stage's module."""
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def is_recv(self) -> bool:
        return self in _RECVS

    @property
    def is_comm(self) -> bool:
        """Point-to-point pipeline communication (carries a micro-batch and a peer rank)."""
        return self in _COMM

    @property
    def is_stage_level(self) -> bool:
        """REDUCE, GATHER, FREE: concern a whole stage, no micro-batch."""
        return self in _STAGE_LEVEL

    @property
    def is_exchange(self) -> bool:
        """EXCHANGE: the tied gradients' swap with the peer rank (a whole stage, with a peer, no micro-batch)."""
        return self is _EXCHANGE

    @property
    def is_reduce(self) -> bool:
        """REDUCE (the stage's gradient of the step) or REDUCE_MB (one micro-batch's): a data-parallel reduction."""
        return self in _REDUCES

    @property
    def carries_gradient(self) -> bool:
        """True for SEND_B/RECV_B (gradients flow backward), False for SEND_F/RECV_F (activations)."""
        return self in _GRADIENT_MESSAGES


_K = ActionKind
_COMPUTE = (_K.FORWARD, _K.BACKWARD, _K.BACKWARD_INPUT, _K.BACKWARD_WEIGHT)
_SENDS, _RECVS = (_K.SEND_F, _K.SEND_B), (_K.RECV_F, _K.RECV_B)
_COMM = _SENDS + _RECVS
_STAGE_LEVEL = (_K.REDUCE_GRAD, _K.GATHER_PARAMS, _K.FREE_PARAMS)
_EXCHANGE = _K.EXCHANGE_TIED
_REDUCES = (_K.REDUCE_GRAD, _K.REDUCE_MICROBATCH)
_GRADIENT_MESSAGES = (_K.SEND_B, _K.RECV_B)
_MESSAGE_OF = {_K.SEND_F: ("act", 0), _K.RECV_F: ("act", -1), _K.SEND_B: ("grad", 0), _K.RECV_B: ("grad", 1)}
"""A SEND/RECV kind -> (what its message carries, the producer stage's offset from the action's stage)."""
_KIND_ALTERNATION = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KIND_ALTERNATION})(\d+)?(?:(->|<-|<>)r(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``stage`` is the global virtual stage, ``microbatch`` is ``None`` only for
    stage-level kinds and EXCHANGE, ``peer`` is the other rank of a SEND/RECV/EXCHANGE (``None`` otherwise)."""

    stage: int
    kind: ActionKind
    microbatch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        if type(kind) is not ActionKind:  # a letter: schedules are built by the hundred thousand from members
            kind = ActionKind(kind)
            object.__setattr__(self, "kind", kind)
        if self.stage < 0:
            raise ScheduleError(f"action stage must be >= 0, got {self.stage}")
        if kind is _EXCHANGE:
            if self.microbatch is not None or self.peer is None or self.peer < 0:
                raise ScheduleError(
                    "EXCHANGE concerns a whole stage: give no micro-batch and a peer rank >= 0"
                )
            return
        if kind in _STAGE_LEVEL:
            if self.microbatch is not None or self.peer is not None:
                raise ScheduleError(f"{kind.name} concerns a whole stage: give no micro-batch or peer")
            return
        if self.microbatch is None or self.microbatch < 0:
            raise ScheduleError(f"{kind.name} needs a micro-batch index >= 0, got {self.microbatch}")
        if kind in _COMM:
            if self.peer is None or self.peer < 0:
                raise ScheduleError(f"{kind.name} needs a peer rank >= 0, got {self.peer}")
        elif self.peer is not None:  # compute or REDUCE_MB
            raise ScheduleError(f"{kind.name} takes no peer rank")

    def __str__(self) -> str:
        if self.kind.is_stage_level:
            return f"{self.stage}{self.kind.value}"
        if self.kind.is_exchange:
            return f"{self.stage}{self.kind.value}<>r{self.peer}"
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.kind.is_send:
            return f"{text}->r{self.peer}"
        if self.kind.is_recv:
            return f"{text}<-r{self.peer}"
        return text

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("2F0")``, ``Action.parse("3RECV_F0<-r0")``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected e.g. '2F0', '2B1', '2SEND_F0->r1', '3RECV_B0<-r0', "
                "'2REDUCE', '2REDUCE_MB0', '2GATHER', '2FREE', '0EXCHANGE<>r1'"
            )
        stage, kind_text, mb, arrow, peer = match.groups()
        kind = ActionKind(kind_text)
        expected_arrow = (
            "->" if kind.is_send else "<-" if kind.is_recv else "<>" if kind.is_exchange else None
        )
        if arrow != expected_arrow:
            want = f"'{expected_arrow}rN'" if expected_arrow else "no peer"
            raise ScheduleError(f"cannot parse action {text!r}: {kind.name} takes {want}")
        try:
            return cls(int(stage), kind, None if mb is None else int(mb), None if peer is None else int(peer))
        except ScheduleError as error:
            raise ScheduleError(f"cannot parse action {text!r}: {error}") from None

    @property
    def message(self) -> tuple[str, int, int | None] | None:
        """The message a SEND/RECV moves, identical at both ends: ``("act", producer_stage, microbatch)`` for
        activations, ``("grad", producer_stage, microbatch)`` for gradients; ``None`` for other kinds."""
        # one dict lookup, not four comparisons with members looked up on their class: the simulator asks this of
        # every SEND and RECV it runs
        entry = _MESSAGE_OF.get(self.kind)
        if entry is None:
            return None
        what, offset = entry
        return (what, self.stage + offset, self.microbatch)

    def short(self) -> str:
        """A compact label for pictures: compute actions as ``str``; others abbreviated (``2sF0``, ``2R``)."""
        if self.kind.is_compute:
            return str(self)
        if self.kind.is_comm:
            direction = "s" if self.kind.is_send else "r"
            return f"{self.stage}{direction}{'B' if self.kind.carries_gradient else 'F'}{self.microbatch}"
        if self.kind is ActionKind.REDUCE_MICROBATCH:
            return f"{self.stage}R{self.microbatch}"
        if self.kind.is_exchange:
            return f"{self.stage}X"
        return f"{self.stage}{self.kind.value[0]}"


Schedule = list[list[Action]]
"""Per-rank action lists: ``schedule[rank]`` is executed in order by pipeline rank ``rank``."""

PLACEMENTS = ("loop", "vshape")


def stage_to_rank(stage: int, p: int, placement: str = "loop") -> int:
    """Rank holding global stage ``stage`` out of ``p`` ranks.

    ``loop`` (modular / interleaved / breadth-first): ``stage % p``, activations loop through the ranks ``v``
    times. ``vshape``: chunks alternate direction (0..p-1, then p-1..0, ...), so the turn-around stages of two
    consecutive chunks sit on the same rank and need no transfer. With ``v = 1`` both equal contiguous placement.
    """
    if p < 1:
        raise ScheduleError(f"pipeline size p must be >= 1, got {p}")
    if stage < 0:
        raise ScheduleError(f"stage must be >= 0, got {stage}")
    chunk, offset = divmod(stage, p)
    if placement == "loop":
        return offset
    if placement == "vshape":
        return offset if chunk % 2 == 0 else p - 1 - offset
    raise ScheduleError(f"unknown stage placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")


def rank_stages(rank: int, p: int, v: int, placement: str = "loop") -> list[int]:
    """Global stages held by ``rank``, ascending."""
    return [s for s in range(p * v) if stage_to_rank(s, p, placement) == rank]


def infer_stage_ranks(schedule: Schedule) -> dict[int, int]:
    """Map each stage to the rank whose list holds its actions; raise if a stage appears on two ranks."""
    owner: dict[int, int] = {}
    for rank, actions in enumerate(schedule):
        for action in actions:
            previous = owner.setdefault(action.stage, rank)
            if previous != rank:
                raise ScheduleError(
                    f"stage {action.stage} has actions on rank {previous} and on rank {rank} ({action}); "
                    "each stage must live on exactly one rank"
                )
    return owner


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: ``r0: 0F0 0F1 0B0 0B1``."""
    return "\n".join(f"r{r}: " + " ".join(str(a) for a in actions) for r, actions in enumerate(schedule))


def parse_schedule(text: str) -> Schedule:
    """Inverse of ``format_schedule``; lines ``rN: a a a`` must list ranks 0, 1, ... in order."""
    schedule: Schedule = []
    for line_no, line in enumerate(filter(str.strip, text.splitlines()), start=1):
        head, _, body = line.partition(":")
        if head.strip() != f"r{len(schedule)}":
            raise ScheduleError(f"line {line_no}: expected 'r{len(schedule)}: ...', got {line.strip()!r}")
        schedule.append([Action.parse(token) for token in body.split()])
    return schedule
