"""Hybrid sharding (HSDP, `parallel.zero_shard_size`) against the single-device reference (gloo, fp32).

Each case is built as the trainer builds it (`build_groups` with the plan's shard size, `ScheduledStepper`,
tensor parallelism through `parallelize`) and trains `STEPS` AdamW steps, clipping by a threshold low enough to
fire. Every step the data-parallel mean loss, EVERY gradient (the reduced shards all-gathered over the shard
group back into full tensors) and the clipping norm must equal the single-device run's on the whole global batch;
after the last step every parameter must too. The tolerances are test_zero.py's (imported, not restated).

Per step the collectives must be hybrid sharding's: reduce-scatters and all-gathers on the shard group
("data_shard" in comm.STATS), one all-reduce per stage of exactly its padded gradient shard on the replica group
("data_replicate"), whatever the accumulation order, and no ZeRO collective on the whole data group; and the
replicas must hold bit-identical parameters after every update.

One spawn per world size: the dp 4 = 2 × 2 cases (4 ranks), then pipeline and tensor parallel ones (8 ranks).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.config import Config, ModelConfig, ParallelConfig, TrainConfig
from tessera.execution import resolve
from tessera.groups import Groups, build_groups
from tessera.layout import Axis, Layout
from tessera.parallel.apply import parallelize
from tessera.train.steppers import ScheduledStepper
from tests.distributed.test_zero import (
    BETAS,
    EPS,
    GRAD_ATOL,
    GRAD_RTOL,
    LOSS_ATOL,
    LR,
    MICRO,
    PARAM_ATOL,
    WD,
    _batches,
    _cfg,
    _model,
    _reference_steps,
)
from tests.harness import run_distributed

STEPS, M = 2, 2
MAX_NORM = 0.05
"""Below the reference's gradient norms (~0.5 here), so clipping scales every step: a norm counted r times
(each replica's copy of a shard) would clip by a different factor."""
NORM_RTOL = 1e-5
"""The clipping norm: one square root of a sum over a few thousand fp32 squares, summed in another order."""

CASES = {  # name: (world size, parallel section); the model is `_model_cfg(name)`
    "dp4_s2_z1_layered": (4, {"zero": 1, "zero_shard_size": 2}),
    "dp4_s2_z1_depth_first": (4, {"zero": 1, "zero_shard_size": 2, "accumulation": "depth_first"}),
    "dp4_s2_z2_layered": (4, {"zero": 2, "zero_shard_size": 2}),
    "dp4_s2_z2_depth_first": (4, {"zero": 2, "zero_shard_size": 2, "accumulation": "depth_first"}),
    "dp4_s2_z3_layered": (4, {"zero": 3, "zero_shard_size": 2}),
    "dp4_s2_z3_depth_first": (4, {"zero": 3, "zero_shard_size": 2, "accumulation": "depth_first"}),
    "dp4_s2_pp2_z3_1f1b": (8, {"data": 4, "pipeline": 2, "zero": 3, "zero_shard_size": 2}),
    "dp4_s2_pp2_z2_depth_first": (
        8,
        {"data": 4, "pipeline": 2, "zero": 2, "zero_shard_size": 2, "accumulation": "depth_first"},
    ),
    "dp4_s2_tp2_z3": (8, {"data": 4, "tensor": 2, "zero": 3, "zero_shard_size": 2}),
    # One stage per rank, depth-first: the stage's REDUCEs follow each other, so the one in flight is never the
    # step's last when the next launches (a 1-block model; a pipeline of 1-block ranks under 1F1B).
    "dp4_s2_z2_depth_first_one_stage": (4, {"zero": 2, "zero_shard_size": 2, "accumulation": "depth_first"}),
    "dp4_s2_z3_depth_first_one_stage": (4, {"zero": 3, "zero_shard_size": 2, "accumulation": "depth_first"}),
    "dp4_s2_pp2_z2_1f1b_one_stage": (
        8,
        {
            "data": 4,
            "pipeline": 2,
            "schedule": "1f1b",
            "zero": 2,
            "zero_shard_size": 2,
            "accumulation": "depth_first",
        },
    ),
}
MODEL_CHANGES = {  # name: changes to test_zero's model (2 blocks, tied) for the cases that hold one stage per rank
    "dp4_s2_z2_depth_first_one_stage": {"n_layers": 1},
    "dp4_s2_z3_depth_first_one_stage": {"n_layers": 1},
    "dp4_s2_pp2_z2_1f1b_one_stage": {"tie_embeddings": False},  # as the trainer crashed on; tied it did not
}


def _model_cfg(name: str) -> ModelConfig:
    return replace(_cfg(), **MODEL_CHANGES.get(name, {}))


def _config(name: str, parallel: dict, dp: int) -> Config:
    return Config(
        model=_model_cfg(name),
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(
            global_batch=dp * M * MICRO,
            micro_batch=MICRO,
            lr=LR,
            beta1=BETAS[0],
            beta2=BETAS[1],
            eps=EPS,
            weight_decay=WD,
        ),
    )


def _reference(
    model: ModelConfig, steps: list[list]
) -> tuple[list[float], list[float], list[dict[str, torch.Tensor]], dict]:
    """One process, torch.optim.AdamW with torch's clipping: per step the loss, the norm clipped by and every
    gradient (by every name, tied aliases too), then the parameters."""
    norms: list[float] = []
    losses, grads, final = _reference_steps(model, steps, clip=(MAX_NORM, norms))
    return losses, norms, grads, final


def _plain_names(model: nn.Module) -> dict[str, str]:
    """Every plain parameter name (tied aliases included) → the name ``full_parameters`` keys it by."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def _full_grads(model: nn.Module, stepper: ScheduledStepper) -> dict[str, torch.Tensor]:
    """Every reduced gradient as a full tensor by plain name: the shards all-gathered over the shard group into
    each parameter's ``.grad`` (ZeRO-1's unreduced full gradients overwritten), tensor-parallel blocks joined."""
    zero = stepper.zero
    assert zero is not None
    for flat in zero.flats.values():
        full = torch.empty(flat.padded)
        dist.all_gather_into_tensor(full, flat.grad_shard.contiguous(), group=zero.group)
        for p, off in zip(flat.params, flat.offsets, strict=True):
            p.grad = full[off : off + p.numel()].view_as(p).clone()
    if hasattr(model, "full_parameters"):
        full = model.full_parameters(grad=True)  # collective over the tensor group
        return {plain: full[key] for plain, key in _plain_names(model).items()}
    return {n: p.grad for st in stepper.engine.stages.values() for n, p in st.named_parameters()}


def _full_params(model: nn.Module, stepper: ScheduledStepper) -> dict[str, torch.Tensor]:
    zero = stepper.zero
    assert zero is not None
    zero.gather_all()
    if hasattr(model, "full_parameters"):
        full = model.full_parameters()
        out = {plain: full[key].clone() for plain, key in _plain_names(model).items()}
    else:
        out = {
            n: p.detach().clone() for st in stepper.engine.stages.values() for n, p in st.named_parameters()
        }
    zero.free_all()
    return out


def _check_traffic(stepper: ScheduledStepper, case: str) -> None:
    """This step's data-parallel collectives (comm.STATS since the step began) are hybrid sharding's."""
    zero = stepper.zero
    assert zero is not None
    shard = sum(f.shard_numel * 4 for f in zero.flats.values())  # fp32 gradient shards, padded
    assert comm.STATS.bytes.get(("all_reduce", "data_replicate")) == shard, (
        f"{case}: replica all-reduce {comm.STATS.bytes.get(('all_reduce', 'data_replicate'))} B, expected {shard}"
    )
    assert comm.STATS.calls.get(("all_reduce", "data_replicate")) == len(zero.flats), case
    assert comm.STATS.bytes.get(("reduce_scatter", "data_shard"), 0) > 0, case
    for kind in ("reduce_scatter", "all_gather", "all_reduce"):
        assert (kind, "data") not in comm.STATS.bytes, f"{case}: a {kind} on the whole data-parallel group"


def _check_replicas_equal(stepper: ScheduledStepper, groups: Groups, case: str) -> None:
    """Every replica of a shard holds the same updated values, bit for bit."""
    zero = stepper.zero
    assert zero is not None and groups.replica is not None
    r = comm.group_size(groups.replica)
    for s, flat in zero.flats.items():
        copies = [torch.empty_like(flat.shard) for _ in range(r)]
        dist.all_gather(copies, flat.shard.contiguous(), group=groups.replica)
        assert all(torch.equal(c, copies[0]) for c in copies), f"{case}: stage {s}'s replicas differ"


def _run_case(name: str, groups_of: dict[Layout, Groups], world: int) -> int:
    parallel = CASES[name][1]
    layout = Layout.from_config(ParallelConfig(**parallel), world)
    cfg = _config(name, parallel, layout.dp)
    plan = resolve(cfg, world, training=False)
    assert plan.zero_shard == 2 and plan.zero_replicas == 2, name
    if layout not in groups_of:
        groups_of[layout] = build_groups(layout, "cpu", zero_shard=plan.zero_shard)
    groups = groups_of[layout]
    steps = [_batches(layout.dp * M * STEPS)[k::STEPS] for k in range(STEPS)]
    ref_losses, ref_norms, ref_grads, ref_params = _reference(cfg.model, steps)
    model = parallelize(_model(cfg.model), layout, groups, cfg)
    stepper = ScheduledStepper(model, cfg, layout, groups, plan)
    assert stepper.zero is not None and stepper.zero.group is groups.shard, name
    d = groups.coord(Axis.DATA)
    for k, batches in enumerate(steps):
        comm.STATS.reset()
        loss = torch.tensor(stepper.run(batches[d * M : (d + 1) * M]))
        _check_traffic(stepper, name)
        comm.all_reduce(loss, groups.dp)
        assert abs(loss.item() / layout.dp - ref_losses[k]) < LOSS_ATOL, (
            f"{name} step {k}: loss {loss.item() / layout.dp} vs {ref_losses[k]}"
        )
        grads = _full_grads(model, stepper)
        assert grads, name
        for n, g in grads.items():
            torch.testing.assert_close(
                g,
                ref_grads[k][n],
                atol=GRAD_ATOL,
                rtol=GRAD_RTOL,
                msg=lambda e, n=n, k=k: f"{name} step {k} grad {n}: {e}",
            )
        norm = stepper.clip(MAX_NORM)
        torch.testing.assert_close(norm, ref_norms[k], rtol=NORM_RTOL, atol=0.0, msg=f"{name} step {k}: norm")
        stepper.optimizer.step()
        stepper.optimizer.zero_grad()
        _check_replicas_equal(stepper, groups, name)
    for n, p in _full_params(model, stepper).items():
        torch.testing.assert_close(
            p, ref_params[n], atol=PARAM_ATOL, rtol=0, msg=lambda e, n=n: f"{name} param {n}: {e}"
        )
    stepper.close()
    return 1


def _cases(rank: int, world: int) -> int:
    torch.set_num_threads(1)
    groups_of: dict[Layout, Groups] = {}
    return sum(_run_case(name, groups_of, world) for name, (w, _) in CASES.items() if w == world)


def test_hsdp_dp4_as_2x2_zero123_matches_reference() -> None:
    """dp 4 = 2 replicas × shard groups of 2, ZeRO 1/2/3, layered and depth-first."""
    counts = run_distributed(_cases, 4, timeout=240)
    assert counts == [sum(w == 4 for w, _ in CASES.values())] * 4


def test_hsdp_with_pipeline_and_tensor_parallel_matches_reference() -> None:
    """dp 4 = 2 × 2 with a pipeline of 2 (tied embedding and head across it) and with 1D tensor parallel 2."""
    counts = run_distributed(_cases, 8, timeout=300)
    assert counts == [sum(w == 8 for w, _ in CASES.values())] * 8
