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
autocast makes (`autocast_weight_bytes`, one per step: 2D's SUMMA casts its weight blocks under autocast's caching
rule); a formula counting 2-byte activations fails every bf16 case.
"""

from __future__ import annotations

import pytest

from tessera.config import Config, from_dict
from tessera.dryrun import dry_run, estimated_memory
from tessera.memory import plan_from_config
from tessera.planner.cost import (
    ModelShape,
    Plan,
    activation_bytes_per_layer,
    autocast_weight_bytes,
    autocast_weight_bytes_per_layer,
    cached_weight_bytes,
    head_activation_bytes,
    shared_mask_bytes,
)

RTOL = 0.01
"""Measured: the rows of statistics (one float per token per norm, per head for SDPA) are ≤ 0.5 % of a block."""

FAMILIES = {
    "gpt": {"family": "gpt", "n_heads": 4},
    # grouped-query attention (2 KV heads for 4 query heads) so the expansion of K and V shows
    "llama": {"family": "llama", "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 384, "tie_embeddings": False},
    # Llama with biased wq, wk, wv: in 2D their outputs are fp32 under autocast (the bias is added in fp32)
    "qwen2": {"family": "qwen2", "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 384, "tie_embeddings": False},
    # Llama with per-head q/k RMSNorms: each keeps its input and the normalised tensor, RoPE its input
    "qwen3": {"family": "qwen3", "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 384, "tie_embeddings": False},
    # head_dim 48 ≠ 128 / 4: Q, the expanded K and V, SDPA's output and wo's input 4·48 = 192 wide, not 128
    "llama_hd": {"family": "llama", "n_heads": 4, "n_kv_heads": 2, "head_dim": 48, "ffn_hidden": 384},
    "qwen3_hd": {"family": "qwen3", "n_heads": 4, "n_kv_heads": 2, "head_dim": 48, "ffn_hidden": 384},
    # Gemma 2: four norms per block, GeGLU, the soft-capped attention written out (its scores kept)
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
    "gemma2_nocap": {"family": "gemma2", "n_heads": 4, "n_kv_heads": 2, "head_dim": 48, "ffn_hidden": 384},
    # Gemma 3: per-head (1 + w) q/k norms; pattern 3 makes both blocks of the 1- and 2-block models local, so the
    # block measured is a windowed one (its band goes to SDPA: one per micro-batch, shared by the local layers, so
    # not in the per-block difference; the head's test and test_gemma3_band_estimate_is_the_dry_runs count it)
    "gemma3": {
        "family": "gemma3",
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 48,
        "ffn_hidden": 384,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
    },
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
    # Qwen3's q/k norms split like the heads (tp2 as tp2_sp); their one dtype rule shows plain in fp32
    if family != "qwen3" or (layout != "tp2" and (dtype == "bf16" or layout == "plain"))
    if not family.endswith("_hd") or layout != "tp2"  # the heads split as in tp2_sp
    for checkpointing in ("none", "selective")
]
SEQ, BATCH = 32, 2


def _raw(
    family: str, parallel: dict, layers: int, checkpointing: str, dtype: str, documents: bool = False
) -> dict:
    model = {**FAMILIES[family], "d_model": 128, "vocab_size": 64, "seq_len": SEQ, "n_layers": layers}
    return {
        "model": model,
        "parallel": {**parallel, "checkpointing": checkpointing},
        "train": {"global_batch": BATCH, "micro_batch": BATCH, "dtype": dtype},
        "data": {"document_mask": documents},
    }


def _saved(
    family: str, layout: str, checkpointing: str, dtype: str, documents: bool = False
) -> tuple[dict[int, int], dict[int, Config], int]:
    """Activation bytes the dry run counts for models of 1 and 2 blocks, their configs, the world size."""
    world, parallel = LAYOUTS[layout]
    saved, cfg = {}, {}
    for layers in (1, 2):
        cfg[layers] = from_dict(_raw(family, parallel, layers, checkpointing, dtype, documents))
        saved[layers] = dry_run(cfg[layers], world, 0).activations
    return saved, cfg, world


def _saved_copies(shape: ModelShape, plan: Plan) -> float:
    """The bf16 weight copies a backward saves: those autocast makes (`autocast_weight_bytes`) less those only its
    cache holds (`cached_weight_bytes`: the sequence-parallel entry saves fp32 weights), which a count of saved
    tensors does not see; the estimate's activation row counts the same difference."""
    return autocast_weight_bytes(shape, plan, 0) - cached_weight_bytes(shape, plan, 0)


