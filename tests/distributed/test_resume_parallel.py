"""Resume in every parallel layout (and fp16): a run interrupted after a checkpoint and resumed reproduces the
uninterrupted run's losses bit for bit (same ranks, same layout).

Each rank saves and reloads only its own slice (tensor shards, pipeline stages, ZeRO shards and moments), so this
checks that every slice comes back and that state derived from it (ZeRO's full parameter copies, tied weights on
other pipeline ranks) is rebuilt before the next step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.train.metrics import read_metrics
from tests.distributed.conftest import interrupted_then_resumed, train_losses, trainer_config
from tests.harness import run_distributed

STEPS = 4
CRASH_AT = 2  # after the checkpoint written at step 2 (every 2 steps)

LAYOUTS = {  # name: (world size, model size, parallel section[, train section])
    "dp2_zero1": (2, "gpt2-tiny", {"data": 2, "zero": 1}),
    "dp2_zero2": (2, "gpt2-tiny", {"data": 2, "zero": 2}),
    "dp2_zero3": (2, "gpt2-tiny", {"data": 2, "zero": 3}),
    "pp2_1f1b_tied": (2, "gpt2-tiny", {"pipeline": 2, "schedule": "1f1b"}),
    "tp2x2": (4, "llama-tiny", {"tensor": "2x2"}),
    "dp2_pp2_zero3": (4, "gpt2-tiny", {"data": 2, "pipeline": 2, "zero": 3, "schedule": "breadth_first"}),
    # hybrid sharding: ZeRO-2 shards over 2 of the 4 data ranks, the replicas all-reduce them (one block each saved)
    "dp4_shard2_zero2": (4, "gpt2-tiny", {"data": 4, "zero": 2, "zero_shard_size": 2}),
    # the loss scale must come back too: 2**19 overflows at steps 0 and 1, so the checkpoint holds 2**17
    "dp2_zero2_fp16": (2, "gpt2-tiny", {"data": 2, "zero": 2}, {"dtype": "fp16", "fp16_init_scale": 2.0**19}),
    "dp2_fp16": (
        2,
        "gpt2-tiny",
        {"data": 2, "accumulation": "depth_first"},
        {"dtype": "fp16", "fp16_init_scale": 2.0**19},
    ),
}


def _config(token_file: Path, run_dir: Path, size: str, parallel: dict, train: dict) -> dict:
    raw = trainer_config(token_file, run_dir, {"size": size}, parallel, steps=STEPS, **train)
    raw["checkpoint"] = {"every": 2, "resume": True}
    return raw


@pytest.mark.parametrize("name", LAYOUTS)
def test_resume_reproduces_losses_exactly(token_file: Path, tmp_path: Path, name: str) -> None:
    world, size, parallel, *train = LAYOUTS[name]
    full = _config(token_file, tmp_path / "full", size, parallel, *train or [{}])
    cut = _config(token_file, tmp_path / "cut", size, parallel, *train or [{}])
    expected = run_distributed(train_losses, world, full, timeout=240)[0]
    resumed = run_distributed(interrupted_then_resumed, world, cut, CRASH_AT, timeout=240)[0]
    if train:  # fp16: the scale must have backed off before the checkpoint and allowed an update after it
        skipped = [m["skipped_steps"] for m in read_metrics(tmp_path / "full")]
        assert skipped[CRASH_AT - 1] >= 1 and skipped[-1] < STEPS, (
            f"the case tests nothing: skipped {skipped}"
        )
    assert sorted(resumed) == list(range(CRASH_AT, STEPS))  # earlier steps came from the checkpoint
    for step in range(CRASH_AT, STEPS):
        assert resumed[step] == expected[step], f"step {step}: resumed {resumed[step]} vs {expected[step]}"
