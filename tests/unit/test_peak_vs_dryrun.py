"""`tessera memory`'s per-rank peak against the dry run's allocator peak (tessera/fake.py) on small multi-axis
layouts: the estimate walks the rank's lowered action list (tessera/peak_memory.py) for what coexists, as the
runtime does when it executes that list; issue #11 requires 5 % at real scale (benchmarks/results/dryrun.md).

The model is small but not tiny, so that what the estimate leaves out (norm statistics, SDPA's log-sum-exp rows,
scalars, the optimizer's step counters) stays well under the tolerance.
"""

from __future__ import annotations

import json

import pytest

from tessera.config import from_dict
from tessera.dryrun import RankResult, default_ranks, dry_run, estimated_memory
from tessera.layout import Axis, Layout

PEAK_RTOL = 0.05
"""Issue #11's acceptance; measured on these layouts: within 2.2 %."""
MICRO_BATCHES_RTOL = 0.005
"""Plain data parallelism, depth-first: the measured peak at m = 16 against m = 4. Measured: 0.04 % (the step's
token batches); keeping every micro-batch's flat gradient copy, as the runtime did, added 12 copies (+133 %)."""
GRADS_RTOL = 0.005
"""Gradients held after backward (ZeRO-1: the full gradients and the reduced shard); measured: 0.1 %."""

MODEL = {
    "family": "llama",
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_model": 256,
    "vocab_size": 512,
    "seq_len": 128,
    "n_layers": 8,
    "tie_embeddings": False,
}
LAYOUTS = {  # name: (world size, parallel section)
    "pp2_1f1b_tp2_dp2_zero1": (8, {"pipeline": 2, "schedule": "1f1b", "tensor": 2, "zero": 1}),
    "pp2_breadth_first_v2_dp2_zero3": (
        4,
        {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2, "zero": 3},
    ),
    "pp2_interleaved_v2_dp2_depth_first": (
        4,
        {"pipeline": 2, "schedule": "interleaved", "stages_per_rank": 2, "accumulation": "depth_first"},
    ),
    "pp2_1f1b_dp2_depth_first": (4, {"pipeline": 2, "schedule": "1f1b", "accumulation": "depth_first"}),
    "pp2_1f1b_dp2_depth_first_tied": (4, {"pipeline": 2, "schedule": "1f1b", "accumulation": "depth_first"}),
    "pp2_1f1b_dp2_zero2_depth_first_tied": (
        4,
        {"pipeline": 2, "schedule": "1f1b", "accumulation": "depth_first", "zero": 2},
    ),
    # 2D under bf16 autocast, 8 micro-batches in flight: every one saves the same bf16 copy of each weight block
    "pp2_breadth_first_v2_tp2x2_bf16": (
        8,
        {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2, "tensor": "2x2"},
    ),
    # 1D + sequence parallelism under bf16 autocast: the column-parallel weights' and the head's bf16 copies live
    # only in autocast's cache (the sequence-parallel entry saves the fp32 weights), through the step; without
    # them (`cast_cache`) the estimate falls 7.5 % / 5.4 % under the dry run's peak
    "pp2_1f1b_tp2sp_bf16": (4, {"pipeline": 2, "schedule": "1f1b", "tensor": 2, "sequence_parallel": True}),
    # hybrid sharding (parallel.zero_shard_size): ZeRO state over shard groups of 2 of the 4 data ranks, so every
    # rank holds what dp 2 would; the replica all-reduce runs in place on the fp32 shards (no buffer)
    "pp2_1f1b_dp4_shard2_zero3": (8, {"pipeline": 2, "schedule": "1f1b", "zero": 3, "zero_shard_size": 2}),
    "dp4_shard2_zero1_depth_first": (4, {"zero": 1, "zero_shard_size": 2, "accumulation": "depth_first"}),
    # the direct loop, its flat gradient copy reduce-scattered in bf16 (train.grad_reduce_dtype)
    "dp2_zero2_depth_first_bf16_reduce": (2, {"zero": 2, "accumulation": "depth_first"}),
}
TIED = {name for name in LAYOUTS if name.endswith("_tied")}
"""Embedding and head tied across the two pipeline ranks: the engine reduces both stages once, at the end."""
TRAIN = {
    "pp2_breadth_first_v2_tp2x2_bf16": {"dtype": "bf16"},
    "pp2_1f1b_tp2sp_bf16": {"dtype": "bf16"},
    "dp2_zero2_depth_first_bf16_reduce": {"grad_reduce_dtype": "bf16"},
}
"""What a layout changes in the train section besides its batch."""

_DRY_RUNS: dict[str, RankResult] = {}


def _dry_run(raw: dict, world: int, rank: int) -> RankResult:
    """`dry_run` of ``from_dict(raw)``, once per module for each config, world and rank: the dry run is
    deterministic, and test_plain_depth_first_peak_does_not_grow_with_micro_batches's m = 4 run of rank 0 is
    the very one test_estimated_peak_is_the_dry_runs[pp2_1f1b_dp2_depth_first] makes."""
    key = json.dumps([raw, world, rank], sort_keys=True)
    if key not in _DRY_RUNS:
        _DRY_RUNS[key] = dry_run(from_dict(raw), world, rank)
    return _DRY_RUNS[key]


def _assert_peaks_match(raw: dict, world: int, rtol: float) -> None:
    """The estimated peak of each default rank (first and last pipeline rank) against its dry run, within rtol."""
    cfg = from_dict(raw)
    for rank in default_ranks(Layout.from_config(cfg.parallel, world)):
        measured, est = _dry_run(raw, world, rank), estimated_memory(cfg, world, rank)
        assert est["peak"] == pytest.approx(measured.peak, rel=rtol), rank


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_estimated_peak_is_the_dry_runs(layout: str) -> None:
    world, parallel = LAYOUTS[layout]
    model = {**MODEL, "tie_embeddings": layout in TIED}
    train = {"global_batch": 16, "micro_batch": 2, **TRAIN.get(layout, {})}
    raw = {"model": model, "parallel": parallel, "train": train}
    cfg = from_dict(raw)
    for rank in default_ranks(Layout.from_config(cfg.parallel, world)):  # first and last pipeline rank
        measured, est = _dry_run(raw, world, rank), estimated_memory(cfg, world, rank)
        assert est["peak"] == pytest.approx(measured.peak, rel=PEAK_RTOL), rank
        assert est["grads"] == pytest.approx(measured.grads, rel=GRADS_RTOL), rank


@pytest.mark.parametrize(
    ("family", "world", "parallel", "head_dim"),
    [
        ("gpt", 2, {"tensor": 2}, None),  # replicated: norms, row-parallel biases, the position table
        ("gpt", 4, {"tensor": "2x2"}, None),  # every vector split by the grid's columns only
        ("llama", 4, {"tensor": 2, "pipeline": 2, "schedule": "1f1b"}, None),
        ("qwen3", 2, {"tensor": 2}, None),  # the per-head q/k norms whole on every rank
        ("qwen3", 4, {"tensor": "2x2"}, None),  # ... on every grid rank too, not split by the columns
        # head_dim 48 ≠ 128 / 4: wq, wo 4·48 = 192 wide, wk, wv 2·48 (Qwen3-0.6B's kind of heads)
        ("qwen3", 2, {"tensor": 2}, 48),
        ("qwen3", 4, {"tensor": "2x2"}, 48),
        ("llama", 4, {"tensor": 2, "pipeline": 2, "schedule": "1f1b"}, 48),
    ],
)
def test_parameter_and_gradient_bytes_are_exact(
    family: str, world: int, parallel: dict, head_dim: int | None
) -> None:
    """`stage_params` counts what each tensor-parallel rank holds, replicated vectors whole (to the byte)."""
    model = {"family": family, "n_heads": 4, "d_model": 128, "vocab_size": 64, "seq_len": 32, "n_layers": 2}
    model |= {"n_kv_heads": 2, "head_dim": head_dim} if head_dim else {}
    cfg = from_dict({"model": model, "parallel": parallel, "train": {"global_batch": 4, "micro_batch": 2}})
    for rank in (0, world - 1):
        measured, est = dry_run(cfg, world, rank), estimated_memory(cfg, world, rank)
        assert (est["params"], est["grads"]) == (measured.params, measured.grads), rank