def _weight_copies(cfg: dict[int, Config], world: int) -> dict[int, float]:
    """The saved bf16 weight copies (`_saved_copies`) for the models of 1 and 2 blocks."""
    return {
        layers: _saved_copies(ModelShape.from_config(c.model), plan_from_config(c, world))
        for layers, c in cfg.items()
    }


@pytest.mark.parametrize(("family", "layout", "checkpointing", "dtype"), BLOCK_CASES)
def test_block_activation_bytes_equal_the_formula(
    family: str, layout: str, checkpointing: str, dtype: str
) -> None:
    saved, cfg, world = _saved(family, layout, checkpointing, dtype)
    per_block = saved[2] - saved[1]
    shape, plan = ModelShape.from_config(cfg[2].model), plan_from_config(cfg[2], world)
    copies = _weight_copies(cfg, world)
    formula = activation_bytes_per_layer(shape, plan) + copies[2] - copies[1]
    assert per_block == pytest.approx(formula, rel=RTOL)


DOCUMENT_CASES = [
    (family, layout, checkpointing, dtype)
    for dtype in ("fp32", "bf16")
    # GPT: learned positions; llama_hd: RoPE gathered per layer (head_dim 48 ≠ SEQ, so hd·s and s² differ);
    # Gemma 2: soft-capped attention written out (keeps the inverted boolean mask); Gemma 3: band AND documents
    for family in ("gpt", "llama_hd", "gemma2", "gemma3")
    for layout in ("plain", "tp2_sp", "2d2x2")
    for checkpointing in ("none", "selective", "full")
    # full in fp32 only: under bf16 a fully recomputed block saves no weight copy, which `_weight_copies` counts
    if checkpointing != "full" or dtype == "fp32"
]


@pytest.mark.parametrize(("family", "layout", "checkpointing", "dtype"), DOCUMENT_CASES)
def test_document_masked_block_activation_bytes_equal_the_formula(
    family: str, layout: str, checkpointing: str, dtype: str
) -> None:
    """With data.document_mask every layer's SDPA gets the micro-batch's [b, 1, s, s] additive mask (b/q
    sequences per rank in 2D, all b with sequence parallelism, whose attention sees the gathered sequence) and
    saves it by reference, one storage for all layers (`shared_mask_bytes`, not in the per-block difference:
    `test_document_masks_of_micro_batches_in_flight`, tests/unit/test_shared_mask.py), and RoPE gathers its
    tables per layer; a fully recomputed block keeps only its input. Until 2026-12-03 each layer kept its own cast
    of a boolean mask, which this difference then counted (`attention_mask_bytes`)."""
    saved, cfg, world = _saved(family, layout, checkpointing, dtype, documents=True)
    per_block = saved[2] - saved[1]
    shape, plan = ModelShape.from_config(cfg[2].model), plan_from_config(cfg[2], world)
    assert plan.document_mask
    copies = _weight_copies(cfg, world)
    formula = activation_bytes_per_layer(shape, plan) + copies[2] - copies[1]
    assert per_block == pytest.approx(formula, rel=RTOL)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", ["gpt", "llama", "gemma2", "gemma2_nocap", "gemma3"])
def test_head_activation_bytes_equal_the_formula(family: str, layout: str, dtype: str) -> None:
    """The embedding and the head together (a 1-block model less one block): the final norm's tensors, the
    output projection's input (and its bf16 weight copy), the fp32 logits the loss keeps; Gemma 2's final
    soft-cap, tanh's logits-sized output. Gemma 3's models of 1 and 2 blocks (both local) each keep one [s, s]
    band, shared by their layers (`shared_mask_bytes`), which the difference leaves here once."""
    saved, cfg, world = _saved(family, layout, "none", dtype)
    ends = 2 * saved[1] - saved[2]
    shape, plan = ModelShape.from_config(cfg[1].model), plan_from_config(cfg[1], world)
    logits = 4 * SEQ * BATCH * shape.vocab_size / plan.tp
    copies = _weight_copies(cfg, world)
    head_copy = 2 * copies[1] - copies[2]  # the output projection's
    formula = head_activation_bytes(shape, plan) + logits + head_copy + shared_mask_bytes(shape, plan)
    # beside them: token and target ids (int64), norm and loss statistics: measured ≤ 28 bytes per token
    assert ends == pytest.approx(formula, abs=32 * SEQ * BATCH)


