"""`tessera memory`'s activation row against the dry run's, rank by rank, over a named matrix of layouts.

The dry run's activations are what autograd saves for backward on the rank, at their peak over the step
(`SavedActivationCounter` per forward, `SavedStorages` across the micro-batches in flight); the estimate's row is
`estimate(..., stage=)`'s ``breakdown.activations``: the per-block formula × the (block × micro-batch) pairs in
flight, the head's tensors, the bf16 weight copies the Linears save, and with document masking under selective
recomputation each stage's shared mask. `test_activation_formula.py` checks the per-block formula block by block;
this checks the row the user reads, where the pieces are put together.

Before 2026-12-03 the row also held the bf16 copies of the column-parallel weights and the head's under 1D +
sequence parallelism in bf16, which only autocast's cache holds (the sequence-parallel entry saves the fp32
weights): +7.8 % (Gemma 2, tp2 + SP) to +67.6 % (Llama, last rank of tp2 + SP × pp2) against the dry run, while
the peak agreed (the copies are alive, so the walk counted them rightly). They are now a component of their own
(``cast_cache``; `test_peak_vs_dryrun.py`'s pp2_1f1b_tp2sp_bf16 checks that the peak still holds them), and every
sequence-parallel bf16 case here fails with them back in the row.
"""

from __future__ import annotations

import pytest

from tessera.config import Config, from_dict
from tessera.dryrun import dry_run, estimated_memory
from tessera.layout import Layout, default_ranks

FAMILIES = {
    "gpt": {"family": "gpt", "n_heads": 4},
    # grouped-query attention, head_dim 48 ≠ 128 / 4
    "llama": {"family": "llama", "n_heads": 4, "n_kv_heads": 2, "head_dim": 48, "ffn_hidden": 384},
    # four norms per block, the soft-capped attention written out, a final soft-cap
    "gemma2": {
        "family": "gemma2",
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 48,
        "ffn_hidden": 384,
        "query_pre_attn_scalar": 40,
        "attn_softcap": 50.0,
        "final_softcap": 30.0,
    },
}
RTOL = {"gpt": 0.01, "llama": 0.01, "gemma2": 0.02}
"""What the formula leaves out, measured after the fix (largest |difference| over the matrix): each norm's fp32
statistics row ([b, s, 1]) and SDPA's log-sum-exp rows, the token ids; GPT ≤ 0.7 %, Llama ≤ 0.4 %. Gemma 2 ≤ 1.5 %:
four norms per block, each also saving its fp32 (1 + w) vector (4h bytes per norm and micro-batch, whatever b
and s), which weigh ~1 % of a block at these test shapes (h 128, s 32, b 1) and < 0.01 % at Gemma 2 9B's."""

LAYOUTS = {  # name: (world size, parallel section, dtype)
    "1 rank bf16": (1, {}, "bf16"),
    "tp2+SP bf16": (2, {"tensor": 2, "sequence_parallel": True}, "bf16"),
    "pp2 bf16": (2, {"pipeline": 2}, "bf16"),
    "tp2+SP fp32": (2, {"tensor": 2, "sequence_parallel": True}, "fp32"),
    "tp2+SP x pp2 bf16": (4, {"tensor": 2, "sequence_parallel": True, "pipeline": 2}, "bf16"),
}
ROW_CASES = [
    (family, layout, checkpointing)
    for family in FAMILIES
    for layout in LAYOUTS
    for checkpointing in ("none", "selective")
    # GPT and Gemma 2 on the layouts the issue was found on (bf16, sequence parallel); Llama on all
    if family == "llama" or (LAYOUTS[layout][2] == "bf16" and "SP" in layout)
]
SEQ = 32


def _config(
    family: str,
    parallel: dict,
    dtype: str,
    checkpointing: str,
    *,
    documents: bool = False,
    micro_batch: int = 1,
) -> Config:
    model = {**FAMILIES[family], "d_model": 128, "vocab_size": 64, "seq_len": SEQ, "n_layers": 4}
    return from_dict(
        {
            "model": model,
            "parallel": {**parallel, "checkpointing": checkpointing},
            # 4 micro-batches: layered accumulation on one rank, a schedule with several in flight on two
            "train": {"global_batch": 4 * micro_batch, "micro_batch": micro_batch, "dtype": dtype},
            "data": {"document_mask": documents},
        }
    )


@pytest.mark.parametrize(("family", "layout", "checkpointing"), ROW_CASES)
def test_activation_row_equals_the_dry_run(family: str, layout: str, checkpointing: str) -> None:
    world, parallel, dtype = LAYOUTS[layout]
    cfg = _config(family, parallel, dtype, checkpointing)
    # the first and the last pipeline rank
    for rank in default_ranks(Layout.from_config(cfg.parallel, world)):
        measured = dry_run(cfg, world, rank).activations
        estimated = estimated_memory(cfg, world, rank)["activations"]
        assert estimated == pytest.approx(measured, rel=RTOL[family]), (rank, estimated, measured)


DOCUMENT_LAYOUTS = {  # name: (world size, parallel section); micro-batch 2 so that 2D splits the batch
    "1 rank": (1, {}),  # one stage per block (layered accumulation): the stages share a micro-batch's mask
    "tp2+SP": (2, {"tensor": 2, "sequence_parallel": True}),  # the whole b on each rank
    "2D 2x2": (4, {"tensor": "2x2"}),  # b/q sequences per rank
    "pp2": (2, {"pipeline": 2}),
    "pp2 interleaved": (2, {"pipeline": 2, "schedule": "interleaved", "stages_per_rank": 2}),
}


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("layout", list(DOCUMENT_LAYOUTS))
def test_one_document_mask_per_micro_batch(family: str, layout: str, checkpointing: str) -> None:
    """With data.document_mask every layer of a rank is given the micro-batch's same additive [b, 1, s, s] mask
    in the compute dtype (`Documents.bias`, one per micro-batch and rank: the schedule runtime shares it between
    a rank's stages), which SDPA saves by reference (none) or every checkpointed core saves as its input
    (selective; until 2026-12-03 the boolean mask, 1 byte per element instead of 2 here); Gemma 2's capped path
    adds it to its scores and saves none without recomputation. One per micro-batch in flight
    (`shared_mask_bytes`), beside each layer's RoPE gathers. The row with documents less the row without is
    those alone, to the byte (no statistics differ). Until 2026-12-03 every layer (none) or every stage
    (selective: one block per stage on one rank) kept its own; this test fails with either."""
    world, parallel = DOCUMENT_LAYOUTS[layout]
    rank = 0
    measured, estimated = {}, {}
    for documents in (False, True):
        cfg = _config(family, parallel, "bf16", checkpointing, documents=documents, micro_batch=2)
        measured[documents] = dry_run(cfg, world, rank).activations
        estimated[documents] = estimated_memory(cfg, world, rank)["activations"]
    added = measured[True] - measured[False]
    assert estimated[True] - estimated[False] == added
