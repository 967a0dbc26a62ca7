"""Mode names, defined once: schedules, activation checkpointing, gradient accumulation, dtypes, families.

Every other module (config checks, the execution plan, the runtime, the cost model, the planner's search space)
imports these tuples instead of spelling the names again. No imports: anything may use it.
"""

from __future__ import annotations

__all__ = [
    "ACCUMULATION",
    "BREADTH_FIRST",
    "CHECKPOINTING",
    "DEPTH_FIRST",
    "DTYPES",
    "FAMILIES",
    "LAYERED",
    "NONFINITE",
    "SCHEDULES",
    "STOP_SIGNALS",
]

FAMILIES = ("gpt", "llama")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "breadth_first")
"""Pipeline schedules a config may name (or a .csv file of its own, tessera.pipeline.csvio)."""
BREADTH_FIRST = "breadth_first"
CHECKPOINTING = ("none", "full", "selective")
"""Activation checkpointing: none, full (per block) or selective (the attention core only)."""
DTYPES = ("fp32", "bf16", "fp16")
LAYERED, DEPTH_FIRST = "layered", "depth_first"
ACCUMULATION = (LAYERED, DEPTH_FIRST)
"""Gradient accumulation order: layered (breadth-first over micro-batches) or depth-first."""
NONFINITE = ("stop", "skip")
"""What a NaN/inf loss or gradient norm does (train.nonfinite): stop the run, or skip the update."""
STOP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU")
"""Signals train.stop_signal may name; SIGTERM and SIGINT always stop cleanly."""