def test_micro_batches_in_flight_share_the_weight_copies() -> None:
    """GPipe keeps 4 micro-batches in flight on a 1D pipeline rank; every one saves the same cached bf16 copy of
    each weight, which exists once: the runtime's count (`SavedStorages`) and the estimate hold 4 micro-batches'
    activations and one set of copies."""
    raw = _raw("gpt", {"tensor": 2, "pipeline": 2, "schedule": "gpipe"}, 4, "none", "bf16")
    cfg = from_dict({**raw, "train": {"global_batch": 4, "micro_batch": 1, "dtype": "bf16"}})
    shape, plan = ModelShape.from_config(cfg.model), plan_from_config(cfg, 4)
    blocks = 2  # of 4, on pipeline rank 0
    formula = 4 * blocks * activation_bytes_per_layer(shape, plan) + _saved_copies(shape, plan)
    assert dry_run(cfg, 4, 0).activations == pytest.approx(formula, rel=RTOL)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_document_masks_of_micro_batches_in_flight(dtype: str) -> None:
    """A 1D pipeline rank (tensor 2, pipeline 2, GPipe: 4 micro-batches in flight) with document masking:
    each micro-batch's stage builds its own additive mask, which every layer of the stage keeps by reference
    (`shared_mask_bytes`, one per micro-batch; until 2026-12-03 every layer kept its own cast, which this test
    counted as `attention_mask_bytes` per layer), and its RoPE gathers per layer."""
    raw = _raw(
        "llama_hd",
        {"tensor": 2, "pipeline": 2, "schedule": "gpipe"},
        4,
        "none",
        dtype,
        True,
    )
    cfg = from_dict({**raw, "train": {"global_batch": 4, "micro_batch": 1, "dtype": dtype}})
    shape, plan = ModelShape.from_config(cfg.model), plan_from_config(cfg, 4)
    blocks = 2  # of 4, on pipeline rank 0
    per_micro_batch = blocks * activation_bytes_per_layer(shape, plan) + shared_mask_bytes(shape, plan)
    formula = 4 * per_micro_batch + _saved_copies(shape, plan)
    assert dry_run(cfg, 4, 0).activations == pytest.approx(formula, rel=RTOL)


def test_2d_weight_copies_do_not_grow_with_the_micro_batches_in_flight() -> None:
    """2D 2×2 with breadth-first (layered) accumulation keeps every micro-batch in flight on a pipeline rank; all
    of them save the same bf16 copy of each weight block (cast once per step, as autocast's cache does for 1D).
    Going from 2 to 8 micro-batches adds 6 micro-batches' activations and no weight copy; with a fresh cast per
    call each micro-batch would also add its blocks' weights (here about 80 % of its activations)."""
    raw = _raw("llama", {"tensor": "2x2", "pipeline": 2, "schedule": "breadth_first"}, 4, "none", "bf16")
    raw["parallel"]["stages_per_rank"] = 2  # pipeline rank 0: the embedding and blocks 0 and 2, no head
    cfg = {
        m: from_dict({**raw, "train": {"global_batch": m * BATCH, "micro_batch": BATCH, "dtype": "bf16"}})
        for m in (2, 8)
    }
    shape, plan = ModelShape.from_config(cfg[2].model), plan_from_config(cfg[2], 8)
    blocks = 2
    weights = blocks * autocast_weight_bytes_per_layer(shape, plan)  # one bf16 copy of each weight block
    assert autocast_weight_bytes(shape, plan, 0) == weights
    saved = {m: dry_run(c, 8, 0).activations for m, c in cfg.items()}
    per_microbatch = blocks * activation_bytes_per_layer(shape, plan)
    assert (saved[8] - saved[2]) / 6 == pytest.approx(per_microbatch, rel=RTOL)
    assert saved[2] == pytest.approx(2 * per_microbatch + weights, rel=RTOL)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["plain", "tp2_sp"])
