"""The start-up build peak: `tessera.startup.startup_memory(...).build` against the dry run's allocator peak while
the rank builds its model (`RankResult.build_peak`, tessera/fake.py), and ZeRO's flat buffers filled without
making a parameter whole (`tessera.model.materialize.read_flat`), with the values of the whole parameter.

The estimate replays what the build allocates, in its order (tessera/startup.py): the RoPE tables, each local
tensor (or ZeRO's flat buffer, ZeRO-3's shard of it) as it is allocated, and on top of it one read of the value
source (the answer and the drawn row block). Until 2026-12-03 it was held parameters + the largest tensor + two
4 MiB row blocks, which over-counted every layout by at least 8 MiB (+1490 % on the demo's context layout).
"""

from __future__ import annotations

import pytest
import torch

from tessera.config import from_dict
from tessera.dryrun import dry_run, estimated_memory
from tessera.layout import Axis, Layout
from tessera.model.build import meta_model
from tessera.model.init import BLOCK_ELEMENTS, InitSource
from tessera.model.materialize import ShardSpec, read_flat, read_local
from tessera.startup import startup_memory

torch.set_num_threads(1)

MESH_BYTES_PER_RANK = 4
"""What the dry run counts and the estimate leaves out: the device mesh's int32 rank table, one entry per rank of
the world (host memory on a GPU run; the dry run runs on the CPU). Measured: the estimate is below the dry run
by exactly 4 × world bytes on every layout here."""

# An odd vocabulary (padded under tensor parallelism) of 8191 × 256: 8 MiB, two row blocks, so both the row block
# and the answer are 4 MiB on the tables, and whole small tensors elsewhere
LLAMA = {
    "family": "llama",
    "n_layers": 4,
    "d_model": 256,
    "n_heads": 8,
    "n_kv_heads": 4,
    "ffn_hidden": 768,
    "vocab_size": 8191,
    "seq_len": 32,
    "tie_embeddings": False,
}
GPT = {"family": "gpt", "n_layers": 4, "d_model": 256, "n_heads": 4, "vocab_size": 8191, "seq_len": 32}
QWEN3 = {**LLAMA, "family": "qwen3", "head_dim": 96}  # q/k norms; q_dim 384 ≠ d_model
GEMMA2 = {**LLAMA, "family": "gemma2", "head_dim": 64, "tie_embeddings": True}  # post-norms
GEMMA3 = {**LLAMA, "family": "gemma3", "head_dim": 64, "tie_embeddings": True, "sliding_window": 16}
PP = {"pipeline": 2, "schedule": "1f1b"}

CASES = {  # name: (model, world, pipeline rank, parallel section, micro-batch); data, context and tensor rank 0
    "llama_single": (LLAMA, 1, 0, {}, 1),
    "llama_tp4_sp": (LLAMA, 4, 0, {"tensor": 4, "sequence_parallel": True}, 1),
    "llama_tp2x2": (LLAMA, 4, 0, {"tensor": "2x2"}, 2),
    "llama_pp2_first": (LLAMA, 2, 0, PP, 1),
    "llama_pp2_last": (LLAMA, 2, 1, PP, 1),
    "llama_dp2_zero1": (LLAMA, 2, 0, {"data": 2, "zero": 1}, 1),
    "llama_dp4_zero3": (LLAMA, 4, 0, {"data": 4, "zero": 3}, 1),
    "llama_tp2_dp2_zero3": (LLAMA, 4, 0, {"tensor": 2, "data": 2, "zero": 3}, 1),
    "llama_tp2x2_dp2_zero3": (LLAMA, 8, 0, {"tensor": "2x2", "data": 2, "zero": 3}, 2),
    "llama_pp2_bf_v2_dp2_zero3": (
        LLAMA,
        4,
        1,
        {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2, "data": 2, "zero": 3},
        1,
    ),
    "llama_dp4_shard2_zero3": (LLAMA, 4, 0, {"data": 4, "zero": 3, "zero_shard_size": 2}, 1),
    # an 8-way shard (3.7 MiB) below the token table (8 MiB): the build's moment is that table made whole at its
    # local size and freed (`materialize._real_parameter`), before any flat buffer (megatron-1t on 65,536 GPUs,
    # ZeRO-3 d512: 1.22 GiB measured, 0.07 estimated before it was counted)
    "llama_dp8_zero3": (LLAMA, 8, 0, {"data": 8, "zero": 3}, 1),
    "gpt_tied_tp2": (GPT, 2, 0, {"tensor": 2}, 1),
    "gpt_tied_tp2x2": (GPT, 4, 0, {"tensor": "2x2"}, 2),
    "gpt_tied_pp2_last": (GPT, 2, 1, PP, 1),
    "gpt_tied_pp2_last_dp2_zero1": (GPT, 4, 1, {**PP, "data": 2, "zero": 1}, 1),
    "gpt_context2_dp2_tp2_zero3": (
        GPT,
        8,
        0,
        {"context": 2, "data": 2, "tensor": 2, "sequence_parallel": True, "zero": 3, "checkpointing": "full"},
        1,
    ),
    "qwen3_tp2": (QWEN3, 2, 0, {"tensor": 2}, 1),
    "gemma2_tp2_zero1": (GEMMA2, 4, 0, {"tensor": 2, "data": 2, "zero": 1}, 1),
    "gemma3_pp2_last": (GEMMA3, 2, 1, PP, 1),
    "gemma3_dp2_zero3": (GEMMA3, 2, 0, {"data": 2, "zero": 3}, 1),
}


