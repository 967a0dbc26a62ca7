"""Checkpoints of a hybrid-sharded run (`parallel.zero_shard_size`) are layout-free like every other: saved once,
loaded back at any layout, the same state.

A run at dp 4 = 2 replicas × shard groups of 2 with ZeRO-3 trains `K` steps through `tessera.train.train` and
writes its checkpoint. Then each layout of `LOADS` (the same hybrid layout, plain ZeRO-3 over the 4 data ranks,
plain ZeRO-3 over 2) builds its `TrainingRun`, resumes from that checkpoint and at once saves it again elsewhere:
every tensor of the second checkpoint (weights, both Adam moments and the step of every parameter) must equal the
first bit for bit, which holds only if every rank loaded exactly its part and saved it back under its global name.
The first checkpoint must also hold each tensor's elements exactly once: the two replicas of a shard hold equal
blocks, which DCP's global plan writes once (no duplicate data, no two ranks writing one block).

Continuing after such a resume is bit-identical to the uninterrupted run: tests/distributed/test_resume_parallel.py
(its hybrid layout).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tessera.config import from_dict
from tessera.train import checkpoint as ckpt
from tessera.train.checkpoint.safe_read import read_metadata_safely
from tessera.train.trainer import TrainingRun, train
from tests.distributed.conftest import trainer_config
from tests.harness import run_distributed

K = 2
HYBRID = {"data": 4, "zero": 3, "zero_shard_size": 2}
LOADS = {  # name: (world size, parallel section)
    "hybrid_same": (4, HYBRID),
    "zero3_dp4": (4, {"data": 4, "zero": 3}),
    "zero3_dp2": (2, {"data": 2, "zero": 3}),
}


def _raw(token_file: Path, run_dir: Path, parallel: dict, ckpt_dir: Path | None = None) -> dict:
    raw = trainer_config(token_file, run_dir, {"size": "gpt2-tiny"}, parallel, steps=K, global_batch=8)
    raw["checkpoint"] = {"every": K, "resume": True, **({"dir": str(ckpt_dir)} if ckpt_dir else {})}
    return raw


def _train(rank: int, world: int, raw: dict) -> None:
    train(from_dict(raw))


def _load_and_save_again(rank: int, world: int, jobs: list[tuple[dict, str]]) -> list[int]:
    """For each (raw config resuming from the hybrid run's checkpoint, folder): resume, then save at once."""
    steps = []
    for raw, out in jobs:
        run = TrainingRun(from_dict(raw), rank, world)
        step = run.resume()
        run.ckpt_dir = Path(out)  # the same save, into a folder of its own
        run.save(step)
        run.stepper.close()
        steps.append(step)
    return steps


def _tensors(path: Path) -> dict[str, TensorStorageMetadata]:
    meta = read_metadata_safely(path)
    return {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


@pytest.fixture(scope="module")
def saved(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("hsdp_ckpt")
    run_distributed(_train, 4, _raw(token_file, root / "hybrid", HYBRID), timeout=240)
    first = ckpt.latest_checkpoint(root / "hybrid" / "checkpoints")
    assert first is not None
    again: dict[str, Path] = {}
    for world in sorted({w for w, _ in LOADS.values()}):
        jobs = []
        for name, (w, parallel) in LOADS.items():
            if w == world:
                again[name] = root / f"again_{name}"
                raw = _raw(token_file, root / f"run_{name}", parallel, ckpt_dir=first.parent)
                jobs.append((raw, str(again[name])))
        assert run_distributed(_load_and_save_again, world, jobs, timeout=240)[0] == [K] * len(jobs)
    return first, {name: ckpt.latest_checkpoint(folder) for name, folder in again.items()}


def test_hybrid_checkpoint_holds_every_element_once(saved: tuple[Path, dict[str, Path]]) -> None:
    first, _ = saved
    tensors = _tensors(first)
    assert any(k.startswith("model.") for k in tensors) and any(k.endswith(".exp_avg_sq") for k in tensors)
    for fqn, entry in tensors.items():
        blocks = {(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks}
        assert len(blocks) == len(entry.chunks), f"{fqn}: a block written twice"
        held = sum(math.prod(sizes) for _, sizes in blocks)
        assert held == math.prod(entry.size), (
            f"{fqn}: {held} elements in its blocks, {math.prod(entry.size)} in it"
        )


@pytest.mark.parametrize("name", LOADS)
def test_hybrid_checkpoint_loads_at_any_layout_as_the_same_state(
    saved: tuple[Path, dict[str, Path]], name: str
) -> None:
    first, again = saved
    tensors = _tensors(first)
    assert _tensors(again[name]).keys() == tensors.keys()
    for fqn in tensors:
        a, b = ckpt.read_tensor(first, fqn), ckpt.read_tensor(again[name], fqn)
        assert torch.equal(a, b), f"{name}: {fqn} differs after load and save"
