"""The trainer with tensor parallelism (1D, 2D, and with data parallelism) against the single-device reference.

The layer-by-layer checks live in test_tensor_1d.py and test_tensor_2d.py; this file checks the whole training
step as a user runs it: data slicing, gradient synchronisation, clipping over shards (the global norm it clips
by is compared every step), recomputation, ZeRO on top of tensor parallelism and the optimizer update. Every
step's loss, gradient norm, full gradient (gathered from tensor blocks and ZeRO shards alike) and updated
parameter must match (`tessera.parity.compare_records`), each step from the reference's state after the one
before (`record_layouts`' ``follow``, as `tessera compare` runs: docs/parity.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.config import from_dict
from tessera.parity import FP32, Record
from tests.distributed.conftest import (
    assert_layout_matches_reference,
    follow_file,
    record_layouts,
    trainer_config,
)
from tests.harness import run_distributed

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
# = docs/parity.md's fp32 tolerances (`tessera.parity.FP32`, whose clipping-norm rtol is GRAD_RTOL too)
STEPS = 2

LAYOUTS = {  # name: (world size, parallel section)
    "tp1d_2": (2, {"tensor": 2}),
    "dp2_tp1d_2_sp": (4, {"tensor": 2, "data": 2, "sequence_parallel": True}),
    "tp2x2": (4, {"tensor": "2x2"}),
    # recomputation replays the blocks' collectives in backward: every rank must replay the same ones
    "tp1d_2_sp_full_ckpt": (2, {"tensor": 2, "sequence_parallel": True, "checkpointing": "full"}),
    # tp_comm_overlap: the all-gathers / reduce-scatters as rings under the GEMMs, replayed by recomputation too
    "tp1d_2_sp_overlap_full_ckpt": (
        2,
        {"tensor": 2, "sequence_parallel": True, "tp_comm_overlap": True, "checkpointing": "full"},
    ),
    "tp2x2_full_ckpt": (4, {"tensor": "2x2", "checkpointing": "full"}),
    "tp2x2_selective_ckpt": (4, {"tensor": "2x2", "checkpointing": "selective"}),
}


def _config(token_file: Path, run_dir: Path, parallel: dict) -> dict:
    model = {"size": "llama-tiny", "n_heads": 4, "n_kv_heads": 2, "d_model": 32, "ffn_hidden": 64}
    # a low clip threshold makes clipping fire, so the sharded global norm is exercised
    return trainer_config(token_file, run_dir, model, parallel, steps=STEPS, grad_clip=0.5)


@pytest.fixture(scope="module")
def reference(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Record:
    """The single-device run every layout follows and is compared with, recorded once for the module."""
    run_dir = tmp_path_factory.mktemp("tp_reference") / "ref"
    ref = _config(token_file, run_dir, {"accumulation": "depth_first"})
    return record_layouts(0, 1, [ref], keep_states=True)[0].record


def _assert_layout_matches(
    token_file: Path, tmp_path: Path, name: str, world: int, parallel: dict, reference: Record
) -> None:
    """Layout ``name`` recorded following ``reference``: loss, clipping norm (shards counted once each,
    replicated tensors once in all: Adam is nearly invariant to a common gradient scale, so a wrong clipping norm
    hardly moves the losses and is checked directly), every gradient and updated parameter, every step."""
    raw = _config(token_file, tmp_path / name, parallel)
    follow = follow_file(tmp_path / "follow.pt", [reference])
    got = run_distributed(record_layouts, world, [raw], follow, timeout=240)[0][0].record
    assert_layout_matches_reference(got, reference, FP32, from_dict(raw).model, world, STEPS)


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_parallel_training_matches_reference(
    token_file: Path, tmp_path: Path, name: str, reference: Record
) -> None:
    world, parallel = LAYOUTS[name]
    _assert_layout_matches(token_file, tmp_path, name, world, parallel, reference)


ZERO_LAYOUTS = {  # ZeRO-2/3 keep only reduced gradient shards: gathered from them (tessera.parity)
    "dp2_tp1d_2_zero1": (4, {"tensor": 2, "data": 2, "zero": 1}),
    "dp2_tp1d_2_sp_zero3": (4, {"tensor": 2, "data": 2, "zero": 3, "sequence_parallel": True}),
}


@pytest.mark.parametrize("name", ZERO_LAYOUTS)
def test_tensor_parallel_with_zero_matches_reference(
    token_file: Path, tmp_path: Path, name: str, reference: Record
) -> None:
    world, parallel = ZERO_LAYOUTS[name]
    _assert_layout_matches(token_file, tmp_path, name, world, parallel, reference)
