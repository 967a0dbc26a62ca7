"""ZeRO-3 with layered accumulation on dp2 × Optimus 2D 2×2 (8 gloo ranks) against the single-device model.

The step is built exactly as the trainer builds it for one pipeline rank (``ScheduledStepper``: one stage per
block, breadth-first, ``ZeroStageComm`` over the data-parallel group). After one step every rank holds only its
reduced ZeRO gradient shards of its 2D blocks; the test all-gathers them over the data-parallel group back into
each stage's flat gradient, hangs the slices on the 2D parameters as ``.grad`` and lets
``Model2D.full_parameters(grad=True)`` reassemble the full tensors, which must equal the plain model's gradients
on the whole global batch — every one of them, on every rank. The loss must match too, and the ZeRO-3
all-gather / reduce-scatter bytes per step must not depend on the micro-batch count m (layered accumulation).

One spawn of 8 processes runs every case (starting gloo workers dominates the cost on two cores).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.distributed as dist

from tessera import comm
from tessera.config import Config, from_dict
from tessera.groups import Groups, build_groups
from tessera.layout import Axis, Layout
from tessera.model.build import build_model
from tessera.parallel.apply import parallelize
from tessera.parallel.model_2d import Model2D
from tessera.pipeline.stage_comm import ZeroStageComm
from tessera.train.steppers import ScheduledStepper
from tests.harness import run_distributed

# fp32 on CPU: layered accumulation, SUMMA and the data-parallel average only reorder sums, so the results agree
# to rounding (the loss tolerances of the pipeline-runtime test).
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL_REL = 1e-4, 1e-6
"""Gradients: rtol per element; atol = GRAD_ATOL_REL × the model's largest reference gradient entry (~0.1 here,
so atol ~1e-7), which bounds entries near zero such as the key bias's, analytically 0. Measured: ≤ 5e-8."""
DP, Q, MICRO_BATCH, SEQ, M = 2, 2, 2, 16, 2
SEED, DATA_SEED = 0, 1
WORLD = DP * Q * Q
FAMILIES = ("gpt", "llama", "qwen2", "qwen3", "qwen3_hd16")
SIZES = {
    "gpt": "gpt2-tiny",
    "llama": "llama-tiny",
    "qwen2": "qwen2-tiny",
    "qwen3": "qwen3-tiny",
    "qwen3_hd16": "qwen3-tiny",
}
HEAD_DIMS = {"qwen3_hd16": 16}
"""head_dim 16 ≠ 32 / 4: the attention 64 wide (Qwen3-0.6B's kind of heads), its SUMMA blocks ZeRO-3 sharded."""


def _config(family: str, m: int) -> Config:
    # d_model 32, 4 heads, 2 blocks; GPT ties the embedding and the head, Llama, Qwen2 and Qwen3 (2 kv heads) do not
    return from_dict(
        {
            "model": {
                "size": SIZES[family],
                "seq_len": SEQ,
                "tie_embeddings": family == "gpt",
                **({"head_dim": HEAD_DIMS[family]} if family in HEAD_DIMS else {}),
            },
            "parallel": {"data": DP, "tensor": f"{Q}x{Q}", "zero": 3, "accumulation": "layered"},
            "train": {"global_batch": DP * m * MICRO_BATCH, "micro_batch": MICRO_BATCH},
        }
    )


