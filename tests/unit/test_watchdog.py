"""The hang watchdog's last act (tessera/train/watchdog.py), without training: what it reads from the
heartbeats, and a rank that times out writes its stack, reports instead of printing under tessera's launcher,
and exits 4 at once. tests/distributed/test_hang_once.py runs it in real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tessera.errors import EXIT_HANG
from tessera.rank_errors import ERROR_DIR
from tessera.train.watchdog import Watchdog

FRESH = time.time() + 3600.0
"""A heartbeat that stays fresh however slowly the test runs (the staleness check compares with the clock when it
reads: 2.8 s at timeout 6, which a subprocess's start-up on a busy machine could exceed); STALE is one from 1970."""
STALE = 1000.0


def _beats(run_dir: Path, beats: dict[int, tuple[int, float]]) -> None:
    (run_dir / "heartbeat").mkdir(parents=True, exist_ok=True)
    for rank, (step, when) in beats.items():
        (run_dir / "heartbeat" / f"rank{rank}").write_text(f"{step} {when:.3f}\n")


def test_the_diagnosis_groups_ranks_by_step_and_reads_no_clock(tmp_path: Path) -> None:
    """A node of 4 silent ranks is one entry (it was one per rank, each with its own 'Ns ago', which made every
    reader's line differ from the others')."""
    now, old = FRESH, STALE
    _beats(tmp_path, {r: (41, now) for r in range(4)} | {r: (41, old) for r in range(4, 8)} | {8: (40, old)})
    dog = Watchdog(tmp_path, 0, 10, timeout_s=6)  # rank 9 wrote no heartbeat
    assert dog._culprits() == (
        "not responding: ranks 4-7 (step 41), rank 8 (step 40), rank 9 (no step yet)",
        [4, 5, 6, 7, 8, 9],
    )
    _beats(tmp_path, {r: (41 if r not in (2, 5) else 40, now) for r in range(8)})
    assert Watchdog(tmp_path, 0, 8, timeout_s=6)._culprits() == (
        "behind the others (step 41): ranks 2, 5 (step 40)",
        [],
    )
    _beats(tmp_path, {r: (41, now) for r in range(8)})
    assert Watchdog(tmp_path, 0, 8, 6)._culprits()[0].startswith("every rank responds at the same step")


def test_a_rank_that_times_out_writes_its_stack_reports_and_exits_4(tmp_path: Path) -> None:
    run, errors = tmp_path / "run", tmp_path / "errors"
    errors.mkdir()
    _beats(run, {0: (41, FRESH), 1: (41, STALE), 2: (41, FRESH)})
    code = (
        "import pathlib; from tessera.train.watchdog import Watchdog\n"
        f"dog = Watchdog(pathlib.Path({str(run)!r}), 2, 3, 6.0); dog.step = 41; dog._fire(7.4)\n"
        "raise SystemExit('not reached: the watchdog exits the process')\n"
    )
    env = {**os.environ, "WORLD_SIZE": "3", "RANK": "2", ERROR_DIR: str(errors)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_HANG and out.stderr == "", out.stderr
    assert 'File "' in (run / "stacks" / "rank2.txt").read_text()  # faulthandler's dump of every thread
    report = json.loads((errors / "rank2.json").read_text())
    assert report["message"] == (
        "no progress for {idle}s (train.hang_timeout_s = 6) after step {step}; not responding: rank 1 (step 41); "
        f"stacks in {run / 'stacks'}/"
    )
    assert (
        report["numbers"] == {"idle": 7.4, "step": 41} and report["silent"] == [1] and report["others_follow"]
    )
