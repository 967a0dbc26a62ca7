"""The dry run's traffic formulas (tessera.dryrun.formula_traffic) against the dry run itself, in-process.

tests/distributed/test_dryrun.py shows the dry run reports what a real run does (1D with sequence parallelism);
here further layouts check the formulas against the dry run: every collective kind on the tensor and pipeline
axes and the step's scalars must match to the byte. Each layout runs its first and last pipeline rank under fake
tensors in a few seconds.
"""

from __future__ import annotations

import pytest

from tessera.config import from_dict
from tessera.dryrun import default_ranks, dry_run, formula_traffic, measured_by_axis
from tessera.layout import Layout

LAYOUTS = {
    # 2D 2x2 × pp2, tied embeddings (exchanged between the pipeline ends), two micro-batches
    "tp2x2_pp2": (8, {"tensor": "2x2", "pipeline": 2}, {"global_batch": 4, "micro_batch": 2}),
    # 2D 2x2, full checkpointing: each block's forward collectives replayed (norm statistics included)
    "tp2x2_full": (4, {"tensor": "2x2", "checkpointing": "full"}, {"global_batch": 4, "micro_batch": 2}),
    # 1D tp2 × pp2 × dp2, ZeRO-3, full checkpointing (replayed forward collectives)
    "tp2_pp2_dp2_z3_full": (
        8,
        {"tensor": 2, "pipeline": 2, "zero": 3, "checkpointing": "full"},
        {"global_batch": 4, "micro_batch": 1},
    ),
    # bf16 autocast: fp32 boundary tensors and 1D entries, bf16 exits; 1D SP × pp2 (tied ends)
    "tp2_sp_pp2_bf16": (
        4,
        {"tensor": 2, "sequence_parallel": True, "pipeline": 2},
        {"global_batch": 4, "micro_batch": 2, "dtype": "bf16"},
    ),
    # bf16 autocast: 1D without SP, full checkpointing (replayed exits in bf16), pp2
    "tp2_pp2_full_bf16": (
        4,
        {"tensor": 2, "pipeline": 2, "checkpointing": "full"},
        {"global_batch": 4, "micro_batch": 2, "dtype": "bf16"},
    ),
    # tied ends on two pipeline ranks, plain data parallelism, depth-first: every other stage would all-reduce
    # each micro-batch, these two reduce once, after the EXCHANGE of the table's gradient (send/recv on pipe)
    "pp2_dp2_depth_first_tied": (
        4,
        {"pipeline": 2, "accumulation": "depth_first"},
        {"global_batch": 16, "micro_batch": 2},
    ),
    # the same with interleaved stages: ranks 0 and 1 each hold one tied stage and one reduced per micro-batch
    "pp2_v2_dp2_depth_first_tied": (
        4,
        {"pipeline": 2, "schedule": "interleaved", "stages_per_rank": 2, "accumulation": "depth_first"},
        {"global_batch": 16, "micro_batch": 2},
    ),
    # bf16 autocast: bf16 SUMMA blocks, fp32 norm statistics, embedding, loss pairs and boundary tensors
    "tp2x2_pp2_bf16": (
        8,
        {"tensor": "2x2", "pipeline": 2},
        {"global_batch": 4, "micro_batch": 2, "dtype": "bf16"},
    ),
    # op checkpointing with context 2: SDPA's backward reads the gathered K/V, so the replay gathers them again
    "cp2_dp2_op": (4, {"context": 2, "checkpointing": "op"}, {"global_batch": 4, "micro_batch": 1}),
    # context 2 × tensor 2 (SP) × data 2, ZeRO-3, full checkpointing: K/V all-gathered per block (again in the
    # replayed forward) and dK/dV reduce-scattered on "context"; ZeRO over data × context ("data_context"); the
    # tensor collectives on the rank's s/c tokens
    "cp2_tp2_sp_dp2_z3_full": (
        8,
        {"context": 2, "tensor": 2, "sequence_parallel": True, "zero": 3, "checkpointing": "full"},
        {"global_batch": 4, "micro_batch": 1},
    ),
}