def test_soft_capped_attention_keeps_no_mask(layout: str, dtype: str) -> None:
    """Gemma 2's written-out attention adds the additive mask to its capped scores, and an add saves nothing for
    backward. Until 2026-12-03 it masked them with ``masked_fill(~mask)``, and every layer kept its own inverted
    [s, s] causal mask, 1 byte per element (at Gemma 2 9B's shape, t = 8 + SP, bf16, s 4096: 16 MiB a layer,
    3.9 % of a block). At a long sequence and a narrow block (s 256, h 32, 2 heads) that mask was 3.5-7.4 % of
    a block, so this test, whose formula counts none, fails if a layer keeps one again."""
    world, parallel = LAYOUTS[layout]
    model = {
        **FAMILIES["gemma2"],
        "n_heads": 2,
        "n_kv_heads": 2,
        "head_dim": 16,
        "ffn_hidden": 64,
        "d_model": 32,
        "seq_len": 256,
    }
    cfg, saved = {}, {}
    for layers in (1, 2):
        cfg[layers] = from_dict(
            {
                "model": {**model, "vocab_size": 64, "n_layers": layers},
                "parallel": parallel,
                "train": {"global_batch": 1, "micro_batch": 1, "dtype": dtype},
            }
        )
        saved[layers] = dry_run(cfg[layers], world, 0).activations
    shape, plan = ModelShape.from_config(cfg[2].model), plan_from_config(cfg[2], world)
    copies = _weight_copies(cfg, world)
    formula = activation_bytes_per_layer(shape, plan) + copies[2] - copies[1]
    assert saved[2] - saved[1] == pytest.approx(formula, rel=RTOL)


BAND_MODEL = {**FAMILIES["gemma3"], "d_model": 64, "head_dim": 16, "ffn_hidden": 128, "vocab_size": 64}
"""Gemma 3 at s = 256: 4 blocks, pattern 3 (local, local, global, local); its [s, s] band is 128 KiB in bf16."""
BAND_LAYOUTS = {  # name: (world size, parallel section, train section)
    "plain": (1, {}, {"global_batch": 2, "micro_batch": 1}),
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}, {"global_batch": 2, "micro_batch": 1}),
    "2d2x2": (4, {"tensor": "2x2"}, {"global_batch": 4, "micro_batch": 2}),  # the grid's rows split b
    # GPipe: 4 micro-batches in flight on pipeline rank 0 (blocks 0 and 1, both local), a band each
    "pp2_gpipe_tp2": (
        4,
        {"tensor": 2, "pipeline": 2, "schedule": "gpipe"},
        {"global_batch": 4, "micro_batch": 1},
    ),
    # ZeRO-3 runs a stage per block: the runtime shares one band per micro-batch among them
    "dp2_zero3": (2, {"zero": 3}, {"global_batch": 4, "micro_batch": 1}),
}


def _band_activations(layout: str, checkpointing: str, window: int | None) -> tuple[float, float]:
    """(the dry run's, the estimate's) activation row of rank 0 for `BAND_MODEL` with sliding window ``window``
    (None: every layer global)."""
    world, parallel, train = BAND_LAYOUTS[layout]
    cfg = from_dict(
        {
            "model": {**BAND_MODEL, "sliding_window": window, "seq_len": 256, "n_layers": 4},
            "parallel": {**parallel, "checkpointing": checkpointing},
            "train": {**train, "dtype": "bf16"},
        }
    )
    return dry_run(cfg, world, 0).activations, estimated_memory(cfg, world, 0)["activations"]


@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
@pytest.mark.parametrize("layout", list(BAND_LAYOUTS))
def test_gemma3_band_is_in_the_estimate(layout: str, checkpointing: str) -> None:
    """Gemma 3 without document masking: its local layers share one additive [s, s] band per micro-batch and rank
    (`AttentionMasks.bias`, `shared_mask_bytes`; the global layers none: is_causal); selective recomputation's
    cores cut their band themselves and keep none; full recomputation keeps none past the forward. What the band
    adds to the activation row (the model less the same model without a window) is the dry run's, to the byte
    (what both leave out of a block is the same with and without the band: 1.2 % of this small model). Until
    2026-12-03 every local layer kept its own cast of a boolean band, and the estimate counted it per layer,
    averaged over the layers (-2.5 % on a pipeline stage of local layers only)."""
    banded, plain = (
        _band_activations(layout, checkpointing, 8),
        _band_activations(layout, checkpointing, None),
    )
    assert banded[1] - plain[1] == banded[0] - plain[0]
