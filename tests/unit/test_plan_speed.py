"""The planner's shortcuts answer as the computations they replace: the search's cheap lower bounds
(`memory.model_state_mean`, `memory._rank_state_floor`) never exceed the bound they stand in for, so they only
reject layouts the exact check rejects; the step time's backward releases, the report's re-timing without the
simulator's summary and the cached compute lists equal the plain computations exactly; the search and the report
pause the cycle collector only while they run."""

from __future__ import annotations

import dataclasses
import gc
import itertools
from collections.abc import Iterator

import pytest

from tessera import memory
from tessera.config import ModelConfig
from tessera.execution import ExecutionPlan
from tessera.pipeline.build import compute_options
from tessera.pipeline.schedules import rank_steps
from tessera.planner import report as report_module
from tessera.planner import search as search_module
from tessera.planner.cost import ModelShape, Plan, rank_memory
from tessera.planner.hardware import load_hardware
from tessera.planner.search import SearchSpace, model_config, search, without_cycle_collection
from tessera.planner.steptime import (
    BUCKETED_RELEASES,
    MAX_RELEASES,
    ChunkCosts,
    _backward_releases,
    _kept_backwards,
    _reduce_items,
    simulate_step,
    simulated_breakdown,
)
from tests.plan_grid import valid_plan
from tests.unit.test_search import _tp2_plan

A100 = load_hardware("a100-80gb")


def _grid(tied: bool) -> list[tuple[ModelShape, ExecutionPlan]]:
    """Valid plans over the layout, ZeRO, schedule, split and checkpointing, 1D and 2D, of a small model whose
    head is heavy (a large vocabulary: the end stages hold much more than the middle ones)."""
    model = ModelConfig(n_layers=6, d_model=64, n_heads=4, vocab_size=4096, seq_len=32, tie_embeddings=tied)
    shape = ModelShape.from_config(model)
    plans = []
    for tensor, pipeline, data, schedule, v, zero, ckpt, split in itertools.product(
        (1, 2, "2x2"),
        (1, 2, 3),
        (1, 2),
        ("1f1b", "gpipe", "interleaved", "breadth_first"),
        (1, 3),
        (0, 1, 2, 3),
        ("none", "full"),
        (None, [1, 2, 3], [1, 4, 1]),
    ):
        if split is not None and (pipeline, v) != (3, 1):
            continue
        parallel = dict(
            tensor=tensor,
            pipeline=pipeline,
            data=data,
            schedule=schedule,
            stages_per_rank=v,
            zero=zero,
            checkpointing=ckpt,
            stage_layers=split,
            accumulation="layered" if schedule == "breadth_first" else "depth_first",  # as the search
        )
        plan = valid_plan(model, parallel, global_batch=12, micro_batch=2)
        if plan is not None:
            plans.append((shape, plan))
    return plans


@pytest.fixture(scope="module")
def grid() -> list[tuple[ModelShape, ExecutionPlan]]:
    return _grid(tied=False) + _grid(tied=True)


def test_the_grid_covers_the_cases(grid: list[tuple[ModelShape, ExecutionPlan]]) -> None:
    kinds = {(p.pp, p.q, p.zero, p.schedule, p.stage_layers) for _, p in grid}
    assert len(grid) > 400 and len(kinds) > 100
    assert any(len(set(p.stage_layers)) > 1 and p.pp == 3 for _, p in grid)  # uneven stages
    assert any(p.q > 1 for _, p in grid) and any(p.runner == "direct" for _, p in grid)


def test_model_state_mean_is_at_most_every_plans_model_state_floor(
    grid: list[tuple[ModelShape, ExecutionPlan]],
) -> None:
    """The mean over the ranks, from the layout and ZeRO stage alone, is below the fullest rank's model state
    whatever the split, schedule, stages per rank and checkpointing; where every rank holds the same share of
    parameters (the middle of a deep even pipeline) it is close to it, so a wrong term would show."""
    ratios = []
    for shape, plan in grid:
        mean = memory.model_state_mean(shape, memory.cost_plan(plan))
        floor = memory.model_state_floor(shape, plan)
        assert mean <= floor, plan
        ratios.append(mean / floor)
    assert max(ratios) > 0.9  # the one-rank layouts: the mean is the rank's state (less the rounding margin)


