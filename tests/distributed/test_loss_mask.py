"""data.loss_mask on every layout that computes the loss its own way, against the single-device run with the mask.

The data is prompt/completion records of varied lengths (byte tokens): every window holds prompts (not targets)
and completions (targets) in changing proportions, so micro-batches, data-parallel ranks and 2D grid rows hold
different numbers of targets. Each layout trains 2 steps through the trainer's `TrainingRun`, step 1 from the
reference's state after step 0 (`record_layouts`' ``follow``, as `tessera compare` runs: docs/parity.md), and
must give the reference's target count, loss, gradient norm, every gradient (gathered from tensor blocks, pipeline
stages and ZeRO shards alike) and every updated parameter, every step, within docs/parity.md's fp32 tolerances,
which holds only if each layout divides the summed loss by the target count of the whole global batch (a
per-micro-batch or per-rank mean gives another gradient). The layouts: data
parallel with 2 micro-batches per rank, 1D tensor with sequence parallelism (the vocabulary-parallel loss), the
pipeline (1F1B; breadth-first), ZeRO-3 and 2D 2×2 (its vocabulary-parallel loss over grid rows), one with
document masking too, and data parallel with document masking and windows that start at document starts
(data.window_start = "document": every rank must draw the same document for a sample index). ZeRO-3's layered step
is also checked in a direct run of the schedule runtime below, on micro-batches of very different target counts. A resumed masked run
continues as the uninterrupted one, with windows starting anywhere or at document starts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tessera.config import from_dict
from tessera.model.build import build_model
from tessera.model.sizes import SIZES
from tessera.model.targets import IGNORE_INDEX
from tessera.parity import FP32
from tessera.train.data import prepare
from tessera.train.metrics import read_metrics
from tessera.train.trainer import TrainingRun
from tests.distributed.conftest import (
    Recorded,
    assert_layout_matches_reference,
    follow_file,
    interrupted_then_resumed,
    record_layouts,
    train_losses,
    trainer_config,
)
from tests.distributed.test_document_mask import (
    GPT,
    GRAD_ATOL,
    GRAD_RTOL,
    LLAMA,
    LOSS_ATOL,
    LOSS_RTOL,
    MICRO,
    SEQ,
    STEPS,
    M,
    _zero_model_cfg,
)
from tests.harness import run_distributed

DOCS = {"document_mask": True}
DOC_WINDOWS = {"document_mask": True, "window_start": "document"}
LAYOUTS = {  # name: (world size, model, parallel section, data settings besides the loss mask)
    "dp2_m2": (2, LLAMA, {"data": 2}, {}),  # 8 sequences = 2 ranks × 2 micro-batches × 2
    "gpt_tp2_sp": (2, GPT, {"tensor": 2, "sequence_parallel": True}, {}),
    "pp2_1f1b_docs": (2, LLAMA, {"pipeline": 2, "schedule": "1f1b"}, DOCS),
    "gpt_pp2_bf": (2, GPT, {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 1}, {}),
    "dp2_z3": (2, LLAMA, {"data": 2, "zero": 3}, {}),
    "dp2_m2_doc_windows": (2, LLAMA, {"data": 2}, DOC_WINDOWS),
    "tp2x2": (4, LLAMA, {"tensor": "2x2"}, {}),
}
REFERENCES = {"llama": {}, "gpt": {}, "llama_docs": DOCS, "llama_doc_windows": DOC_WINDOWS}


@pytest.fixture(scope="module")
def masked_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte tokens of 1500 prompt/completion records with their loss mask."""
    root = tmp_path_factory.mktemp("sft")
    rng = random.Random(11)
    words = ["".join(rng.choices("etaoinshrdlu", k=rng.randint(1, 6))) for _ in range(60)]

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(lo, hi)))

    lines = [json.dumps({"q": text(1, 9), "a": text(0, 5)}) for _ in range(1500)]
    (root / "sft.jsonl").write_text("\n".join(lines) + "\n")
    prepare([root / "sft.jsonl"], root / "sft.bin", "byte", prompt_key="q", completion_key="a")
    return root / "sft.bin"