def test_plain_depth_first_peak_does_not_grow_with_micro_batches() -> None:
    """A REDUCE_MB per micro-batch, each added into a running total as the next is launched: the allocator's
    peak of the first pipeline rank (two micro-batches in flight under 1F1B whatever m) stays put from m = 4 to
    m = 16, and the estimate says the same."""
    world, parallel = LAYOUTS["pp2_1f1b_dp2_depth_first"]
    peaks, estimates = [], []
    for global_batch in (16, 64):  # m = 4, 16 per data-parallel rank
        train = {"global_batch": global_batch, "micro_batch": 2}
        raw = {"model": MODEL, "parallel": parallel, "train": train}
        cfg = from_dict(raw)
        peaks.append(_dry_run(raw, world, 0).peak)
        estimates.append(estimated_memory(cfg, world, 0)["peak"])
    assert peaks[1] == pytest.approx(peaks[0], rel=MICRO_BATCHES_RTOL)
    assert estimates[1] == estimates[0]


@pytest.mark.parametrize(
    ("world", "parallel"),
    [
        (4, {"pipeline": 2, "schedule": "1f1b", "zero": 2}),
        (4, {"pipeline": 2, "schedule": "1f1b", "zero": 3}),
    ],
)
def test_bf16_reduce_scatter_buffer_is_two_bytes(world: int, parallel: dict) -> None:
    """`train.grad_reduce_dtype = "bf16"`: the flat copy ZeRO reduce-scatters (`ZeroStage.flat_grads`) is bf16,
    so the estimate's communication buffer is 2 bytes less per parameter of the rank's stage (one per rank
    here) than under fp32, and the gradients it holds (the fp32 reduced shard) do not change."""
    est = {}
    for dtype in ("fp32", "bf16"):
        train = {"global_batch": 8, "micro_batch": 1, "grad_reduce_dtype": dtype}
        est[dtype] = estimated_memory(
            from_dict({"model": MODEL, "parallel": parallel, "train": train}), world, 0
        )
    dp = world // parallel.get("pipeline", 1)
    stage_params = est["fp32"]["params"] / 4 * (dp if parallel["zero"] == 3 else 1)  # fp32 master weights
    assert est["bf16"]["grads"] == est["fp32"]["grads"]
    assert est["fp32"]["comm_buffers"] - est["bf16"]["comm_buffers"] == pytest.approx(2 * stage_params)


def test_overlapped_parameter_gathers_inputs_are_in_the_estimate() -> None:
    """parallel.overlap_param_gather keeps every stage's shard copy (its all-gather's input) from the update to
    the stage's first compute of the next step. With small activations the optimizer step's moment is the peak:
    the measured peak rises by more than the tolerance (measured: +9.9 %), and the estimate follows it."""
    peaks = {}
    for overlap in (False, True):
        parallel = {"zero": 1, "overlap_param_gather": overlap}
        train = {"global_batch": 2, "micro_batch": 1}
        cfg = from_dict({"model": {**MODEL, "seq_len": 16}, "parallel": parallel, "train": train})
        measured, est = dry_run(cfg, 2, 0), estimated_memory(cfg, 2, 0)
        assert est["peak"] == pytest.approx(measured.peak, rel=PEAK_RTOL), overlap
        peaks[overlap] = measured.peak
    assert peaks[True] > (1 + PEAK_RTOL) * peaks[False], peaks


@pytest.mark.parametrize(
    "parallel",
    [
        {"zero": 3, "zero_shard_size": 2},
        {"zero": 2, "zero_shard_size": 2, "accumulation": "depth_first"},
    ],
)
def test_hybrid_bf16_replica_copies_are_in_the_estimate(parallel: dict) -> None:
    """Hybrid sharding with grad_reduce_dtype bf16: each stage's replica all-reduce sends a bf16 copy of its fp32
    gradient shard, held from its launch (the rank's next REDUCE after the stage's last) to `ZeroStageComm.finish`:
    Psi/s x 2 bytes in all when backward ends. With small activations that moment is the peak: the measured peak
    rises from fp32 to bf16 although the flat copies halve (ZeRO-3 layered: +6.9 %), and the estimate follows
    (without the copies it fell 2.5 %: 5.3 % under the measured peak)."""
    peaks = {}
    for dtype in ("fp32", "bf16"):
        train = {"global_batch": 8, "micro_batch": 1, "grad_reduce_dtype": dtype}
        cfg = from_dict({"model": {**MODEL, "seq_len": 16}, "parallel": parallel, "train": train})
        measured, est = dry_run(cfg, 4, 0), estimated_memory(cfg, 4, 0)
        assert est["peak"] == pytest.approx(measured.peak, rel=PEAK_RTOL), dtype
        assert est["grads"] == pytest.approx(measured.grads, rel=GRADS_RTOL), dtype
        peaks[dtype] = measured.peak
    assert peaks["bf16"] > peaks["fp32"], peaks


HEAD_RTOL = 0.01
"""The head's moments against the dry run's peak, on models whose vocabulary dominates (h 64, V 4095, s 256: one
micro-batch's logits on a rank weigh more than all its blocks' activations; h 512, V 8191, s 64: the table's
gradients and the optimizer's temporaries weigh more than the activations). Measured after the fix: within 0.95 %
(2D: the SUMMA backward's broadcast blocks of the logits' gradient, left out; the bf16 weight gradients a
backward holds until it ends); before it: -30.9 % to +13.3 %. Each case fails with its fix removed: the old head
transient (two fp32 logits and the weight gradient) -7.2 to +17.8 %, the direct loop's cast cache -3.9 %, the tied
gradient made at the embedding's backward -7.4 %, the embedding's second table gradient -1.2 %, AdamW's
temporaries -13.7 %, the gradients beside one micro-batch's activations +4.6 to +8.9 %."""

HEAD_MODEL = {"family": "gpt", "n_heads": 4, "d_model": 64, "vocab_size": 4095, "seq_len": 256, "n_layers": 2}
HEAD_CASES = {  # name: (world size, rank, parallel section, train section, model overrides)
    # the direct loop: its autocast region is one micro-batch's forward, whose last moment is the loss's (bf16
    # logits, their fp32 copy, the shifted logits) with the cache's weight copies; no gradients yet
    "tp2sp_bf16_direct": (2, 0, {"tensor": 2, "sequence_parallel": True}, {"global_batch": 1}, {}),
    # layered accumulation: the first backward's loss moment (softmax clone and its bf16 cast), not two fp32
    # logits and the weight gradient beside every activation
    "tp2sp_bf16_layered": (2, 0, {"tensor": 2, "sequence_parallel": True}, {"global_batch": 2}, {}),
    # fp32 on the rank whose vocabulary shard holds the padding column: the loss clones its logits to mask it
    "tp2_fp32_padded_rank": (2, 1, {"tensor": 2}, {"global_batch": 2, "dtype": "fp32"}, {}),
    # one rank: F.cross_entropy's backward (the NLL's and the log-softmax's gradients)
    "one_rank_bf16_layered": (1, 0, {}, {"global_batch": 2}, {}),
    "tp2x2_bf16_layered": (4, 0, {"tensor": "2x2"}, {"global_batch": 4, "micro_batch": 2}, {}),
    # a tied table, hidden size above the tokens (h 512 > s 64): the head's weight gradient is the table's, alive
    # from the head's first backward; the embedding's backward makes a second one (one graph: and their sum)
    "tied_wide_one_micro_batch": (
        2,
        0,
        {"tensor": 2, "sequence_parallel": True},
        {"global_batch": 1},
        {"d_model": 512, "seq_len": 64, "vocab_size": 8191},
    ),
    "tied_wide_layered": (
        2,
        0,
        {"tensor": 2, "sequence_parallel": True},
        {"global_batch": 8},
        {"d_model": 512, "seq_len": 64, "vocab_size": 8191},
    ),
    # two micro-batches: the embedding's first backward makes the table's gradient beside the head's, the other
    # gradients and the other micro-batch's first-stage activations, more than the optimizer step's moment
    "tied_wide_layered_two": (
        2,
        0,
        {"tensor": 2, "sequence_parallel": True},
        {"global_batch": 2},
        {"d_model": 512, "seq_len": 64, "vocab_size": 8191},
    ),
    # untied, one micro-batch: the optimizer step is the peak, AdamW's two fp32 temporaries of the largest
    # parameter (the output layer's table shard) beside the gradients and the state
    "untied_wide_one_micro_batch": (
        2,
        0,
        {"tensor": 2, "sequence_parallel": True},
        {"global_batch": 1},
        {"d_model": 512, "seq_len": 64, "vocab_size": 8191, "tie_embeddings": False},
    ),
}


