"""`tessera compare` on real layouts (gloo): parity with the one-process run, and a wrong gradient caught.

The one-process run (B) trains once for the module, recording its state after each step; each layout (A) then
trains 2 steps following it (tessera/parity.py) and every loss, gradient norm, full gradient and updated
parameter must be within the fp32 tolerances of docs/parity.md, for every parameter name of the plain model.
The command's own exit statuses: test_parity_cli.py (a wrong gradient) and tests/unit/test_parity.py (bad input).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from tessera.config import Config, from_dict
from tessera.model.build import meta_model
from tessera.parity import FP32, Record, compare, run_config, tolerance_for
from tessera.train.data import TokenDataset, prepare, target_count
from tests.distributed.conftest import assert_layout_matches_reference, trainer_config

STEPS = 2
MODEL = {"family": "llama", "n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "seq_len": 16}
LAYOUTS = {  # name: (processes, parallel section)
    "dp2_zero3": (2, {"data": 2, "zero": 3}),
    "pp2_1f1b_tied": (2, {"pipeline": 2, "schedule": "1f1b"}),  # the tied embedding and head on two ranks
    "tp2_1d": (2, {"tensor": 2}),
    # full recomputation with SP's collectives as rings (tp_comm_overlap): the replay stops before each block's
    # MLP exit ring, its x and weight saved before the ring (checkpointing.save_early); the backward reads them
    "tp2_sp_overlap_full": (
        2,
        {"tensor": 2, "sequence_parallel": True, "tp_comm_overlap": True, "checkpointing": "full"},
    ),
    # the same inside a breadth-first pipeline with ZeRO-3 (the megatron-1t plan's layout, dp 1)
    "pp2_bf_tp2_sp_overlap_z3_full": (
        4,
        {
            "pipeline": 2,
            "schedule": "breadth_first",
            "tensor": 2,
            "sequence_parallel": True,
            "tp_comm_overlap": True,
            "zero": 3,
            "checkpointing": "full",
        },
    ),
    # 2D 2×2 with full recomputation: the replay stops before each block's MLP output Linear's SUMMA, its
    # operands saved before the broadcasts (checkpointing.save_early); the product's backward reads them from there
    "tp2x2_full": (4, {"tensor": "2x2", "checkpointing": "full"}),
}


def _raw(token_file: Path, run_dir: Path, parallel: dict) -> dict:
    # clipping at 0.5 fires (norms ~2): the clipped update is compared too
    return trainer_config(token_file, run_dir, MODEL, parallel, steps=3, grad_clip=0.5)


@pytest.fixture(scope="module")
def reference(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Record:
    work = tmp_path_factory.mktemp("parity_ref")
    return run_config(from_dict(_raw(token_file, work, {})), 1, STEPS, work, "ref", keep_states=True)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(token_file: Path, tmp_path: Path, reference: Record, name: str) -> None:
    nproc, parallel = LAYOUTS[name]
    cfg = from_dict(_raw(token_file, tmp_path, parallel))
    got = run_config(cfg, nproc, STEPS, tmp_path, name, follow=reference)
    tol = tolerance_for(cfg, from_dict(_raw(token_file, tmp_path, {})))
    assert tol is FP32
    assert_layout_matches_reference(got, reference, tol, cfg.model, nproc, STEPS)


def _prompt_heavy_file(root: Path) -> Path:
    """Byte tokens of prompt/completion records with 40-byte prompts and 1-byte completions, with their loss
    mask: 2 targets (the completion and its end-of-text token) in every 43 tokens, so many windows hold none."""
    rng = random.Random(3)
    lines = [
        json.dumps({"q": "".join(rng.choices("abcdefgh ", k=40)), "a": rng.choice("xyz")}) for _ in range(400)
    ]
    (root / "sft.jsonl").write_text("\n".join(lines) + "\n")
    prepare([root / "sft.jsonl"], root / "sft.bin", "byte", prompt_key="q", completion_key="a")
    return root / "sft.bin"


def test_a_step_without_targets_is_skipped_as_train_skips_it(tmp_path: Path) -> None:
    """data.loss_mask: a step whose global batch is all prompt is skipped by `tessera train` (docs/data.md); compare
    skips it too (NaN loss and norm, no gradients, no update) in both runs and compares the next step, where it
    used to stop with the trainer's 'holds no target tokens' error."""
    tokens = _prompt_heavy_file(tmp_path)
    data = TokenDataset(tokens)
    counts = {s: [target_count(data, k, 2, MODEL["seq_len"], s) for k in range(STEPS)] for s in range(100)}
    seed = next(s for s, (first, second) in counts.items() if first == 0 and second > 0)

    def cfg(parallel: dict) -> Config:
        raw = trainer_config(
            tokens, tmp_path, MODEL, parallel, steps=3, global_batch=2, micro_batch=1, seed=seed
        )
        raw["data"]["loss_mask"] = True
        return from_dict(raw)

    reference = cfg({})
    report = compare(cfg({"data": 2, "zero": 2}), reference, 2, 1, STEPS, tmp_path / "work")
    assert report.ok, report.table(20)
    names = {n for n, _ in meta_model(reference.model).named_parameters(remove_duplicate=False)}
    for run in (report.a, report.b):
        assert math.isnan(run.losses[0]) and math.isnan(run.norms[0]) and run.grads[0] == {}
        assert math.isfinite(run.losses[1]) and set(run.grads[1]) == names