def _config(
    token_file: Path, run_dir: Path, model: dict, parallel: dict, data: dict | None = None, **train
) -> dict:
    raw = trainer_config(token_file, run_dir, model, parallel, **{"steps": STEPS, "grad_clip": 0.5, **train})
    raw["data"].update(loss_mask=True, **(data or {}))
    return raw


def _target_tokens(run: TrainingRun, step: int) -> int | None:
    """The step's target count as the run's layout counts it over the whole global batch (`record_layouts`'
    ``observe``; `train` logs it as ``target_tokens``)."""
    return run.target_tokens(step)


@pytest.fixture(scope="module")
def references(masked_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Recorded]:
    """The single-device runs (depth-first: one micro-batch at a time, the plain loss) with their target counts
    and states to follow: Llama and GPT with the loss mask, Llama with document masking too (and windows at
    document starts), and Llama without the loss mask (it must differ)."""
    root, one = tmp_path_factory.mktemp("refs"), {"accumulation": "depth_first"}
    configs = {
        name: _config(masked_file, root / f"ref_{name}", GPT if name == "gpt" else LLAMA, one, data)
        for name, data in REFERENCES.items()
    }
    configs["llama_unmasked"] = _config(masked_file, root / "ref_off", LLAMA, one)
    configs["llama_unmasked"]["data"]["loss_mask"] = False
    recorded = record_layouts(0, 1, list(configs.values()), keep_states=True, observe=_target_tokens)
    return dict(zip(configs, recorded, strict=True))


def _reference_of(name: str) -> str:
    _, model, _, data = LAYOUTS[name]
    family = "gpt" if model is GPT else "llama"
    return next(n for n, d in REFERENCES.items() if n.startswith(family) and d == data)


def _run_world(
    rank: int, world: int, configs: list[dict], follow: Path
) -> tuple[list[Recorded], tuple | None]:
    """One spawn per world size: the layouts recorded following their references, then (world 2) the ZeRO-3
    gradient check's step."""
    recorded = record_layouts(rank, world, configs, follow, observe=_target_tokens)
    return recorded, _zero3_gradients(rank, world) if world == 2 else None


@pytest.mark.parametrize("world", sorted({w for w, _, _, _ in LAYOUTS.values()}))
def test_loss_mask_matches_single_device(
    masked_file: Path, references: dict[str, Recorded], tmp_path: Path, world: int
) -> None:
    refs = {name: r.record for name, r in references.items()}
    # the mask changes the computation: otherwise matching the reference would prove nothing about it
    masked, unmasked = refs["llama"].grads[0], refs["llama_unmasked"].grads[0]
    assert any(not torch.allclose(g, unmasked[n], rtol=GRAD_RTOL, atol=GRAD_ATOL) for n, g in masked.items())
    # windows at document starts train other samples than windows anywhere (the same masks otherwise)
    assert refs["llama_doc_windows"].losses != refs["llama_docs"].losses
    counts = references["llama"].seen
    assert all(0 < c < 8 * SIZES["llama-tiny"]["seq_len"] for c in counts), counts  # some left out
    names = [n for n, (w, _, _, _) in LAYOUTS.items() if w == world]
    configs = [_config(masked_file, tmp_path / n, LAYOUTS[n][1], LAYOUTS[n][2], LAYOUTS[n][3]) for n in names]
    follow = follow_file(tmp_path / "follow.pt", [refs[_reference_of(n)] for n in names])
    recorded, zero3 = run_distributed(_run_world, world, configs, follow, timeout=600)[0]
    if world == 2:
        _check_zero3_gradients(*zero3)
    for name, raw, got in zip(names, configs, recorded, strict=True):
        reference = references[_reference_of(name)]
        assert got.seen == reference.seen, name
        assert_layout_matches_reference(
            got.record, reference.record, FP32, from_dict(raw).model, world, STEPS
        )