@pytest.mark.parametrize("case", list(HEAD_CASES))
def test_head_moments_are_in_the_estimate(case: str) -> None:
    """The loss's and the output layer's moments (`head_transient_bytes`), the direct loop's cast cache and the
    tied table's gradients (`tied_gradient_bytes`, the walk's ``uses``) against the dry run's peak."""
    world, rank, parallel, train, model = HEAD_CASES[case]
    raw = {
        "model": {**HEAD_MODEL, **model},
        "parallel": parallel,
        "train": {"micro_batch": 1, "dtype": "bf16", **train},
    }
    cfg = from_dict(raw)
    measured, est = _dry_run(raw, world, rank), estimated_memory(cfg, world, rank)
    assert est["peak"] == pytest.approx(measured.peak, rel=HEAD_RTOL)


FULL_PEAK_RTOL = 0.025
"""Full recomputation's peak against the dry run's; measured: -0.9 % to +0.6 % (2026-12-03, with the sequence-
parallel entry's weight gradients, ZeRO-3's cached weight copies and ZeRO's flattened gradients kept until their
reduce-scatter is waited: the context + ZeRO-3 case +4.5 % without that last, the dry run having freed them);
before, -2.4 % to +1.3 % (2026-12-03, the replay's backward
the larger of its MLP's and its sequence-parallel entry's moments, `replay_gradient_bytes`; ZeRO-3 tensor 2 + SP
lowest, the weight gradients the entry's loop makes not counted); before that -0.9 % to +3.3 % (the two moments
added: the context + ZeRO-3 rank +3.3 %, a strict expected failure; 1D + SP +0.1 % to +2.0 %); before the runtime
stopped holding the bf16 weight gradients -0.9 % to +2.2 %. Before the replay's moments were counted: -13.9 % to
+6.9 %; before the 2D replay's SUMMA moment, the stage inputs and gradients a layered rank keeps and a context
rank's replayed masks (2026-12-03): 2D -6.1 %, context -12.5 %, ZeRO-3 dp2 -3.5 %, its tp2 + SP -2.5 %, one rank
layered -2.0 % (docs/memory.md, "Full recomputation's moments")."""
FULL_ACTIVATIONS_RTOL = 0.01
"""The activation row under full recomputation: the checkpoints' inputs and the head's tensors, no weight copy
(no block saves one). Measured after the fix: within 0.5 %; before: +16 % (one rank, bf16) to +32 % (ZeRO-3)."""

FULL_MODEL = {
    "family": "llama",
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_model": 256,
    "vocab_size": 512,
    "seq_len": 256,
    "n_layers": 4,
    "tie_embeddings": False,
}
FULL_CASES = {  # name: (world size, rank, parallel section, train section, model overrides[, document masking])
    # the direct loop, one micro-batch: the first block's replay holds every later block's gradients (-13.9 %)
    "one_rank_direct_fp32": (1, 0, {}, {"global_batch": 2, "dtype": "fp32"}, {}),
    # ... GELU's MLP backward: two gradients in flight, not three (-7.8 %)
    "one_rank_direct_gpt_fp32": (
        1,
        0,
        {},
        {"global_batch": 2, "dtype": "fp32"},
        {"family": "gpt", "n_kv_heads": 4},
    ),
    # layered, 8 micro-batches, bf16: every block's weight copies in autocast's cache, none saved (row +16 %)
    "one_rank_layered_bf16": (1, 0, {}, {"global_batch": 16}, {}),
    # the sequence-parallel entry's backward gathers its input again and makes its gradient (-5.8 %)
    "tp2sp_bf16_two_micro_batches": (2, 0, {"tensor": 2, "sequence_parallel": True}, {"global_batch": 4}, {}),
    "pp2_1f1b_tp2sp_bf16_first": (
        4,
        0,
        {"tensor": 2, "sequence_parallel": True, "pipeline": 2, "schedule": "1f1b"},
        {"global_batch": 16},
        {},
    ),
    # ... and the last stage, whose replay comes once the head's saved tensors are freed
    "pp2_1f1b_tp2sp_bf16_last": (
        4,
        3,
        {"tensor": 2, "sequence_parallel": True, "pipeline": 2, "schedule": "1f1b"},
        {"global_batch": 16},
        {},
    ),
    # document masking: the replays build the micro-batch's mask again (one per micro-batch since 2026-12-03)
    "one_rank_direct_fp32_documents": (1, 0, {}, {"global_batch": 2, "dtype": "fp32"}, {}, True),
    "tp2sp_bf16_two_micro_batches_documents": (
        2,
        0,
        {"tensor": 2, "sequence_parallel": True},
        {"global_batch": 4},
        {},
        True,
    ),
    # ZeRO-3 clears autocast's cache at every FREE: only the replayed block's copies exist (+6.9 %)
    "zero3_dp2_bf16": (2, 0, {"zero": 3}, {"global_batch": 16}, {}),
    "zero3_tp2sp_dp2_bf16": (
        4,
        0,
        {"zero": 3, "tensor": 2, "sequence_parallel": True},
        {"global_batch": 16},
        {},
    ),
    # the 2D replay runs the MLP output Linear's SUMMA whole: its broadcast slots beside the forward's locals and
    # the upstream gradient (-6.1 %); the layered rank keeps each stage's input and its gradient (below)
    "tp2x2_bf16": (4, 0, {"tensor": "2x2"}, {"global_batch": 16}, {}),
    # a context rank: each micro-batch's replayed masks, kept by the checkpoints until
    # its last backward on the rank (-12.5 %)
    "cp2_tp2sp_dp2_zero3_bf16": (
        8,
        0,
        {"context": 2, "data": 2, "tensor": 2, "sequence_parallel": True, "zero": 3},
        {"global_batch": 16},
        {},
    ),
}


@pytest.mark.parametrize("case", list(FULL_CASES))
def test_full_recomputation_peak_is_the_dry_runs(case: str) -> None:
    """Full recomputation (`recompute_working_bytes`, `replay_gradient_bytes`, the direct loop's replay moment,
    the weight copies as autocast's cache holds them) against the dry run's peak and activation row."""
    world, rank, parallel, train, model, *documents = FULL_CASES[case]
    raw = {
        "model": {**FULL_MODEL, **model},
        "parallel": {"checkpointing": "full", **parallel},
        "train": {"micro_batch": 2, "dtype": "bf16", **train},
        "data": {"document_mask": bool(documents)},
    }
    cfg = from_dict(raw)
    measured, est = _dry_run(raw, world, rank), estimated_memory(cfg, world, rank)
    assert est["peak"] == pytest.approx(measured.peak, rel=FULL_PEAK_RTOL)
    assert est["activations"] == pytest.approx(measured.activations, rel=FULL_ACTIVATIONS_RTOL)


RING_PEAK_RTOL = 0.025
"""`parallel.tp_comm_overlap`'s rings against the dry run's peak (the rings on a CUDA run's lanes,
`ring_1d.device_lanes`). Measured (2026-12-03): -0.6 % to +0.7 %; without the rings' moment
(`rank_memory.ring_moment_bytes`) -3.1 % to -7.1 %, every case below outside this tolerance."""

