"""The memory yardsticks of the MosaicML FSDP rows (benchmarks/results/planner_published.md, "Memory pressure"):
the row as a tessera run config, tessera's estimate of it, and the hand count of what Composer's FSDP holds."""

from __future__ import annotations

import pytest

from tessera.execution import resolve
from tessera.memory import estimate
from tessera.planner.cost import ModelShape
from tessera.planner.mosaic_table import FsdpRow, fsdp_held_bytes, fsdp_memory, fsdp_run_config

WORST = FsdpRow("a100-40gb", "70b", 2048, 64, 2, 1, True, 276, 35.87, 64862437376)
NO_CKPT = FsdpRow("a100-80gb", "13b", 2048, 8, 2, 3, False, 2262, 59.57, 12853954560)
ZERO2 = FsdpRow("h100", "3b", 2048, 128, 8, 1, False, 23422, 42.43, 2651837440, 2)


@pytest.mark.parametrize("row", [WORST, NO_CKPT, ZERO2], ids=["70b-ckpt", "13b-no-ckpt", "3b-zero2"])
def test_run_config_is_the_row(row: FsdpRow) -> None:
    """The config passes tessera's checks, has the row's parameter count (NumParams, exactly), GPUs, micro-
    batch, accumulation, ZeRO stage and checkpointing."""
    cfg = fsdp_run_config(row)
    plan = resolve(cfg, row.gpus, training=False)
    assert ModelShape.from_config(cfg.model).n_params() == row.n_params
    assert plan.micro_batches == row.accumulation
    assert cfg.train.micro_batch == row.micro_batch
    assert cfg.parallel.zero == row.zero_stage
    assert cfg.parallel.checkpointing == ("full" if row.checkpointing else "none")


def test_memory_is_what_tessera_memory_prints() -> None:
    """`fsdp_memory` is `tessera memory`'s estimate of that config (the checked path) on the row's GPU."""
    got = fsdp_memory(WORST)
    assert got.total == pytest.approx(estimate(fsdp_run_config(WORST), WORST.gpus).total, rel=1e-12)
    assert got.device_memory == 40e9


def test_held_bytes_by_hand() -> None:
    """16 B per parameter over the GPUs, plus one bf16 b·s·h checkpoint per block when the row checkpoints:
    MPT-70B on 64 GPUs at b2: 16 · 64,862,437,376 / 64 + 80 · 2 · 2048 · 8192 · 2 = 21,584,318,464 bytes;
    MPT-13B on 8 GPUs without checkpointing: 16 · 12,853,954,560 / 8 = 25,707,909,120 bytes."""
    assert fsdp_held_bytes(WORST) == 16_215_609_344 + 5_368_709_120 == 21_584_318_464
    assert fsdp_held_bytes(NO_CKPT) == 25_707_909_120