# --- ZeRO-3's gradients, gathered from its shards --------------------------------------------------------------


def _masked_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random tokens whose targets are ignored in runs of changing length: micro-batches of different counts."""
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(n):
        x = torch.randint(0, 32, (MICRO, SEQ), generator=g)
        y = torch.randint(0, 32, (MICRO, SEQ), generator=g)
        ignored = torch.rand(MICRO, SEQ, generator=g) < 0.2 + 0.15 * k  # 20% .. 65% left out
        out.append((x, y.masked_fill(ignored, IGNORE_INDEX)))
    return out


def _targets(batches: list) -> int:
    return sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)


def _zero3_gradients(rank: int, world: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One layered ZeRO-3 step over dp2 through the schedule runtime, each micro-batch's summed loss weighted by
    dp / the global batch's target count; the loss and the gathered gradients."""
    from tessera import comm
    from tessera.pipeline.passes import lower
    from tessera.pipeline.runtime import PipelineEngine
    from tessera.pipeline.schedules import breadth_first
    from tessera.pipeline.stage import split_stages
    from tessera.pipeline.stage_comm import ZeroStageComm
    from tests.distributed.test_zero import _full_grads

    cfg = _zero_model_cfg()
    model = build_model(cfg, seed=0)
    names = {id(p): n for n, p in model.named_parameters()}
    stages = split_stages(model, cfg.n_layers)
    zero = ZeroStageComm(stages, None, 3, "layered")
    lowered = lower(breadth_first(1, M, len(stages)), 1, zero3=True)
    engine = PipelineEngine(dict(enumerate(stages)), lowered, 0, None, zero, microbatches=M)
    batches = _masked_batches(world * M)
    loss = torch.tensor(engine.step(batches[rank * M : (rank + 1) * M], world / _targets(batches)))
    comm.all_reduce(loss, None)
    return loss.item() / world, {names[pid]: g for pid, g in _full_grads(zero).items()}


def _check_zero3_gradients(loss: float, grads: dict[str, torch.Tensor]) -> None:
    """ZeRO-3's loss and gathered gradients against one process: the whole batch's summed loss / its targets."""
    model = build_model(_zero_model_cfg(), seed=0)
    batches = _masked_batches(2 * M)
    counts = {int((y != IGNORE_INDEX).sum()) for _, y in batches}
    assert len(counts) > 1  # micro-batches of different target counts: a per-micro-batch mean would differ
    ref = sum(model(x, y, reduction="sum") for x, y in batches) / _targets(batches)
    ref.backward()
    torch.testing.assert_close(loss, ref.item(), rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert grads.keys() == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=n)


# --- resuming --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window_start", ["any", "document"])
def test_masked_run_resumes_as_it_would_have_continued(
    masked_file: Path, tmp_path: Path, window_start: str
) -> None:
    """A masked run checkpointed every step and crashed at step 2 resumes with the uninterrupted run's losses and
    target counts (the mask, like the samples, is a pure function of the data and the step; with windows at
    document starts, the start index is rebuilt from the file on resume)."""
    data = {"window_start": window_start}
    whole = _config(masked_file, tmp_path / "whole", GPT, {}, data, steps=3)
    resumed = _config(masked_file, tmp_path / "resumed", GPT, {}, data, steps=3)
    for raw in (whole, resumed):
        raw["checkpoint"] = {"every": 1, "resume": True}
    expected = train_losses(0, 1, whole)
    got = interrupted_then_resumed(0, 1, resumed, 2)
    assert sorted(got) == [2] and got[2] == expected[2]
    counts = {m["step"]: m["target_tokens"] for m in read_metrics(tmp_path / "resumed")}
    assert counts == {m["step"]: m["target_tokens"] for m in read_metrics(tmp_path / "whole")}
