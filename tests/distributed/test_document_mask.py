"""data.document_mask on every layout attention runs under, against the single-device run with the mask.

The data is many short documents (JSON records of 10-40 bytes, byte tokens, seq_len 32), so every window spans
several document boundaries. Each layout trains 2 steps through the trainer's `TrainingRun` (which derives the
positions from the windows), step 1 from the reference's state after step 0 (`record_layouts`' ``follow``, as
`tessera compare` runs: docs/parity.md); its loss, gradient norm, every gradient (gathered from tensor blocks,
pipeline stages and ZeRO shards alike) and every updated parameter, every step, must equal the reference's within
docs/parity.md's fp32 tolerances. ZeRO-3's layered step is also checked in a direct run of the schedule runtime
below, whose batches hold more document starts. GPT (learned positions) runs where positions are
sharded differently (1D with sequence parallelism, the 2D grid); Llama (RoPE) everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config import ModelConfig, from_dict
from tessera.model.build import build_model
from tessera.model.documents import document_positions
from tessera.parity import FP32, Record
from tests.distributed.conftest import (
    Recorded,
    assert_layout_matches_reference,
    follow_file,
    record_layouts,
    trainer_config,
)
from tests.harness import run_distributed

# as the trainer tests: docs/parity.md's fp32 tolerances (`tessera.parity.FP32`)
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
STEPS = 2  # as test_trainer_tp
EOT = 0  # the byte tokenizer's end-of-text token
LLAMA = {"size": "llama-tiny", "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_model": 32, "ffn_hidden": 64}
GPT = {"size": "gpt2-tiny", "n_layers": 2}

LAYOUTS = {  # name: (world size, model, parallel section)
    "dp2": (2, LLAMA, {"data": 2}),
    "tp2_sp": (2, LLAMA, {"tensor": 2, "sequence_parallel": True}),
    "gpt_tp2_sp_full_ckpt": (2, GPT, {"tensor": 2, "sequence_parallel": True, "checkpointing": "full"}),
    "pp2_1f1b": (2, LLAMA, {"pipeline": 2, "schedule": "1f1b"}),
    "gpt_pp2_bf": (2, GPT, {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 1}),
    "dp2_z3": (2, LLAMA, {"data": 2, "zero": 3}),
    "tp2x2": (4, LLAMA, {"tensor": "2x2", "checkpointing": "selective"}),
    "gpt_tp2x2": (4, GPT, {"tensor": "2x2"}),
}


def _config(token_file: Path, run_dir: Path, model: dict, parallel: dict, mask: bool = True) -> dict:
    raw = trainer_config(token_file, run_dir, model, parallel, steps=STEPS, grad_clip=0.5)
    raw["data"]["document_mask"] = mask
    return raw


@pytest.fixture(scope="module")
def references(documents_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Record]:
    """The single-device runs, with their states to follow: Llama and GPT with the mask, Llama without."""
    token_file, root = documents_file, tmp_path_factory.mktemp("refs")
    configs = {
        "llama": _config(token_file, root / "ref_llama", LLAMA, {"accumulation": "depth_first"}),
        "gpt": _config(token_file, root / "ref_gpt", GPT, {"accumulation": "depth_first"}),
        "llama_unmasked": _config(
            token_file, root / "ref_off", LLAMA, {"accumulation": "depth_first"}, False
        ),
    }
    recorded = record_layouts(0, 1, list(configs.values()), keep_states=True)
    return {name: r.record for name, r in zip(configs, recorded, strict=True)}


def _run_world(
    rank: int, world: int, configs: list[dict], follow: Path
) -> tuple[list[Recorded], tuple | None]:
    """One spawn per world size: the layouts recorded following their references, then (world 2) the ZeRO-3
    gradient check's step."""
    return record_layouts(rank, world, configs, follow), _zero3_gradients(rank, world) if world == 2 else None


@pytest.mark.parametrize("world", sorted({w for w, _, _ in LAYOUTS.values()}))
def test_document_mask_matches_single_device(
    documents_file: Path, references: dict[str, Record], tmp_path: Path, world: int
) -> None:
    # the mask changes the computation: otherwise matching the reference would prove nothing about it
    masked, unmasked = references["llama"].grads[0], references["llama_unmasked"].grads[0]
    assert any(not torch.allclose(g, unmasked[n], rtol=GRAD_RTOL, atol=GRAD_ATOL) for n, g in masked.items())
    names = [n for n, (w, _, _) in LAYOUTS.items() if w == world]
    configs = [_config(documents_file, tmp_path / n, LAYOUTS[n][1], LAYOUTS[n][2]) for n in names]
    refs = [references["gpt" if LAYOUTS[n][1] is GPT else "llama"] for n in names]
    follow = follow_file(tmp_path / "follow.pt", refs)
    recorded, zero3 = run_distributed(_run_world, world, configs, follow, timeout=600)[0]
    if world == 2:
        _check_zero3_gradients(*zero3)
    for raw, ref, got in zip(configs, refs, recorded, strict=True):
        assert_layout_matches_reference(got.record, ref, FP32, from_dict(raw).model, world, STEPS)


# --- ZeRO-3's gradients, gathered from its shards --------------------------------------------------------------

SEQ, MICRO, M = 16, 2, 2


def _zero_model_cfg() -> ModelConfig:
    return ModelConfig(family="llama", n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=SEQ)


def _packed_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random tokens with about one EOT in five: several documents per sequence."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        x = torch.randint(0, 32, (MICRO, SEQ), generator=g)
        x = x.masked_fill(torch.rand(MICRO, SEQ, generator=g) < 0.2, EOT)
        out.append((x, torch.randint(0, 32, (MICRO, SEQ), generator=g), document_positions(x, EOT)))
    return out


def _zero3_gradients(rank: int, world: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One layered ZeRO-3 step over dp2 through the schedule runtime; the loss and the gathered gradients."""
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
    loss = torch.tensor(engine.step(_packed_batches(world * M)[rank * M : (rank + 1) * M]))
    comm.all_reduce(loss, None)
    return loss.item() / world, {names[pid]: g for pid, g in _full_grads(zero).items()}


def _check_zero3_gradients(loss: float, grads: dict[str, torch.Tensor]) -> None:
    """ZeRO-3's loss and gathered gradients against one process running all micro-batches."""
    model = build_model(_zero_model_cfg(), seed=0)
    batches = _packed_batches(2 * M)
    ref_loss = 0.0
    for x, y, positions in batches:
        part = model(x, y, positions=positions) / len(batches)
        part.backward()
        ref_loss += part.item()
    torch.testing.assert_close(loss, ref_loss, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert grads.keys() == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=n)
