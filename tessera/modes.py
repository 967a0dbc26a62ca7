"""Mode names, defined once: schedules, activation checkpointing, gradient accumulation, dtypes.

Every other module (config checks, the execution plan, the runtime, the cost model, the planner's search space)
imports these tuples instead of spelling the names again. No imports: anything may use it. Model families are
declared in tessera/model/family.py (`FAMILIES` there).
"""

from __future__ import annotations

__all__ = [
    "ACCUMULATION",
    "BREADTH_FIRST",
    "CHECKPOINTING",
    "DEPTH_FIRST",
    "DTYPES",
    "LAYERED",
    "NONFINITE",
    "REPLAYS_FORWARD_COLLECTIVES",
    "SCHEDULES",
    "STOP_SIGNALS",
    "WINDOW_STARTS",
    "reduces_every_microbatch",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "breadth_first")
"""Pipeline schedules a config may name (or a .csv file of its own, tessera.pipeline.csvio)."""
BREADTH_FIRST = "breadth_first"
CHECKPOINTING = ("none", "full", "selective", "op")
"""Activation checkpointing: none, full (per block), selective (the attention core only) or op (torchtitan's
selective op policy: per block, every second matmul, the norms and activations replayed; SDPA not)."""
REPLAYS_FORWARD_COLLECTIVES = ("full", "op")
"""The checkpointing modes whose replay runs a block's forward collectives again (all but the MLP exit's, unless
a post-norm saves its output: `tessera.traffic.replayed_1d`): full replays the whole forward; op replays the
entries' all-gathers (the Linears' saved inputs), the attention exit (wo's output is the residual's) and, with
context parallelism, the K/V gathers (SDPA's backward reads them)."""
DTYPES = ("fp32", "bf16", "fp16")
LAYERED, DEPTH_FIRST = "layered", "depth_first"
ACCUMULATION = (LAYERED, DEPTH_FIRST)
"""Gradient accumulation order: layered (breadth-first over micro-batches) or depth-first."""
NONFINITE = ("stop", "skip")
"""What a NaN/inf loss or gradient norm does (train.nonfinite): stop the run, or skip the update."""
STOP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU")
"""Signals train.stop_signal may name; SIGTERM and SIGINT always stop cleanly."""
WINDOW_STARTS = ("any", "document")
"""Where a training or validation window may start (data.window_start): at any token, or at a document start."""


def reduces_every_microbatch(accumulation: str, zero_stage: int) -> bool:
    """Whether the schedule runtime reduces each micro-batch's gradient on its own, right after its backward:
    depth-first accumulation with ZeRO-2/3 (sharded gradient buffers cannot hold a step's full gradient: one
    reduce-scatter per micro-batch) and with plain data parallelism (one all-reduce per micro-batch, each under
    the next micro-batch's work: m× the bytes of reducing once). ZeRO-1 keeps full gradients and reduce-scatters
    once per step, as does layered accumulation. Decides the lowered schedule's REDUCE / REDUCE_MB actions
    (`tessera.pipeline.passes`), which the runtime executes and the planner's simulator prices."""
    return accumulation == DEPTH_FIRST and zero_stage != 1
