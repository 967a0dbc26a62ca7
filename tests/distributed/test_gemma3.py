"""Gemma 3 text at every parallel layout against the one-process run: loss, every gradient and every updated
parameter (`tessera compare`'s harness, tessera/parity.py), from an imported random-weight transformers
Gemma3ForCausalLM (tests/hf_models.py "gemma3_qpas": 4 layers local, local, global, local with a 5-position
window and RoPE bases 10 / 1e6 at a 32-token context, (1 + w) q/k norms drawn, head_dim 16 ≠ 32 / 4, 2 KV heads,
query_pre_attn_scalar 24, untied, vocabulary 259).

Layouts: Megatron 1D tensor 2 with sequence parallelism (attention sees the gathered sequence, so each band is
the whole sequence's), Optimus 2D 2×2, pipeline 2 (the second stage holds layers 2 and 3, global then local: a
stage that renumbered its layers from 0 would make both local), ZeRO-3 over data 2; tensor 2 + SP with
document masking (data.document_mask on short documents: the band and the document mask together) against the
one-process run with the same mask; and with recomputation (selective at tensor 2 + SP, full at pipeline 2 and
ZeRO-3), whose replays cut or rebuild the band the layers share. Tolerances: docs/parity.md's fp32 ones (`tessera.parity.FP32`). That the
step-0 loss is transformers' own at each layout: tests/distributed/test_hf.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.config import from_dict
from tessera.model.build import meta_model
from tessera.parity import FP32, Record, compare_records, run_config, tolerance_for
from tests.distributed.conftest import assert_layout_matches_reference, trainer_config
from tests.hf_models import make_gemma3_multimodal, make_hf

STEPS = 2
LAYOUTS = {  # name: (processes, parallel section, document masking)
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}, False),
    "tp2x2": (4, {"tensor": "2x2"}, False),
    "pp2": (2, {"pipeline": 2, "schedule": "1f1b"}, False),
    "dp2_zero3": (2, {"data": 2, "zero": 3}, False),
    "tp2_sp_docs": (2, {"tensor": 2, "sequence_parallel": True}, True),
    # the local layers' shared band under recomputation: selective's cores cut their own, full's replays rebuild
    # the released band once (through ZeRO-3's one-block stages, which share the micro-batch's band)
    "tp2_sp_selective": (2, {"tensor": 2, "sequence_parallel": True, "checkpointing": "selective"}, False),
    "pp2_full": (2, {"pipeline": 2, "schedule": "1f1b", "checkpointing": "full"}, False),
    "dp2_zero3_full": (2, {"data": 2, "zero": 3, "checkpointing": "full"}, False),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gemma3")
    make_hf(root / "hf", "gemma3_qpas")
    return root / "hf"


def _raw(token_file: Path, run_dir: Path, folder: Path, parallel: dict, docs: bool) -> dict:
    # clipping at 0.5 fires: the clipped update is compared too; micro-batch 4 splits over a 2×2 grid's rows
    model = {"init": f"hf:{folder}"}
    raw = trainer_config(token_file, run_dir, model, parallel, steps=3, grad_clip=0.5, micro_batch=4)
    raw["data"]["document_mask"] = docs
    return raw


@pytest.fixture(scope="module")
def references(
    token_file: Path,
    documents_file: Path,
    folder: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[bool, Record]:
    """The one-process runs, without and with document masking (on the short-document corpus)."""
    out = {}
    for docs, data in ((False, token_file), (True, documents_file)):
        work = tmp_path_factory.mktemp(f"gemma3_ref_{docs}")
        raw = _raw(data, work, folder, {}, docs)
        out[docs] = run_config(from_dict(raw), 1, STEPS, work, "ref", keep_states=True)
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_gemma3_layout_matches_one_process(
    token_file: Path,
    documents_file: Path,
    tmp_path: Path,
    folder: Path,
    references: dict[bool, Record],
    name: str,
) -> None:
    nproc, parallel, docs = LAYOUTS[name]
    data = documents_file if docs else token_file
    cfg = from_dict(_raw(data, tmp_path, folder, parallel, docs))
    assert cfg.model.family == "gemma3" and cfg.model.sliding_window == 5 < cfg.model.seq_len
    reference = references[docs]
    got = run_config(cfg, nproc, STEPS, tmp_path, name, follow=reference)
    tol = tolerance_for(cfg, from_dict(_raw(data, tmp_path, folder, {}, docs)))
    assert tol is FP32
    names = assert_layout_matches_reference(got, reference, tol, cfg.model, nproc, STEPS)
    assert any("q_norm" in n for n in names)


MULTIMODAL_LAYOUTS = {
    "tp2_sp": LAYOUTS["tp2_sp"],
    "tp2x2": LAYOUTS["tp2x2"],
    "pp2": (2, {"pipeline": 2, "schedule": "1f1b", "stage_layers": [1, 2]}, False),
}
"""Gemma 3 4B/12B/27B's folders: each rank reads its slices of the language model under the multimodal prefix; the
pipeline's second stage holds layers 1 (global, scaled RoPE) and 2 (local)."""


@pytest.fixture(scope="module")
def multimodal(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Record]:
    """A random-weight Gemma3ForConditionalGeneration folder (tests/hf_models.py: 3 layers local, global, local,
    window 4, the global layers' RoPE linearly scaled by 8, tied) and its one-process run."""
    root = tmp_path_factory.mktemp("gemma3_mm")
    make_gemma3_multimodal(root / "hf")
    work = tmp_path_factory.mktemp("gemma3_mm_ref")
    raw = _raw(token_file, work, root / "hf", {}, False)
    return root / "hf", run_config(from_dict(raw), 1, STEPS, work, "ref", keep_states=True)


@pytest.mark.parametrize("name", MULTIMODAL_LAYOUTS)
def test_multimodal_linear_rope_layout_matches_one_process(
    token_file: Path, tmp_path: Path, multimodal: tuple[Path, Record], name: str
) -> None:
    """The language model of a Gemma3ForConditionalGeneration folder with linear-scaled global layers, at 1D
    tensor 2 + SP, 2D 2×2 and pipeline 2 (its global layer first on the second stage), equals
    its one-process run: loss, every gradient and every updated parameter."""
    folder, reference = multimodal
    nproc, parallel, _ = MULTIMODAL_LAYOUTS[name]
    cfg = from_dict(_raw(token_file, tmp_path, folder, parallel, False))
    assert cfg.model.rope_scaling == {"type": "linear", "factor": 8.0}
    got = run_config(cfg, nproc, STEPS, tmp_path, name, follow=reference)
    report = compare_records(got, reference, FP32)
    assert report.ok, report.table(20)
    names = {n for n, _ in meta_model(cfg.model).named_parameters(remove_duplicate=False)}
    for k in range(STEPS):  # every tensor was gathered and compared, not a subset
        assert set(got.grads[k]) == set(reference.grads[k]) == names
        assert set(got.params[k]) == names
