"""Op-level selective checkpointing (`parallel.checkpointing = "op"`, torchtitan's policy) on real layouts (gloo):
each layout with op mode trains 2 steps following the one-process run *without* checkpointing, and every loss,
gradient norm, full gradient and updated parameter must be within docs/parity.md's stated tolerances (fp32's,
or bf16's where both runs compute in bf16), for every parameter name of the plain model.

The matrix (8 layouts, ~120 s: the suite's time is budgeted): the direct loop (dp2, depth-first); ZeRO-1 and,
in bf16, ZeRO-3 (the schedule runtime, one stage per block); 1D tensor parallelism with sequence parallelism; the
1F1B (GPT: its biased Linears reach the dispatcher as aten.addmm, Llama's as aten.mm) and breadth-first
pipelines; context parallelism; document masking, whose masks the first block to need them builds and the
others share, in the replay too, in reverse block order (the one-process reference masks too); and Gemma 2
(tests/distributed/test_gemma2.py's imported random-weight model: soft-capped attention, which is not SDPA, so
op mode keeps no attention output and replays the core whole; post-norms on the sequence shards) under 1D
tensor 2 with sequence parallelism. Run once while
building it, all passing: dp2 layered, dp2 ZeRO-2, dp2 ZeRO-3, tensor 2 without SP, Llama tensor 2 + SP, GPT
tensor 2 + SP, Llama 1F1B and breadth-first without masks, dp2 with masks, pipeline 2 × tensor 2 + SP in bf16.
What op mode replays on one process: tests/unit/test_op_checkpointing.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.config import from_dict
from tessera.parity import BF16, FP32, Record, run_config, tolerance_for
from tests.distributed.conftest import assert_layout_matches_reference, documents_corpus, trainer_config
from tests.hf_models import make_hf

STEPS = 2
LLAMA = {"family": "llama", "n_layers": 4, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "seq_len": 16}
GPT = {"family": "gpt", "n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16}
GEMMA2 = {"init": "hf:"}  # the `gemma2_folder` fixture's model (`_model`)
OP = {"checkpointing": "op"}
LAYOUTS = {  # name: (processes, model, parallel section, dtype); "_docs": with document masking
    "dp2_depth_first": (2, LLAMA, {"data": 2, "accumulation": "depth_first"} | OP, "fp32"),  # the direct loop
    "dp2_zero1": (2, LLAMA, {"data": 2, "zero": 1} | OP, "fp32"),  # the schedule runtime, a stage per block
    "dp2_zero3_bf16": (2, LLAMA, {"data": 2, "zero": 3} | OP, "bf16"),
    "tp2_sp_docs": (2, LLAMA, {"tensor": 2, "sequence_parallel": True} | OP, "fp32"),
    "gpt_pp2_1f1b": (2, GPT, {"pipeline": 2, "schedule": "1f1b"} | OP, "fp32"),  # biased Linears: aten.addmm
    "pp2_bf_v2_docs": (
        2,
        LLAMA,
        {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2} | OP,
        "fp32",
    ),
    "cp2": (2, LLAMA, {"context": 2} | OP, "fp32"),  # K/V all-gathered again in the replay
    # the capped attention core replayed whole on each tensor rank's heads, the post-norms on sequence shards
    "gemma2_tp2_sp": (2, GEMMA2, {"tensor": 2, "sequence_parallel": True} | OP, "fp32"),
}


def _raw(token_file: Path, run_dir: Path, model: dict, parallel: dict, dtype: str, docs: bool) -> dict:
    # clipping at 0.5 fires (norms ~2): the clipped update is compared too
    raw = trainer_config(token_file, run_dir, model, parallel, steps=3, grad_clip=0.5, dtype=dtype)
    raw["data"]["document_mask"] = docs
    return raw


@pytest.fixture(scope="module")
def short_documents_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Records of 1 to 3 words (`documents_corpus`): every 16-token window spans several documents."""
    return documents_corpus(tmp_path_factory.mktemp("op_docs"), (1, 3))


@pytest.fixture(scope="module")
def gemma2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_gemma2.py's Gemma 2: head_dim 16 ≠ 32 / 4, 2 KV heads, soft-caps that bite, (1 + w) norms drawn."""
    root = tmp_path_factory.mktemp("op_gemma2")
    make_hf(root / "hf", "gemma2_tied")
    return root / "hf"


def _model(model: dict, request: pytest.FixtureRequest) -> dict:
    """The layout's model section; GEMMA2 imports `gemma2_folder` (built only for the cases that use it)."""
    return {"init": f"hf:{request.getfixturevalue('gemma2_folder')}"} if model is GEMMA2 else model


_REFERENCES: dict[tuple[str, str, bool], Record] = {}


def _reference(token_file: Path, work: Path, model: dict, dtype: str, docs: bool) -> Record:
    """The one-process run without checkpointing, once per model, dtype and document masking."""
    key = (repr(model), dtype, docs)
    if key not in _REFERENCES:
        cfg = from_dict(_raw(token_file, work, model, {}, dtype, docs))
        _REFERENCES[key] = run_config(cfg, 1, STEPS, work, "ref", keep_states=True)
    return _REFERENCES[key]


@pytest.mark.parametrize("name", LAYOUTS)
def test_op_checkpointing_matches_one_process_without_it(
    token_file: Path,
    short_documents_file: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
    name: str,
) -> None:
    nproc, model, parallel, dtype = LAYOUTS[name]
    model = _model(model, request)
    docs = name.endswith("_docs")
    data = short_documents_file if docs else token_file
    reference = _reference(data, tmp_path_factory.mktemp("op_ref"), model, dtype, docs)
    cfg = from_dict(_raw(data, tmp_path, model, parallel, dtype, docs))
    got = run_config(cfg, nproc, STEPS, tmp_path, name, follow=reference)
    tol = tolerance_for(cfg, from_dict(_raw(data, tmp_path, model, {}, dtype, docs)))
    assert tol is (BF16 if dtype == "bf16" else FP32)
    names = assert_layout_matches_reference(got, reference, tol, cfg.model, nproc, STEPS)
    if model is not LAYOUTS[name][1]:  # Gemma 2: capped scores (not SDPA) and the post-norms were trained
        assert cfg.model.family == "gemma2" and cfg.model.attn_softcap is not None
        assert any("post_norm" in n for n in names)
