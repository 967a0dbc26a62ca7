"""Context parallelism (parallel.context = 2) against the single-device run: loss and every gradient.

Each layout of the matrix trains 2 steps through `TrainingRun.step` (the trainer cuts each window into the
rank's chunks i and 2c−1−i and passes global positions); before each update every parameter's full gradient is
gathered under its plain name from whatever the ranks hold — whole tensors, 1D shards, ZeRO shards — through
the checkpoints' layout-free geometry (`tessera.parity`'s gather, which also reports how far two ranks' copies
of one block differ: context ranks must hold the same reduced gradients). The reference is one process,
depth-first, on the same samples. As `tessera compare` does (docs/parity.md, "B first, then A following B"),
step 1 of a layout starts from the reference's state after its step 0 (parameters and AdamW moments), so each
step is judged on its own arithmetic: left to run freely, AdamW turns a rounding-level gradient element into an
update of ±lr whose sign depends on the summation order, and step 1's gradients then differ by more than
rounding on some CPUs (gemma3_cp2_docs's MLP, 4 of 2,048 elements at 2.3e-4 relative) with no parallel bug.
Tolerances: docs/parity.md's fp32 ones (`tessera.parity.FP32`): loss, gradient norm, every gradient (element
and whole tensor) and every parameter after each update.

The data are prompt/completion records (byte tokens, ended by end-of-text): with data.document_mask each
window spans several documents, and with data.loss_mask the context ranks' chunks hold different numbers of
targets, so a per-rank mean would give another loss. Models: Llama-tiny (grouped-query: 4 heads, 2 KV heads;
RoPE), GPT-2-tiny (learned positions), Gemma-3-tiny (sliding window 4 on local layers: the band crosses
chunks of 8), Gemma-2-tiny (soft-capped attention, written out: its masked scores are [s/c, s]). Layouts: context 2 alone; context 2 × data 2 with ZeRO-1 and ZeRO-3; context 2 × tensor 2 with
sequence parallelism. Each run's K/V all-gather and dK/dV reduce-scatter bytes are checked against
`tessera.traffic.context_traffic`, and the activation bytes it saved for backward against `tessera memory`'s
estimate at the peak (within 5 %).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera import comm
from tessera.config import from_dict
from tessera.memory import estimate
from tessera.parity import FP32
from tessera.traffic import context_traffic
from tessera.train.trainer import TrainingRun
from tests.distributed.conftest import (
    Recorded,
    assert_layout_matches_reference,
    follow_file,
    record_layouts,
    trainer_config,
)
from tests.distributed.test_document_mask import GPT, LLAMA
from tests.distributed.test_loss_mask import masked_file  # noqa: F401 (the fixture)
from tests.harness import run_distributed

STEPS = 2
ACT_RTOL = (
    0.05  # the estimate's saved activations against the measured (tests/distributed/test_memory_measured)
)
GEMMA3 = {"size": "gemma3-tiny"}
GEMMA2 = {"size": "gemma2-tiny"}
DOCS_MASK = {"document_mask": True, "loss_mask": True}
DOCS = {"document_mask": True}
LAYOUTS = {  # name: (world size, model, parallel section, data settings)
    "llama_cp2": (2, LLAMA, {"context": 2}, {}),
    "gpt_cp2_docs_mask": (2, GPT, {"context": 2}, DOCS_MASK),
    "gemma3_cp2": (2, GEMMA3, {"context": 2}, {}),
    "gemma3_cp2_docs": (2, GEMMA3, {"context": 2}, DOCS),
    "gemma2_cp2_docs": (2, GEMMA2, {"context": 2}, DOCS),
    "llama_cp2_dp2_z1_docs_mask": (4, LLAMA, {"context": 2, "data": 2, "zero": 1}, DOCS_MASK),
    "llama_cp2_dp2_z3": (4, LLAMA, {"context": 2, "data": 2, "zero": 3}, {}),
    "llama_cp2_tp2_sp_docs_mask": (
        4,
        LLAMA,
        {"context": 2, "tensor": 2, "sequence_parallel": True},
        DOCS_MASK,
    ),
    "gpt_cp2_tp2_sp": (4, GPT, {"context": 2, "tensor": 2, "sequence_parallel": True}, {}),
}
MODELS = {"llama": LLAMA, "gpt": GPT, "gemma3": GEMMA3, "gemma2": GEMMA2}


def _config(token_file: Path, run_dir: Path, model: dict, parallel: dict, data: dict) -> dict:
    raw = trainer_config(token_file, run_dir, model, parallel, steps=STEPS, grad_clip=0.5)
    raw["data"].update(data)
    return raw


def _reference_key(name: str) -> tuple[str, tuple]:
    _, model, _, data = LAYOUTS[name]
    return next(k for k, m in MODELS.items() if m is model), tuple(sorted(data.items()))


def _observe(run: TrainingRun, step: int) -> dict:
    """Right after a step's update (`record_layouts`' ``observe``): its context-group traffic and saved activation
    bytes."""
    traffic = {kind: comm.STATS.bytes.get((kind, "context"), 0) for kind in ("all_gather", "reduce_scatter")}
    return {"saved": run.saved_bytes, "traffic": traffic}


def _record(rank: int, world: int, configs: list[dict], follow: Path | None = None) -> list[Recorded]:
    """Each config recorded (following the states in ``follow``, else keeping its own), with what `_observe`
    saw."""
    return record_layouts(rank, world, configs, follow, keep_states=follow is None, observe=_observe)


@pytest.fixture(scope="module")
def references(masked_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    """One single-process run per (model, data settings) the matrix uses."""
    root = tmp_path_factory.mktemp("refs")
    keys = sorted({_reference_key(n) for n in LAYOUTS})
    configs = [
        _config(masked_file, root / f"ref_{i}", MODELS[m], {"accumulation": "depth_first"}, dict(d))
        for i, (m, d) in enumerate(keys)
    ]
    return {k: r.record for k, r in zip(keys, _record(0, 1, configs), strict=True)}


def _expected_traffic(raw: dict) -> int:
    """What `context_traffic` says one step moves over the context group (all-gather = reduce-scatter bytes)."""
    cfg = from_dict(raw)
    t = cfg.parallel.tensor if isinstance(cfg.parallel.tensor, int) else 1
    m = cfg.train.global_batch // (cfg.train.micro_batch * (cfg.parallel.data or 1))
    per_micro = context_traffic(
        cfg.model, cfg.train.micro_batch, cfg.parallel.context, t, bytes_per_element=4
    )
    return m * per_micro


@pytest.mark.parametrize("world", sorted({w for w, _, _, _ in LAYOUTS.values()}))
def test_context_parallel_matches_single_device(
    masked_file: Path,  # noqa: F811
    references: dict,
    tmp_path: Path,
    world: int,
) -> None:
    names = [n for n, (w, _, _, _) in LAYOUTS.items() if w == world]
    configs = [_config(masked_file, tmp_path / n, *LAYOUTS[n][1:]) for n in names]
    follow = follow_file(tmp_path / "follow.pt", [references[_reference_key(n)] for n in names])
    results = run_distributed(_record, world, configs, follow, timeout=600)[0]
    for name, raw, recorded in zip(names, configs, results, strict=True):
        got, extra = recorded.record, recorded.seen[-1]  # the traffic and saved bytes of the last step
        cfg = from_dict(raw)
        assert_layout_matches_reference(got, references[_reference_key(name)], FP32, cfg.model, world, STEPS)
        # `tessera memory`'s activations at the peak: s/c tokens, the gathered K/V and the [b, 1, s/c, s] masks
        estimated = estimate(cfg, world).at_peak.activations
        assert abs(estimated - extra["saved"]) <= ACT_RTOL * extra["saved"], (name, estimated, extra["saved"])
        expected = _expected_traffic(raw)
        assert extra["traffic"] == {"all_gather": expected, "reduce_scatter": expected}, name