HYBRID = {
    # hybrid sharding: ZeRO's collectives on the shard group ("data_shard"), the gradient shards all-reduced over
    # the replica group ("data_replicate") once per step, the norm over the shard group, the loss over all data
    "dp4_shard2_z2_depth_first": (
        4,
        {"zero": 2, "zero_shard_size": 2, "accumulation": "depth_first"},
        {"global_batch": 8, "micro_batch": 1},
    ),
    "pp2_dp4_shard2_z3_tied": (
        8,
        {"pipeline": 2, "zero": 3, "zero_shard_size": 2},
        {"global_batch": 16, "micro_batch": 2},
    ),
    "tp2_dp4_shard2_z1": (
        8,
        {"tensor": 2, "zero": 1, "zero_shard_size": 2},
        {"global_batch": 8, "micro_batch": 1},
    ),
    # grad_reduce_dtype bf16: the replica all-reduce carries a bf16 copy of each shard (2 bytes an element)
    "dp4_shard2_z3_bf16_reduce": (
        4,
        {"zero": 3, "zero_shard_size": 2},
        {"global_batch": 8, "micro_batch": 1, "grad_reduce_dtype": "bf16"},
    ),
}

MODEL = {"pp2_v2_dp2_depth_first_tied": {"n_layers": 4}}  # llama-tiny's model section, changed

