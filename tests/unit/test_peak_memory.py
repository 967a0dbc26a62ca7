"""tessera.peak_memory: which sizes coexist at a rank's peak.

Hand-written action lists with hand-computed answers; then the fast path (one rank's list built alone, the
walk compiled once, covered moments dropped, repeated periods skipped, stages of equal sizes counted together)
against the definitions: the whole schedule's list, `lower`, and a plain walk that prices every moment.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from tessera.config import from_dict
from tessera.execution import resolve
from tessera.memory import _rank_floor, _stage_classes, _stage_sizes, estimate_plan, memory_floor
from tessera.peak_memory import _LABELS, StageBytes, compile_walk, floor, lowered_events, walk
from tessera.pipeline.ir import Action, ActionKind, stage_to_rank
from tessera.pipeline.passes import lower, tied_across, tied_stages
from tessera.pipeline.schedules import build_schedule, rank_steps
from tessera.planner.cost import ModelShape

F, B, R, RM = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.REDUCE_GRAD, ActionKind.REDUCE_MICROBATCH
G, FREE = ActionKind.GATHER_PARAMS, ActionKind.FREE_PARAMS


def _sizes(zero: int, dp: int, **kw) -> StageBytes:
    # stage 0: 10 bytes of activations per micro-batch, 100 bytes of gradients; stage 1: 30 and 40
    return StageBytes(
        activations={0: 10.0, 1: 30.0},
        grads={0: 100.0, 1: 40.0},
        flat={0: 100.0, 1: 40.0},
        working={0: 5.0, 1: 5.0},
        zero=zero,
        dp=dp,
        **kw,
    )


def test_gradients_replace_a_micro_batchs_activations() -> None:
    # all forwards, then backwards: the peak follows the first backward (its gradients exceed what it frees)
    actions = [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)]
    moment, held = walk(actions, _sizes(zero=0, dp=1))
    assert (moment.activations, moment.grads, moment.buffers) == (10.0, 100.0, 0.0)
    assert held == 100.0


def test_working_counts_at_the_start_of_a_backward() -> None:
    # stage 1 frees 30 of activations for 40 of gradients: before B0 60 + 5 of working, before B1 30 + 40 + 5
    actions = [Action(1, F, 0), Action(1, F, 1), Action(1, B, 0), Action(1, B, 1)]
    moment, _ = walk(actions, _sizes(zero=0, dp=1))
    assert (moment.activations, moment.grads, moment.working) == (30.0, 40.0, 5.0)


def test_a_stages_input_and_gradient_and_the_replayed_masks_wait_for_later_backwards() -> None:
    # full recomputation, layered breadth-first on one rank, stages 0 and 1, two micro-batches. B1 leaves its
    # input and the input's gradient (held, 7) until B0 of the micro-batch; the masks a micro-batch's first
    # replay (B1) builds again (3) stay until its last backward (B0). At the first B0: 2 x 10 of stage 0's
    # activations, 1 of stage 1's gradients, both micro-batches' held inputs and masks, stage 0's working 5
    events = [(F, 0), (F, 0), (F, 1), (F, 1), (B, 1), (B, 1), (B, 0), (B, 0)]
    sizes = StageBytes(
        activations={0: 10.0, 1: 10.0},
        grads={0: 1.0, 1: 1.0},
        flat={0: 1.0, 1: 1.0},
        working={0: 5.0, 1: 0.0},
        zero=0,
        dp=1,
        held={1: 7.0},
        masks=3.0,
    )
    moment, _ = compile_walk(events, zero=0, sharded=False, held_inputs=True).evaluate(sizes)
    assert (moment.activations, moment.grads, moment.working) == (20.0 + 2 * 7.0, 1.0, 5.0 + 2 * 3.0)
    assert moment.label == "0B"
    # without them (other modes): the forwards' end, 40 of activations, is the peak
    moment, _ = compile_walk(events, zero=0, sharded=False).evaluate(sizes)
    assert (moment.total, moment.activations) == (40.0, 40.0)


def test_zero3_holds_the_gathered_stage_and_one_flat_buffer() -> None:
    actions = [
        Action(0, G),
        Action(0, F, 0),
        Action(0, FREE),
        Action(0, G),
        Action(0, B, 0),
        Action(0, R),
        Action(0, FREE),
    ]
    moment, held = walk(actions, _sizes(zero=3, dp=4))
    # at REDUCE: gathered 100 + gradients 100 + their flat copy 100; the shard (25) comes after
    assert (moment.grads, moment.buffers) == (100.0, 200.0)
    assert held == 25.0


def test_zero1_keeps_full_gradients_and_the_shard() -> None:
    actions = [Action(0, F, 0), Action(0, B, 0), Action(0, R)]
    _, held = walk(actions, _sizes(zero=1, dp=4))
    assert held == 125.0


def test_plain_data_parallelism_adds_each_reduction_into_a_running_total() -> None:
    actions = [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, RM, 0), Action(0, B, 1)]
    actions.append(Action(0, RM, 1))
    moment, held = walk(actions, _sizes(zero=0, dp=2))
    # at the second REDUCE_MB: the first flat buffer, reduced (the total), the gradients and their flat copy
    assert (moment.grads, moment.buffers, moment.total) == (100.0, 200.0, pytest.approx(300.0))
    assert held == 100.0


@pytest.mark.parametrize("m", [1, 2, 3, 8, 64])
def test_plain_data_parallelism_holds_two_flat_buffers_whatever_the_micro_batches(m: int) -> None:
    # depth-first on one stage: F, B, REDUCE_MB per micro-batch. From the second REDUCE_MB on: the running
    # total, the gradients and their new flat copy (the previous one was added into the total first); never m
    # copies. At the end the total and the gradients written back from it.
    actions = [Action(0, kind, j) for j in range(m) for kind in (F, B, RM)]
    moment, held = walk(actions, _sizes(zero=0, dp=2))
    flats = 2 if m > 1 else 1
    assert (moment.grads, moment.buffers) == (100.0, flats * 100.0)
    assert held == 100.0


@pytest.mark.parametrize(("name", "p", "v"), [("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 2, 2)])
def test_plain_depth_first_flat_buffers_do_not_grow_with_micro_batches(name: str, p: int, v: int) -> None:
    """On a real list: only flat buffers priced (1 byte each), so the peak is the most alive at once: a
    running total per stage of the rank and one in flight, the same for m = 2p and m = 16p."""
    for r in range(p):
        counts = set()
        for m in (2 * p, 16 * p):
            events = lowered_events(rank_steps(name, p, m, v, r), zero3=False, every_microbatch=True)
            stages = sorted({s for _, s in events})
            zeros = dict.fromkeys(stages, 0.0)
            ones = dict.fromkeys(stages, 1.0)
            sizes = StageBytes(activations=zeros, grads=zeros, flat=ones, working=zeros, zero=0, dp=2)
            counts.add(compile_walk(events, zero=0, sharded=True).evaluate(sizes)[0].buffers)
        assert counts == {v + 1.0}, (r, counts)


# --- the floor: each term is alive in every walk, and equals the walk's peak where that moment is the peak ------


def _one_stage(acts: float, grads: float, working: float, zero: int, dp: int) -> StageBytes:
    return StageBytes(
        activations={0: acts}, grads={0: grads}, flat={0: grads}, working={0: working}, zero=zero, dp=dp
    )


def test_the_floor_is_the_backward_after_the_activations_peak() -> None:
    # ZeRO-3: B0 notes both micro-batches (200), its transient (5) and the gathered stage (10); reduced once
    actions = [Action(0, G), Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)]
    actions += [Action(0, FREE), Action(0, R)]
    sizes = _one_stage(acts=100.0, grads=10.0, working=5.0, zero=3, dp=2)
    moment, held = walk(actions, sizes)
    assert moment.total == 215.0
    assert floor(sizes, activations=200.0, reductions=1) == (215.0, held)


@pytest.mark.parametrize("zero", [2, 3])
def test_the_floor_is_the_reduction_after_the_peaks_backward(zero: int) -> None:
    # per micro-batch: at REDUCE_MB 0 one micro-batch (100), the gradients and their flat copy (60 + 60); the
    # gathered stage (60) under ZeRO-3: the one-stage list's FREE comes after B1
    actions = [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, RM, 0), Action(0, B, 1)]
    actions += [Action(0, RM, 1)]
    if zero == 3:
        actions = [Action(0, G), *actions[:-1], Action(0, FREE), actions[-1]]
    sizes = _one_stage(acts=100.0, grads=60.0, working=0.0, zero=zero, dp=2)
    moment, held = walk(actions, sizes)
    assert moment.total == {2: 220.0, 3: 280.0}[zero]
    got = floor(sizes, activations=200.0, reductions=2, reduced_backwards=True)
    assert got == (moment.total, held)


@pytest.mark.parametrize(
    ("zero", "dp", "peak", "held"), [(0, 2, 80.0, 40.0), (1, 2, 160.0, 120.0), (2, 2, 100.0, 40.0)]
)
def test_the_floor_is_the_last_reduction(zero: int, dp: int, peak: float, held: float) -> None:
    # two stages of 40 bytes of gradients, reduced once each. R0 first waits for R1 (its flat copy freed, its
    # output now stage 1's shard), then flattens stage 0's gradients. ZeRO-2: the gradients, their flat copy and
    # stage 1's shard (40 + 40 + 20); ZeRO-1 also keeps stage 1's gradients (+40) and allocates stage 0's
    # reduce-scatter output beside the flat copy (+20). Until 2026-12-03 the walk kept R1's flat copy alive
    # through R0's flattening (ZeRO-2 140, ZeRO-1 180), and the floor left ZeRO-1's output out. Plain data
    # parallelism: R0's flat copy beside the gradients (the write-back at the end holds as much)
    actions = [Action(0, F, 0), Action(1, F, 0), Action(1, B, 0), Action(1, R), Action(0, B, 0), Action(0, R)]
    if zero == 0:
        actions = [Action(0, F, 0), Action(0, B, 0), Action(0, R)]
    stages = (0,) if zero == 0 else (0, 1)
    grads = dict.fromkeys(stages, 40.0)
    sizes = StageBytes(
        activations=dict.fromkeys(stages, 1.0),
        grads=grads,
        flat=grads,
        working=dict.fromkeys(stages, 0.0),
        zero=zero,
        dp=dp,
    )
    moment, got_held = walk(actions, sizes)
    assert (moment.total, got_held) == (peak, held)
    assert floor(sizes, activations=2.0, reductions=len(stages)) == (peak, held)


# --- the fast path against the definitions ---------------------------------------------------------------------

GRID = [  # (schedule, p, m, v)
    *[(name, p, m, 1) for name in ("1f1b", "gpipe") for p in (1, 2, 3, 4) for m in (1, 2, 3, 5, 8, 13)],
    *[("interleaved_1f1b", p, m, v) for p in (2, 3) for m in (p, 2 * p, 5 * p) for v in (2, 3)],
    *[("breadth_first", p, m, v) for p in (1, 2, 3) for m in (1, 2, 4, 5, 9) for v in (1, 2, 3)],
]


def _options(name: str, consecutive: bool) -> dict:
    return {"consecutive": 1} if consecutive and name == "breadth_first" else {}


@pytest.mark.parametrize(("name", "p", "m", "v"), GRID)
def test_one_ranks_steps_equal_its_list_of_the_whole_schedule(name: str, p: int, m: int, v: int) -> None:
    for consecutive in (False, True):
        whole = build_schedule(name, p, m, v, **_options(name, consecutive))
        for r in range(p):
            steps = rank_steps(name, p, m, v, r, **_options(name, consecutive))
            assert [Action(s, kind, j) for s, kind, j in steps] == whole[r]


def _tied_cases(p: int, v: int) -> list[tuple[tuple[int, int], ...]]:
    """Pairs of stages sharing a parameter: none, a tied embedding and head, and (with p > 1) stages 0 and 1,
    on ranks 0 and 1 (a middle rank's stage tied across)."""
    return [(), tied_stages(True, p * v), *([((0, 1),)] if p > 1 else [])]


def _reduction_modes(name: str, p: int, m: int, v: int) -> Iterator[tuple]:
    """Every mode of reduction of one schedule: (ZeRO stage, dp, per micro-batch, consecutive, tied pairs,
    schedule options, `lower`'s lists)."""
    modes = itertools.product(range(4), (1, 3), (False, True), (False, True), _tied_cases(p, v))
    for zero, dp, every, consecutive, tied in modes:
        options = _options(name, consecutive)
        lowered = lower(
            build_schedule(name, p, m, v, **options),
            p,
            zero3=zero == 3,
            reduce_every_microbatch=every,
            tied=tied,
        )
        yield zero, dp, every, consecutive, tied, options, lowered


def _exchanged(pairs: tuple[tuple[int, int], ...], p: int, r: int) -> tuple[int, ...]:
    """Rank r's stages exchanged at the end of its list (`ExecutionPlan.exchanged_stages`'s rule)."""
    rank_of = lambda s: stage_to_rank(s, p)  # noqa: E731
    return tuple(s for pair in tied_across(pairs, rank_of) for s in pair if rank_of(s) == r)


@pytest.mark.parametrize(("name", "p", "m", "v"), GRID)
def test_lowered_events_are_lowers_list_without_point_to_point(name: str, p: int, m: int, v: int) -> None:
    for zero3, every, tied in itertools.product((False, True), (False, True), _tied_cases(p, v)):
        lowered = lower(
            build_schedule(name, p, m, v), p, zero3=zero3, reduce_every_microbatch=every, tied=tied
        )
        for r in range(p):
            want = [(a.kind, a.stage) for a in lowered[r] if not a.kind.is_comm]
            steps = rank_steps(name, p, m, v, r)
            got = lowered_events(steps, zero3=zero3, every_microbatch=every, exchanged=_exchanged(tied, p, r))
            assert got == want, (r, zero3, every, tied)


def _reference_walk(actions: list[Action], sizes: StageBytes) -> tuple[float, list[float], float]:
    """The walk as first written: every moment priced as it happens (the module docstring's rules, one by one).
    (peak total, its activations/grads/buffers/working, gradients held after backward)."""
    d, z = sizes.dp, sizes.zero
    acts, grads, shards, gathered, users, totals = 0.0, {}, {}, {}, {}, {}
    inflight, inflight_stage, best = 0.0, None, [0.0, [0.0] * 4]
    out, out_stage = 0.0, None  # ZeRO: a later reduction's output in flight (not the stage's shard)

    def note(extra: float = 0.0, working: float = 0.0) -> None:
        parts = [
            acts,
            sum(grads.values()) + sum(shards.values()),
            sum(gathered.values()) + sum(totals.values()) + inflight + out + extra,
            working,
        ]
        if sum(parts) > best[0]:
            best[:] = [sum(parts), parts]

    def settle() -> None:  # plain data parallelism: the flat buffer in flight is added into its stage's total
        nonlocal inflight, inflight_stage
        if inflight_stage is not None:
            totals.setdefault(inflight_stage, inflight)
        inflight, inflight_stage = 0.0, None

    def wait() -> None:  # ZeRO: the reduction in flight; a later one's output, cast to fp32, joins the shard
        nonlocal inflight, out, out_stage
        if out_stage is not None:
            g = sizes.grads[out_stage]
            note(extra=g / d if sizes.flat[out_stage] < g else 0.0)
        inflight, out, out_stage = 0.0, 0.0, None

    def reduce(s: int) -> None:
        nonlocal inflight, inflight_stage, out, out_stage
        flat = sizes.flat.get(s, 0.0)
        if z == 0:
            if d > 1:
                settle()
                note(extra=flat)
                inflight, inflight_stage = flat, s
                grads.pop(s, None)
            return
        wait()  # before this stage is flattened
        note(extra=flat)
        inflight = flat if d > 1 else 0.0
        if z >= 2:
            grads.pop(s, None)
        # the reduce-scatter's output beside the flat copy in flight: the stage's shard, or on a later reduction
        # a new buffer (without data parallelism the flat copy itself)
        if s not in shards:
            shards[s] = flat / d
        else:
            out, out_stage = flat / d, s
        if d > 1 or out_stage is not None:
            note()

    last_reduce = {a.stage: i for i, a in enumerate(actions) if a.kind in (R, RM)}
    for index, a in enumerate(actions):
        s, kind = a.stage, a.kind
        if kind is ActionKind.FORWARD:
            acts += sizes.activations[s]
            note()
        elif kind is B:
            note(working=sizes.working[s])
            acts -= sizes.activations[s]
            grads[s] = sizes.grads[s]
            note()
        elif kind in (R, RM):
            # ZeRO-1 depth-first: one reduce-scatter per step, at the stage's last REDUCE
            if not sizes.deferred_reduce or last_reduce[s] == index:
                reduce(s)
        elif kind is G and z >= 3 and d > 1:
            for owner in sizes.uses.get(s, (s,)):
                users[owner] = users.get(owner, 0) + 1
                gathered[owner] = sizes.grads[owner]
            note()
        elif kind is FREE:
            for owner in sizes.uses.get(s, (s,)):
                users[owner] = max(0, users.get(owner, 0) - 1)
                if not users[owner]:
                    gathered.pop(owner, None)
    if z:
        wait()
    settle()
    for s in sorted(totals):  # each stage's averaged gradients written back beside its total
        note(extra=sizes.grads[s])
        del totals[s]
        grads[s] = sizes.grads[s]
    return best[0], best[1], sum(grads.values()) + sum(shards.values())


def _random_sizes(stages: list[int], zero: int, dp: int, deferred: bool, rng: random.Random) -> StageBytes:
    # whole multiples of dp: every sum is exact, so moments that tie (a flat copy the size of the gradients it
    # replaces) tie in both walks, and both report the first
    grads = {s: float(dp * rng.randint(1, 100)) for s in stages}
    return StageBytes(
        activations={s: float(dp * rng.randint(1, 100)) for s in stages},
        grads=grads,
        flat=grads,
        working={s: float(dp * rng.randint(0, 50)) for s in stages},
        zero=zero,
        dp=dp,
        deferred_reduce=deferred,
    )


@pytest.mark.parametrize(("name", "p", "m", "v"), GRID)
def test_the_compiled_walk_prices_like_the_plain_walk(name: str, p: int, m: int, v: int) -> None:
    """Every mode of reduction (ZeRO 0-3, data parallel or not, per micro-batch or once, deferred, stages tied
    across ranks exchanged and reduced at the end or none), each rank, random sizes: the same peak, components
    and gradients after backward as pricing every moment of `lower`'s list."""
    rng = random.Random(f"{name}{p}{m}{v}")
    for zero, dp, every, consecutive, tied, options, lowered in _reduction_modes(name, p, m, v):
        deferred = zero == 1 and consecutive
        for r in range(p):
            events = lowered_events(
                rank_steps(name, p, m, v, r, **options),
                zero3=zero == 3,
                every_microbatch=every,
                exchanged=_exchanged(tied, p, r),
            )
            compiled = compile_walk(events, zero=zero, sharded=dp > 1, deferred_reduce=deferred)
            for _ in range(3):
                sizes = _random_sizes(sorted({a.stage for a in lowered[r]}), zero, dp, deferred, rng)
                peak, parts, held = _reference_walk(lowered[r], sizes)
                moment, got_held = compiled.evaluate(sizes)
                case = (zero, dp, every, consecutive, r, tied)
                assert moment.total == pytest.approx(peak, rel=1e-12), case
                got = [moment.activations, moment.grads, moment.buffers, moment.working]
                assert got == pytest.approx(parts, rel=1e-9, abs=1e-9), case
                assert got_held == pytest.approx(held, rel=1e-12), case


def _exact_peak_activations(actions: list[Action], acts: dict[int, float]) -> float:
    live = peak = 0.0
    for a in actions:
        if a.kind is F:
            live += acts[a.stage]
        elif a.kind in (B, ActionKind.BACKWARD_WEIGHT):
            live -= acts[a.stage]
        peak = max(peak, live)
    return peak


FLOOR_GRID = [
    *[(name, 3, 5, 1) for name in ("1f1b", "gpipe")],
    ("1f1b", 2, 1, 1),  # one micro-batch: its backward is the last action
    ("interleaved_1f1b", 2, 4, 3),
    ("breadth_first", 2, 5, 3),
    ("breadth_first", 1, 4, 2),
]


@pytest.mark.parametrize(("name", "p", "m", "v"), FLOOR_GRID)
def test_the_floor_is_below_the_walk(name: str, p: int, m: int, v: int) -> None:
    """Every mode of reduction, each rank, random sizes: the floor never exceeds the walked peak or the
    gradients held after backward."""
    rng = random.Random(f"floor{name}{p}{m}{v}")
    for zero, dp, every, consecutive, tied, _, lowered in _reduction_modes(name, p, m, v):
        deferred = zero == 1 and consecutive
        for r in range(p):
            exchanged = _exchanged(tied, p, r)
            events = [(a.kind, a.stage) for a in lowered[r] if not a.kind.is_comm]
            compiled = compile_walk(events, zero=zero, sharded=dp > 1, deferred_reduce=deferred)
            for _ in range(3):
                sizes = _random_sizes(sorted({a.stage for a in lowered[r]}), zero, dp, deferred, rng)
                moment, held = compiled.evaluate(sizes)
                low, low_held = floor(
                    sizes,
                    activations=_exact_peak_activations(lowered[r], sizes.activations),
                    reductions=sum(kind in (R, RM) for kind, _ in events),
                    reduced_backwards=every and not exchanged,
                )
                case = (zero, dp, every, consecutive, r, tied)
                assert low <= moment.total * (1 + 1e-12), case
                assert low_held <= held * (1 + 1e-12), case


def test_stages_of_equal_sizes_are_counted_together() -> None:
    """`classes` (stage -> a stage of the same sizes) changes how terms are counted, not the answer."""
    rng = random.Random(0)
    steps = rank_steps("breadth_first", 2, 4, 3, 0)  # stages 0, 2, 4
    for zero, every in itertools.product(range(4), (False, True)):
        events = list(lowered_events(steps, zero3=zero == 3, every_microbatch=every))
        one = {s: rng.uniform(1, 9) for s in (0, 2)}
        same = {0: one[0], 2: one[2], 4: one[2]}  # stage 4 has stage 2's sizes
        sizes = StageBytes(activations=same, grads=same, flat=same, working=same, zero=zero, dp=2)
        plain = compile_walk(events, zero=zero, sharded=True).evaluate(sizes)
        grouped = compile_walk(events, zero=zero, sharded=True, classes={0: 0, 2: 2, 4: 2})
        assert grouped.evaluate(sizes)[0].total == pytest.approx(plain[0].total, rel=1e-12)
        assert grouped.evaluate(sizes)[1] == pytest.approx(plain[1], rel=1e-12)


MODEL = {"family": "llama", "n_heads": 4, "n_kv_heads": 2, "d_model": 64, "vocab_size": 96, "seq_len": 16}
PLANS = [  # (world, parallel, global batch): uneven stages, every schedule, each ZeRO stage
    (4, {"pipeline": 4, "schedule": "1f1b", "stage_layers": [2, 3, 2, 1]}, 8),
    (
        8,
        {
            "pipeline": 4,
            "schedule": "gpipe",
            "zero": 2,
            "accumulation": "depth_first",
            "stage_layers": [1, 2, 2, 3],
        },
        8,
    ),
    (
        8,
        {
            "pipeline": 2,
            "schedule": "interleaved",
            "stages_per_rank": 3,
            "zero": 3,
            "stage_layers": [2, 2, 1, 2, 2, 1],
        },
        8,
    ),
    (
        6,
        {
            "pipeline": 3,
            "schedule": "breadth_first",
            "stages_per_rank": 2,
            "zero": 1,
            "stage_layers": [2, 2, 1, 1, 1, 1],
        },
        12,
    ),
    (
        4,
        {
            "pipeline": 4,
            "schedule": "interleaved",
            "stages_per_rank": 2,
            "stage_layers": [1, 1, 2, 1, 1, 2, 1, 1],
        },
        8,
    ),
]


@pytest.mark.parametrize(("world", "parallel", "batch"), PLANS)
def test_the_fullest_rank_is_a_candidate_and_the_floor_is_below(
    world: int, parallel: dict, batch: int
) -> None:
    """Uneven stages: the estimate (first rank of each stage profile, the ends) is the largest over every
    pipeline rank; the search's cheap `memory_floor` never exceeds it; the classes are stages of equal sizes."""
    model = {**MODEL, "n_layers": sum(parallel["stage_layers"])}
    cfg = from_dict({"model": model, "parallel": parallel, "train": {"global_batch": batch}})
    plan = resolve(cfg, world, training=False)
    shape = ModelShape.from_config(cfg.model)
    per_rank = [estimate_plan(shape, plan, stage=r).total for r in range(plan.pp)]
    assert estimate_plan(shape, plan).total == max(per_rank)
    assert memory_floor(shape, plan) <= estimate_plan(shape, plan).total
    for r in range(plan.pp):
        _assert_classes_have_equal_sizes(shape, plan, r)


def _assert_classes_have_equal_sizes(shape: ModelShape, plan, rank: int) -> dict[int, int]:
    """Each of the rank's stages and its class (`memory._stage_classes`) have the same blocks, the same place and
    the same size in every table the walk reads (`StageBytes.table`); returns the classes."""
    sizes = _stage_sizes(shape, plan, rank)
    classes = _stage_classes(plan, rank, sizes)
    for s, c in classes.items():
        assert plan.stage_layers[s] == plan.stage_layers[c] and (s == 0) == (c == 0)
        for what in range(len(_LABELS)):
            assert sizes.table(what).get(s) == sizes.table(what).get(c), (rank, s, c, _LABELS[what])
    return classes


@pytest.mark.parametrize(("zero", "classes"), [(3, {0: 0, 2: 2, 4: 4}), (1, {0: 0, 2: 2, 4: 2})])
def test_a_stage_that_holds_its_forwards_copies_has_a_class_of_its_own(zero: int, classes: dict) -> None:
    """Breadth-first v3 on pp2, 1D + SP, bf16, no recomputation, rank 0 (stages 0, 2, 4): under ZeRO-3 stage 4
    runs its forwards and backwards in one GATHER/FREE window and holds its forward's cast copies through its
    backwards (`memory._forward_in_window`), stage 2 does not: they differ in size and must not share terms.
    Under ZeRO-1 the cache holds every stage's copies alike and the two middle stages share one class."""
    cfg = from_dict(
        {
            "model": {**MODEL, "family": "gpt", "n_kv_heads": None, "n_layers": 6},
            "parallel": {
                "pipeline": 2,
                "schedule": "breadth_first",
                "stages_per_rank": 3,
                "data": 2,
                "tensor": 2,
                "sequence_parallel": True,
                "zero": zero,
            },
            "train": {"global_batch": 8, "micro_batch": 1, "dtype": "bf16"},
        }
    )
    plan = resolve(cfg, 8, training=False)
    assert _assert_classes_have_equal_sizes(ModelShape.from_config(cfg.model), plan, 0) == classes


HEAVY = {"family": "gpt", "n_heads": 4, "d_model": 32, "vocab_size": 64, "seq_len": 256, "n_layers": 4}
"""Activations outweigh the model state: a backward at the activations' peak is the step's peak."""


def _plan(model: dict, parallel: dict, dp: int, dtype: str, world: int, batch: int = 8):
    cfg = from_dict(
        {
            "model": model,
            "parallel": {"data": dp, **parallel},
            "train": {"global_batch": batch * dp, "micro_batch": 4 if model is HEAVY else 2, "dtype": dtype},
        }
    )
    return ModelShape.from_config(cfg.model), resolve(cfg, world, training=False)


@pytest.mark.parametrize(("zero", "dp"), [(z, d) for z in range(4) for d in (1, 2)])
def test_the_floor_equals_the_estimate_where_the_peaks_backward_is_the_peak(zero: int, dp: int) -> None:
    """GPipe, two ranks, two micro-batches, activations outweighing the model state: the peak is the first
    backward (with its reduction after it under ZeRO-2/3), which the floor prices exactly on both ranks: the
    boundary sent on, the head's activations and transient, the recompute transient, autocast's copies, ZeRO-3's
    gathered stage. A term the floor over-counted would put it above the estimate here."""
    for checkpointing, dtype, tied in itertools.product(
        ("none", "selective", "full"), ("bf16", "fp32"), (True, False)
    ):
        parallel = {"pipeline": 2, "schedule": "gpipe", "zero": zero, "checkpointing": checkpointing}
        shape, plan = _plan({**HEAVY, "tie_embeddings": tied}, parallel, dp, dtype, 2 * dp)
        for r in range(2):
            want = estimate_plan(shape, plan, stage=r).total
            assert _rank_floor(shape, plan, r) == pytest.approx(want, rel=1e-12), (
                checkpointing,
                dtype,
                tied,
                r,
            )


SCHEDULE_GRID = [  # (pipeline, schedule, stages per rank, accumulation)
    (1, "1f1b", 1, "depth_first"),
    (1, "breadth_first", 4, "layered"),
    (2, "1f1b", 1, "depth_first"),
    (2, "gpipe", 1, "layered"),
    (2, "interleaved", 2, "depth_first"),
    (2, "breadth_first", 2, "layered"),
    (2, "breadth_first", 2, "depth_first"),
]


@pytest.mark.parametrize(("pp", "schedule", "v", "accumulation"), SCHEDULE_GRID)
def test_the_floor_is_below_the_estimate_on_every_rank(
    pp: int, schedule: str, v: int, accumulation: str
) -> None:
    """Every schedule, ZeRO 0-3, with and without data parallelism, each checkpointing mode, bf16 and fp32,
    tied and untied head, a model whose state dominates and one whose activations do: each rank's floor is at
    most its estimate."""
    small = {**MODEL, "n_layers": 4}
    for model, zero, dp, checkpointing, dtype, tied in itertools.product(
        (small, HEAVY), range(4), (1, 2), ("none", "selective", "full"), ("bf16", "fp32"), (True, False)
    ):
        parallel = {
            "pipeline": pp,
            "schedule": schedule,
            "stages_per_rank": v,
            "accumulation": accumulation,
            "zero": zero,
            "checkpointing": checkpointing,
        }
        shape, plan = _plan({**model, "tie_embeddings": tied}, parallel, dp, dtype, pp * dp)
        for r in range(plan.pp):
            case = (model["family"], zero, dp, checkpointing, dtype, tied, r)
            assert _rank_floor(shape, plan, r) <= estimate_plan(shape, plan, stage=r).total * (1 + 1e-12), (
                case
            )


@pytest.mark.parametrize(("world", "parallel", "batch"), PLANS)
def test_stop_above_answers_whether_the_limit_is_exceeded(world: int, parallel: dict, batch: int) -> None:
    """The search's early stop: with ``stop_above`` the floor and the estimate exceed the limit exactly when the
    full answers do; below it the estimate is the full one."""
    model = {**MODEL, "n_layers": sum(parallel["stage_layers"])}
    cfg = from_dict({"model": model, "parallel": parallel, "train": {"global_batch": batch}})
    plan = resolve(cfg, world, training=False)
    shape = ModelShape.from_config(cfg.model)
    full, low = estimate_plan(shape, plan), memory_floor(shape, plan)
    per_rank = sorted({estimate_plan(shape, plan, stage=r).total for r in range(plan.pp)} | {low})
    for limit in [x * f for x in per_rank for f in (0.999, 1.0, 1.001)]:
        assert (memory_floor(shape, plan, stop_above=limit) > limit) == (low > limit)
        stopped = estimate_plan(shape, plan, stop_above=limit)
        assert (stopped.total > limit) == (full.total > limit)
        if full.total <= limit:
            assert stopped == full


def test_the_covered_moments_dropped_at_once_are_those_dropped_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_pareto` checks a moment against the kept ones one by one, or, once `_MATRIX_FROM` are kept, all at
    once (a matrix of their counts): the same moments kept, in the same order, on a long list's walk (interleaved,
    p 8, v 8, 16 micro-batches, each stage its own size class, ZeRO-3, full recomputation's held inputs and masks:
    ~180 moments kept) and on random moments with missing terms and negative counts (a term a moment lacks reads
    0)."""
    from tessera import peak_memory

    def both(compute):  # (one by one throughout, at once from the first kept on)
        monkeypatch.setattr(peak_memory, "_MATRIX_FROM", 10**9)
        alone = compute()
        monkeypatch.setattr(peak_memory, "_MATRIX_FROM", 1)
        return alone, compute()

    events = lowered_events(rank_steps("interleaved", 8, 16, 8, 0), zero3=True, every_microbatch=True)
    classes = {s: s for _, s in events}
    alone, at_once = both(
        lambda: compile_walk(events, zero=3, sharded=True, classes=classes, held_inputs=True)
    )
    assert len(alone.moments) > 100 and at_once == alone
    rng = random.Random(0)
    terms = [(what, stage) for what in range(4) for stage in range(3)]
    for _ in range(200):
        moments = {}
        for i in range(rng.randint(0, 300)):
            key = tuple(sorted((t, rng.randint(-2, 5)) for t in rng.sample(terms, rng.randint(0, 6))))
            moments[key] = (i, "x")
        alone, at_once = both(lambda moments=moments: peak_memory._pareto(moments))
        assert at_once == alone


def test_a_chain_keeps_the_ends_of_each_straight_run() -> None:
    """`_Live._record` drops the previous moment of a shape when it lies between the one before it and the new
    one: a straight run keeps its ends, and after a turn the chain starts again from the turning point (the
    moment before the new one, not the chain's first). Counts (a, b) of two terms: (1, 10) -> (3, 12) turns back
    to (2, 11), then goes on to (0, 9) in a straight line from the turn: (2, 11) is dropped, the turn kept."""
    from tessera import peak_memory

    live = peak_memory._Live(zero=0, sharded=False, cls={})
    for i, (a, b) in enumerate([(1, 10), (3, 12), (2, 11), (0, 9)]):
        live._record(((0, a), (1, b)), (i, "x"))
    assert [dict(key)[0] for key in live.moments] == [1, 3, 0]
    # another shape (a third term) keeps its own chain: nothing of the first is dropped by it
    live._record(((0, 5), (1, 5), (2, 1)), (4, "x"))
    assert len(live.moments) == 4


def test_stages_past_the_term_encoding_are_refused() -> None:
    """A walk counts a term as one int (`peak_memory._STRIDE`): a stage at or past the stride is refused, not
    read as another kind of term."""
    from tessera import peak_memory

    events = [(ActionKind.FORWARD, peak_memory._STRIDE), (ActionKind.BACKWARD, peak_memory._STRIDE)]
    with pytest.raises(ValueError, match="stages are numbered below"):
        compile_walk(events, zero=0, sharded=False)
    below = [(kind, peak_memory._STRIDE - 1) for kind, _ in events]
    walked = compile_walk(below, zero=0, sharded=False)
    assert all(stage == peak_memory._STRIDE - 1 for terms in walked.moments for (_, stage), _ in terms)
