"""ZeRO-2 and ZeRO-3 with a bf16 gradient reduce-scatter (`train.grad_reduce_dtype`) against the single-device
fp32 reference (2 gloo ranks, data parallel).

The step is built as the trainer builds it (``ScheduledStepper`` from the config: the execution plan decides the
reduction dtype). After one step the reduced ZeRO gradient shards are all-gathered back into every parameter's
gradient, which must equal the plain model's gradient on the whole global batch within the bf16 bound derived
below; the loss is untouched by the reduction's dtype and must match to fp32 rounding. The same layouts with the
default fp32 reduction must match to the fp32 tolerance, and the bf16 run must show that it reduced in bf16.

The bound. Rank r holds its fp32 gradient g_r (its replica's micro-batches; the reference's (g_0 + g_1)/2 is the
full-batch gradient g). The reduce-scatter rounds each rank's g_r to bf16 (8 significant bits, unit roundoff
u = 2^-8: relative error ≤ u), adds the two and rounds the sum to bf16 (≤ u·(1 + u)·(|g_0| + |g_1|)), and the
average over 2 ranks halves it exactly in fp32. So, elementwise,

    |ĝ − g| ≤ (2 + u)·u·a,   a = (|g_0| + |g_1|)/2,

plus the fp32 tolerance for the ranks' own summation order. The bound is in a, not |g|: where the replicas'
gradients cancel, the rounding error is relative to what each rank sent, not to the small average. Measured:
at most 1.81·u·a (ZeRO-2 and ZeRO-3 alike), and 3.8e-4 beyond the fp32 rtol, so the fp32 tolerance would fail.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.distributed as dist

from tessera.config import Config, from_dict
from tessera.groups import Groups, build_groups
from tessera.layout import Axis, Layout
from tessera.model.build import build_model
from tessera.parallel.apply import parallelize
from tessera.train.steppers import ScheduledStepper
from tests.harness import run_distributed

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
"""The loss of a data-parallel step differs from the reference by summation order only (fp32)."""
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7
"""fp32 slack: the ranks' gradients differ from the reference's by summation order (test_zero_tp2d.py's)."""
U = 2.0**-8
"""bf16's unit roundoff (8 significant bits, round to nearest)."""
BF16_BOUND = (2 + U) * U
"""Elementwise bound on the bf16 reduce-scatter's error, in units of a = (|g_0| + |g_1|)/2 (module docstring)."""
DP, MICRO_BATCH, SEQ, M = 2, 2, 16, 2
SEED, DATA_SEED = 0, 1
CASES = [(zero, reduce) for zero in (2, 3) for reduce in ("fp32", "bf16")]


def _config(zero: int, reduce: str) -> Config:
    # gpt2-tiny: d_model 32, 4 heads, 2 blocks, tied embedding and head
    return from_dict(
        {
            "model": {"size": "gpt2-tiny", "seq_len": SEQ},
            "parallel": {"data": DP, "zero": zero, "accumulation": "layered"},
            "train": {
                "global_batch": DP * M * MICRO_BATCH,
                "micro_batch": MICRO_BATCH,
                "grad_reduce_dtype": reduce,
            },
        }
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch [dp·m·b, s]: replica d takes rows d·m·b .. (d+1)·m·b, micro-batch j the j-th b of them."""
    g = torch.Generator().manual_seed(DATA_SEED)
    rows = DP * M * MICRO_BATCH
    return torch.randint(0, 256, (rows, SEQ), generator=g), torch.randint(0, 256, (rows, SEQ), generator=g)


def _replica_rows(d: int) -> slice:
    return slice(d * M * MICRO_BATCH, (d + 1) * M * MICRO_BATCH)


def _replica_batches(d: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _data()
    rows = range(_replica_rows(d).start, _replica_rows(d).stop, MICRO_BATCH)
    return [(x[r : r + MICRO_BATCH], y[r : r + MICRO_BATCH]) for r in rows]


def _step(zero: int, reduce: str, layout: Layout, groups: Groups) -> dict:
    """One ZeRO step as the trainer runs it; returns the replica loss and every parameter's reduced gradient."""
    cfg = _config(zero, reduce)
    torch.manual_seed(SEED)
    model = parallelize(build_model(cfg.model), layout, groups, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    stepper = ScheduledStepper(model, cfg, layout, groups)
    zero_comm = stepper.zero
    assert zero_comm is not None and zero_comm.zero_stage == zero
    loss = stepper.run(_replica_batches(groups.coord(Axis.DATA)))
    grads = {}
    for flat in zero_comm.flats.values():
        full = torch.empty(flat.padded, dtype=torch.float32)
        dist.all_gather_into_tensor(full, flat.grad_shard.contiguous(), group=zero_comm.group)
        for p, off in zip(flat.params, flat.offsets, strict=True):
            grads[names[id(p)]] = full[off : off + p.numel()].view_as(p).clone()
    return {"loss": loss, "grads": grads}


def _run_all(rank: int, world: int) -> dict[tuple[int, str], dict]:
    layout = Layout(dp=DP)
    groups = build_groups(layout)
    return {(zero, reduce): _step(zero, reduce, layout, groups) for zero, reduce in CASES}


@cache
def _reference() -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(loss, gradients, a = (|g_0| + |g_1|)/2) of the plain fp32 model: the whole batch, and each replica's."""
    cfg = _config(2, "fp32")
    x, y = _data()

    def grads(rows: slice) -> tuple[float, dict[str, torch.Tensor]]:
        torch.manual_seed(SEED)
        model = build_model(cfg.model)
        loss = model(x[rows], y[rows])
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    loss, full = grads(slice(None))
    replicas = [grads(_replica_rows(d))[1] for d in range(DP)]
    scale = {n: (replicas[0][n].abs() + replicas[1][n].abs()) / 2 for n in full}
    return loss, full, scale


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[int, str], dict]]:
    return run_distributed(_run_all, DP, timeout=120)


def _loss_matches(results: list[dict], case: tuple[int, str]) -> None:
    ref_loss = _reference()[0]
    loss = sum(r[case]["loss"] for r in results) / DP  # ranks are the replicas
    torch.testing.assert_close(loss, ref_loss, rtol=LOSS_RTOL, atol=LOSS_ATOL, msg=str(case))


@pytest.mark.parametrize("zero", [2, 3])
def test_fp32_reduction_matches_single_device(results: list[dict], zero: int) -> None:
    _loss_matches(results, (zero, "fp32"))
    ref = _reference()[1]
    for rank, r in enumerate(results):
        got = r[(zero, "fp32")]["grads"]
        assert got.keys() == ref.keys(), f"rank {rank}: {sorted(got)}"
        for name, grad in got.items():
            torch.testing.assert_close(
                grad, ref[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda e, n=name: f"z{zero} {n}: {e}"
            )


@pytest.mark.parametrize("zero", [2, 3])
def test_bf16_reduction_within_the_bf16_bound(results: list[dict], zero: int) -> None:
    """Every gradient within (2 + u)·u·a of the fp32 reference (module docstring), on both ranks; and the
    reduction did run in bf16: each reduced element times the 2 ranks is a bf16 number (the halving is exact),
    which the fp32 run's gradients are not, and so the two runs' gradients differ."""
    _loss_matches(results, (zero, "bf16"))
    _, ref, scale = _reference()
    for rank, r in enumerate(results):
        got, fp32 = r[(zero, "bf16")]["grads"], r[(zero, "fp32")]["grads"]
        assert got.keys() == ref.keys(), f"rank {rank}: {sorted(got)}"
        for name, grad in got.items():
            bound = BF16_BOUND * scale[name] + GRAD_RTOL * ref[name].abs() + GRAD_ATOL
            excess = (grad - ref[name]).abs() - bound
            assert excess.max() <= 0, f"z{zero} rank {rank} {name}: over the bound by {excess.max():.3g}"
            summed = grad * DP
            assert torch.equal(summed, summed.bfloat16().float()), f"z{zero} {name}: not reduced in bf16"
        fp32_flat = torch.cat([g.flatten() for g in fp32.values()]) * DP
        assert not torch.equal(fp32_flat, fp32_flat.bfloat16().float()), "the fp32 run reduced in bf16"
        assert any(not torch.equal(got[n], fp32[n]) for n in got), (
            f"z{zero}: bf16 and fp32 runs agree exactly"
        )