RING_MODEL = {**FULL_MODEL, "n_kv_heads": 4}  # 4 KV heads: tensor 4 divides them
RING_CASES = {  # name: (world size, rank, parallel section, train section, model overrides)
    "tp2sp_b1_none": (2, 0, {"tensor": 2}, {"micro_batch": 1, "global_batch": 2}, {}),
    "tp4sp_b1_selective": (
        4,
        0,
        {"tensor": 4, "checkpointing": "selective"},
        {"micro_batch": 1, "global_batch": 2},
        {},
    ),
    "tp2sp_b1_full": (
        2,
        0,
        {"tensor": 2, "checkpointing": "full"},
        {"micro_batch": 1, "global_batch": 2},
        {},
    ),
    "tp2sp_b2_full": (
        2,
        0,
        {"tensor": 2, "checkpointing": "full"},
        {"micro_batch": 2, "global_batch": 4},
        {},
    ),
    # four chunks on three lanes: a lane's second gradient is added to its sum
    "tp4sp_b1_full": (
        4,
        0,
        {"tensor": 4, "checkpointing": "full"},
        {"micro_batch": 1, "global_batch": 2},
        {},
    ),
    "gpt_tp4sp_b1_none": (4, 0, {"tensor": 4}, {"micro_batch": 1, "global_batch": 2}, {"family": "gpt"}),
    "gpt_tp4sp_b2_none": (4, 0, {"tensor": 4}, {"micro_batch": 2, "global_batch": 4}, {"family": "gpt"}),
    "gpt_tp2sp_b2_full": (
        2,
        0,
        {"tensor": 2, "checkpointing": "full"},
        {"micro_batch": 2, "global_batch": 4},
        {"family": "gpt"},
    ),
    "pp2_1f1b_tp2sp_full_last": (
        4,
        3,
        {"tensor": 2, "checkpointing": "full", "pipeline": 2, "schedule": "1f1b"},
        {"micro_batch": 2, "global_batch": 16},
        {},
    ),
    "zero3_tp2sp_dp2_full": (
        4,
        0,
        {"tensor": 2, "checkpointing": "full", "zero": 3},
        {"micro_batch": 2, "global_batch": 16},
        {},
    ),
}


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_backward_peak_is_the_dry_runs(case: str) -> None:
    """The rings' backward moment (`ring_memory.ring_exit_backward_bytes`, `ring_entry_backward_bytes`: chunks in
    flight, weight casts, per-lane weight-gradient sums) against the dry run's peak, with none, selective and full
    recomputation, one and two sequences, tensor 2 and 4, a pipeline's last stage and ZeRO-3."""
    world, rank, parallel, train, model = RING_CASES[case]
    raw = {
        "model": {**RING_MODEL, **model},
        "parallel": {"sequence_parallel": True, "tp_comm_overlap": True, **parallel},
        "train": {"dtype": "bf16", **train},
    }
    cfg = from_dict(raw)
    measured, est = _dry_run(raw, world, rank), estimated_memory(cfg, world, rank)
    assert est["peak"] == pytest.approx(measured.peak, rel=RING_PEAK_RTOL)


def test_dry_run_runs_the_rings_on_cuda_lanes() -> None:
    """A CUDA run keeps a weight-gradient partial sum per lane (three for tensor 4); a plain CPU process runs one
    lane. The dry run stands for the CUDA run: its peak is the lanes' (measured: +4.0 % over one lane here), and
    the estimate follows the lanes."""
    from tessera.dryrun import measure_step
    from tessera.fake import FakeRank, fake_process_group

    world, rank, parallel, train, model = RING_CASES["tp4sp_b1_full"]
    raw = {
        "model": {**RING_MODEL, **model},
        "parallel": {"sequence_parallel": True, "tp_comm_overlap": True, **parallel},
        "train": {"dtype": "bf16", **train},
    }
    cfg = from_dict(raw)
    with fake_process_group(rank, world), FakeRank() as tracker:
        one_lane = measure_step(cfg, world, rank, tracker, values=False)
    lanes = _dry_run(raw, world, rank)
    assert lanes.peak > (1 + RING_PEAK_RTOL) * one_lane.peak
    assert estimated_memory(cfg, world, rank)["peak"] == pytest.approx(lanes.peak, rel=RING_PEAK_RTOL)


LAST_STAGE_RTOL = 0.025
"""The last pipeline stage under full recomputation, ZeRO-3, 1D + sequence parallelism and bf16 (the shape of the
megatron-1t plan's binding rank, d48 p8 t8+SP breadth-first v16 b2 m32, at world 3072: 2.0 % under its dry run
before 2026-12-03), against the dry run's peak. Measured: -0.2 % to +0.2 %. Without the input Linears' weight
gradients in the sequence-parallel entry's backward (`_entry_buffer_bytes`): -4.3 % to -6.6 %; without the
cache's copies of every block of a ZeRO-3 stage (`zero3_block_copies_bytes`): -5.3 % to -5.5 % where a stage
holds two blocks; without the head's copy in the cache until the last stage's FREE (`zero3_cached_head_bytes`):
-5.1 % to -6.5 % with a 16384-token vocabulary (docs/memory.md, "Full recomputation's moments")."""

LAST_STAGE_MODEL = {
    "family": "gpt",
    "n_layers": 4,
    "d_model": 768,
    "n_heads": 12,
    "vocab_size": 1024,
    "seq_len": 64,
}
"""GPT (GELU MLP, f = 4h) with the 1T plan's proportions where they matter: the MLP's input weight [f/t, h] is
several times the rank's [N, h] tokens (1T: f/t 12800, N 4096; here f/t 1536, N 128 at b 2), so its gradient, not
the gathered input, fills the entry's backward."""
LAST_STAGE_CASES = {  # name: (tensor degree, micro-batch, parallel overrides, model overrides)
    # two blocks per stage: the cache holds both blocks' copies until the stage's FREE
    "pp2_1f1b_tp2sp_b2": (2, 2, {}, {}),
    "pp2_1f1b_tp2sp_b1": (2, 1, {}, {}),
    "pp2_1f1b_tp4sp_b2": (4, 2, {}, {}),
    # one block per stage and the last stage's forward and backward in one GATHER window, as on the 1T rank
    "pp2_breadth_first_v2_tp2sp_b2": (2, 2, {"schedule": "breadth_first", "stages_per_rank": 2}, {}),
    # a wide vocabulary: the head's cached copy is 6 % of the peak
    "pp2_1f1b_tp2sp_b2_wide_vocab": (2, 2, {}, {"vocab_size": 16384}),
    "pp2_breadth_first_v2_tp2sp_b2_wide_vocab": (
        2,
        2,
        {"schedule": "breadth_first", "stages_per_rank": 2},
        {"vocab_size": 16384},
    ),
}


@pytest.mark.parametrize("case", list(LAST_STAGE_CASES))
def test_last_stage_under_zero3_and_full_recomputation(case: str) -> None:
    """pp2 × tensor t + SP × data 2, ZeRO-3, full recomputation, bf16, 4 micro-batches per rank: the last pipeline
    rank's estimated peak against its dry run's."""
    tp, micro_batch, parallel, model = LAST_STAGE_CASES[case]
    world = 2 * tp * 2
    raw = {
        "model": {**LAST_STAGE_MODEL, **model},
        "parallel": {
            "pipeline": 2,
            "schedule": "1f1b",
            "tensor": tp,
            "sequence_parallel": True,
            "data": 2,
            "zero": 3,
            "checkpointing": "full",
            **parallel,
        },
        "train": {"micro_batch": micro_batch, "global_batch": 8 * micro_batch, "dtype": "bf16"},
    }
    cfg = from_dict(raw)
    layout = Layout.from_config(cfg.parallel, world)
    rank = default_ranks(layout)[-1]
    assert layout.coords(rank)[Axis.PIPE] == 1  # the last pipeline rank, which holds the head
    measured, est = _dry_run(raw, world, rank), estimated_memory(cfg, world, rank)
    assert est["peak"] == pytest.approx(measured.peak, rel=LAST_STAGE_RTOL)


FIRST_BACKWARD_CASES = {  # name: (model overrides, parallel overrides)
    # one micro-batch per data rank: every backward is its stage's first (-3.8 % before)
    "zero3_dp2_tp2sp_one_micro_batch": ({}, {}),
    # Llama with a tied table: the head's backward makes the table's gradient before the replay
    "zero3_dp2_tp2sp_one_micro_batch_tied_llama": (
        {"family": "llama", "n_kv_heads": 4, "tie_embeddings": True},
        {},
    ),
    "pp2_breadth_first_v2_zero3_dp2_tp2sp_one_micro_batch": (
        {},
        {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2},
    ),
}


