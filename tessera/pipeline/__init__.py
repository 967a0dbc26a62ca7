"""Pipeline schedules as data: IR, schedule builders, lowering passes, validator, CSV I/O.

Pure Python: nothing here imports torch, so the planner and the simulator can use it anywhere.
"""

from __future__ import annotations

from tessera.pipeline.csvio import from_csv, to_csv
from tessera.pipeline.ir import (
    PLACEMENTS,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    format_schedule,
    infer_stage_ranks,
    parse_schedule,
    rank_stages,
    stage_to_rank,
)
from tessera.pipeline.passes import (
    add_communication,
    add_grad_reduction,
    add_param_gather,
    add_tied_exchange,
    lower,
    tied_across,
    tied_stages,
)
from tessera.pipeline.schedules import (
    SCHEDULES,
    breadth_first,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
)
from tessera.pipeline.validate import render_grid, validate

__all__ = [
    "PLACEMENTS",
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "add_communication",
    "add_grad_reduction",
    "add_param_gather",
    "add_tied_exchange",
    "breadth_first",
    "build_schedule",
    "format_schedule",
    "from_csv",
    "gpipe",
    "infer_stage_ranks",
    "interleaved_1f1b",
    "lower",
    "one_f_one_b",
    "parse_schedule",
    "rank_stages",
    "render_grid",
    "stage_to_rank",
    "tied_across",
    "tied_stages",
    "to_csv",
    "validate",
]
