"""The planner's file is a run, as a user runs it: `tessera plan --out` for a tiny model on two CPU ranks, then
`tessera train FILE --nproc 2` on it, unchanged: it trains the data and steps it names and checkpoints where and
as often as it says."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tessera.cli import main
from tessera.config import load_config
from tessera.planner.hardware import save_hardware
from tests.planner_hardware import TWO_CPUS


def test_plan_out_trains_as_written(tmp_path: Path, token_file: Path) -> None:
    # an MTBF of 3.6 ms: the Young/Daly interval is below one step, so the file checkpoints every step
    hardware = tmp_path / "two-cpus.toml"
    save_hardware(dataclasses.replace(TWO_CPUS, gpu_mtbf_hours=1e-6), hardware)
    out, run_dir = tmp_path / "plan.toml", tmp_path / "run"
    plan = ["plan", "--model", "gpt2-tiny", "--gpus", "2", "--hardware", str(hardware), "--global-batch", "4"]
    flags = ["--dtype", "fp32", "--data", str(token_file), "--steps", "4", "--run-dir", str(run_dir)]
    assert main([*plan, *flags, "--out", str(out), "--top", "1"]) == 0
    cfg = load_config(out)
    assert (cfg.train.steps, cfg.checkpoint.every, cfg.checkpoint.dir) == (4, 1, f"{run_dir}/checkpoints")

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "tessera", "train", str(out), "--nproc", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    ran = json.loads((run_dir / "config.json").read_text())
    assert ran["data"]["path"] == str(token_file)  # the planned data, not the demo corpus
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    # every step saved; keep = 2 leaves the last two (saving only at the end would leave step 4 alone)
    saved = sorted(p.name for p in Path(cfg.checkpoint.dir).glob("step_*"))
    assert saved == ["step_00000003", "step_00000004"]