CHECKPOINTING = ("none", "selective", "full")
TENSOR_1D = {  # 1D tensor parallelism's three forms
    "tp2": {"tensor": 2},
    "tp2_sp": {"tensor": 2, "sequence_parallel": True},
    "tp2_sp_overlap": {"tensor": 2, "sequence_parallel": True, "tp_comm_overlap": True},
}
PLACES = {  # where the blocks run: (world size, parallel section besides the tensor form, model section)
    # one process per tensor rank, layered accumulation (the direct loop)
    "direct": (2, {}, {}),
    "dp2_depth_first": (4, {"data": 2, "accumulation": "depth_first"}, {}),
    # the megatron-1t plan's layout, small: breadth-first pipeline with stages per rank, ZeRO-3 over data
    "pp2_bf_v2_dp2_zero3": (
        8,
        {"data": 2, "pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2, "zero": 3},
        {"n_layers": 4},
    ),
    # Gemma 2's post-norms save each sublayer's output: full recomputation replays the MLP exit too
    "gemma2": (2, {}, {"size": "gemma2-tiny"}),
    "gemma3_pp2": (4, {"pipeline": 2}, {"size": "gemma3-tiny", "n_layers": 4}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_formulas_equal_the_dry_runs_bytes(name: str) -> None:
    world, parallel, train = LAYOUTS[name]
    raw = {"model": {"size": "llama-tiny", **MODEL.get(name, {})}, "parallel": parallel, "train": train}
    cfg = from_dict(raw)
    for rank in default_ranks(Layout.from_config(cfg.parallel, world)):
        measured = measured_by_axis(dry_run(cfg, world, rank))
        formula = formula_traffic(cfg, world, rank)
        exact = [key for key in measured if key[1] != "data" or key[0] == "all_reduce"]
        assert {k: formula.get(k) for k in exact} == {k: measured[k] for k in exact}, f"rank {rank}"


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("tensor", list(TENSOR_1D))
@pytest.mark.parametrize("place", list(PLACES))
def test_1d_tensor_traffic_equals_the_dry_run_over_the_toggles(
    place: str, tensor: str, checkpointing: str
) -> None:
    """Every 1D tensor-parallel collective a step issues, by kind, equals `traffic`'s formulas to the byte over
    checkpointing × {plain, SP, SP + tp_comm_overlap} × where the blocks run. Full recomputation replays a
    block's forward collectives but its MLP exit's (nothing saves that exit's output), unless a post-norm saves
    it (Gemma): with the overlap, the ring exit once saved x and its weight after its ring, so each replay
    reduce-scattered one [b, s, h] more than the formula (megatron-1t: 650.96 GB against 543.58 GB)."""
    _assert_1d_traffic(place, tensor, checkpointing)


@pytest.mark.parametrize("tensor", ["tp2", "tp2_sp"])  # op refuses tp_comm_overlap
@pytest.mark.parametrize(
    "place", [p for p in PLACES if p != "gemma3_pp2"]
)  # gemma2 has the post-norms (16 s)
def test_op_checkpointing_replays_the_collectives_full_does(place: str, tensor: str) -> None:
    """Op checkpointing's replay (wk, wo, w3, the norms) runs the same tensor collectives as full's: the entries'
    all-gathers (their Linears' saved inputs), the attention exit (wo's output is the residual's), not the MLP
    exit unless a post-norm saves its output (`modes.REPLAYS_FORWARD_COLLECTIVES`), to the byte."""
    _assert_1d_traffic(place, tensor, "op")


def _assert_1d_traffic(place: str, tensor: str, checkpointing: str) -> None:
    world, parallel, model = PLACES[place]
    raw = {
        "model": {"size": "llama-tiny", **model},
        "parallel": {**parallel, **TENSOR_1D[tensor], "checkpointing": checkpointing},
        "train": {"global_batch": 8, "micro_batch": 2},
    }
    cfg = from_dict(raw)
    for rank in default_ranks(Layout.from_config(cfg.parallel, world)):
        measured = measured_by_axis(dry_run(cfg, world, rank))
        formula = formula_traffic(cfg, world, rank)
        tensor_axis = {k for k in measured.keys() | formula.keys() if k[1] == "tensor"}
        sp = "sequence_parallel" in TENSOR_1D[tensor]
        assert (("reduce_scatter", "tensor") in measured) == sp, "the layout is not the one named"
        assert {k: formula.get(k) for k in tensor_axis} == {k: measured.get(k) for k in tensor_axis}, rank


PLACES_2D = {  # where 2D 2×2 blocks run: (world size, parallel section besides the grid, model section)
    "direct": (4, {}, {}),
    "pp2_bf16": (8, {"pipeline": 2}, {}),  # the train section's dtype is set below for this place
    "dp2_zero3": (8, {"data": 2, "zero": 3}, {}),
    # Gemma's post-norms save each sublayer's output: full recomputation replays the MLP exit's SUMMA too
    "gemma2": (4, {}, {"size": "gemma2-tiny"}),
    "gemma3_pp2": (8, {"pipeline": 2}, {"size": "gemma3-tiny", "n_layers": 4}),
}


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("place", list(PLACES_2D))
def test_2d_tensor_traffic_equals_the_dry_run_over_the_toggles(place: str, checkpointing: str) -> None:
    """Every 2D (2×2 SUMMA) collective a step issues, by kind, equals `traffic`'s formulas to the byte over
    checkpointing × where the blocks run. Full recomputation replays a block's forward collectives but the MLP
    output Linear's SUMMA broadcasts (`traffic.replayed_2d`), unless a post-norm saves its output (Gemma): the
    product once saved its operands after its broadcasts, so each replay broadcast the exit's blocks again."""
    world, parallel, model = PLACES_2D[place]
    train = {"global_batch": 8, "micro_batch": 2, **({"dtype": "bf16"} if "bf16" in place else {})}
    raw = {
        "model": {"size": "llama-tiny", **model},
        "parallel": {**parallel, "tensor": "2x2", "checkpointing": checkpointing},
        "train": train,
    }
    cfg = from_dict(raw)
    for rank in default_ranks(Layout.from_config(cfg.parallel, world)):
        measured = measured_by_axis(dry_run(cfg, world, rank))
        formula = formula_traffic(cfg, world, rank)
        tensor_axis = {k for k in measured.keys() | formula.keys() if k[1] == "tensor"}
        assert ("broadcast", "tensor") in measured, "the layout is not 2D"
        assert {k: formula.get(k) for k in tensor_axis} == {k: measured.get(k) for k in tensor_axis}, rank


@pytest.mark.parametrize("zero", [2, 3])
def test_bf16_gradient_reduction_halves_the_reduce_scatter_bytes(zero: int) -> None:
    """train.grad_reduce_dtype = "bf16": the dry run counts 2-byte reduce-scatters and the formula
    (`Plan.grad_reduce_width`) agrees, to the byte; the parameters' all-gathers stay fp32. Without tensor
    parallelism every data-axis collective is exact (no replicated norm weights to count)."""
    data = {}
    for reduce in ("fp32", "bf16"):
        raw = {
            "model": {"size": "llama-tiny"},
            "parallel": {"data": 2, "zero": zero},
            "train": {"global_batch": 4, "micro_batch": 1, "grad_reduce_dtype": reduce},
        }
        cfg = from_dict(raw)
        measured = measured_by_axis(dry_run(cfg, 2, 0))
        formula = formula_traffic(cfg, 2, 0)
        data[reduce] = {k: v for k, v in measured.items() if k[1] == "data"}
        assert {k: formula.get(k) for k in data[reduce]} == data[reduce], reduce
    rs, ag = ("reduce_scatter", "data"), ("all_gather", "data")
    assert data["bf16"][rs] * 2 == data["fp32"][rs] > 0
    assert data["bf16"][ag] == data["fp32"][ag] > 0


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_sharding_traffic_splits_into_shard_and_replica_groups(name: str) -> None:
    """Every data-parallel collective of a hybrid-sharded step is on the shard or the replica group, none of
    ZeRO's on the whole data group; the formulas equal the dry run to the byte on the replica group, the scalars
    and the pipe and tensor axes, and within the flat buffers' padding (one element per stage and shard rank) on
    the shard group."""
    world, parallel, train = HYBRID[name]
    cfg = from_dict({"model": {"size": "llama-tiny"}, "parallel": parallel, "train": train})
    for rank in default_ranks(Layout.from_config(cfg.parallel, world)):
        measured = measured_by_axis(dry_run(cfg, world, rank))
        formula = formula_traffic(cfg, world, rank)
        assert measured.keys() == formula.keys(), rank
        assert measured[("all_reduce", "data")] == 4, "only the loss on the whole data group"
        assert measured[("all_reduce", "data_replicate")] > 0
        for key, nbytes in measured.items():
            if key[1] == "data_shard" and key[0] != "all_reduce":
                assert abs(formula[key] - nbytes) <= 0.01 * nbytes, (rank, key)
            else:
                assert formula[key] == nbytes, (rank, key)


def test_the_traffic_table_keeps_a_1t_ranks_byte_counts_apart() -> None:
    """A rank of the 1T plan moves 1,516,660,326,400 bytes over its tensor group: 17 characters, which a fixed
    16-wide column printed glued to the formula's figure."""
    from tessera.dryrun import RankResult, format_rank

    big = 1_516_660_326_400
    result = RankResult(
        rank=24,
        coords={"data": 0, "pipe": 3, "tensor": 0},
        params=1,
        grads=1,
        optimizer=1,
        activations=1,
        peak=2**31,
        build_peak=1,
        comm={("all_gather", "tensor"): big},
    )
    estimate = {k: 1.0 for k in ("params", "grads", "optimizer", "activations", "peak", "build_peak")}
    text = format_rank(result, estimate, {("all_gather", "tensor"): float(big)})
    row = next(line for line in text.splitlines() if line.lstrip().startswith("all_gather/tensor"))
    assert row.split()[1:] == [f"{big:,}", f"{big:,}", "+0.0%"], row
