"""Saved activations per rank: 2D (q=2) partitions every activation by q², 1D (t=4) only the attention/MLP interior.

Issue 3 asked for 2D q=2 ≤ 1/3 of 1D t=4. That bound is not reachable at 4 ranks by the arithmetic below (measured
2D/1D ≈ 0.48-0.55; the issue is left open with the numbers). What this test asserts is the property the Optimus
method guarantees and the bound that does hold: 2D saves at most 1/q² of the single-device bytes (plus 5% for
the token ids every rank keeps), and strictly less than 1D at the same world size.

Both layouts run in one 4-process gloo job on the same plain model (same seed) and the same micro-batch; each rank
measures the bytes autograd saves for backward during one forward with `SavedActivationCounter` (unique storages,
parameters excluded). The per-rank figure is the largest over the 4 ranks. The ratio is printed (run with ``-s``)
and stated in the assertion message, with each layout's fraction of the single-device model's saved bytes.

2D at q = 2 quarters every saved tensor; 1D at t = 4 without sequence parallelism quarters only the attention/MLP
interior and keeps the norm inputs/outputs replicated. With a replicated fraction R of the single-device
activations, 2D/1D ≈ 1 / (1 + 3R), so the 1/3 bound needs R ≥ 2/3; see benchmarks/results/tensor_parallel.md.
"""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig, ParallelConfig
from tessera.groups import build_groups
from tessera.layout import Layout
from tessera.model.build import build_model
from tessera.parallel.memory import SavedActivationCounter
from tessera.parallel.model_1d import apply_tensor_1d
from tessera.parallel.model_2d import apply_tensor_2d
from tests.harness import run_distributed

Q = 2
MAX_2D_OVER_PLAIN = (
    1.05 / Q**2
)  # every saved tensor is partitioned over the q×q grid; 5% for replicated token ids
SEED = 1234
BATCH = 8  # divisible by q = 2
TIMEOUT_S = 120.0

MODELS = {
    "gpt": dict(family="gpt", d_model=64, n_heads=4, vocab_size=128, seq_len=32, n_layers=2),
    "llama": dict(
        family="llama", d_model=64, n_heads=8, n_kv_heads=4, vocab_size=128, seq_len=32, n_layers=2,
        tie_embeddings=False,
    ),
}  # fmt: skip


def _saved_bytes(pmodel: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    with SavedActivationCounter(pmodel) as saved:
        loss = pmodel(tokens, targets)
    del loss
    return saved.bytes


def _measure(rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """{family: (1D t=4 bytes, 2D 2x2 bytes, plain single-device bytes)} saved by one forward on this rank."""
    groups_1d = build_groups(Layout(tp=world))
    groups_2d = build_groups(Layout(q=2))
    out = {}
    for family, fields in MODELS.items():
        cfg = ModelConfig(**fields)
        g = torch.Generator().manual_seed(SEED + 1)
        data = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=g)
        tokens, targets = data[:, :-1], data[:, 1:]  # [b, s] each, the full micro-batch on every rank
        sizes = []
        for apply, groups in ((apply_tensor_1d, groups_1d), (apply_tensor_2d, groups_2d)):
            torch.manual_seed(SEED)
            pmodel = apply(build_model(cfg), groups, ParallelConfig(tensor=world))
            sizes.append(_saved_bytes(pmodel, tokens, targets))
        torch.manual_seed(SEED)
        plain = _saved_bytes(build_model(cfg), tokens, targets)  # context: 1D ≈ plain/2, 2D ≈ plain/4
        out[family] = (sizes[0], sizes[1], plain)
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict[str, tuple[int, int, int]]]:
    return run_distributed(_measure, 4, timeout=TIMEOUT_S)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_2d_partitions_activations_by_q_squared(
    measured: list[dict[str, tuple[int, int, int]]], family: str
) -> None:
    bytes_1d = max(r[family][0] for r in measured)
    bytes_2d = max(r[family][1] for r in measured)
    plain = measured[0][family][2]
    ratio = bytes_2d / bytes_1d
    summary = (
        f"{family}: saved activations per rank: 1D t=4 {bytes_1d} B ({bytes_1d / plain:.3f} of plain), "
        f"2D 2x2 {bytes_2d} B ({bytes_2d / plain:.3f} of plain), plain {plain} B; 2D/1D = {ratio:.3f}"
    )
    print(summary)
    assert bytes_2d / plain <= MAX_2D_OVER_PLAIN, f"{summary}; 2D/plain > {MAX_2D_OVER_PLAIN:.4f}"
    assert ratio < 1, summary
