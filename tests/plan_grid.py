"""The memory model's unit grids: one execution plan per parallel setting, where that setting is valid."""

from __future__ import annotations

from tessera.config import Config, ModelConfig, ParallelConfig, TrainConfig
from tessera.execution import ExecutionPlan, resolve, violations


def valid_plan(
    model: ModelConfig, parallel: dict[str, object], *, global_batch: int, micro_batch: int
) -> ExecutionPlan | None:
    """The plan of ``model`` under ``parallel`` (ParallelConfig fields, ``data`` given) on exactly the ranks it
    names, or None where `violations` rejects it."""
    par = ParallelConfig(**parallel)
    world = par.tensor_ranks * par.pipeline * par.data
    cfg = Config(
        model=model, parallel=par, train=TrainConfig(global_batch=global_batch, micro_batch=micro_batch)
    )
    return None if violations(cfg, world, training=False) else resolve(cfg, world, training=False)
