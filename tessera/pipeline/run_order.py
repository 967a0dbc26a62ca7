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
    """Index of the action before which each RECV is posted: ``ahead`` compute actions before it (list order),
    at 0 when fewer computes precede it, at the RECV itself when ``ahead`` is 0.

    One pass, keeping the positions of the computes seen so far: a rescan of the earlier actions per RECV was
    quadratic (20,000 micro-batches on 4 pipeline ranks: 80,000-120,000 actions a rank, 20-70 s of its start).
    """
    if ahead < 0:
        raise ValueError(f"recv_ahead must be 0 or more compute actions, got {ahead}")
    seen: list[int] = []  # positions of the compute actions before the current one
    post: dict[int, list[Action]] = {}
    for index, action in enumerate(actions):
        kind = action.kind
        if kind.is_recv:
            if not ahead:
                at = index
            elif len(seen) >= ahead:
                at = seen[-ahead]
            else:
                at = 0
            post.setdefault(at, []).append(action)
        if kind.is_compute:
            seen.append(index)
    return post


def check_p2p_order(lowered: Schedule) -> None:
    """NCCL matches P2P messages by issue order: every channel's send order must equal its receive order.

    Each list is read once, its messages grouped by channel (sender, receiver); pairs are then compared in the
    order (sender, receiver), so the first mismatch reported is the one a scan of every pair would find first.
    """
    sends: dict[tuple[int, int], list[tuple]] = {}
    recvs: dict[tuple[int, int], list[tuple]] = {}
    for rank, actions in enumerate(lowered):
        for x in actions:
            if x.kind.is_send:
                sends.setdefault((rank, x.peer), []).append(x.message)
            elif x.kind.is_recv:
                recvs.setdefault((x.peer, rank), []).append(x.message)
    for a in range(len(lowered)):
        for b in range(len(lowered)):
            if sends.get((a, b), []) != recvs.get((a, b), []):
                raise ScheduleError(
                    f"rank {a} sends to rank {b} in a different order than rank {b} receives; this backend "
                    "matches messages by order (use gloo, or reorder the hand-written schedule)"
                )
