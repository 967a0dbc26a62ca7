"""The CLI as a user runs it: prepare → train --nproc 2 → plot → generate (and export for a sharded run), in
subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest


def _tessera(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TESSERA_CACHE": str(cwd / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "tessera", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _concurrently(*commands: tuple[tuple[str, ...], Path]) -> list[subprocess.CompletedProcess]:
    """Run independent commands, each ``(args, cwd)``, side by side; results in order. Each process spends
    seconds of one core importing torch, and CI has two."""
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return list(pool.map(lambda command: _tessera(*command[0], cwd=command[1]), commands))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def prepared(workdir: Path) -> subprocess.CompletedProcess:
    """`tessera prepare` of three small text files into workdir/data/tokens.bin, once for the module."""
    texts = workdir / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"doc{i}.txt").write_text(("the quick brown fox jumps over the lazy dog. " * 40) + str(i))
    return _tessera("prepare", str(texts), "--out", "data/tokens.bin", cwd=workdir)


def test_prepare_train_plot_generate(workdir: Path, prepared: subprocess.CompletedProcess) -> None:
    assert prepared.returncode == 0, prepared.stderr
    assert "tokens to data/tokens.bin" in prepared.stdout

    overrides = [
        "--model.size=gpt2-tiny",
        "--train.steps=6",
        "--train.global_batch=4",
        "--train.micro_batch=2",
        "--train.warmup_steps=1",
        "--data.path=data/tokens.bin",
        "--log.run_dir=runs/cli",
        "--log.progress=false",
        "--checkpoint.every=3",
    ]
    out = _tessera("train", "--nproc", "2", *overrides, cwd=workdir)
    assert out.returncode == 0, out.stderr + out.stdout
    assert "done: loss" in out.stdout
    run = workdir / "runs" / "cli"
    assert (run / "metrics.jsonl").read_text().count("\n") == 6
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000003", "step_00000006"]

    # plot reads metrics.jsonl and writes curves.png; generate reads the checkpoint: independent
    plot, out = _concurrently(
        (("plot", "runs/cli"), workdir),
        (("generate", "runs/cli", "--prompt", "the ", "--tokens", "20"), workdir),
    )
    assert plot.returncode == 0 and (run / "curves.png").stat().st_size > 1000, plot.stderr

    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("the ") and len(out.stdout) >= 10


def test_sharded_run_generates_and_exports(workdir: Path, prepared: subprocess.CompletedProcess) -> None:
    """A 2D tensor-parallel run's checkpoint is layout-free: generate reads it in one process, export writes it
    from one process, and an export started on several ranks (each calls it) finishes instead of hanging."""
    assert prepared.returncode == 0, prepared.stderr
    overrides = [
        "--model.size=llama-tiny",
        "--model.n_kv_heads=2",
        "--parallel.tensor=2x2",
        "--train.steps=2",
        "--train.global_batch=4",
        "--train.micro_batch=2",
        "--data.path=data/tokens.bin",
        "--log.run_dir=runs/tp",
        "--log.progress=false",
    ]
    out = _tessera("train", "--nproc", "4", *overrides, cwd=workdir)
    assert out.returncode == 0, out.stderr + out.stdout
    # Side by side: generate reads runs/tp's training checkpoint (layout-free: never RUN/export), and each export
    # writes RUN/export/step_N of its own run folder, so the one on two ranks exports a copy of the run (two
    # exports into one folder would race on its step_N.tmp). Replacing an existing export is commit()'s
    # re-save, tested in tests/unit/test_checkpoint_files.py.
    shutil.copytree(workdir / "runs" / "tp", workdir / "runs" / "tp_copy")
    out, one, ranks = _concurrently(
        (("generate", "runs/tp", "--prompt", "the ", "--tokens", "5"), workdir),
        (("export", "runs/tp"), workdir),  # one process reads every tensor
        (("export", "runs/tp_copy", "--nproc", "2"), workdir),  # rank 0 exports, rank 1 returns
    )
    assert out.returncode == 0 and out.stdout.startswith("the "), out.stderr
    assert one.returncode == 0, one.stderr + one.stdout
    assert "local processes" not in one.stdout and "tp/export/step_00000002" in one.stdout, one.stdout
    assert ranks.returncode == 0, ranks.stderr + ranks.stdout
    assert "on 2 local processes" in ranks.stdout, ranks.stdout + ranks.stderr
    assert "Traceback" not in ranks.stderr, ranks.stdout + ranks.stderr
    assert "tp_copy/export/step_00000002" in ranks.stdout, ranks.stdout


def test_bad_input_is_a_message_not_a_traceback(workdir: Path) -> None:
    cases = [
        ("train", "--model.n_heads=5", "--train.steps=1"),  # d_model 64 not divisible by 5
        ("train", "--data.path=missing.bin"),
        ("generate", "no_such_run"),
        ("export", "no_such_run"),
        ("plot", "no_such_run"),
        ("prepare", "missing_dir", "--out", "x.bin"),
        ("train", "--nproc", "2", "--parallel.tensor=3"),
        ("train", "--nproc", "2", "--data.path=missing.bin"),
    ]
    # side by side, each in a folder of its own (the same relative paths are missing there): the default run
    # directory's lock is per folder, so no case can fail on another's lock instead of on its own input
    folders = [workdir / f"bad_input_{i}" for i in range(len(cases))]
    for folder in folders:
        folder.mkdir()
    outs = _concurrently(*zip(cases, folders, strict=True))
    for args, out in zip(cases, outs, strict=True):
        assert out.returncode != 0, args
        assert "Traceback" not in out.stderr + out.stdout, (args, out.stderr)
        assert "error:" in out.stderr, (args, out.stderr)