def test_model_state_mean_reads_the_layout_and_zero_stage() -> None:
    """Each of the fields it reads moves it (a bound that ignored one would be wrong for some layout)."""
    shape = ModelShape.from_config(model_config("llama-8b")[1])
    base = Plan(dp=4, pp=2, tp=2, zero_stage=1)
    value = memory.model_state_mean(shape, base)
    for change in (dict(dp=8), dict(pp=4), dict(tp=4), dict(zero_stage=2), dict(tp=4, tp_kind="2d")):
        assert memory.model_state_mean(shape, dataclasses.replace(base, **change)) != value, change
    # the fields it does not read (the search builds it from a base plan of one micro-batch variant)
    for same in (dict(micro_batch=4), dict(recompute="full"), dict(virtual_stages=2), dict(n_microbatches=8)):
        assert memory.model_state_mean(shape, dataclasses.replace(base, **same)) == value, same


def test_rank_state_floor_is_at_most_the_rank_floor(grid: list[tuple[ModelShape, ExecutionPlan]]) -> None:
    """`memory_floor`'s early answer: each candidate rank's cheap bound is below its `_rank_floor`, and with
    ``stop_above`` anywhere around those values the floor exceeds the limit exactly when the full floor does."""
    stopped_early = 0
    for shape, plan in grid:
        full = memory.memory_floor(shape, plan)
        cheap = []
        for rank in memory._candidate_ranks(plan):
            state = memory._rank_state_floor(shape, plan, rank)
            assert state <= memory._rank_floor(shape, plan, rank), (plan, rank)
            cheap.append(state)
        for limit in [x * f for x in (*cheap, full) for f in (0.999, 1.0, 1.001)]:
            answer = memory.memory_floor(shape, plan, stop_above=limit)
            assert (answer > limit) == (full > limit), (plan, limit)
            stopped_early += answer > limit and answer in cheap
    assert stopped_early > 100  # the early answer was taken


