"""ZeRO-1 with depth-first accumulation: each stage's reduce-scatter overlapped with the rest of the backward (gloo).

Order, not timing: one training step is run as the trainer builds it, with every compute action and every
stage's reduce-scatter logged in the order the rank issues them. ZeRO-1 keeps full gradients and reduce-scatters
them once per step, so each stage's is launched at its last REDUCE of the step, when its gradients are final
(Megatron's distributed optimizer does the same per bucket): before the last backward of the next lower stage on
the rank, only the lowest stage's after the rank's last compute. Before this every ZeRO-1 depth-first
reduce-scatter was held until ``ZeroStageComm.finish``, after the whole backward, which these assertions reject.
The gradient shards are bit-identical to that held-back order (the engine's REDUCE counts withheld:
`ZeroStageComm.expect_reductions` never called), run on the same model and batches.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from tessera.config import Config, ParallelConfig, TrainConfig
from tessera.execution import resolve
from tessera.groups import build_groups
from tessera.layout import Axis, Layout
from tessera.parallel.apply import parallelize
from tessera.train.steppers import ScheduledStepper
from tests.distributed.test_zero import MICRO, _batches, _cfg, _model
from tests.harness import run_distributed

M, LAYERS = 4, 4
CASES = {  # name: (parallel section, tied embedding and head); every one ZeRO-1 with depth-first accumulation
    # one rank per pipeline: one stage per block, breadth-first, one micro-batch at a time
    "dp4_one_stage_per_block": ({"zero": 1, "accumulation": "depth_first"}, True),
    # two stages per pipeline rank (interleaved 1F1B, p = 2, m = 4); untied: a stage tied across the pipeline
    # reduces only after its EXCHANGE, at the end of the list
    "dp2_pp2_interleaved": (
        {
            "zero": 1,
            "accumulation": "depth_first",
            "pipeline": 2,
            "schedule": "interleaved",
            "stages_per_rank": 2,
        },
        False,
    ),
}


def _stepper(cfg: Config, layout: Layout, groups, plan) -> ScheduledStepper:
    return ScheduledStepper(parallelize(_model(cfg.model), layout, groups, cfg), cfg, layout, groups, plan)


def _logged_step(stepper: ScheduledStepper, batches: list) -> list[tuple[str, int]]:
    """Run one step; return ("RS", stage) per reduce-scatter launched and (kind name, stage) per compute, in
    issue order on this rank."""
    zero, engine = stepper.zero, stepper.engine
    assert zero is not None
    log: list[tuple[str, int]] = []
    run = engine._run

    def logged_run(state, action) -> None:
        if action.kind.is_compute:
            log.append((action.kind.name, action.stage))
        run(state, action)

    def logged_launch(s: int, launch):
        def call(*args, **kwargs):
            log.append(("RS", s))
            return launch(*args, **kwargs)

        return call

    for s, flat in zero.flats.items():
        flat.launch_reduce = logged_launch(s, flat.launch_reduce)
    engine._run = logged_run
    try:
        stepper.run(batches)
    finally:
        del engine._run
    return log


def _check_order(case: str, log: list[tuple[str, int]], stages: list[int]) -> None:
    rs = [s for kind, s in log if kind == "RS"]
    assert sorted(rs) == sorted(stages), f"{case}: one reduce-scatter per stage and step, got {rs}"
    last = {entry: i for i, entry in enumerate(log)}  # each entry's last occurrence
    desc = sorted(stages, reverse=True)  # the order the backward finishes them
    for upper, lower in itertools.pairwise(desc):
        assert last["RS", upper] < last["BACKWARD", lower], (
            f"{case}: stage {upper}'s reduce-scatter not launched before stage {lower}'s last backward: {log}"
        )
    last_compute = max(i for i, (kind, _) in enumerate(log) if kind != "RS")
    late = [s for i, (kind, s) in enumerate(log) if kind == "RS" and i > last_compute]
    assert late == desc[-1:], f"{case}: reduce-scatters after the last compute: {late}"


def _cases(rank: int, world: int) -> int:
    torch.set_num_threads(1)
    for name, (parallel, tied) in CASES.items():
        par = ParallelConfig(**parallel)
        cfg = Config(
            model=replace(_cfg(tied), n_layers=LAYERS),
            parallel=par,
            train=TrainConfig(global_batch=M * MICRO * par.data_size(world), micro_batch=MICRO),
        )
        plan = resolve(cfg, world, training=False)
        assert plan.accumulation == "depth_first" and plan.micro_batches == M, name
        layout = Layout.from_config(par, world)
        groups = build_groups(layout, "cpu")
        d = groups.coord(Axis.DATA)
        mine = _batches(M * layout.dp)[d * M : (d + 1) * M]

        stepper = _stepper(cfg, layout, groups, plan)
        zero = stepper.zero
        assert zero is not None and len(zero.flats) >= 2, name
        _check_order(name, _logged_step(stepper, mine), sorted(zero.flats))
        shards = {s: f.grad_shard.clone() for s, f in zero.flats.items()}

        # the same model and batches, every reduce-scatter in finish
        held = _stepper(cfg, layout, groups, plan)
        assert held.zero is not None
        held.zero._expected = None  # as if the engine had not said how many REDUCEs a step has
        log = _logged_step(held, mine)
        first_rs = next(i for i, (kind, _) in enumerate(log) if kind == "RS")
        assert all(kind == "RS" for kind, _ in log[first_rs:]), (
            f"{name}: the held-back order is not held back"
        )
        for s, flat in held.zero.flats.items():
            assert torch.equal(flat.grad_shard, shards[s]), f"{name}: stage {s}'s gradient shard differs"
        for st in (stepper, held):
            st.optimizer.zero_grad()
            st.close()
    return 1


def test_zero1_depth_first_reduce_scatter_overlaps_backward() -> None:
    """Each stage's reduce-scatter at its last REDUCE, before the next lower stage's last backward; gradient
    shards bit-identical to reducing everything in ``finish``."""
    assert run_distributed(_cases, 4, timeout=240) == [1] * 4
