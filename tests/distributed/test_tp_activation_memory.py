"""Saved activations per rank: 2D (q=2) partitions every activation by q², 1D (t=4) only some of them.

Issue 3 asks for 2D q=2 ≤ 1/3 of 1D t=4 at the same model and batch. Whether that holds depends on what is saved:

- **Full activation checkpointing** (the setting the Optimus paper benchmarked, `--checkpoint-activations`):
  each block keeps only its input. 1D without sequence parallelism keeps it replicated, [b, s, h] per layer;
  2D keeps a [b/q, s, h/q] block. With L layers of checkpoints C and output-layer activations H (norm output,
  vocabulary-parallel logits), 2D/1D = (L·C + H) / q² / (L·C + H_1D), which falls toward 1/q² = 1/4 as the
  layer stack outweighs the output layer. **The bound is asserted here** (`test_issue_bound_full_checkpointing`).
- **No checkpointing**: 1D at t = 4 quarters the attention/MLP interior but keeps the norm inputs/outputs
  replicated (a fraction R of the single-device bytes), so 2D/1D ≈ 1 / (1 + 3R) ≈ 0.5: the 1/3 bound needs
  R ≥ 2/3 and cannot hold at 4 ranks. What holds, and is asserted, is 2D ≤ 1/q² of single-device (+5% for the
  token ids every rank keeps) and 2D < 1D. See docs/tensor-2d.md and benchmarks/results/tensor_parallel.md.

Both layouts run in one 4-process gloo job on the same plain model (same seed) and the same micro-batch; each rank
measures the bytes autograd saves for backward during one forward with `SavedActivationCounter` (unique storages,
parameters excluded; under `torch.utils.checkpoint` that is the blocks' inputs). The per-rank figure is the
largest over the 4 ranks. Ratios are printed (run with ``-s``) and stated in the assertion messages.
"""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig, ParallelConfig
from tessera.groups import build_groups
from tessera.layout import Layout
from tessera.model.build import build_model
from tessera.parallel.checkpointing import apply_checkpointing
from tessera.parallel.model_1d import apply_tensor_1d
from tessera.parallel.model_2d import apply_tensor_2d
from tessera.parallel.saved_activations import SavedActivationCounter
from tests.harness import run_distributed

Q = 2
MAX_2D_OVER_PLAIN = 1.05 / Q**2
"""Every saved tensor is partitioned over the q×q grid; 5% for the token ids every rank keeps."""
ISSUE_BOUND = 1 / 3
"""Issue 3: 2D q=2 saved activations ≤ 1/3 of 1D t=4 (asserted with full checkpointing, see the docstring)."""
SEED = 1234
BATCH = 8  # divisible by q = 2
TIMEOUT_S = 120.0
MODES = ("none", "full")

MODELS = {
    "gpt": dict(family="gpt", d_model=64, n_heads=4, vocab_size=128, seq_len=32, n_layers=4),
    "llama": dict(
        family="llama", d_model=64, n_heads=8, n_kv_heads=4, vocab_size=128, seq_len=32, n_layers=4,
        tie_embeddings=False,
    ),
}  # fmt: skip

Measured = dict[tuple[str, str], tuple[int, int, int]]
"""{(family, checkpointing): (1D t=4 bytes, 2D 2x2 bytes, plain single-device bytes)} on one rank."""


def _saved_bytes(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    with SavedActivationCounter(model) as saved:
        loss = model(tokens, targets)
    del loss
    return saved.bytes


def _measure(rank: int, world: int) -> Measured:
    groups_1d = build_groups(Layout(tp=world))
    groups_2d = build_groups(Layout(q=Q))
    out = {}
    for family, fields in MODELS.items():
        cfg = ModelConfig(**fields)
        g = torch.Generator().manual_seed(SEED + 1)
        data = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=g)
        tokens, targets = data[:, :-1], data[:, 1:]  # [b, s] each, the full micro-batch on every rank
        for mode in MODES:
            sizes = []
            for apply, groups in ((apply_tensor_1d, groups_1d), (apply_tensor_2d, groups_2d), (None, None)):
                torch.manual_seed(SEED)
                model = build_model(cfg)
                if apply is not None:
                    model = apply(model, groups, ParallelConfig(tensor=world))
                sizes.append(_saved_bytes(apply_checkpointing(model, mode), tokens, targets))
            out[(family, mode)] = (sizes[0], sizes[1], sizes[2])
    return out


@pytest.fixture(scope="module")
def measured() -> list[Measured]:
    return run_distributed(_measure, 4, timeout=TIMEOUT_S)


def _summary(measured: list[Measured], family: str, mode: str) -> tuple[float, float, str]:
    """(2D/1D, 2D/plain, a line with every figure) for one family and checkpointing mode."""
    key = (family, mode)
    bytes_1d = max(r[key][0] for r in measured)
    bytes_2d = max(r[key][1] for r in measured)
    plain = measured[0][key][2]
    ratio = bytes_2d / bytes_1d
    line = (
        f"{family}, checkpointing={mode}: saved activations per rank: 1D t=4 {bytes_1d} B "
        f"({bytes_1d / plain:.3f} of plain), 2D 2x2 {bytes_2d} B ({bytes_2d / plain:.3f} of plain), "
        f"plain {plain} B; 2D/1D = {ratio:.3f}"
    )
    print(line)
    return ratio, bytes_2d / plain, line


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", sorted(MODELS))
def test_2d_partitions_activations_by_q_squared(measured: list[Measured], family: str, mode: str) -> None:
    ratio, of_plain, line = _summary(measured, family, mode)
    assert of_plain <= MAX_2D_OVER_PLAIN, f"{line}; 2D/plain > {MAX_2D_OVER_PLAIN:.4f}"
    assert ratio < 1, line


@pytest.mark.parametrize("family", sorted(MODELS))
def test_issue_bound_full_checkpointing(measured: list[Measured], family: str) -> None:
    ratio, _, line = _summary(measured, family, "full")
    assert ratio <= ISSUE_BOUND, f"{line}; issue 3 bound is 2D/1D ≤ {ISSUE_BOUND:.3f}"
