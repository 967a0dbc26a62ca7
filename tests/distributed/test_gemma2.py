"""Gemma 2 at every parallel layout against the one-process run: loss, every gradient and every updated
parameter (`tessera compare`'s harness, tessera/parity.py), from an imported random-weight transformers
Gemma2ForCausalLM (tests/hf_models.py: head_dim 16 ≠ 32 / 4, 2 KV heads, soft-caps that bite, the (1 + w) norm
weights drawn, vocabulary 259 that no tensor degree divides).

Layouts: Megatron 1D tensor 2 with sequence parallelism (post-norms on the sequence shards, the final soft-cap
on vocabulary shards; also with its rings and full recomputation), Optimus 2D 2×2 (the (1 + w) norms over the grid row, the cap on logit blocks), pipeline 2
with the tied embedding and head on different ranks, ZeRO-3 over data 2. Tolerances: docs/parity.md's fp32 ones
(`tessera.parity.FP32`), the repository's distributed tests' own; the runs compute the same fp32 arithmetic in
another order. That the step-0 loss is transformers' own at each layout: tests/distributed/test_hf.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.config import from_dict
from tessera.parity import FP32, Record, run_config, tolerance_for
from tests.distributed.conftest import assert_layout_matches_reference, trainer_config
from tests.hf_models import make_hf

STEPS = 2
LAYOUTS = {  # name: (processes, parallel section)
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}),
    # full recomputation with SP's collectives as rings: the post-norm saves the MLP exit's output, so each
    # block's replay runs that exit's ring after its saved-tensor node (checkpointing.save_early)
    "tp2_sp_overlap_full": (
        2,
        {"tensor": 2, "sequence_parallel": True, "tp_comm_overlap": True, "checkpointing": "full"},
    ),
    "tp2x2": (4, {"tensor": "2x2"}),
    # full recomputation on the grid: the post-norm saves the MLP exit's output, so the replay runs its SUMMA
    # (the saved operands, checkpointing.save_early, are read by the product's backward either way)
    "tp2x2_full": (4, {"tensor": "2x2", "checkpointing": "full"}),
    "pp2_tied": (2, {"pipeline": 2, "schedule": "1f1b"}),
    "dp2_zero3": (2, {"data": 2, "zero": 3}),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gemma2")
    make_hf(root / "hf", "gemma2_tied")
    return root / "hf"


def _raw(token_file: Path, run_dir: Path, folder: Path, parallel: dict) -> dict:
    # clipping at 0.5 fires: the clipped update is compared too; micro-batch 4 splits over a 2×2 grid's rows
    model = {"init": f"hf:{folder}"}
    return trainer_config(token_file, run_dir, model, parallel, steps=3, grad_clip=0.5, micro_batch=4)


@pytest.fixture(scope="module")
def reference(token_file: Path, folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Record:
    work = tmp_path_factory.mktemp("gemma2_ref")
    return run_config(from_dict(_raw(token_file, work, folder, {})), 1, STEPS, work, "ref", keep_states=True)


@pytest.mark.parametrize("name", LAYOUTS)
def test_gemma2_layout_matches_one_process(
    token_file: Path, tmp_path: Path, folder: Path, reference: Record, name: str
) -> None:
    nproc, parallel = LAYOUTS[name]
    cfg = from_dict(_raw(token_file, tmp_path, folder, parallel))
    assert cfg.model.family == "gemma2" and cfg.model.attn_softcap is not None
    got = run_config(cfg, nproc, STEPS, tmp_path, name, follow=reference)
    tol = tolerance_for(cfg, from_dict(_raw(token_file, tmp_path, folder, {})))
    assert tol is FP32
    names = assert_layout_matches_reference(got, reference, tol, cfg.model, nproc, STEPS)
    assert any("post_norm" in n for n in names)
