"""The per-block activation formula (`activation_bytes_per_layer`) and the head's (`head_activation_bytes`)
against what the runtime saves, per layout, in fp32 and under bf16 autocast.

The dry run (tessera/fake.py) counts the bytes every forward saves for backward. The difference between a model
of 2 blocks and one of 1 is one block's worth, independent of the embedding and the head; per block it must equal
the formula for GPT (Korthikanti's table) and for tessera's Llama block (its own per-tensor count; Qwen2 through
its family plan), with no parallelism, 1D tensor parallelism with and without sequence parallelism, and 2D, with
and without selective recomputation. What remains beside the formula is the normalisation statistics and SDPA's
log-sum-exp rows.

Under bf16 autocast each tensor has its own dtype (fp32 residual stream and norms, bf16 matmul inputs and
outputs, one bf16 cast of its input per Linear), and a block also saves the bf16 copies of its weights that
autocast makes (`autocast_weight_bytes_per_layer`); a formula counting 2-byte activations fails every bf16 case.
"""

from __future__ import annotations

import pytest

from tessera.config import from_dict
from tessera.dryrun import dry_run
from tessera.memory import plan_from_config
from tessera.planner.cost import (
    ModelShape,
    Plan,
    activation_bytes_per_layer,
    autocast_weight_bytes_per_layer,
    head_activation_bytes,
)

RTOL = 0.01
"""Measured: the rows of statistics (one float per token per norm, per head for SDPA) are ≤ 0.5 % of a block."""

FAMILIES = {
    "gpt": {"family": "gpt", "n_heads": 4},
    # grouped-query attention (2 KV heads for 4 query heads) so the expansion of K and V shows
    "llama": {"family": "llama", "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 384, "tie_embeddings": False},
    # Llama with biased wq, wk, wv: in 2D their outputs are fp32 under autocast (the bias is added in fp32)
    "qwen2": {"family": "qwen2", "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 384, "tie_embeddings": False},
}
LAYOUTS = {  # name: (world size, parallel section)
    "plain": (1, {}),
    "tp2": (2, {"tensor": 2}),
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}),
    "2d2x2": (4, {"tensor": "2x2"}),
}
BLOCK_CASES = [
    (family, layout, checkpointing, dtype)
    for dtype in ("fp32", "bf16")
    for family in FAMILIES
    if family != "qwen2" or dtype == "bf16"  # in fp32 Qwen2's block saves what Llama's does
    for layout in LAYOUTS
    for checkpointing in ("none", "selective")
]
SEQ, BATCH = 32, 2


def _raw(family: str, parallel: dict, layers: int, checkpointing: str, dtype: str) -> dict:
    model = {**FAMILIES[family], "d_model": 128, "vocab_size": 64, "seq_len": SEQ, "n_layers": layers}
    return {
        "model": model,
        "parallel": {**parallel, "checkpointing": checkpointing},
        "train": {"global_batch": BATCH, "micro_batch": BATCH, "dtype": dtype},
    }


def _saved(family: str, layout: str, checkpointing: str, dtype: str) -> tuple[dict[int, int], object, int]:
    """Activation bytes the dry run counts for models of 1 and 2 blocks; the config of the latter; the world."""
    world, parallel = LAYOUTS[layout]
    saved = {}
    for layers in (1, 2):
        cfg = from_dict(_raw(family, parallel, layers, checkpointing, dtype))
        saved[layers] = dry_run(cfg, world, 0).activations
    return saved, cfg, world


def _saved_weight_copies(shape: ModelShape, plan: Plan) -> float:
    """The bf16 weight copies a block's forward saves for backward, beside its activations: every Linear's under
    1D (2D's are counted per micro-batch in the formula itself). The sequence-parallel entry saves the fp32
    weights instead: its Linears' copies stay in autocast's cache, not among the saved tensors."""
    if plan.tp_kind == "2d":
        return 0.0
    copies = autocast_weight_bytes_per_layer(shape, plan)
    if plan.sequence_parallel and copies:
        linears = shape.features.block_linears(shape.d_model, shape.kv_dim, shape.ffn_hidden)
        column = sum(lin.d_in * lin.d_out for lin in linears if lin.role == "column")
        copies -= plan.act_bytes * column / plan.tp
    return copies


@pytest.mark.parametrize(("family", "layout", "checkpointing", "dtype"), BLOCK_CASES)
def test_block_activation_bytes_equal_the_formula(
    family: str, layout: str, checkpointing: str, dtype: str
) -> None:
    saved, cfg, world = _saved(family, layout, checkpointing, dtype)
    per_block = saved[2] - saved[1]
    shape, plan = ModelShape.from_config(cfg.model), plan_from_config(cfg, world)
    formula = activation_bytes_per_layer(shape, plan) + _saved_weight_copies(shape, plan)
    assert per_block == pytest.approx(formula, rel=RTOL)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_head_activation_bytes_equal_the_formula(family: str, layout: str, dtype: str) -> None:
    """The embedding and the head together (a 1-block model less one block): the final norm's tensors, the
    output projection's input (and its bf16 weight copy), the fp32 logits the loss keeps."""
    saved, cfg, world = _saved(family, layout, "none", dtype)
    ends = 2 * saved[1] - saved[2]
    shape, plan = ModelShape.from_config(cfg.model), plan_from_config(cfg, world)
    logits = 4 * SEQ * BATCH * shape.vocab_size / plan.tp
    head_copy = 0.0  # saved once per step under 1D (2D: in head_activation_bytes; SP: autocast's cache)
    if plan.casts and plan.tp_kind == "1d" and not plan.sequence_parallel:
        head_copy = plan.act_bytes * shape.vocab_size * shape.d_model / plan.tp
    formula = head_activation_bytes(shape, plan) + logits + head_copy
    # beside them: token and target ids (int64), norm and loss statistics: measured ≤ 28 bytes per token
    assert ends == pytest.approx(formula, abs=32 * SEQ * BATCH)
