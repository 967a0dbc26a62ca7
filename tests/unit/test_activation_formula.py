"""The per-block activation formula (`activation_bytes_per_layer`) against what a block saves, per layout.

The dry run (tessera/fake.py) counts the bytes every forward saves for backward. The difference between a model
of 2 blocks and one of 1 is one block's worth, independent of the embedding and the head; per block it must equal
the formula for GPT (Korthikanti's table) and for tessera's Llama block (its own per-tensor count), with no
parallelism, 1D tensor parallelism with and without sequence parallelism, and 2D, with and without selective
recomputation. What remains beside the formula is the normalisation statistics and SDPA's log-sum-exp rows.
"""

from __future__ import annotations

import pytest

from tessera.config import from_dict
from tessera.dryrun import dry_run
from tessera.memory import plan_from_config
from tessera.planner.cost import ModelShape, activation_bytes_per_layer

RTOL = 0.01
"""Measured: the rows of statistics (one float per token per norm, per head for SDPA) are ≤ 0.4 % of a block."""

FAMILIES = {
    "gpt": {"family": "gpt", "n_heads": 4},
    # grouped-query attention (2 KV heads for 4 query heads) so the expansion of K and V shows
    "llama": {"family": "llama", "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 384, "tie_embeddings": False},
}
LAYOUTS = {  # name: (world size, parallel section)
    "plain": (1, {}),
    "tp2": (2, {"tensor": 2}),
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}),
    "2d2x2": (4, {"tensor": "2x2"}),
}


def _raw(family: str, parallel: dict, layers: int, checkpointing: str) -> dict:
    model = {**FAMILIES[family], "d_model": 128, "vocab_size": 64, "seq_len": 32, "n_layers": layers}
    return {
        "model": model,
        "parallel": {**parallel, "checkpointing": checkpointing},
        "train": {"global_batch": 2, "micro_batch": 2},
    }


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_activation_bytes_equal_the_formula(family: str, layout: str, checkpointing: str) -> None:
    world, parallel = LAYOUTS[layout]
    saved = {}
    for layers in (1, 2):
        cfg = from_dict(_raw(family, parallel, layers, checkpointing))
        saved[layers] = dry_run(cfg, world, 0).activations
    per_block = saved[2] - saved[1]
    formula = activation_bytes_per_layer(ModelShape.from_config(cfg.model), plan_from_config(cfg, world))
    assert per_block == pytest.approx(formula, rel=RTOL)
