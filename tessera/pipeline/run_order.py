"""Where the runtime does what, read off one rank's lowered action list; pure Python, no torch.

The engine (`tessera.pipeline.runtime`) executes a lowered list action by action; these functions derive from
that list what it needs besides: the forward-only list of an evaluation, the points at which receives are posted
early, and the check that a backend matching messages by issue
order (NCCL) sees every channel's sends in the order of its receives.
"""

from __future__ import annotations

from tessera.pipeline.ir import Action, ActionKind, Schedule, ScheduleError

__all__ = ["check_p2p_order", "forward_only", "recv_post_positions"]

_K = ActionKind


def forward_only(actions: list[Action]) -> list[Action]:
    """A rank's action list without backward work: forwards, their SEND_F/RECV_F, and the ZeRO-3 GATHER/FREE
    pairs that enclose a forward. Removing the backward direction keeps the forwards' relative order on every
    rank, so the list stays deadlock-free."""
    keep = (_K.FORWARD, _K.SEND_F, _K.RECV_F, _K.GATHER_PARAMS, _K.FREE_PARAMS)
    out: list[Action | None] = []
    opened: dict[int, int] = {}  # stage -> position of its open GATHER
    used: set[int] = set()  # stages that ran a forward since their GATHER
    for a in (a for a in actions if a.kind in keep):
        if a.kind is _K.GATHER_PARAMS:
            opened[a.stage] = len(out)
            used.discard(a.stage)
        elif a.kind is _K.FREE_PARAMS and a.stage in opened:
            start = opened.pop(a.stage)
            if a.stage not in used:
                out[start] = None  # a backward-only phase: neither gather nor free
                continue
        elif a.kind is _K.FORWARD:
            used.add(a.stage)
        out.append(a)
    return [a for a in out if a is not None]


def recv_post_positions(actions: list[Action], ahead: int) -> dict[int, list[Action]]:
    """Index of the action before which each RECV is posted: ``ahead`` compute actions before it (list order)."""
    computes = [i for i, a in enumerate(actions) if a.kind.is_compute]
    post: dict[int, list[Action]] = {}
    for index, action in enumerate(actions):
        if not action.kind.is_recv:
            continue
        before = [c for c in computes if c < index]
        at = before[-ahead] if ahead and len(before) >= ahead else (0 if ahead else index)
        post.setdefault(at, []).append(action)
    return post


def check_p2p_order(lowered: Schedule) -> None:
    """NCCL matches P2P messages by issue order: every channel's send order must equal its receive order."""
    for a, actions in enumerate(lowered):
        for b in range(len(lowered)):
            sends = [x.message for x in actions if x.kind.is_send and x.peer == b]
            recvs = [x.message for x in lowered[b] if x.kind.is_recv and x.peer == a]
            if sends != recvs:
                raise ScheduleError(
                    f"rank {a} sends to rank {b} in a different order than rank {b} receives; this backend "
                    "matches messages by order (use gloo, or reorder the hand-written schedule)"
                )
