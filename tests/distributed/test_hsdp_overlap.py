"""Hybrid sharding's replica all-reduce overlapped with the backward, and its wire dtype (gloo, dp 4 = 2 × 2).

Order, not timing: one training step is run as the trainer builds it (one rank per pipeline: one stage per
block, breadth-first) with every compute action and every gradient collective logged in the order the rank
issues them. With layered accumulation each stage's replica all-reduce ("data_replicate") must follow its own
reduce-scatter ("data_shard") and come before the next stage's: it is launched at the rank's next REDUCE, so it
runs under the backwards of the stages below (launched before the backward of the stage two below; launching it
before the very next stage's backward would make that backward wait for the reduce-scatter); only the last two
stages' are launched after the last compute. With depth-first accumulation a stage's shard is final after its
last micro-batch's reduce-scatter, so its all-reduce is launched at the next REDUCE of that last micro-batch's
backward (the ``z2_depth_first`` case below asserts the same order). Before this overlap every
replica all-reduce ran in ``finish`` after the whole backward, which the layered assertions reject.

Wire dtype: ``train.grad_reduce_dtype = "bf16"`` puts a bf16 copy of the fp32 shard on the wire (half the
bytes in comm.STATS) and writes the sum back into the fp32 shard, exactly as computed here by hand.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tessera import comm
from tessera.comm import CommStats
from tessera.config import Config, ParallelConfig, TrainConfig
from tessera.execution import resolve
from tessera.groups import build_groups
from tessera.layout import Axis, Layout
from tessera.parallel.apply import parallelize
from tessera.parallel.zero import FlatStage
from tessera.train.steppers import ScheduledStepper
from tests.distributed.test_zero import MICRO, _batches, _cfg, _model
from tests.harness import run_distributed

M, LAYERS = 2, 4
CASES = {  # name: (parallel section, train.grad_reduce_dtype)
    "z1_layered": ({"zero": 1}, "fp32"),
    "z2_layered": ({"zero": 2}, "fp32"),
    "z3_layered_bf16": ({"zero": 3}, "bf16"),
    "z2_depth_first": ({"zero": 2, "accumulation": "depth_first"}, "fp32"),
}
LOGGED = {("reduce_scatter", "data_shard"): "RS", ("all_reduce", "data_replicate"): "AR"}


def _config(parallel: dict, reduce: str) -> Config:
    return Config(
        model=replace(_cfg(), n_layers=LAYERS),
        parallel=ParallelConfig(**parallel, zero_shard_size=2),
        train=TrainConfig(global_batch=4 * M * MICRO, micro_batch=MICRO, grad_reduce_dtype=reduce),
    )


def _logged_step(stepper: ScheduledStepper, batches: list) -> list[tuple[str, int]]:
    """Run one step; return ("RS" | "AR", stage) per gradient collective and (kind name, stage) per compute,
    in issue order on this rank."""
    zero, engine = stepper.zero, stepper.engine
    assert zero is not None
    log: list[tuple[str, int]] = []
    current: list[int] = []
    stats, run = comm.STATS, engine._run

    class LoggedStats(CommStats):
        __slots__ = ()

        def record(self, kind: str, group: str, nbytes: int) -> None:
            CommStats.record(self, kind, group, nbytes)
            if (kind, group) in LOGGED:
                log.append((LOGGED[kind, group], current[-1]))

    def logged_run(state, action) -> None:
        if action.kind.is_compute:
            log.append((action.kind.name, action.stage))
        run(state, action)

    def in_stage(s: int, method):
        def call(*args, **kwargs):
            current.append(s)
            try:
                return method(*args, **kwargs)
            finally:
                current.pop()

        return call

    for s, flat in zero.flats.items():
        flat.launch_reduce = in_stage(s, flat.launch_reduce)
        flat.launch_replica_reduce = in_stage(s, flat.launch_replica_reduce)
    comm.STATS, engine._run = LoggedStats(stats.calls, stats.bytes), logged_run
    try:
        stepper.run(batches)
    finally:
        comm.STATS = stats
        del engine._run
    return log


def _check_order(case: str, log: list[tuple[str, int]], stages: list[int], layered: bool) -> None:
    desc = sorted(stages, reverse=True)  # the order the backward reaches them
    # layered: before the stage two below starts its backwards; depth-first (here micro-batch by micro-batch
    # through every stage): before that stage's last micro-batch's backward
    when = {entry: i for i, entry in (reversed(list(enumerate(log))) if layered else enumerate(log))}
    ar = [s for kind, s in log if kind == "AR"]
    assert sorted(ar) == sorted(stages), f"{case}: one replica all-reduce per stage, got {ar}"
    reductions = [entry for entry in log if entry[0] in ("RS", "AR")]
    for s in stages:  # right after the stage's last reduce-scatter: no other reduction between
        last_rs = max(i for i, entry in enumerate(reductions) if entry == ("RS", s))
        assert reductions[last_rs + 1] == ("AR", s), f"{case}: stage {s}'s all-reduce late in {reductions}"
    for upper, lower in zip(desc, desc[2:], strict=False):
        assert when["AR", upper] < when["BACKWARD", lower], (
            f"{case}: stage {upper}'s replica all-reduce not launched before stage {lower}'s backward: {log}"
        )
    last_compute = max(i for i, (kind, _) in enumerate(log) if kind not in LOGGED.values())
    late = [s for i, (kind, s) in enumerate(log) if kind == "AR" and i > last_compute]
    # the last stage's, and the one above it (launched at the last REDUCE)
    assert late == desc[-2:], f"{case}: after the last compute: {late}"


def _order_cases(rank: int, world: int) -> int:
    torch.set_num_threads(1)
    layout = Layout.from_config(ParallelConfig(zero=1), world)
    groups = None
    for name, (parallel, reduce) in CASES.items():
        cfg = _config(parallel, reduce)
        plan = resolve(cfg, world, training=False)
        assert plan.zero_replicas == 2, name
        groups = groups or build_groups(layout, "cpu", zero_shard=plan.zero_shard)
        stepper = ScheduledStepper(
            parallelize(_model(cfg.model), layout, groups, cfg), cfg, layout, groups, plan
        )
        zero = stepper.zero
        assert zero is not None and len(zero.flats) >= 4, name
        d = groups.coord(Axis.DATA)
        comm.STATS.reset()
        log = _logged_step(stepper, _batches(4 * M)[d * M : (d + 1) * M])
        _check_order(name, log, sorted(zero.flats), layered=plan.accumulation == "layered")
        width = 2 if reduce == "bf16" else 4
        shards = sum(f.shard_numel * width for f in zero.flats.values())
        assert comm.STATS.bytes[("all_reduce", "data_replicate")] == shards, name
        stepper.optimizer.zero_grad()
        stepper.close()
    return 1


def test_replica_all_reduce_overlaps_layered_backward() -> None:
    """Each stage's replica all-reduce right after its last reduce-scatter, before the backward of the stage two
    below, layered and depth-first; bf16: half the replica bytes."""
    assert run_distributed(_order_cases, 4, timeout=240) == [1] * 4


def _bf16_wire(rank: int, world: int) -> int:
    """A FlatStage's reduce-scatter and replica all-reduce in bf16 against the same arithmetic by hand: every
    rank's gradient is known to all, so the expected shard is computed locally, bit for bit."""
    layout = Layout.from_config(ParallelConfig(zero=2), world)
    groups = build_groups(layout, "cpu", zero_shard=2)
    weight = nn.Parameter(torch.zeros(6, 5))
    flat = FlatStage([weight], groups.shard, 2, groups.replica)
    grads = [torch.randn(6, 5, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    weight.grad = grads[rank].clone()
    comm.STATS.reset()
    flat.launch_reduce(torch.bfloat16, drop_grads=True)
    flat.wait_reduce()
    flat.launch_replica_reduce(torch.bfloat16)
    flat.wait_replica_reduce()
    assert flat.grad_shard is not None and flat.grad_shard.dtype == torch.float32
    assert comm.STATS.bytes[("all_reduce", "data_replicate")] == flat.shard_numel * 2

    def padded(r: int) -> torch.Tensor:
        out = torch.zeros(flat.padded)
        out[: flat.numel] = grads[r].reshape(-1)
        return out

    lo = flat.rank * flat.shard_numel
    shard_of = {}  # each shard group's fp32 mean of this rank's slice, from the bf16 reduce-scatter
    for group in layout.data_shard_groups(2):
        a, b = (padded(r)[lo : lo + flat.shard_numel].bfloat16() for r in group)
        shard_of[tuple(group)] = (a + b).float() / 2
    x, y = shard_of.values()
    expected = (x.bfloat16() + y.bfloat16()).float() / 2
    assert torch.equal(flat.grad_shard, expected), (flat.grad_shard - expected).abs().max()
    assert not torch.equal(expected, (x + y) / 2)  # an fp32 wire would differ: the test can tell them apart
    return 1


def test_replica_all_reduce_bf16_wire_fp32_shard() -> None:
    """grad_reduce_dtype bf16: the replica all-reduce sums a bf16 copy, written back into the fp32 shard."""
    assert run_distributed(_bf16_wire, 4, timeout=120) == [1] * 4
