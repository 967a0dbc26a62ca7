"""The lowered, validated action lists of a named or hand-written (CSV) schedule. Pure Python, no torch.

The execution plan (`tessera.execution`) calls this to prove, before launch, that the schedule a run will execute
builds and is deadlock-free; the runtime calls it to get the very same lists. One training rank asks up to three
times for the same lists (the CLI's early check, the trainer's `resolve`, the runtime), and a large global batch
makes each build seconds long (20,000 micro-batches on 4 pipeline ranks: ~7 s), so the last few results are
memoised (`lowered_schedule`).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError
from tessera.modes import ACCUMULATION, DEPTH_FIRST
from tessera.pipeline.csvio import from_csv
from tessera.pipeline.ir import Action, Schedule, infer_stage_ranks, stage_to_rank
from tessera.pipeline.passes import lower
from tessera.pipeline.schedules import build_schedule
from tessera.pipeline.validate import validate

__all__ = ["MEMO_SIZE", "compute_options", "lowered_schedule"]

_BREADTH_FIRST_NAMES = ("breadth_first", "bf", "bfs")


def compute_options(schedule_name: str, accumulation: str) -> dict[str, int]:
    """The named schedule's options an accumulation mode implies: depth-first runs breadth_first one
    micro-batch at a time (``consecutive = 1``)."""
    return {"consecutive": 1} if accumulation == DEPTH_FIRST and schedule_name in _BREADTH_FIRST_NAMES else {}


def lowered_schedule(
    schedule_name: str,
    p: int,
    m: int,
    v: int = 1,
    *,
    zero3: bool = False,
    accumulation: str = "layered",
    reduce_every_microbatch: bool = False,
    tied: Iterable[tuple[int, int]] = (),
    **options: Any,
) -> tuple[Schedule, str]:
    """Build, lower and validate a named schedule; returns (lowered lists, placement).

    ``accumulation = "depth_first"`` runs breadth_first one micro-batch at a time (``consecutive = 1``);
    ``reduce_every_microbatch`` (`tessera.modes.reduces_every_microbatch`: depth-first except ZeRO-1) lowers a
    REDUCE after every micro-batch's backward, which the runtime executes and the simulator prices. ``tied``:
    pairs of stages sharing a parameter (`passes.tied_stages`); those on different ranks end their ranks' lists
    with an EXCHANGE and their one REDUCE (`passes.add_tied_exchange`).

    Memoised, per process: the last `MEMO_SIZE` results, keyed by every argument (``tied`` as a tuple of pairs,
    in order, as it orders the EXCHANGEs; ``options`` by name: every schedule option is an int or a string). A
    schedule file is read on every call and keyed by its text, so an edited file is parsed and validated again
    and a missing one raises as before. A build that raises is not memoised: the same call raises again. The memo
    holds tuples and each call returns fresh lists of the shared, frozen actions, so a caller may edit its lists
    without changing another's: no caller does today, and the copy costs ~10 ms for 400,000 actions against the
    seconds of a build. The planner's search does not come here (it lowers with `passes.lower` and walks
    `peak_memory`), so its thousands of layouts neither fill the memo nor pay for it.
    """
    if accumulation not in ACCUMULATION:
        raise ConfigError(f"unknown accumulation {accumulation!r}; choose one of {', '.join(ACCUMULATION)}")
    text = _read_schedule_file(schedule_name) if schedule_name.endswith(".csv") else None
    pairs = tuple(tuple(pair) for pair in tied)
    lowered, placement = _build(
        schedule_name,
        text,
        p,
        m,
        v,
        zero3,
        accumulation,
        reduce_every_microbatch,
        pairs,
        tuple(sorted(options.items())),
    )
    return [list(actions) for actions in lowered], placement


MEMO_SIZE = 4
"""Results `lowered_schedule` keeps: a training rank needs one; 400,000 actions (20,000 micro-batches, 4 ranks)
hold ~32 MiB."""


@lru_cache(maxsize=MEMO_SIZE)
def _build(
    schedule_name: str,
    text: str | None,
    p: int,
    m: int,
    v: int,
    zero3: bool,
    accumulation: str,
    reduce_every_microbatch: bool,
    tied: tuple[tuple[int, int], ...],
    options: tuple[tuple[str, Any], ...],
) -> tuple[tuple[tuple[Action, ...], ...], str]:
    """`lowered_schedule`'s build, as tuples (the memo's entries must not change); ``text``: the schedule
    file's contents, ``None`` for a named schedule."""
    named = dict(options)
    placement = str(named.get("placement", "loop"))
    if text is not None:
        compute = _schedule_from_text(schedule_name, text, p, m, v)
        placement = _placement_of(compute, p)
    else:
        named = {**named, **compute_options(schedule_name, accumulation)}
        compute = build_schedule(schedule_name, p, m, v, **named)
    lowered = lower(
        compute, p, placement, zero3=zero3, reduce_every_microbatch=reduce_every_microbatch, tied=tied
    )
    validate(lowered, p, microbatches=m)
    return tuple(map(tuple, lowered)), placement


def _read_schedule_file(path: str) -> str:
    """The text of a user's schedule file (tessera.pipeline.csvio format)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"parallel.schedule = {path!r}: no such file; write one with tessera.pipeline.csvio.to_csv"
        )
    try:
        return file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"parallel.schedule = {path!r} is not UTF-8 text ({e}); save it as CSV text "
            "(tessera.pipeline.csvio.to_csv writes one)"
        ) from None


def _schedule_from_text(path: str, text: str, p: int, m: int, v: int) -> Schedule:
    """A user's own compute schedule from the CSV text of file ``path``, checked against p, m and v."""
    compute = from_csv(text, p)
    stages = {a.stage for rank in compute for a in rank}
    batches = {a.microbatch for rank in compute for a in rank if a.microbatch is not None}
    if stages != set(range(p * v)) or batches != set(range(m)):
        raise ConfigError(
            f"schedule file {path}: it has stages {sorted(stages)} and micro-batches {sorted(batches)}, but this run "
            f"has pipeline {p} × stages_per_rank {v} = {p * v} stages and {m} micro-batches per step"
        )
    return compute


def _placement_of(compute: Schedule, p: int) -> str:
    """The placement (loop or vshape) whose stage → rank map the schedule follows."""
    owner = infer_stage_ranks(compute)
    for placement in ("loop", "vshape"):
        if all(stage_to_rank(s, p, placement) == r for s, r in owner.items()):
            return placement
    raise ConfigError(
        f"schedule file puts stages on ranks {owner}, which is neither the loop nor the vshape placement"
    )
