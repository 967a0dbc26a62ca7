"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.train.data import prepare


@pytest.fixture(scope="session")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level token file: tessera's own sources (no download, same on every machine)."""
    root = tmp_path_factory.mktemp("data")
    sources = sorted(Path(__file__).resolve().parents[2].joinpath("tessera").rglob("*.py"))
    prepare(sources, root / "tokens.bin", "byte")
    return root / "tokens.bin"


def trainer_config(token_file: Path, run_dir: Path, model: dict, parallel: dict, **train: object) -> dict:
    """A raw config for a short, quiet test run: 8 sequences per step in micro-batches of 2."""
    return {
        "model": model,
        "parallel": parallel,
        "train": {"steps": 3, "global_batch": 8, "micro_batch": 2, "warmup_steps": 1, "lr": 1e-2, **train},
        "data": {"path": str(token_file)},
        "checkpoint": {"every": 0, "resume": False},
        "log": {"run_dir": str(run_dir), "progress": False, "tensorboard": False},
    }