def _data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch [dp·m·b, s]: replica d takes rows d·m·b .. (d+1)·m·b, micro-batch j the j-th b of them."""
    g = torch.Generator().manual_seed(DATA_SEED)
    rows = DP * m * MICRO_BATCH
    return torch.randint(0, 256, (rows, SEQ), generator=g), torch.randint(0, 256, (rows, SEQ), generator=g)


def _replica_batches(m: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _data(m)
    rows = [(dp_rank * m + j) * MICRO_BATCH for j in range(m)]
    return [(x[r : r + MICRO_BATCH], y[r : r + MICRO_BATCH]) for r in rows]


def _full_flat_grads(zero: ZeroStageComm) -> None:
    """All-gather every stage's reduced gradient shard over the data-parallel group and set each parameter's
    ``.grad`` to its slice of the rebuilt flat gradient (this rank's 2D blocks, averaged over replicas)."""
    for flat in zero.flats.values():
        if flat.grad_shard is None:
            raise AssertionError(f"a stage holding {len(flat.params)} parameters has no reduced gradient")
        full = torch.empty(flat.padded, dtype=torch.float32)
        dist.all_gather_into_tensor(full, flat.grad_shard.contiguous(), group=zero.group)
        for p, off in zip(flat.params, flat.offsets, strict=True):
            p.grad = full[off : off + p.numel()].view_as(p).clone()


def _plain_names(model: Model2D) -> dict[str, str]:
    """Every plain parameter name (tied aliases included) → the name ``full_parameters`` keys it by."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def _step(family: str, m: int, layout: Layout, groups: Groups) -> dict:
    """One ZeRO-3 step; returns the replica loss, the full gradients and the data-parallel collective bytes."""
    cfg = _config(family, m)
    torch.manual_seed(SEED)
    model = parallelize(build_model(cfg.model), layout, groups, cfg)
    assert isinstance(model, Model2D)
    stepper = ScheduledStepper(model, cfg, layout, groups)
    zero = stepper.zero
    assert zero is not None and zero.zero_stage == 3 and zero.group is groups.dp
    assert len(stepper.engine.stages) == cfg.model.n_layers  # one stage per block, all on this rank
    dp_name = comm.group_name(groups.dp)
    comm.STATS.reset()
    loss = stepper.run(_replica_batches(m, groups.coord(Axis.DATA)))
    counted = {
        kind: comm.STATS.total(kind, dp_name) for kind in ("all_gather", "reduce_scatter", "all_reduce")
    }
    calls = {kind: n for (kind, group), n in comm.STATS.calls.items() if group == dp_name}
    stage_bytes = {s: f.nbytes for s, f in zero.flats.items()}
    _full_flat_grads(zero)
    full = model.full_parameters(grad=True)  # collective over the grid rows and columns
    grads = {plain: full[key] for plain, key in _plain_names(model).items()}
    return {"loss": loss, "grads": grads, "bytes": counted, "calls": calls, "stage_bytes": stage_bytes}


def _run_all(rank: int, world: int) -> dict[tuple[str, int], dict]:
    layout = Layout(dp=DP, q=Q)
    groups = build_groups(layout)
    out = {}
    for family in FAMILIES:
        for m in (1, M):
            result = _step(family, m, layout, groups)
            if m != M:  # only the bytes of the m = 1 step are compared
                result = {k: v for k, v in result.items() if k != "grads"}
            result["dp_rank"] = groups.coord(Axis.DATA)
            out[(family, m)] = result
    return out


@cache
def _reference(family: str, m: int) -> tuple[float, dict[str, torch.Tensor]]:
    cfg = _config(family, m)
    torch.manual_seed(SEED)
    model = build_model(cfg.model)
    x, y = _data(m)
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[str, int], dict]]:
    torch.set_num_threads(1)
    return run_distributed(_run_all, WORLD, timeout=180)


@pytest.mark.parametrize("family", FAMILIES)
def test_zero3_layered_dp2_tp2x2_matches_single_device(results: list[dict], family: str) -> None:
    """The loss (replica losses averaged) and every gradient on every rank equal the plain model's."""
    ref_loss, ref_grads = _reference(family, M)
    per_rank = [r[(family, M)] for r in results]
    by_replica = {r["dp_rank"]: r["loss"] for r in per_rank}
    assert sorted(by_replica) == list(range(DP))
    for r in per_rank:  # every grid rank of a replica reports the same loss
        assert r["loss"] == by_replica[r["dp_rank"]]
    torch.testing.assert_close(sum(by_replica.values()) / DP, ref_loss, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    atol = GRAD_ATOL_REL * max(float(g.abs().max()) for g in ref_grads.values())
    for rank, r in enumerate(per_rank):
        assert r["grads"].keys() == ref_grads.keys(), f"rank {rank}: {sorted(r['grads'])}"
        for name, grad in r["grads"].items():
            torch.testing.assert_close(
                grad,
                ref_grads[name],
                rtol=GRAD_RTOL,
                atol=atol,
                msg=lambda e, n=f"rank {rank} {name}": f"{n}: {e}",
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_zero3_layered_dp_bytes_independent_of_m(results: list[dict], family: str) -> None:
    """Layered accumulation moves the same data-parallel bytes for m = 1 and m = 2, and exactly:

    - reduce-scatter: every stage's padded flat buffer once (one REDUCE per stage per step);
    - all-gather: every stage once per phase (forward, backward) except the last, whose forward and backward are
      adjacent (one GATHER); with tied embeddings the last stage's GATHER also brings back stage 0's buffer,
      which owns the tied weight and was freed after its forward;
    - no data-parallel all-reduce (ZeRO replaces it).
    """
    tied = _config(family, M).model.tie_embeddings
    for rank, r in enumerate(results):
        one, many = r[(family, 1)], r[(family, M)]
        sizes = one["stage_bytes"]
        assert sizes == many["stage_bytes"] and len(sizes) == _config(family, M).model.n_layers
        psi, last = sum(sizes.values()), sizes[max(sizes)]
        expected = {"reduce_scatter": psi, "all_gather": 2 * psi - last + (sizes[0] if tied else 0)}
        for m, step in ((1, one), (M, many)):
            got = step["bytes"]
            assert got == {**expected, "all_reduce": 0}, f"rank {rank} m={m}: {got}, expected {expected}"
        assert one["calls"] == many["calls"], f"rank {rank}: m=1 {one['calls']} vs m={M} {many['calls']}"
