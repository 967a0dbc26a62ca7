"""The planner's context parallelism (docs/planner.md, "Context parallelism"; docs/cost-model.md): the step-time
terms of a context rank (its s/c tokens, its queries against the gathered sequence, the K/V all-gathers and dK/dV
reduce-scatters on the context group, the gradient reduction over data × context), the search offering it at long
context only, and `tessera plan --out` writing configs with parallel.context that `tessera validate` accepts and
`tessera memory` agrees with."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.config import ModelConfig
from tessera.planner.cost import (
    ModelShape,
    Plan,
    context_calls,
    cp_comm_time_per_layer,
    dp_collective_times,
    layer_time,
    local_tokens,
)
from tessera.planner.cost.compute import attention_core_time
from tessera.planner.hardware import load_hardware
from tessera.planner.network import TESSERA_ORDER
from tessera.planner.report import explain, render_text
from tessera.planner.search import CONTEXT_MIN_SEQ, PLANNER_SIZES, SearchSpace, search
from tessera.planner.steptime import fast_step, simulate_step
from tessera.traffic import context_traffic

REL = 1e-12
"""Hand formulas and the code do the same arithmetic: equal up to float rounding."""
FAST_VS_SIM_TOLERANCE = 0.01
"""As tests/unit/test_search.py: the closed form within 1 % of the simulator."""
MIB = 2**20

# a network with round numbers, so the hand-computed times below read as arithmetic
FLAT = replace(
    load_hardware("h100"),
    gpus_per_node=8,
    intra_node_bandwidth=400e9,
    intra_node_latency=5e-6,
    inter_node_bandwidth=50e9,
    inter_node_latency=20e-6,
    pod_gpus=0,
)


def _llama8b(seq_len: int) -> ModelConfig:
    return ModelConfig(**{**PLANNER_SIZES["llama3.1-8b"], "seq_len": seq_len})


def _shape(seq_len: int) -> ModelShape:
    cfg = _llama8b(seq_len)
    return replace(ModelShape.from_config(cfg), n_kv_heads=cfg.kv_heads)


def _plan(**kw) -> Plan:
    return Plan(**{"dtype": "bf16", "autocast": True, "rank_order": TESSERA_ORDER, **kw})


def test_context_bytes_equal_the_dry_run_verified_formula() -> None:
    """What the cost model prices per block, over the layers, is `tessera.traffic.context_traffic` (the formula
    the dry run prints and the distributed tests measure): every layout of c, t, b."""
    shape = _shape(32768)
    for c, t, b in ((2, 1, 1), (4, 2, 1), (8, 1, 2), (2, 8, 4)):
        plan = _plan(cp=c, tp=t, micro_batch=b)
        calls = context_calls(shape, plan)
        gathered = shape.n_layers * sum(x.total for x in calls if x.kind == "all_gather")
        scattered = shape.n_layers * sum(x.total for x in calls if x.kind == "reduce_scatter")
        expected = context_traffic(_llama8b(32768), b, c, t, bytes_per_element=2)
        assert gathered == expected == scattered, (c, t, b)
    # the doc's example: Llama 3 8B, s = 32768, b = 1, bf16, t = 1: 128 MiB per layer gathered, 4 GiB a step
    assert context_traffic(_llama8b(32768), 1, 2, 1, 2) == 32 * 128 * MIB
    assert context_calls(shape, _plan(cp=1)) == []


def test_context_comm_within_a_node_by_hand() -> None:
    """c = 4, t = 2: the context group is ranks {0, 2, 4, 6} (stride t), one node: NVLink ring. Per block K and V
    [1, 8/2, 32768, 128] bf16 = 32 MiB each gathered; ring all-gather (n−1)/n·bytes/bw + (n−1)·latency."""
    shape = _shape(32768)
    plan = _plan(cp=4, tp=2, micro_batch=1)
    kv = 1 * (8 // 2) * 128 * 32768 * 2
    assert kv == 32 * MIB
    one = 3 / 4 * kv / 400e9 + 3 * 5e-6
    got = cp_comm_time_per_layer(shape, FLAT, plan)
    assert got.forward == pytest.approx(2 * one, rel=REL)  # K and V
    assert got.backward == pytest.approx(2 * one, rel=REL)  # dK and dV reduce-scattered: the same ring
    assert got.recompute == 0.0  # no checkpointing: nothing replayed
    # full checkpointing replays the block's forward, its gathers included; selective only the core after them
    assert cp_comm_time_per_layer(shape, FLAT, replace(plan, recompute="full")).recompute == pytest.approx(
        2 * one, rel=REL
    )
    assert cp_comm_time_per_layer(shape, FLAT, replace(plan, recompute="selective")).recompute == 0.0


def test_context_comm_across_nodes_by_hand() -> None:
    """c = 8, t = 2: ranks {0, 2, …, 14} span two nodes, 4 per node: the ring's node-crossing traffic shares the
    node's 4 NICs (4 × 50 GB/s = 200 GB/s < NVLink), 1 of its 7 steps crosses (`network.ring_time`). K and V
    [2, 4, 65536, 128] bf16 = 128 MiB each."""
    shape = _shape(65536)
    plan = _plan(cp=8, tp=2, micro_batch=2)
    kv = 2 * 4 * 128 * 65536 * 2
    assert kv == 128 * MIB
    one = 7 / 8 * kv / 200e9 + 6 * 5e-6 + 1 * 20e-6
    got = cp_comm_time_per_layer(shape, FLAT, plan)
    assert got.forward == pytest.approx(2 * one, rel=REL)
    assert got.backward == pytest.approx(2 * one, rel=REL)


def test_a_context_rank_computes_on_its_tokens_and_one_cth_of_the_attention() -> None:
    """GEMMs at b·s/c rows: the block at c and s costs what the block at s/c tokens costs but for attention.
    Attention: fused causal 4·s²·d/2/c FLOPs per head (the 2c-chunk balance: every rank 1/c of the causal
    work); unfused [s/c × d]·[d × s] and [s/c × s]·[s × d]."""
    hw = load_hardware("h100")
    s, c = 32768, 4
    plan = _plan(cp=c, tp=2, micro_batch=1, flash_attention=True)
    assert local_tokens(_shape(s), plan) == s // c
    fused, fused_bwd = attention_core_time(_shape(s), hw, plan)
    whole, whole_bwd = attention_core_time(_shape(s), hw, replace(plan, cp=1))
    assert fused == pytest.approx(whole / c, rel=REL)
    assert fused_bwd == pytest.approx(whole_bwd / c, rel=REL)
    rate = hw.flash_attention_flops * hw.gemm_framework_share
    assert fused == pytest.approx(4 * s * s * 128 * (32 / 2) / 2 / c / rate, rel=REL)
    # everything else of the block is per token: the same as a whole device's block at s/c tokens
    local = replace(plan, cp=1)
    short = attention_core_time(_shape(s // c), hw, local)[0]
    ours = layer_time(_shape(s), hw, plan)
    theirs = layer_time(_shape(s // c), hw, local)
    assert ours.forward - fused == pytest.approx(theirs.forward - short, rel=1e-9)


def test_gradients_reduce_over_data_times_context() -> None:
    """Data 2 × context 4 × tensor 2: the gradient group is 8 ranks t = 2 apart (16 ranks, two nodes); with
    data 2 alone it would be 2 ranks 8 apart. The all-reduce is priced on the 8."""
    plan = _plan(dp=2, cp=4, tp=2)
    got, _ = dp_collective_times(1e9, FLAT, plan, grad_bytes=4)
    ring8_two_nodes = 2 * 7 / 8 * 4e9 / 200e9 + 12 * 5e-6 + 2 * 20e-6
    tree = 2 * 4e9 / (0.9 * 200e9) + 2 * (3 * 5e-6 + 1 * 20e-6)
    assert got == pytest.approx(min(ring8_two_nodes, tree), rel=REL)
    assert dp_collective_times(1e9, FLAT, _plan(cp=4, tp=2))[0] > 0  # context alone still reduces


def _cp_search(seq_len: int, gpus: int, batch: int, **space):
    return search(
        _llama8b(seq_len),
        gpus,
        load_hardware("h100"),
        batch,
        space=SearchSpace(max_micro_batch=2, **space),
        keep=200,
    )


def test_search_offers_context_at_long_context_and_not_at_short() -> None:
    long = _cp_search(65536, 16, 16)
    assert long.candidates and long.best.plan.cp > 1, long.best.label  # it wins at 64K on 16 H100
    for c in long.candidates:
        if c.plan.cp > 1:  # what validate refuses is never offered
            assert c.plan.pp == 1 and c.plan.tp_kind == "1d" and not c.plan.tp_comm_overlap, c.label
            assert c.plan.zero_replicas == 1 and c.execution.zero_shard == c.plan.dp * c.plan.cp
    short = _cp_search(4096, 16, 16)
    assert short.candidates and all(c.plan.cp == 1 for c in short.candidates)
    assert 4096 < CONTEXT_MIN_SEQ <= 65536
    # explicitly asked for: tried at any length; and an empty tuple turns it off even at long context
    assert any(c.plan.cp == 2 for c in _cp_search(4096, 16, 16, context=(2,)).candidates)
    without = _cp_search(65536, 16, 16, context=())
    assert without.candidates and all(c.plan.cp == 1 for c in without.candidates)
    assert without.best.step_time > long.best.step_time


def test_report_shows_context_traffic_as_its_own_part() -> None:
    result = _cp_search(65536, 16, 16)
    entries = explain(result, 4)
    text = render_text(result, entries)
    assert "| cp_comm |" in text
    assert any(f" c{c} " in text for c in (2, 4, 8, 16))
    best = entries[0].candidate
    assert best.breakdown.cp_comm > 0
    assert best.breakdown.step_time == pytest.approx(sum(best.breakdown.parts.values()), rel=REL)
    short = _cp_search(4096, 8, 8)
    assert "cp_comm" not in render_text(short, explain(short, 2))  # no column without context parallelism


@pytest.mark.parametrize(
    ("schedule", "accumulation", "zero", "recompute"),
    [
        ("1f1b", "depth_first", 0, "full"),
        ("breadth_first", "layered", 3, "none"),
        ("1f1b", "depth_first", 2, "selective"),
    ],
)
def test_fast_step_matches_the_simulator_with_context(
    schedule: str, accumulation: str, zero: int, recompute: str
) -> None:
    """The closed form the search ranks with and the simulator the report re-times with agree on a context
    layout (data 2 × context 4 × tensor 2), the context part included, at test_search's tolerance."""
    shape = _shape(32768)
    v = shape.n_layers if schedule == "breadth_first" else 1
    plan = _plan(
        dp=2,
        cp=4,
        tp=2,
        sequence_parallel=True,
        micro_batch=1,
        n_microbatches=4,
        virtual_stages=v,
        zero_stage=zero,
        zero_shard=8,
        accumulation=accumulation,
        recompute=recompute,
    )
    fast = fast_step(shape, FLAT, plan, schedule)
    simulated, _ = simulate_step(shape, FLAT, plan, schedule)
    assert fast.cp_comm > 0 and fast.cp_comm == pytest.approx(simulated.cp_comm, rel=REL)
    assert fast.step_time == pytest.approx(simulated.step_time, rel=FAST_VS_SIM_TOLERANCE)
    per_block = cp_comm_time_per_layer(shape, FLAT, plan)
    expected = 4 * shape.n_layers * (per_block.forward + per_block.backward + per_block.recompute)
    assert fast.cp_comm == pytest.approx(expected, rel=REL)