@pytest.mark.parametrize("case", list(FIRST_BACKWARD_CASES))
def test_a_first_backward_holds_the_gradients_it_has_made(case: str) -> None:
    """ZeRO-3, data 2, tensor 2 + SP, full recomputation, bf16, one micro-batch of 4 per rank: each backward is
    its stage's first (ZeRO-3 drops the gradients at every reduction), whose replay's moment holds the weight
    gradients that backward made before it (the MLP output Linear's; on the last stage the head's), which the walk
    counts among the stage's gradients only after the backward (`memory._first_backward`, `StageBytes.first`).
    Measured: -1.2 % to +0.2 %; without them -1.9 % to -3.8 % (docs/memory.md, "Full recomputation's
    moments"); the 1T planner winner's one rank -8.2 %, now -2.2 %."""
    model, parallel = FIRST_BACKWARD_CASES[case]
    world = 4 * parallel.get("pipeline", 1)
    raw = {
        "model": {**LAST_STAGE_MODEL, **model},
        "parallel": {
            "data": 2,
            "tensor": 2,
            "sequence_parallel": True,
            "zero": 3,
            "checkpointing": "full",
            **parallel,
        },
        "train": {"micro_batch": 4, "global_batch": 8, "dtype": "bf16"},
    }
    cfg = from_dict(raw)
    rank = default_ranks(Layout.from_config(cfg.parallel, world))[-1]
    measured, est = _dry_run(raw, world, rank), estimated_memory(cfg, world, rank)
    assert est["peak"] == pytest.approx(measured.peak, rel=LAST_STAGE_RTOL)


ATTENTION_RTOL = 0.025
"""The attention's entry backward (`rank_memory.attention_entry_bytes`: wq, wk and wv's sequence-parallel entry,
plain or the ring, with dQ, dK, dV and their weight gradients) against the dry run's peak, where it binds: an MLP
no wider than the model (f = h, GQA's f = h/2) or a stage's first backward, whose attention entry holds every
other weight gradient of the block (megatron-1t's winner). Measured (2026-12-03): -0.3 % to +0.2 %; without the
attention's moment -2.9 % to -16.8 % (docs/memory.md, "The attention's entry backward")."""

