"""Llama 3.1's RoPE scaling (``model.rope_scaling``, llama3) at parallel layouts against the single-device run.

The one `Rope` module computes the scaled tables (tessera/model/layers.py); tensor-parallel attention and the
pipeline stages share it, and the meta-device build recomputes it in `Rope.reset`. Each layout trains the
steps of test_trainer_tp.py, each from the reference's state after the one before (`record_layouts`' ``follow``,
as `tessera compare` runs: docs/parity.md), and must match the single-device reference in every step's loss,
gradient norm, full gradient and updated parameter, with that file's tolerances (`tessera.parity.FP32`). The scaling is chosen so that the tiny head dim (8, wavelengths 6.3, 63,
628 and 6283 positions) has a kept, an interpolated and two divided frequencies; the reference's attention
gradients differ from the unscaled model's beyond those tolerances, so a layout that lost the scaling fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config import from_dict
from tessera.parity import FP32, Record
from tests.distributed.conftest import (
    assert_layout_matches_reference,
    follow_file,
    record_layouts,
    trainer_config,
)
from tests.distributed.test_trainer_tp import GRAD_ATOL, GRAD_RTOL, STEPS
from tests.harness import run_distributed

SCALING = {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 128,
}

LAYOUTS = {  # name: (world size, parallel section)
    "pp2_tp1d_2": (4, {"pipeline": 2, "tensor": 2}),
    "tp2x2": (4, {"tensor": "2x2"}),
}


def _config(token_file: Path, run_dir: Path, parallel: dict, scaling: dict | None = SCALING) -> dict:
    model = {"size": "llama-tiny", "n_heads": 4, "n_kv_heads": 2, "d_model": 32, "ffn_hidden": 64}
    model |= {"rope_scaling": scaling} if scaling is not None else {}
    return trainer_config(token_file, run_dir, model, parallel, steps=STEPS, grad_clip=0.5)


@pytest.fixture(scope="module")
def reference(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Record:
    run_dir = tmp_path_factory.mktemp("rope_reference") / "ref"
    ref = _config(token_file, run_dir, {"accumulation": "depth_first"})
    return record_layouts(0, 1, [ref], keep_states=True)[0].record


def test_the_scaling_changes_the_reference(token_file: Path, tmp_path: Path, reference: Record) -> None:
    """Without the scaling, step 0's query and key gradients differ beyond the tolerances the layouts meet."""
    unscaled_raw = _config(token_file, tmp_path / "unscaled", {"accumulation": "depth_first"}, scaling=None)
    unscaled = record_layouts(0, 1, [unscaled_raw])[0].record.grads
    for name in ("blocks.0.attn.wq.weight", "blocks.1.attn.wk.weight"):
        scaled = reference.grads[0][name]
        assert not torch.allclose(unscaled[0][name], scaled, rtol=GRAD_RTOL, atol=GRAD_ATOL), name


@pytest.mark.parametrize("name", LAYOUTS)
def test_llama3_scaling_matches_reference(
    token_file: Path, tmp_path: Path, name: str, reference: Record
) -> None:
    world, parallel = LAYOUTS[name]
    raw = _config(token_file, tmp_path / name, parallel)
    follow = follow_file(tmp_path / "follow.pt", [reference])
    got = run_distributed(record_layouts, world, [raw], follow, timeout=300)[0][0].record
    assert_layout_matches_reference(got, reference, FP32, from_dict(raw).model, world, STEPS)