def _cfg(name: str):
    model, world, _, parallel, micro = CASES[name]
    return from_dict(
        {"model": model, "parallel": parallel, "train": {"micro_batch": micro, "global_batch": micro * world}}
    )


@pytest.mark.parametrize("name", list(CASES))
def test_build_estimate_is_the_dry_runs_build_peak(name: str) -> None:
    _, world, stage, _, _ = CASES[name]
    cfg = _cfg(name)
    rank = Layout.from_config(cfg.parallel, world).rank({Axis.PIPE: stage})
    measured = dry_run(cfg, world, rank).build_peak
    estimate = estimated_memory(cfg, world, rank)["build_peak"]  # `tessera dryrun`'s "build peak" row
    mesh = MESH_BYTES_PER_RANK * world
    assert measured - mesh <= estimate <= measured, (
        f"{name}: dry run {measured:,} B, estimate {estimate:,.0f} B ({estimate - measured:+,.0f} B; the mesh "
        f"table is {mesh} B)"
    )


def test_a_stage_outside_the_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match="not a pipeline rank"):
        startup_memory(_cfg("llama_pp2_first"), 2, stage=2)


# --- ZeRO's flat buffers: the shard's part of each parameter read in place ------------------------------------

VOCAB, D = 3 * BLOCK_ELEMENTS // 64 + 5, 64  # several row blocks, an odd vocabulary padded by a 2-way split
SPECS = {
    "whole": ShardSpec.replicated("embed.tok.weight", (VOCAB, D)),
    "rows, padded": ShardSpec.split("embed.tok.weight", (VOCAB, D), {0: (2, 1)}),
    "columns": ShardSpec.split("head.out.weight", (VOCAB, D), {1: (2, 1)}),
    "columns, transposed": ShardSpec.split("head.out.weight", (VOCAB, D), {1: (2, 1)}, transpose=True),
    "2D block, transposed": ShardSpec.split("head.out.weight", (VOCAB, D), {0: (2, 0), 1: (2, 1)}, True),
    "a norm (constant)": ShardSpec.replicated("blocks.0.attn_norm.weight", (D,)),
}


def _ranges(numel: int, width: int) -> list[tuple[int, int]]:
    """(first, count): the whole tensor, whole rows, rows with partial ends, inside one row, a last element."""
    ranges = [
        (0, numel),
        (width, 3 * width),
        (width // 2, 5 * width),
        (3 * width + 1, width - 2),
        (numel - 1, 1),
        (numel // 3 + 7, numel // 3),
    ]
    return [(first, count) for first, count in ranges if count > 0 and first + count <= numel]


@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
def test_read_flat_gives_the_whole_parameters_elements(spec: str) -> None:
    """Bit for bit what the build wrote before (the whole local tensor read, then its part copied)."""
    model = {"family": "llama", "n_layers": 1, "d_model": D, "n_heads": 4, "vocab_size": VOCAB}
    source = InitSource.for_model(meta_model(from_dict({"model": model}).model), seed=5)
    s = SPECS[spec]
    whole = read_local(s, source).reshape(-1)
    width = whole.numel() // s.local_shape[0]
    for first, count in _ranges(whole.numel(), width):
        out = torch.full((count,), float("nan"))
        read_flat(s, source, out, first)
        assert torch.equal(out, whole[first : first + count]), (spec, first, count)


def test_read_flat_refuses_a_range_outside_the_block() -> None:
    s = SPECS["a norm (constant)"]
    source = InitSource.for_model(
        meta_model(from_dict({"model": {"family": "llama", "d_model": D}}).model), 1
    )
    with pytest.raises(ValueError, match="outside the local block"):
        read_flat(s, source, torch.empty(2), D - 1)
