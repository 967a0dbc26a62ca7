"""Pipeline schedules as pure functions ``(p, m, v=1, **options) -> list[list[Action]]``.

Each returns per-rank *compute* lists (F and B only); ``passes.lower`` adds communication and ZeRO actions.
Bubble fractions below assume equal stage costs and free communication (t_b = 2 t_f does not change them):

- ``gpipe``            all forwards, then all backwards; (p-1)/(m+p-1); memory: m micro-batches in flight.
- ``1f1b``             PipeDream-flush: p-1-r warm-up forwards, then alternate; same bubble, ≤ p in flight.
- ``interleaved_1f1b`` Megatron depth-first over v looped chunks; (p-1)/(v·m+p-1); needs m % p == 0.
- ``breadth_first``    looped placement + layered gradient accumulation: each local stage runs all micro-batches
                       of a group of ``consecutive`` before the next stage, forward and backward;
                       (p-1)/(v·m+p-1) when consecutive = m ≥ p.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable

from tessera.pipeline.ir import Action, ActionKind, Schedule, ScheduleError, rank_stages

__all__ = [
    "SCHEDULES",
    "breadth_first",
    "build_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "rank_steps",
]

_F = ActionKind.FORWARD
_B = ActionKind.BACKWARD


def _check_sizes(name: str, p: int, m: int, v: int) -> None:
    for label, value in (("pipeline ranks p", p), ("micro-batches m", m), ("stages per rank v", v)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name}: {label} must be an integer >= 1, got {value!r}")


def _require_single_stage(name: str, v: int) -> None:
    if v != 1:
        raise ScheduleError(
            f"{name} places one contiguous stage per rank (v = 1), got v = {v}; "
            "use 'interleaved_1f1b' or 'breadth_first' for several stages per rank"
        )


Step = tuple[int, ActionKind, int]
"""(stage, F or B, micro-batch): one compute action of one rank, before it becomes an `Action` (cheap to make:
the memory estimator walks single ranks' lists of the planner's candidate layouts)."""


def _gpipe_rank(p: int, m: int, v: int, r: int) -> list[Step]:
    return [(r, _F, j) for j in range(m)] + [(r, _B, j) for j in range(m)]


def _one_f_one_b_rank(p: int, m: int, v: int, r: int) -> list[Step]:
    warmup = min(p - 1 - r, m)
    steps = [(r, _F, j) for j in range(warmup)]
    for i in range(m - warmup):
        steps += [(r, _F, warmup + i), (r, _B, i)]
    return steps + [(r, _B, j) for j in range(m - warmup, m)]


def _interleaved_rank(p: int, m: int, v: int, r: int) -> list[Step]:
    total = m * v

    def chunk_and_mb(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        return (chunk if forward else v - 1 - chunk), group * p + k % p

    warmup = total if m == p else min(2 * (p - 1 - r) + (v - 1) * p, total)
    order = [(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        order += [(warmup + i, True), (i, False)]
    order += [(k, False) for k in range(total - warmup, total)]
    steps = []
    for k, forward in order:
        chunk, mb = chunk_and_mb(k, forward)
        steps.append((chunk * p + r, _F if forward else _B, mb))
    return steps


def _breadth_first_rank(p: int, m: int, v: int, r: int, c: int, placement: str) -> list[Step]:
    stages = rank_stages(r, p, v, placement)
    steps: list[Step] = []
    for start in range(0, m, c):
        group = range(start, start + c)
        steps += [(s, _F, j) for s in stages for j in group]
        steps += [(s, _B, j) for s in reversed(stages) for j in group]
    return steps


def _actions(steps: list[Step]) -> list[Action]:
    return [Action(s, kind, j) for s, kind, j in steps]


def _gpipe_ranks(p: int, m: int, v: int) -> Callable[[int], list[Step]]:
    _check_sizes("gpipe", p, m, v)
    _require_single_stage("gpipe", v)
    return lambda r: _gpipe_rank(p, m, v, r)


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe: every rank runs its m forwards, then its m backwards in the same micro-batch order."""
    rank = _gpipe_ranks(p, m, v)
    return [_actions(rank(r)) for r in range(p)]


