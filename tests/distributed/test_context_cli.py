"""`tessera train --parallel.context=2` as a user runs it, against the single-process run, and its checkpoint
resumed at context 1.

Three runs of llama-tiny (grouped-query attention) on one prepared file, a constant learning rate (min_lr = lr,
no warmup: the runs of 2 and 4 steps share one schedule): one process for 4 steps (the reference); 2 processes at
context 2 for 2 steps, which must log the reference's first two losses and checkpoint at step 2; then one process
at context 1, resuming that checkpoint (world size and layout changed: checkpoints are layout-free), which must
log the reference's last two losses. Tolerance: the trainer tests' loss rtol 1e-5, atol 1e-6 (docs/parity.md).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tessera.train.run_files import read_metrics

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
COMMON = [
    "--model.size=llama-tiny",
    "--train.global_batch=4",
    "--train.micro_batch=2",
    "--train.warmup_steps=0",
    "--train.lr=1e-3",
    "--train.min_lr=1e-3",
    "--data.path=data/tokens.bin",
    "--log.progress=false",
    "--checkpoint.every=2",
]


def _tessera(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_CACHE": str(cwd / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "tessera", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run)]


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        math.isclose(g, w, rel_tol=LOSS_RTOL, abs_tol=LOSS_ATOL) for g, w in zip(got, want, strict=True)
    )


def test_train_at_context_2_then_resume_at_context_1(tmp_path: Path) -> None:
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"doc{i}.txt").write_text(("pack my box with five dozen liquor jugs. " * 60) + str(i))
    prepared = _tessera(tmp_path, "prepare", str(texts), "--out", "data/tokens.bin")
    assert prepared.returncode == 0, prepared.stderr

    runs = [
        ("train", *COMMON, "--train.steps=4", "--log.run_dir=runs/one"),
        (
            "train",
            "--nproc",
            "2",
            *COMMON,
            "--train.steps=2",
            "--parallel.context=2",
            "--log.run_dir=runs/cp2",
        ),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        one, cp2 = pool.map(lambda args: _tessera(tmp_path, *args), runs)
    assert one.returncode == 0, one.stderr + one.stdout
    assert cp2.returncode == 0, cp2.stderr + cp2.stdout
    reference = _losses(tmp_path / "runs/one")
    assert _close(_losses(tmp_path / "runs/cp2"), reference[:2]), (_losses(tmp_path / "runs/cp2"), reference)

    resumed = _tessera(tmp_path, "train", *COMMON, "--train.steps=4", "--log.run_dir=runs/cp2")
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    # it trained steps 2 and 3 only: "done: loss <step 2's> -> <step 3's>" (a fresh start would print step 0's)
    first = float(resumed.stdout.split("done: loss ")[1].split(" ->")[0])
    assert abs(first - reference[2]) < 1e-4 < abs(reference[2] - reference[0]), (resumed.stdout, reference)
    got = _losses(tmp_path / "runs/cp2")
    assert _close(got, reference), (got, reference)
