"""An interrupted run resumed from its checkpoint leaves one metrics record per step (single process)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.conftest import interrupted_then_resumed, trainer_config

TINY = {"family": "gpt", "n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 16}


def test_resumed_run_logs_each_step_once(token_file: Path, tmp_path: Path) -> None:
    raw = trainer_config(token_file, tmp_path / "run", TINY, {}, steps=6)
    raw["checkpoint"] = {"every": 2, "resume": True}
    losses = interrupted_then_resumed(0, 1, raw, crash_at=3)  # steps 0-2 ran; the checkpoint holds step 2
    assert sorted(losses) == [2, 3, 4, 5]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == [0, 1, 2, 3, 4, 5]  # without truncation: 0, 1, 2, 2, 3, 4, 5