def _one_f_one_b_ranks(p: int, m: int, v: int) -> Callable[[int], list[Step]]:
    _check_sizes("1f1b", p, m, v)
    _require_single_stage("1f1b", v)
    return lambda r: _one_f_one_b_rank(p, m, v, r)


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): rank r runs min(p-1-r, m) warm-up forwards, then one forward / one backward
    pairs, then the remaining backwards; at most p - r micro-batches are in flight on rank r."""
    rank = _one_f_one_b_ranks(p, m, v)
    return [_actions(rank(r)) for r in range(p)]


def _interleaved_ranks(p: int, m: int, v: int) -> Callable[[int], list[Step]]:
    _check_sizes("interleaved_1f1b", p, m, v)
    if m % p != 0:
        lower, upper = (m // p) * p, (m // p + 1) * p
        near = f"{lower} or {upper}" if lower else f"{upper}"
        raise ScheduleError(
            f"interleaved_1f1b needs the micro-batch count m to be a multiple of p (Megatron's rule): "
            f"m = {m}, p = {p}; use m = {near}, or 'breadth_first' which accepts any m"
        )
    return lambda r: _interleaved_rank(p, m, v, r)


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Megatron-LM interleaved 1F1B over ``v`` chunks per rank, looped placement (stage = chunk·p + rank).

    Micro-batches go through the chunks in groups of p (Megatron's rule: m must be a multiple of p). Rank r
    warms up with 2·(p-1-r) + (v-1)·p forwards (all of them when m == p), then alternates forward / backward.
    Bubble (p-1)/(v·m+p-1) with equal stage costs.
    """
    rank = _interleaved_ranks(p, m, v)
    return [_actions(rank(r)) for r in range(p)]


def _breadth_first_ranks(
    p: int, m: int, v: int, *, consecutive: int | None = None, placement: str = "loop"
) -> Callable[[int], list[Step]]:
    _check_sizes("breadth_first", p, m, v)
    c = m if consecutive is None else consecutive
    if not isinstance(c, int) or not 1 <= c <= m or m % c != 0:
        divisors = [d for d in range(1, m + 1) if m % d == 0]
        raise ScheduleError(
            f"breadth_first: consecutive must divide the micro-batch count m = {m}, got {consecutive!r}; "
            f"valid values: {divisors} (m = fully breadth-first, 1 = depth-first)"
        )
    return lambda r: _breadth_first_rank(p, m, v, r, c, placement)


def breadth_first(
    p: int, m: int, v: int = 2, *, consecutive: int | None = None, placement: str = "loop"
) -> Schedule:
    """Breadth-first pipeline with layered gradient accumulation (looped placement by default).

    Micro-batches are split into groups of ``consecutive`` (default m, fully breadth-first). For each group, a
    rank runs every micro-batch of the group through its first local stage, then its next stage, ... (forward),
    then the backward of the group through its local stages in reverse; groups follow one another like
    ordinary gradient accumulation (Fast-LLM's ``breadth_first_micro_batches`` = consecutive and
    ``depth_first_micro_batches`` = m / consecutive). consecutive = 1 is plain depth-first accumulation, m is
    layered accumulation: each stage's gradients are final after one backward sweep, and ZeRO-3 gathers each
    stage's weights once per forward and once per backward. Bubble (p-1)/(v·m+p-1) when consecutive = m ≥ p.
    """
    rank = _breadth_first_ranks(p, m, v, consecutive=consecutive, placement=placement)
    return [_actions(rank(r)) for r in range(p)]


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "breadth_first": breadth_first,
}
"""Schedule name → pure function; names used by configs and ``tessera schedule show NAME``."""

_ALIASES = {
    "one_f_one_b": "1f1b",
    "interleaved": "interleaved_1f1b",
    "bfs": "breadth_first",
    "bf": "breadth_first",
}


_RANK_BUILDERS: dict[str, Callable[..., Callable[[int], list[Step]]]] = {
    "gpipe": _gpipe_ranks,
    "1f1b": _one_f_one_b_ranks,
    "interleaved_1f1b": _interleaved_ranks,
    "breadth_first": _breadth_first_ranks,
}
"""Each schedule of ``SCHEDULES`` as its checks and one rank's list: the functions above are built from these."""


def rank_steps(name: str, p: int, m: int, v: int, rank: int, **options: object) -> list[Step]:
    """Rank ``rank``'s compute list of schedule ``name`` as `Step` triples, equal to ``build_schedule(...)[rank]``
    (tests/unit/test_peak_memory.py), without building the other ranks' lists or any `Action`."""
    key = _resolve(name, options)
    return _RANK_BUILDERS[key](p, m, v, **options)(rank)


def build_schedule(name: str, p: int, m: int, v: int = 1, **options: object) -> Schedule:
    """Build schedule ``name`` (see ``SCHEDULES``) for p ranks, m micro-batches, v stages per rank."""
    return SCHEDULES[_resolve(name, options)](p, m, v, **options)


def _resolve(name: str, options: dict[str, object]) -> str:
    """The schedule's canonical name; unknown names and options are errors that list the valid ones."""
    key = _ALIASES.get(name, name)
    if key not in SCHEDULES:
        names = sorted(SCHEDULES)
        close = difflib.get_close_matches(name, names + sorted(_ALIASES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(names)}.{hint}")
    function = SCHEDULES[key]
    accepted = [
        n for n, prm in inspect.signature(function).parameters.items() if prm.kind is prm.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ScheduleError(f"schedule {key!r} has no option(s) {unknown}; it accepts {accepted or 'none'}")
    return key
