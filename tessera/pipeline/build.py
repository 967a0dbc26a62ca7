"""The lowered, validated action lists of a named or hand-written (CSV) schedule. Pure Python, no torch.

The execution plan (`tessera.execution`) calls this to prove, before launch, that the schedule a run will execute
builds and is deadlock-free; the runtime calls it to get the very same lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError
from tessera.modes import ACCUMULATION, DEPTH_FIRST
from tessera.pipeline.csvio import from_csv
from tessera.pipeline.ir import Schedule, infer_stage_ranks, stage_to_rank
from tessera.pipeline.passes import lower
from tessera.pipeline.schedules import build_schedule
from tessera.pipeline.validate import validate

__all__ = ["compute_options", "lowered_schedule"]

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
    """
    if accumulation not in ACCUMULATION:
        raise ConfigError(f"unknown accumulation {accumulation!r}; choose one of {', '.join(ACCUMULATION)}")
    placement = str(options.get("placement", "loop"))
    if schedule_name.endswith(".csv"):
        compute = _schedule_from_file(schedule_name, p, m, v)
        placement = _placement_of(compute, p)
    else:
        options = {**options, **compute_options(schedule_name, accumulation)}
        compute = build_schedule(schedule_name, p, m, v, **options)
    lowered = lower(
        compute, p, placement, zero3=zero3, reduce_every_microbatch=reduce_every_microbatch, tied=tied
    )
    validate(lowered, p, microbatches=m)
    return lowered, placement


def _schedule_from_file(path: str, p: int, m: int, v: int) -> Schedule:
    """A user's own compute schedule from CSV (tessera.pipeline.csvio format), checked against p, m and v."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"parallel.schedule = {path!r}: no such file; write one with tessera.pipeline.csvio.to_csv"
        )
    compute = from_csv(file.read_text(), p)
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