ATTENTION_GPT = {
    "family": "gpt",
    "n_layers": 2,
    "d_model": 2048,
    "n_heads": 16,
    "ffn_hidden": 2048,
    "vocab_size": 1024,
    "seq_len": 64,
}
"""GPT with f = h: the attention's three [h/t, h] weight gradients outweigh the MLP's one, and h is 16 times the
128 tokens of a micro-batch of 2, so weight gradients, not tokens, fill the entries' backward."""
ATTENTION_CASES = {  # name: (world size, parallel section, train section, model overrides)
    # the plain entry under no recomputation: a moment beyond the saved tensors (before: none counted)
    "tp2sp_b2_none": (2, {"tensor": 2}, {"micro_batch": 2, "global_batch": 4}, {}),
    "tp2sp_b2_selective_overlap": (
        2,
        {"tensor": 2, "checkpointing": "selective", "tp_comm_overlap": True},
        {"micro_batch": 2, "global_batch": 4},
        {},
    ),
    "tp2sp_b2_full": (2, {"tensor": 2, "checkpointing": "full"}, {"micro_batch": 2, "global_batch": 4}, {}),
    # four chunks on three lanes, one sequence
    "tp4sp_b1_full_overlap": (
        4,
        {"tensor": 4, "checkpointing": "full", "tp_comm_overlap": True},
        {"micro_batch": 1, "global_batch": 2},
        {},
    ),
    "pp2_1f1b_tp2sp_full_last": (
        4,
        {"tensor": 2, "pipeline": 2, "schedule": "1f1b", "checkpointing": "full"},
        {"micro_batch": 2, "global_batch": 8},
        {},
    ),
    "pp2_1f1b_tp2sp_full_overlap_last": (
        4,
        {"tensor": 2, "pipeline": 2, "schedule": "1f1b", "checkpointing": "full", "tp_comm_overlap": True},
        {"micro_batch": 2, "global_batch": 8},
        {},
    ),
    # GQA (4 of 16 heads for K and V): the entry's three Linears of unequal widths, an MLP of f = h/2
    "llama_gqa_tp2sp_b2_full_overlap": (
        2,
        {"tensor": 2, "checkpointing": "full", "tp_comm_overlap": True},
        {"micro_batch": 2, "global_batch": 4},
        {"family": "llama", "n_kv_heads": 4, "ffn_hidden": 1024, "tie_embeddings": False},
    ),
    # megatron-1t's winner in small: ZeRO-3, one micro-batch per data rank, f = 4h, every backward a first one
    "zero3_dp2_tp2sp_b2_first_backward": (
        4,
        {"data": 2, "tensor": 2, "zero": 3, "checkpointing": "full"},
        {"micro_batch": 2, "global_batch": 4},
        {"d_model": 4096, "n_heads": 32, "ffn_hidden": None, "seq_len": 32},
    ),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_entry_backward_is_in_the_estimate(case: str) -> None:
    """Tensor 2 or 4 + SP, bf16: the last pipeline rank's estimated peak against its dry run's where the
    attention's entry backward binds, plain and with `parallel.tp_comm_overlap`'s rings, under no, selective and
    full recomputation, a pipeline's last stage and ZeRO-3's first backward."""
    world, parallel, train, model = ATTENTION_CASES[case]
    raw = {
        "model": {k: v for k, v in {**ATTENTION_GPT, **model}.items() if v is not None},
        "parallel": {"sequence_parallel": True, **parallel},
        "train": {"dtype": "bf16", **train},
    }
    cfg = from_dict(raw)
    rank = default_ranks(Layout.from_config(cfg.parallel, world))[-1]
    measured, est = _dry_run(raw, world, rank), estimated_memory(cfg, world, rank)
    assert est["peak"] == pytest.approx(measured.peak, rel=ATTENTION_RTOL)


SKIPPED_COPY_GPT = {
    "family": "gpt",
    "n_layers": 2,
    "d_model": 4096,
    "n_heads": 32,
    "ffn_hidden": 32768,
    "vocab_size": 1024,
    "seq_len": 32,
}
"""GPT with f = 8h: the MLP output Linear's bf16 copy ([h, f/t], 128 MiB at tensor 2) is 2.6 % of a rank's peak,
more than the tolerance, so counting it where no replay makes it fails."""
SKIPPED_COPY_CASES = {  # name: (world size, parallel overrides, train section, model overrides)
    # one micro-batch per data rank: stage 0's backward (ZeRO-3's stage of one block) binds, its forward freed
    "zero3_dp2_tp2sp_b2": (4, {}, {"micro_batch": 2, "global_batch": 4}, {}),
    # a pipeline: both ranks' peaks on a stage that is not the model's last (rank 1's stage 1 of 0..3)
    "pp2_breadth_first_v2_zero3_dp2_tp2sp_b2": (
        8,
        {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2},
        {"micro_batch": 2, "global_batch": 4},
        {"n_layers": 4},
    ),
    # 1F1B's steady (F, B) pairs run in one GATHER/FREE window: the first rank's stage of two blocks holds the
    # copies its forward cast, the exit's included (`memory._forward_in_window`; f = 4h)
    "pp2_1f1b_zero3_dp2_tp2sp_b2_m4": (
        8,
        {"pipeline": 2, "schedule": "1f1b"},
        {"micro_batch": 2, "global_batch": 8},
        {"n_layers": 4, "ffn_hidden": 16384},
    ),
}


@pytest.mark.parametrize("case", list(SKIPPED_COPY_CASES))
def test_a_replay_does_not_cast_the_ring_exits_weight(case: str) -> None:
    """ZeRO-3, full recomputation, tensor 2 + SP with `parallel.tp_comm_overlap`'s rings, bf16: a block's replay
    stops before its MLP exit ring casts its weight (`checkpointing.save_early`), so a stage holds that copy only
    where its forward ran in the backward's GATHER/FREE window (`rank_memory.replay_skipped_copy_bytes`). Each of
    the first and last pipeline ranks against its dry run at `RING_PEAK_RTOL`. Measured: -0.01 % to +0.09 %;
    with the copy counted in every replay +2.69 % to +2.89 % (the first two), counted on the last stage only
    -3.57 % (1F1B's first rank)."""
    world, parallel, train, model = SKIPPED_COPY_CASES[case]
    raw = {
        "model": {**SKIPPED_COPY_GPT, **model},
        "parallel": {
            "data": 2,
            "tensor": 2,
            "sequence_parallel": True,
            "tp_comm_overlap": True,
            "zero": 3,
            "checkpointing": "full",
            **parallel,
        },
        "train": {"dtype": "bf16", **train},
    }
    _assert_peaks_match(raw, world, RING_PEAK_RTOL)


SELECTIVE_RTOL = 0.025
"""Selective recomputation's peak against the dry run's. Measured (2026-12-03): -1.3 % to +1.3 %; with a replayed
core's working memory the block's whole "none" count (its kept tensors counted twice) +2.7 % to +9.8 %, every
case below outside this tolerance (docs/memory.md, "Selective recomputation's replayed core")."""
SELECTIVE_CASES = {  # name: (world size, parallel section, train section, model overrides)
    "tp2sp_b2": (2, {"tensor": 2, "sequence_parallel": True}, {"global_batch": 4}, {}),
    "tp2sp_b2_overlap": (
        2,
        {"tensor": 2, "sequence_parallel": True, "tp_comm_overlap": True},
        {"global_batch": 4},
        {},
    ),
    # GQA: K and V expanded to the query heads, which the replay makes again
    "gqa_tp2sp_b2": (2, {"tensor": 2, "sequence_parallel": True}, {"global_batch": 4}, {"n_kv_heads": 2}),
    "tp2_b2": (2, {"tensor": 2}, {"global_batch": 4}, {}),
    "one_rank_b2": (1, {}, {"global_batch": 4}, {}),
    "pp2_1f1b_tp2sp_b2": (
        4,
        {"pipeline": 2, "schedule": "1f1b", "tensor": 2, "sequence_parallel": True},
        {"global_batch": 8},
        {},
    ),
}


@pytest.mark.parametrize("case", list(SELECTIVE_CASES))
def test_selective_replay_is_not_counted_twice(case: str) -> None:
    """Llama, 4 layers, h 256, s 256, bf16, micro-batches of 2, `parallel.checkpointing = "selective"`: a
    replayed core makes again only what the selective count does not keep (`recompute_working_bytes`), the
    first and last pipeline ranks against their dry run."""
    world, parallel, train, model = SELECTIVE_CASES[case]
    raw = {
        "model": {**RING_MODEL, **model},
        "parallel": {"checkpointing": "selective", **parallel},
        "train": {"dtype": "bf16", "micro_batch": 2, **train},
    }
    _assert_peaks_match(raw, world, SELECTIVE_RTOL)


STAGE_BLOCKS_GPT = {**SKIPPED_COPY_GPT, "n_layers": 4, "ffn_hidden": 16384}
"""GPT h 4096, f = 4h, s 32: two blocks per stage on a pp2 rank, whose weight gradients (fp32, 0.75 GiB a block at
tensor 2) are a quarter of the rank's peak and its tokens few."""
STAGE_BLOCKS_CASES = {  # name: (global batch, parallel overrides, model overrides)
    # one micro-batch per pipeline rank: its one backward is the stage's first, at its first block's replay every
    # later block's weight gradients whole (-12.3 % / -11.5 % before)
    "pp2_1f1b_m1": (4, {}, {}),
    "pp2_1f1b_m1_overlap": (4, {"tp_comm_overlap": True}, {}),
    # two: the second backward, with the stage's whole gradients, binds (+0.0 % before and after)
    "pp2_1f1b_m2": (8, {}, {}),
    "pp2_1f1b_m2_overlap": (8, {"tp_comm_overlap": True}, {}),
    # two stages of two blocks on each rank (-7.1 % on the first rank before)
    "pp2_breadth_first_v2_m1": (4, {"schedule": "breadth_first", "stages_per_rank": 2}, {"n_layers": 8}),
    # a gated MLP and a table tied across the two ranks (-11.1 % before)
    "pp2_1f1b_m1_overlap_llama_tied": (
        4,
        {"tp_comm_overlap": True},
        {"family": "llama", "n_kv_heads": 8, "ffn_hidden": 8192, "tie_embeddings": True},
    ),
}


def _gpt_pp2_dp2_tp2_sp(
    zero: int, checkpointing: str, global_batch: int, *, model: dict | None = None, **parallel: object
) -> dict:
    """The raw config the stage-blocks, reduction and window-copy cases share: `STAGE_BLOCKS_GPT` (with ``model``'s
    overrides), pp2 (1F1B) × data 2 × tensor 2 + SP with ZeRO ``zero`` (and ``parallel``'s extra keys), bf16,
    micro-batches of 2."""
    return {
        "model": {**STAGE_BLOCKS_GPT, **(model or {})},
        "parallel": {
            "pipeline": 2,
            "schedule": "1f1b",
            "data": 2,
            "tensor": 2,
            "sequence_parallel": True,
            "zero": zero,
            **parallel,
            "checkpointing": checkpointing,
        },
        "train": {"dtype": "bf16", "micro_batch": 2, "global_batch": global_batch},
    }


@pytest.mark.parametrize("case", list(STAGE_BLOCKS_CASES))
def test_a_first_backward_holds_its_later_blocks_gradients(case: str) -> None:
    """pp2 × data 2 × tensor 2 + SP, ZeRO-3, full recomputation, bf16, micro-batches of 2: a stage's backward
    replays its blocks last to first, so at its first block's replay (the moment the walk prices: every block's
    weight copies cached) the later blocks' fp32 weight gradients are whole, which a stage's first backward
    holds beyond its first block's own (`memory._first_backward`). Both pipeline ranks against their dry run at
    `LAST_STAGE_RTOL`. Measured: -0.0 % to +0.1 %; without the later blocks' gradients the m = 1 cases -7.1 % to
    -12.3 %; with two blocks too many every case, the m = 2 ones too (docs/memory.md, "A stage of several
    blocks")."""
    global_batch, parallel, model = STAGE_BLOCKS_CASES[case]
    raw = _gpt_pp2_dp2_tp2_sp(3, "full", global_batch, model=model, **parallel)
    _assert_peaks_match(raw, 8, LAST_STAGE_RTOL)


GRID_RTOL = 0.025
"""The 2D grid's peak against the dry run's on the layered schedule runtime (one block per stage), where the
loss's backward binds with every micro-batch's kept tensors (bf16; fp32's binds in a block's SUMMA backward,
`exit_backward_2d_bytes`). Measured (2026-12-03): -0.6 % to +0.6 % (fp32 -1.5 % / -1.7 % before the exit's
SUMMA backward was counted without full recomputation); without the stage boundaries the runtime keeps and no 2D norm saves
(`memory._kept_boundaries`) -3.3 % to -4.6 % under no and selective recomputation, and with them counted under
full recomputation too +5.1 % / +5.3 % (docs/memory.md, "The 2D grid's stage boundaries")."""
GRID_CASES = {  # name: (parallel overrides, train section, model overrides)
    "none_b2_bf16": ({}, {"micro_batch": 2, "global_batch": 4}, {}),
    "none_b4_bf16": ({}, {"micro_batch": 4, "global_batch": 8}, {}),
    "none_b2_fp32_m4": ({}, {"micro_batch": 2, "global_batch": 8, "dtype": "fp32"}, {}),
    "none_b2_bf16_tied": ({}, {"micro_batch": 2, "global_batch": 4}, {"tie_embeddings": True}),
    "selective_b2_bf16": ({"checkpointing": "selective"}, {"micro_batch": 2, "global_batch": 4}, {}),
    "selective_b4_fp32": (
        {"checkpointing": "selective"},
        {"micro_batch": 4, "global_batch": 8, "dtype": "fp32"},
        {},
    ),
    "selective_b2_bf16_tied": (
        {"checkpointing": "selective"},
        {"micro_batch": 2, "global_batch": 4},
        {"tie_embeddings": True},
    ),
    # full recomputation: the replayed block's checkpoint saves the boundary itself, counted once already (four
    # micro-batches: with two, counting it again moves the peak only +0.9 %)
    "full_b2_bf16_m4": ({"checkpointing": "full"}, {"micro_batch": 2, "global_batch": 8}, {}),
    "full_b4_fp32": ({"checkpointing": "full"}, {"micro_batch": 4, "global_batch": 8, "dtype": "fp32"}, {}),
}


@pytest.mark.parametrize("case", list(GRID_CASES))
def test_2d_grid_stage_boundaries_are_in_the_estimate(case: str) -> None:
    """Llama, 4 layers, h 256, s 256, tensor 2×2, two or four micro-batches on one pipeline rank (the schedule
    runtime's layered accumulation, a stage per block): ranks 0 and 3 of the grid against their dry run."""
    parallel, train, model = GRID_CASES[case]
    raw = {
        "model": {**RING_MODEL, **model},
        "parallel": {"tensor": "2x2", **parallel},
        "train": {"dtype": "bf16", **train},
    }
    cfg = from_dict(raw)
    for rank in (0, 3):
        measured, est = _dry_run(raw, 4, rank), estimated_memory(cfg, 4, rank)
        assert est["peak"] == pytest.approx(measured.peak, rel=GRID_RTOL), rank


REDUCTION_RTOL = 0.025
"""ZeRO-1/2's peak at a stage's gradient reduction against the dry run's. Measured (2026-12-03): +0.02 % (ZeRO-1),
+0.03 % (ZeRO-2); without the reduce-scatter's output shard at its launch ZeRO-1 fell -9.9 % / -10.0 % (ranks 0 /
2), every ZeRO-1 case below outside this tolerance (docs/memory.md, "The reduction's output shard")."""
REDUCTION_CASES = {  # name: (ZeRO stage, global batch, checkpointing)
    f"zero{zero}_m{gb // 4}_{ckpt}": (zero, gb, ckpt)
    for zero in (1, 2)
    for gb in (4, 8)
    for ckpt in ("full", "none")
}


@pytest.mark.parametrize("case", list(REDUCTION_CASES))
def test_the_reduce_scatters_output_is_alive_at_its_launch(case: str) -> None:
    """GPT h 4096, f 4h, 4 layers, s 32, pp2 (1F1B) × data 2 × tensor 2 + SP, bf16, micro-batches of 2, m 1 or
    2: `FlatStage.launch_reduce` allocates the reduce-scatter's output (the stage's fp32 shard once waited)
    after the flat gradient copy; ZeRO-1 keeps the full gradients, and autocast's cached weight copies are still
    alive, so that moment, not the optimizer step's, is the rank's peak (`peak_memory._Live.reduce`). ZeRO-2
    drops the gradients before the output exists: its peak stays the optimizer step's. Both pipeline ranks
    against their dry run at `REDUCTION_RTOL`."""
    zero, global_batch, ckpt = REDUCTION_CASES[case]
    _assert_peaks_match(_gpt_pp2_dp2_tp2_sp(zero, ckpt, global_batch), 8, REDUCTION_RTOL)


OP_CASES = {  # name: (world size, parallel section, train section, model section, document masking)
    "one_rank_layered": (1, {}, {}, {}, False),
    "one_rank_depth_first_bf16": (1, {"accumulation": "depth_first"}, {"dtype": "bf16"}, {}, False),
    "gpt_tp2": (2, {"tensor": 2}, {}, {"family": "gpt", "n_kv_heads": None}, False),
    "tp2sp_documents": (2, {"tensor": 2, "sequence_parallel": True}, {}, {}, True),
    "cp2": (2, {"context": 2}, {}, {}, False),
    "pp2_1f1b_tp2_dp2_zero1": (8, {"pipeline": 2, "schedule": "1f1b", "tensor": 2, "zero": 1}, {}, {}, False),
    "pp2_breadth_first_v2_dp2_zero3": (
        4,
        {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2, "zero": 3},
        {},
        {},
        False,
    ),
    "pp2_1f1b_tp2sp_bf16": (
        4,
        {"pipeline": 2, "schedule": "1f1b", "tensor": 2, "sequence_parallel": True},
        {"dtype": "bf16"},
        {},
        False,
    ),
}


@pytest.mark.parametrize("case", list(OP_CASES))
def test_op_checkpointing_peak_is_the_dry_runs(case: str) -> None:
    """Op checkpointing (docs/memory.md, "Op-level selective checkpointing"): each block keeps its input and the
    outputs `op_kept_bytes` counts, and its replay makes the rest again as full recomputation's does
    (`recompute_working_bytes`, the weight copies and masks as under full). Against the dry run's peak, first and
    last pipeline rank, `PEAK_RTOL`; measured -0.4 % to +3.5 % (the breadth-first ZeRO-3 rank 1 highest). Priced as
    no recomputation, as before 2026-12-03, the one-rank layered case was +54.7 %. The dry run's activation row
    counts what autograd saves, and op mode keeps its outputs outside autograd (`checkpointing.op_contexts`), so
    only the peak is compared."""
    world, parallel, train, model, documents = OP_CASES[case]
    raw = {
        "model": {k: v for k, v in {**MODEL, **model}.items() if v is not None},
        "parallel": {**parallel, "checkpointing": "op"},
        "train": {"global_batch": 16, "micro_batch": 2, **train},
        "data": {"document_mask": documents},
    }
    _assert_peaks_match(raw, world, PEAK_RTOL)


LATER_REDUCTION_RTOL = 0.025
"""ZeRO-2/3 reducing every micro-batch (depth-first accumulation) against the dry run: each stage's second and later
reductions. Measured (2026-12-03): -0.5 % to +0.02 %; before, the walk kept the previous flat copy alive through
the next flattening (`ZeroStageComm._launch` waits for it first) and left a later reduction's own output out:
+8.6 % to +8.8 % (fp32 reduce), -4.7 % (bf16 reduce: the output and its fp32 cast at the wait) (docs/memory.md,
"The reduction's output shard")."""
LATER_REDUCTION_CASES = {  # name: (ZeRO stage, checkpointing, train overrides)
    "zero2_none": (2, "none", {}),
    "zero2_full": (2, "full", {}),
    "zero2_none_bf16_reduce": (2, "none", {"grad_reduce_dtype": "bf16"}),
    "zero3_full": (3, "full", {}),
}


@pytest.mark.parametrize("case", list(LATER_REDUCTION_CASES))
def test_a_later_reductions_output_is_in_flight(case: str) -> None:
    """GPT h 4096, f 4h, 4 layers, untied, s 32, pp2 (1F1B) × data 2 × tensor 2 + SP, bf16, 4 micro-batches of 2,
    depth-first (a REDUCE_MB after every backward): `ZeroStageComm._launch` waits for the reduction in flight
    (freeing its flat copy and output) before `FlatStage.launch_reduce` flattens the next; a stage's later
    reduction allocates a new output ([Ψ/d], reduce dtype) beside the flat copy, in flight until the next launch
    adds it (cast to fp32) into the shard. Both pipeline ranks against their dry run."""
    zero, ckpt, train = LATER_REDUCTION_CASES[case]
    raw = _gpt_pp2_dp2_tp2_sp(zero, ckpt, 16, model={"tie_embeddings": False}, accumulation="depth_first")
    raw["train"].update(train)
    _assert_peaks_match(raw, 8, LATER_REDUCTION_RTOL)


WINDOW_COPIES_RTOL = 0.025
"""ZeRO-3 without full recomputation under 1D + SP and bf16 against the dry run. Measured (2026-12-03): -0.6 % to
+0.05 %; without the column-parallel Linears' cache-only copies beside the gathered stage
(`zero3_window_copies_bytes`) -6.7 % to -7.8 % (and +3.1 % / +3.3 % at m 4 before the later reductions were
walked as the runtime runs them)."""
WINDOW_COPIES_CASES = {  # name: (global batch, checkpointing, tied, accumulation)
    "untied_m1_none": (4, "none", False, "depth_first"),
    "untied_m4_none": (16, "none", False, "depth_first"),
    "untied_m4_selective": (16, "selective", False, "depth_first"),
    "tied_m2_none_layered": (8, "none", True, "layered"),
}


@pytest.mark.parametrize("case", list(WINDOW_COPIES_CASES))
def test_zero3_keeps_a_windows_cast_copies(case: str) -> None:
    """GPT h 4096, f 4h, 4 layers, s 32, pp2 (1F1B) × data 2 × tensor 2 + SP, ZeRO-3, bf16, micro-batches of 2:
    the sequence-parallel entry casts wq, wk, wv and the MLP's input Linear through autocast's cache and saves
    the fp32 weights; the cache keeps the copies until the stage's FREE, so a backward in the GATHER/FREE window
    of its stage's forward (1F1B) holds every block's, during and after it. Both pipeline ranks."""
    global_batch, ckpt, tied, accumulation = WINDOW_COPIES_CASES[case]
    raw = _gpt_pp2_dp2_tp2_sp(
        3, ckpt, global_batch, model={"tie_embeddings": tied}, accumulation=accumulation
    )
    _assert_peaks_match(raw, 8, WINDOW_COPIES_RTOL)


WINDOW_STAGE_GPT = {
    "family": "gpt",
    "n_layers": 6,
    "d_model": 2048,
    "n_heads": 16,
    "ffn_hidden": 8192,
    "vocab_size": 1024,
    "seq_len": 256,
    "tie_embeddings": False,
}
"""GPT h 2048, f 4h, s 256: one block per stage, breadth-first v3 on pp2 (rank 0 runs stages 0, 2, 4), and 8
micro-batches of 2 so that the activations bind at stage 4's backward, the rank's first, while the cast copies of
stage 4's forward (wq, wk, wv, the MLP input: 28 MiB in bf16 at tensor 2) are 2.8 % of its peak."""
WINDOW_STAGE_CASES = {  # name: checkpointing; measured (2026-12-03), rank 0 / rank 2, against WINDOW_COPIES_RTOL
    # -0.25 % / +0.14 %; before, stage 4 priced as stage 2 (the rank's other middle stage, no copies): -3.00 % / +0.14 %
    "none": "none",
    "selective": "selective",  # -0.22 % / +0.17 %; before -2.97 % / +0.17 %
}


@pytest.mark.parametrize("case", list(WINDOW_STAGE_CASES))
def test_a_window_stage_is_not_priced_as_the_ranks_other_stages(case: str) -> None:
    """pp2 breadth-first v3 × data 4 × tensor 2 + SP, ZeRO-3, bf16, layered: rank 0's last stage (4) runs its
    forwards and backwards in one GATHER/FREE window, so at its backwards autocast's cache still holds the copies
    its forward cast (`zero3_window_copies_bytes`); the walk prices stages of equal sizes once
    (`memory._stage_classes`), and stage 4 must not share stage 2's sizes, whose forward's copies were freed.
    megatron-1t's planned layout on 65,536 GPUs (breadth-first v8) was 1.8 % under its dry run on rank 0 this
    way. Both pipeline ranks."""
    raw = {
        "model": WINDOW_STAGE_GPT,
        "parallel": {
            "pipeline": 2,
            "schedule": "breadth_first",
            "stages_per_rank": 3,
            "data": 4,
            "tensor": 2,
            "sequence_parallel": True,
            "zero": 3,
            "checkpointing": WINDOW_STAGE_CASES[case],
        },
        "train": {"dtype": "bf16", "micro_batch": 2, "global_batch": 64},
    }
    _assert_peaks_match(raw, 16, WINDOW_COPIES_RTOL)


EXIT_2D_RTOL = 0.025
"""The 2D grid's MLP exit SUMMA backward without recomputation against the dry run. Measured (2026-12-03): -1.0 %
to -0.1 %; before it was counted (under full recomputation only) -8.2 % (pipeline rank 0), -4.7 % (rank 7),
-2.7 % (direct loop); priced beside the micro-batch's head tensors, which the loss's backward has freed, +2.3 %
(direct loop) / +2.7 % (rank 7) (docs/memory.md, "The 2D grid's stage boundaries")."""
EXIT_2D_CASES = {  # name: (world size, ranks, parallel overrides, train section)
    "direct_b4_fp32": (4, (0, 3), {}, {"micro_batch": 4, "global_batch": 4}),
    "pp2_1f1b_b2_fp32": (
        8,
        (0, 7),
        {"pipeline": 2, "schedule": "1f1b"},
        {"micro_batch": 2, "global_batch": 8},
    ),
}


@pytest.mark.parametrize("case", list(EXIT_2D_CASES))
def test_2d_exit_backward_is_in_the_estimate(case: str) -> None:
    """Llama, 4 layers, h 256, s 256, tensor 2×2, fp32, no recomputation: the peak is a block's MLP output
    Linear's SUMMA backward (`tensor_2d._MatmulAB`: dA, the product's two broadcast slots, the q partial weight
    gradients, the upstream gradient) beside every saved tensor but the micro-batch's head's."""
    world, ranks, parallel, train = EXIT_2D_CASES[case]
    raw = {
        "model": RING_MODEL,
        "parallel": {"tensor": "2x2", **parallel},
        "train": {"dtype": "fp32", **train},
    }
    cfg = from_dict(raw)
    for rank in ranks:
        measured, est = _dry_run(raw, world, rank), estimated_memory(cfg, world, rank)
        assert est["peak"] == pytest.approx(measured.peak, rel=EXIT_2D_RTOL), rank


DRYRUN_LAYOUT_RTOL = 0.025
"""tests/distributed/test_dryrun.py's layout (llama-tiny, dp2 × pp2 × tp2 + SP, ZeRO-1, 1F1B, 2 micro-batches of
2) against the dry run. Measured (2026-12-03): rank 0 -1.8 %, rank 7 +1.3 %; before, -3.7 % (rank 0: its first
backward's MLP output Linear's fp32 weight gradient, `first_backward_gradient_bytes`) and -2.6 % (rank 7: the
output layer's sequence-parallel entry backward, `head_transient_bytes`). What is left on rank 0 (5,792 bytes)
is the step's token batches, RoPE's tables, the embedding's saved ids and mask, the norms' 1/σ and SDPA's
log-sum-exp rows, which the estimate leaves out (docs/memory.md)."""


def test_the_dry_run_tests_layout_is_in_the_estimate() -> None:
    """The real-vs-dry-run layout of tests/distributed/test_dryrun.py, at its own tiny shapes: the first pipeline
    rank peaks in its first backward's MLP activation backward with the MLP output Linear's fp32 weight gradient
    made; the last in the output layer's sequence-parallel entry backward (the input gathered again, the input
    gradient, its reduce-scatter's copy and slice, the new weight gradient beside the accumulated one)."""
    from tests.distributed.test_dryrun import RAW, WORLD

    _assert_peaks_match(RAW, WORLD, DRYRUN_LAYOUT_RTOL)


HEAD_2D_RTOL = 0.025
"""The 2D grid's output-layer SUMMA backward and the received stage inputs against the dry run. Measured
(2026-12-03), MiB, rank 0 / rank 4: V 8192: 15.278 / 23.805 against 15.195 / 19.585 before (-0.5 % / -17.7 %),
15.195 / 23.835 now (-0.5 % / +0.1 %); V 512: 26.709 / 28.080 against 26.066 / 27.067 (-2.4 % / -3.6 %),
26.566 / 28.192 now (-0.5 % / +0.4 %). Since stage outputs are freed once sent (86cd2e2) and the dry run's
asynchronous reduces hold their partial products (fdf43f4): V 8192 15.184 / 23.680 against 15.195 / 23.709
(+0.1 % / +0.1 %), V 512 25.709 / 27.580 against 25.566 / 27.692 (-0.6 % / +0.4 %)."""
HEAD_2D_CASES = {  # name: (vocabulary, sequence)
    "vocab_8192_s64": (8192, 64),
    "vocab_512_s256": (512, 256),
}


@pytest.mark.parametrize("case", list(HEAD_2D_CASES))
def test_2d_head_summa_and_received_inputs_are_in_the_estimate(case: str) -> None:
    """Llama, 4 layers, h 256, 4 heads, tensor 2×2 × pipeline 2 breadth-first v2 × data 2, ZeRO-1, fp32, 4
    micro-batches of 2 (llama-70b 2D's layout in small, docs/dryrun.md): the last rank peaks in its first
    backward's output layer (`tensor_2d._MatmulABT`: the logits' gradient, dA, dC's two broadcast slots, the q
    partial weight gradients), beside each micro-batch's received stage inputs, which the 2D norm does not save
    and the engine keeps for the input gradient (`memory._kept_inputs`). Both pipeline ranks."""
    vocab, seq = HEAD_2D_CASES[case]
    model = {**RING_MODEL, "vocab_size": vocab, "seq_len": seq}
    parallel = {"tensor": "2x2", "pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2, "zero": 1}
    raw = {
        "model": model,
        "parallel": parallel,
        "train": {"micro_batch": 2, "global_batch": 16, "dtype": "fp32"},
    }
    _assert_peaks_match(raw, 16, HEAD_2D_RTOL)