def test_search_with_the_mean_bound_equals_the_search_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search skips a ZeRO stage whose mean model state is over the limit; with the bound turned off (0)
    every one of those layouts is built and rejected by `model_state_floor` instead: the same counts and the
    same candidates, in the same order."""
    space = SearchSpace(micro_batches=(1, 2), checkpointing=("none", "full"))
    fired = []
    mean = memory.model_state_mean

    def counting(shape: ModelShape, plan: Plan) -> float:
        value = mean(shape, plan)
        fired.append(value > 0.95 * A100.memory_bytes)
        return value

    monkeypatch.setattr(search_module, "model_state_mean", counting)
    bounded = search("llama-8b", 8, A100, 16, space=space)
    assert any(fired) and not all(fired)
    monkeypatch.setattr(search_module, "model_state_mean", lambda shape, plan: 0.0)
    plain = search("llama-8b", 8, A100, 16, space=space)
    assert (bounded.enumerated, bounded.rejected_memory) == (plain.enumerated, plain.rejected_memory)
    assert bounded.candidates and bounded.rejected_memory > 0
    assert [(c.label, c.step_time, c.memory) for c in bounded.candidates] == [
        (c.label, c.step_time, c.memory) for c in plain.candidates
    ]


def _releases_by_list(
    schedule: str, p: int, m: int, v: int, c: ChunkCosts, end: float, share: float, skip_every: int = 0
) -> list[tuple[float, float]]:
    """`_backward_releases` as first written: every backward's end in a list, then the items from it."""
    total = m * v
    all_at_end = schedule == "gpipe" or (schedule == "interleaved" and m == p)
    tail = total if all_at_end else min(total, (v - 1) * p + 1)
    ends = [end - k * c.bwd for k in range(tail)]
    ends += [ends[-1] - (k + 1) * (c.fwd + c.bwd) for k in range(total - tail)]
    if skip_every:
        ends = [e for k, e in enumerate(ends) if k % skip_every]
    items: list[tuple[float, float]] = []
    for e in ends[:BUCKETED_RELEASES]:
        items += _reduce_items(e, c.bwd, c.layers, share)
    rest = ends[BUCKETED_RELEASES:]
    group = max(1, -(-len(rest) // MAX_RELEASES))
    items += [
        (rest[min(i + group, len(rest)) - 1], share * len(rest[i : i + group]))
        for i in range(0, len(rest), group)
    ]
    return items


def test_backward_releases_equal_the_list_of_every_backward() -> None:
    """Only the backwards that become items are computed: the same floats as the list of all m·v of them, for
    short steps and for ones long enough to be grouped (more than 16 + 256 backwards), with and without the
    tied stage's backwards skipped (every v-th, v = 1 skipping all)."""
    c = ChunkCosts(
        fwd_compute=0.0123,
        bwd_compute=0.0371,
        fwd_tp=0.0007,
        bwd_tp=0.0011,
        out_fwd=0.0,
        out_bwd=0.0,
        p2p=0.001,
        layers=3,
    )
    for schedule in ("1f1b", "gpipe", "interleaved", "breadth_first"):
        for p, m, v in itertools.product((1, 2, 4, 8), (1, 3, 8, 64, 300, 1024), (1, 2, 3, 5)):
            for skip in sorted({0, 1, 2, 3, v}):
                args = (schedule, p, m, v, c, 123.456, 0.789)
                want = _releases_by_list(*args, skip_every=skip)
                assert _backward_releases(*args, skip_every=skip) == want, (schedule, p, m, v, skip)


def test_kept_backwards_index_the_list_without_the_multiples() -> None:
    """`_kept_backwards`' closed form is the list of the k in range(total) that are not multiples of the skip
    (every k with 0), entry by entry, and its length."""
    for total in (0, 1, 2, 5, 16, 17, 272, 300, 1031):
        for skip in (0, 1, 2, 3, 4, 7, 16, total + 1):
            want = [k for k in range(total) if not skip or k % skip]
            kth, n = _kept_backwards(total, skip)
            assert n == len(want), (total, skip)
            assert [kth(t) for t in range(n)] == want, (total, skip)


@pytest.mark.parametrize("tied", [False, True])
def test_simulated_breakdown_equals_simulate_steps(tied: bool) -> None:
    """The report's re-timing without the simulator's summary: the same breakdown as `simulate_step` (its
    per-rank entries in the same order), with data-parallel reductions per step and per micro-batch, ZeRO-3's
    gathers and the tied exchange."""
    shape = dataclasses.replace(ModelShape.from_config(model_config("llama-8b")[1]), tied=tied)
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("breadth_first", 2)):
        for p, m in ((2, 4), (4, 8)):
            for dp, zero, accumulation in ((1, 0, "depth_first"), (8, 0, "depth_first"), (8, 1, "layered")):
                plan = _tp2_plan(dp, p, v, zero, m, accumulation)
                assert (
                    simulated_breakdown(shape, A100, plan, schedule)
                    == simulate_step(shape, A100, plan, schedule)[0]
                ), (schedule, p, m, dp, zero)
            plan = _tp2_plan(16, p, v, 3, m, "depth_first")
            assert (
                simulated_breakdown(shape, A100, plan, schedule)
                == simulate_step(shape, A100, plan, schedule)[0]
            )


def test_cached_compute_lists_are_the_schedules() -> None:
    """`memory._rank_steps` is `rank_steps` with the options the accumulation implies, per rank; it keeps the
    accumulation in its key (breadth-first depth-first runs one micro-batch at a time: another list)."""
    for name, p, m, v in (("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("breadth_first", 2, 4, 2)):
        for accumulation in ("layered", "depth_first"):
            for rank in range(p):
                want = rank_steps(name, p, m, v, rank, **compute_options(name, accumulation))
                assert memory._rank_steps(name, p, m, v, rank, "loop", accumulation) == tuple(want)
    layered = memory._rank_steps("breadth_first", 2, 4, 2, 0, "loop", "layered")
    assert memory._rank_steps("breadth_first", 2, 4, 2, 0, "loop", "depth_first") != layered


def test_cached_window_stages_are_the_lowered_lists(grid: list[tuple[ModelShape, ExecutionPlan]]) -> None:
    """`memory._forward_in_window` of a named schedule (memoized on the schedule, its sizes, the rank, the
    placement and the accumulation) equals what the lowered lists the runtime executes give
    (`ExecutionPlan.lowered`, the path of a hand-written schedule), on every rank of the grid's ZeRO-3 plans with
    data parallelism (whose lists gather and free); asked in grid order with the memo filled, so a key missing a
    field the lists depend on would return a neighbour's answer."""
    memory._named_in_window.cache_clear()
    answers = set()
    for _, plan in grid:
        if plan.zero != 3 or plan.zero_shard < 2 or plan.runner == "direct":
            continue
        for rank in range(plan.pp):
            want = memory._in_window([(a.kind, a.stage) for a in plan.lowered()[rank]])
            assert memory._forward_in_window(plan, rank) == want, (plan, rank)
            answers.add(want)
    assert memory._named_in_window.cache_info().hits > 20 and len(answers) > 3


def test_memoized_block_terms_equal_fresh_ones(grid: list[tuple[ModelShape, ExecutionPlan]]) -> None:
    """`rank_memory`'s memoized per-block terms (`_MEMO`), asked in grid order with the memo filled (neighbours
    differ in one field), equal the functions computed afresh on every plan's cost view, also with sequence
    parallelism and the rings where they apply (the entries' and rings' moments): a key missing a field a term
    reads would return a neighbour's value."""
    memoized = [f for f in vars(rank_memory).values() if callable(getattr(f, "cache_info", None))]
    assert len(memoized) >= 6
    for f in memoized:
        f.cache_clear()
    values = set()
    for shape, plan in grid:
        cplan = memory.cost_plan(plan)
        variants = [cplan]
        if cplan.tp_kind == "1d" and cplan.tp > 1:
            variants.append(dataclasses.replace(cplan, sequence_parallel=True))
            if variants[-1].rings_fit_layout:
                variants.append(dataclasses.replace(variants[-1], tp_comm_overlap=True))
        for variant in variants:
            for f in memoized:
                value = f(shape, variant)
                assert value == f.__wrapped__(shape, variant), (f.__name__, variant)
                values.add((f.__name__, value))
    assert all(f.cache_info().hits > 100 for f in memoized) and len(values) > 20


def test_the_collector_pause_restores_what_it_found() -> None:
    """`without_cycle_collection` leaves the collector as it found it: back on after the block (also when the
    block raises), still off if the caller had turned it off."""
    assert gc.isenabled()
    with without_cycle_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), without_cycle_collection():
        raise ValueError("no layout fits")
    assert gc.isenabled()
    gc.disable()
    try:
        with without_cycle_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_search_and_explain_run_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search and the report pause the collector themselves, so every caller (`tessera plan`, the analysis,
    the benchmarks) gains: it is off in the work they do per layout (`decide` in the search, `_retime` in the
    report) and on again after each."""
    seen: dict[str, set[bool]] = {"decide": set(), "retime": set()}

    def spy(name: str, fn):
        def call(*args, **kwargs):
            seen[name].add(gc.isenabled())
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(search_module, "decide", spy("decide", search_module.decide))
    monkeypatch.setattr(report_module, "_retime", spy("retime", report_module._retime))
    result = search("llama-1b", 4, load_hardware("h100"), 8)
    assert gc.isenabled() and result.candidates
    assert report_module.explain(result, 3)
    assert gc.isenabled()
    assert seen == {"decide": {False}, "retime": {False}}


def _walk_modes(p: int, v: int, rank: int) -> Iterator[tuple]:
    """(zero, sharded, uses, classes, exchanged, replicated, held_inputs) of the walk's reduction modes: plain,
    data parallel, ZeRO 1-3 with and without data parallelism, hybrid sharding's wire copies, the rank's stages
    in one size class or each its own, a stage tied across ranks (exchanged at the end), ZeRO-3's gather of the
    last stage bringing the first's parameters (a tied head on the embedding's rank), and full recomputation's
    held inputs and replayed masks (`held_inputs`), with the rank's stages in one class or each its own (the
    masks are made at the highest stage's backward and freed at the lowest's)."""
    stages = [c * p + rank for c in range(v)]
    one_class = tuple((s, stages[0]) for s in stages)
    own = tuple((s, s) for s in stages)
    for zero, sharded in itertools.product((0, 1, 2, 3), (False, True)):
        yield zero, sharded, (), one_class, (), False, False
    yield 0, True, (), own, (), False, False
    yield 3, True, (), own, (), False, False
    yield 2, True, (), one_class, (), True, False
    yield 1, True, (), one_class, (stages[0],), False, False
    yield 3, True, (), one_class, (stages[-1],), False, False
    yield 3, True, ((stages[-1], (stages[-1], stages[0])),), own, (), False, False
    for zero, classes in itertools.product((0, 3), (one_class, own)):
        yield zero, True, (), classes, (), False, True


WALK_FAMILIES = [
    *[("1f1b", p, 1, "depth_first") for p in (1, 2, 3, 5, 8)],
    *[("gpipe", p, 1, "depth_first") for p in (1, 3)],
    *[("interleaved", p, v, "depth_first") for p, v in ((2, 2), (3, 2), (2, 3), (4, 3), (3, 1), (8, 2))],
    *[
        ("breadth_first", p, v, acc)
        for p, v in ((1, 3), (2, 2), (3, 1))
        for acc in ("depth_first", "layered")
    ],
]


@pytest.mark.parametrize(("name", "p", "v", "accumulation"), WALK_FAMILIES)
def test_steady_walks_are_equal(name: str, p: int, v: int, accumulation: str) -> None:
    """`memory.steady_walk`: the walks (as compiled: the same moments, labels and gradients after backward) of
    every micro-batch count it calls steady are equal, for every m up to 6·(p + 4)·v (small m < p, m not a
    multiple of p, interleaved multiples of p), each rank, every reduction mode, so the estimate may walk one of
    them for all; lists that hold all m micro-batches (GPipe, layered breadth-first) are never steady."""
    walk = memory._named_walk.__wrapped__
    ramp = name == "gpipe" or accumulation == "layered"
    for rank in range(p):
        steady = [
            m for m in range(1, 6 * (p + 4) * v + 1) if memory.steady_walk(name, p, m, v, rank, accumulation)
        ]
        assert not steady if ramp else len(steady) > 3, steady
        for zero, sharded, uses, classes, exchanged, replicated, held in _walk_modes(p, v, rank):
            args = ("loop", accumulation, zero, sharded, uses, classes, exchanged, replicated, held)
            shared = walk(name, p, steady[0], v, rank, *args) if steady else None
            for m in steady[1:]:
                assert walk(name, p, m, v, rank, *args) == shared, (rank, zero, sharded, uses, classes, m)


def test_the_estimate_walks_a_steady_list_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`memory._rank_walk` compiles one walk for all the steady micro-batch counts of a rank's list: 1F1B on 4
    ranks, m = 8, 16, 32 (rank 0: warm-up 3, 5 periods and more) walk rank 0 once, and return it each time."""
    memory._STEADY_WALKS.clear()
    memory._named_walk.cache_clear()
    compiled = []
    named = memory._named_walk

    def counting(*args):
        compiled.append(args[2])
        return named(*args)

    monkeypatch.setattr(memory, "_named_walk", counting)
    model = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
    walks = []
    for m in (8, 16, 32):
        plan = valid_plan(model, dict(data=1, pipeline=4, schedule="1f1b"), global_batch=m, micro_batch=1)
        walks.append(memory._rank_walk(plan, 0, memory._stage_sizes(ModelShape.from_config(model), plan, 0)))
    assert compiled == [8] and walks[0] is walks[1] is walks[2]
