"""`tessera plan`'s explanations: runner-up reasons from the actual breakdown difference, the MFU flag."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.planner.hardware import load_hardware
from tessera.planner.report import _compute_parts, _why, _why_compute, explain, mfu_warning
from tessera.planner.search import SearchSpace, search

A100 = load_hardware("a100-80gb")


@pytest.fixture(scope="module")
def two_pipelines():
    """llama-8b on 64 GPUs, t = 8 + SP, micro-batch 1, 1F1B: p = 2 (m = 64) and p = 4 (m = 128) run the same
    sequence-blocks per rank (16 × 64 = 8 × 128); only the output layer runs twice as often on p = 4."""
    space = SearchSpace(
        tensor_1d=(8,),
        tensor_2d=(),
        pipeline=(2, 4),
        schedules=("1f1b",),
        zero_stages=(1,),
        checkpointing=("none",),
        sequence_parallel=(True,),
        micro_batches=(1,),
    )
    return search("llama-8b", 64, A100, 256, space=space)


def test_compute_reason_names_the_output_layer_not_smaller_gemms(two_pipelines) -> None:
    by_p = {c.plan.pp: c for c in two_pipelines.candidates}
    reason = _why_compute(two_pipelines, by_p[2], by_p[4])
    assert "output layer" in reason and "128 micro-batches vs 64" in reason
    assert "GEMM" not in reason


def test_a_wider_tensor_split_over_more_blocks_is_not_more_work() -> None:
    """llama-8b on 64 GPUs without a pipeline: t 8 runs twice the sequence-blocks of t 4 (half the data ranks),
    each at half the work per GPU, so both do 1/64 of the step's work: the reason is the time per unit of it
    (the GEMMs at their shapes), never "more sequence-blocks"; a pipeline over 2 ranks does halve a rank's work."""
    space = SearchSpace(
        tensor_1d=(4, 8),
        tensor_2d=(),
        pipeline=(1,),
        schedules=("1f1b",),
        zero_stages=(1,),
        checkpointing=("none",),
        sequence_parallel=(True,),
        micro_batches=(1,),
    )
    result = search("llama-8b", 64, A100, 256, space=space)
    by_t = {c.plan.tp: c for c in result.candidates}
    parts = {t: _compute_parts(result, by_t[t]) for t in (4, 8)}
    assert parts[8]["sequence_blocks"] == 2 * parts[4]["sequence_blocks"]
    assert parts[8]["whole_blocks"] == parts[4]["whole_blocks"] == 32 * 256 / 64
    reason = _why_compute(result, by_t[4], by_t[8])
    assert "sequence-blocks" not in reason and "GEMMs run less efficiently" in reason


def test_mfu_above_the_best_published_is_flagged(two_pipelines) -> None:
    entries = explain(two_pipelines, 2)
    above = any(e.candidate.mfu > A100.best_published_mfu for e in entries)
    assert (mfu_warning(two_pipelines, entries) is not None) == above
    low = dataclasses.replace(two_pipelines, hardware=dataclasses.replace(A100, best_published_mfu=0.01))
    assert "#1, #2" in (mfu_warning(low, entries) or "")
    unknown = dataclasses.replace(two_pipelines, hardware=dataclasses.replace(A100, best_published_mfu=0.0))
    assert mfu_warning(unknown, entries) is None


def test_bubble_reason_is_the_runner_ups_own_idle_share() -> None:
    """Breadth-first over p = 2 with one micro-batch leaves each rank idle while the other works: the reason
    reports the simulated bubble's share of the step, not the interleaved formula (p−1)/(v·m + p − 1)."""
    space = SearchSpace(
        tensor_1d=(1,),
        tensor_2d=(),
        pipeline=(1, 2),
        schedules=("breadth_first",),
        zero_stages=(3,),
        checkpointing=("full",),
        sequence_parallel=(False,),
        micro_batches=(1, 2),
    )
    result = search("gpt2-124m", 8, A100, 8, space=space)
    win = result.candidates[0]
    starved = max(
        (c for c in result.candidates if c.plan.pp == 2 and c.plan.n_microbatches == 1),
        key=lambda c: c.breakdown.bubble / c.step_time,
    )
    idle = starved.breakdown.bubble / starved.step_time
    assert idle > 0.3
    reason = _why("bubble", win, starved, result)
    assert f"idles {idle:.0%} of its step" in reason
    assert "m=1 < p=2" in reason
