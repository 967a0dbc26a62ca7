"""The pipeline runtime against the single-device model: loss and every gradient, for every schedule.

Each pipeline rank returns the gradients of its stages' parameters (plain names); the parent compares the union
with the plain model's gradients on the full batch (mean over micro-batches, and over data-parallel replicas).
All cases of one world size run in one set of gloo processes (a module fixture), checked by named tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

import pytest
import torch

from tessera import comm
from tessera.config import Config, from_dict
from tessera.groups import build_groups
from tessera.layout import Axis, Layout
from tessera.model.build import build_model
from tessera.parallel.apply import parallelize
from tessera.pipeline import ScheduleError, build_schedule, lower
from tessera.pipeline.ir import Action, ActionKind
from tessera.pipeline.runtime import PipelineEngine, build_pipeline
from tessera.pipeline.stage import split_stages, tied_parameters
from tessera.pipeline.stage_comm import DataParallelStageComm
from tests.harness import run_distributed

# fp32 on CPU. The pipeline sums micro-batch gradients in another order than one full-batch backward, so the
# results agree to rounding, not bit for bit (same tolerances as the data-parallel trainer test).
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
MICRO_BATCH, SEQ = 2, 16
SEED, DATA_SEED = 0, 1


@dataclass(frozen=True)
class Case:
    """One pipeline configuration of the matrix."""

    name: str
    schedule: str
    pp: int
    v: int = 1
    m: int = 4
    dp: int = 1
    family: str = "gpt"
    n_layers: int = 8
    stage_layers: tuple[int, ...] | None = None
    checkpointing: str = "none"
    accumulation: str = "layered"
    options: dict[str, Any] = field(default_factory=dict)
    split_backward: bool = False  # hand-made schedule: every B replaced by I then W
    q: int = 1  # Optimus 2D tensor-parallel grid side
    tp: int = 1  # Megatron 1D tensor-parallel size
    sequence_parallel: bool = False
    tie_embeddings: bool = True  # tied across pipeline ranks: the two stages reduce once, at the end
    head_dim: int | None = None  # None: the size's d_model / n_heads

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp * self.q * self.q

    @property
    def tensor(self) -> bool:
        return self.tp > 1 or self.q > 1


CASES = [
    # pp = 2
    Case("pp2_gpipe", "gpipe", 2),
    Case("pp2_1f1b", "1f1b", 2),
    Case("pp2_interleaved_v2", "interleaved_1f1b", 2, v=2),
    Case("pp2_bf_v2", "breadth_first", 2, v=2),
    Case("pp2_bf_v2_c1", "breadth_first", 2, v=2, options={"consecutive": 1}),
    Case("pp2_bf_v2_m3", "breadth_first", 2, v=2, m=3),
    Case("pp2_bf_v2_vshape", "breadth_first", 2, v=2, options={"placement": "vshape"}),
    Case("pp2_bf_v2_uneven", "breadth_first", 2, v=2, stage_layers=(0, 3, 4, 1)),
    Case("pp2_1f1b_uneven", "1f1b", 2, stage_layers=(2, 6)),
    Case("pp2_1f1b_split_iw", "1f1b", 2, split_backward=True),
    Case("pp2_1f1b_full_ckpt", "1f1b", 2, checkpointing="full"),
    Case("pp2_llama_1f1b", "1f1b", 2, family="llama"),
    Case("pp2_llama_bf_v2", "breadth_first", 2, v=2, family="llama", checkpointing="selective"),
    Case("pp2_qwen2_bf_v2", "breadth_first", 2, v=2, family="qwen2"),
    Case("pp2_qwen3_1f1b_full_ckpt", "1f1b", 2, family="qwen3", checkpointing="full"),
    # pp = 4 and dp2 × pp2 (world 4)
    Case("pp4_gpipe", "gpipe", 4),
    Case("pp4_1f1b", "1f1b", 4),
    Case("pp4_interleaved_v2", "interleaved_1f1b", 4, v=2),
    Case("pp4_bf_v2", "breadth_first", 4, v=2),
    Case("pp4_bf_v2_c1", "breadth_first", 4, v=2, options={"consecutive": 1}),
    Case("pp4_bf_v2_m2", "breadth_first", 4, v=2, m=2),
    Case("pp4_bf_v2_uneven", "breadth_first", 4, v=2, stage_layers=(0, 1, 1, 1, 2, 1, 2, 0)),
    Case("pp4_llama_interleaved_v2", "interleaved_1f1b", 4, v=2, family="llama"),
    Case("dp2_pp2_1f1b", "1f1b", 2, dp=2),
    Case("dp2_pp2_bf_v2", "breadth_first", 2, v=2, dp=2),
    Case("dp2_pp2_bf_v2_depth_first", "breadth_first", 2, v=2, dp=2, accumulation="depth_first"),
    Case(
        "dp2_pp2_1f1b_depth_first_m8", "1f1b", 2, m=8, dp=2, accumulation="depth_first", tie_embeddings=False
    ),
    Case("pp2_tp2_1f1b", "1f1b", 2, tp=2, n_layers=4),
    Case("pp2_tp2_sp_bf_v2", "breadth_first", 2, v=2, tp=2, n_layers=4, sequence_parallel=True),
    Case("pp2_tp2_sp_qwen2_1f1b", "1f1b", 2, tp=2, n_layers=4, sequence_parallel=True, family="qwen2"),
    Case(
        "pp4_qwen3_interleaved_v2_selective",
        "interleaved_1f1b",
        4,
        v=2,
        family="qwen3",
        checkpointing="selective",
    ),
    Case("pp2_tp2_qwen3_bf_v2", "breadth_first", 2, v=2, tp=2, n_layers=4, family="qwen3"),
    # head_dim 16 ≠ 32 / 4 (qwen3-tiny with Qwen3-0.6B's kind of heads): the attention 64 wide, split over tp
    Case(
        "pp2_tp2_sp_qwen3_hd16_1f1b",
        "1f1b",
        2,
        tp=2,
        n_layers=4,
        sequence_parallel=True,
        family="qwen3",
        head_dim=16,
    ),
    # pp2 × Optimus 2D 2×2 (world 8); the 1D cases above share the world-4 processes
    Case("pp2_tp2x2_1f1b", "1f1b", 2, q=2, n_layers=4),
]
BY_NAME = {case.name: case for case in CASES}


def _config(case: Case) -> Config:
    return from_dict(
        {
            "model": {
                "size": {"gpt": "gpt2-tiny"}.get(case.family, f"{case.family}-tiny"),
                "n_layers": case.n_layers,
                "tie_embeddings": case.tie_embeddings,
                **({"head_dim": case.head_dim} if case.head_dim else {}),
            },
            "parallel": {
                "pipeline": case.pp,
                "data": case.dp,
                "stages_per_rank": case.v,
                "stage_layers": list(case.stage_layers) if case.stage_layers else None,
                "checkpointing": case.checkpointing,
                "accumulation": case.accumulation,
                "tensor": f"{case.q}x{case.q}" if case.q > 1 else case.tp,
                "sequence_parallel": case.sequence_parallel,
            },
            "train": {"global_batch": case.dp * case.m * MICRO_BATCH, "micro_batch": MICRO_BATCH},
        }
    )


def _data(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch [dp·m·b, s]: replica d takes rows d·m·b .. (d+1)·m·b, micro-batch j the j-th b of them."""
    g = torch.Generator().manual_seed(DATA_SEED)
    rows = case.dp * case.m * MICRO_BATCH
    return torch.randint(0, 256, (rows, SEQ), generator=g), torch.randint(0, 256, (rows, SEQ), generator=g)


def _micro_batches(case: Case, x: torch.Tensor, y: torch.Tensor, dp_rank: int) -> list[tuple]:
    rows = [dp_rank * case.m * MICRO_BATCH + j * MICRO_BATCH for j in range(case.m)]
    return [(x[r : r + MICRO_BATCH], y[r : r + MICRO_BATCH]) for r in rows]


def _split_iw(lowered_compute: list[list[Action]]) -> list[list[Action]]:
    out = []
    for actions in lowered_compute:
        row = []
        for a in actions:
            if a.kind is ActionKind.BACKWARD:
                row += [Action(a.stage, ActionKind.BACKWARD_INPUT, a.microbatch)]
                row += [Action(a.stage, ActionKind.BACKWARD_WEIGHT, a.microbatch)]
            else:
                row.append(a)
        out.append(row)
    return out


def _engine(case: Case, model: torch.nn.Module, layout: Layout, groups: Any) -> PipelineEngine:
    cfg = _config(case)
    if not case.split_backward:
        return build_pipeline(model, layout, groups, cfg, case.schedule, case.m, **case.options)
    lowered = lower(_split_iw(build_schedule(case.schedule, case.pp, case.m, case.v)), case.pp)
    stages = split_stages(model, case.pp * case.v)
    rank = groups.coord(Axis.PIPE)
    mine = {s.index: s for s in stages if s.index % case.pp == rank}
    comm = DataParallelStageComm(mine, groups.dp)
    return PipelineEngine(mine, lowered, rank, groups.pp, comm, tied=tied_parameters(stages))


def _run_cases(rank: int, world: int, names: list[str]) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    groups_by_layout: dict[Layout, Any] = {}
    for name in names:
        case = BY_NAME[name]
        layout = Layout(dp=case.dp, pp=case.pp, tp=case.tp, q=case.q)
        if layout not in groups_by_layout:
            groups_by_layout[layout] = build_groups(layout)
        groups = groups_by_layout[layout]
        torch.manual_seed(SEED)
        model = build_model(_config(case).model)
        if case.tensor:
            model = parallelize(model, layout, groups, _config(case))
        engine = _engine(case, model, layout, groups)
        x, y = _data(case)
        batches = _micro_batches(case, x, y, groups.coord(Axis.DATA))
        comm.STATS.reset()
        loss = engine.step(batches)
        reduces = comm.STATS.calls.get(("all_reduce", "data"), 0)
        # Layered: one REDUCE per stage per step; depth-first: one per micro-batch (tied stages once, at the end).
        per_stage = [
            1 if case.accumulation == "layered" or s in engine.deferred else case.m for s in engine.stages
        ]
        assert case.dp == 1 or reduces == sum(per_stage), (reduces, per_stage)
        norm_sq = None if case.tensor else float(engine.grad_norm_sq())
        out[name] = (loss, _stage_grads(engine, model, case), groups.coord(Axis.DATA), norm_sq)
    return out


def _reference(case: Case) -> tuple[float, dict[str, torch.Tensor]]:
    return _reference_for(case.family, case.n_layers, case.dp, case.m, case.tie_embeddings, case.head_dim)


def _stage_grads(engine: PipelineEngine, model: torch.nn.Module, case: Case) -> dict[str, torch.Tensor]:
    """Gradients of this rank's stage parameters by plain name (full, unsharded tensors under 1D/2D)."""
    named = [(n, p) for s in engine.stages.values() for n, p in s.named_parameters(remove_duplicate=False)]
    if not case.tensor:
        return {n: p.grad.clone() for n, p in named}
    full = model.full_parameters(grad=True)  # collective over the tensor group
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {n: full[name_of[id(p)]] for n, p in named}


@cache
def _reference_for(
    family: str, n_layers: int, dp: int, m: int, tie_embeddings: bool = True, head_dim: int | None = None
) -> tuple[float, dict[str, torch.Tensor]]:
    case = Case(
        "reference",
        "gpipe",
        1,
        family=family,
        n_layers=n_layers,
        dp=dp,
        m=m,
        tie_embeddings=tie_embeddings,
        head_dim=head_dim,
    )
    torch.manual_seed(SEED)
    model = build_model(_config(case).model)
    x, y = _data(case)
    loss = model(x, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def _names(world: int) -> list[str]:
    return [c.name for c in CASES if c.world == world]


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, tuple]]]:
    torch.set_num_threads(1)
    return {world: run_distributed(_run_cases, world, _names(world), timeout=180) for world in (2, 4, 8)}


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_pipeline_matches_single_device(results: dict[int, list[dict[str, tuple]]], name: str) -> None:
    case = BY_NAME[name]
    ref_loss, ref_grads = _reference(case)
    per_rank = [r[name] for r in results[case.world]]
    for (
        loss,
        *_,
    ) in per_rank:  # every pipeline rank gets its replica's loss; replicas average to the batch loss
        assert loss is not None
    by_replica: dict[int, float] = {dp_rank: loss for loss, _, dp_rank, _ in per_rank}
    mean_loss = sum(by_replica.values()) / case.dp
    torch.testing.assert_close(mean_loss, ref_loss, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    seen: set[str] = set()
    for _, grads, _, _ in per_rank:
        for pname, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[pname], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=pname)
            seen.add(pname)
    assert seen == set(ref_grads), f"parameters without a pipeline gradient: {sorted(set(ref_grads) - seen)}"
    # The global norm: per-rank sums of squares over one replica's pipeline, the tied copy once.
    if not case.tensor:
        unique = {id(g): g for g in ref_grads.values()}
        ref_norm = sum(float(g.pow(2).sum()) for g in unique.values()) ** 0.5
        norm = sum(sq for _, _, dp_rank, sq in per_rank if dp_rank == 0) ** 0.5
        torch.testing.assert_close(norm, ref_norm, rtol=GRAD_RTOL, atol=GRAD_ATOL)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_layered_accumulation_one_rank(family: str) -> None:
    """p = 1, v = n_layers: breadth-first on one rank is pure layered gradient accumulation (no process group)."""
    case = Case(f"p1_bf_{family}", "breadth_first", 1, v=8, family=family)
    torch.manual_seed(SEED)
    model = build_model(_config(case).model)
    engine = build_pipeline(model, Layout(), None, _config(case), case.schedule, case.m)
    x, y = _data(case)
    loss = engine.step(_micro_batches(case, x, y, 0))
    ref_loss, ref_grads = _reference(case)
    torch.testing.assert_close(loss, ref_loss, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    grads = {n: p.grad for s in engine.stages.values() for n, p in s.named_parameters(remove_duplicate=False)}
    assert set(grads) == set(ref_grads)
    for pname, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[pname], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=pname)


def test_engine_rejects_wrong_stages_and_batches() -> None:
    case = Case("p1_1f1b", "1f1b", 1, n_layers=2)
    torch.manual_seed(SEED)
    model = build_model(_config(case).model)
    stages = split_stages(model, 2)
    lowered = lower(build_schedule("breadth_first", 1, 2, 2), 1)
    with pytest.raises(ScheduleError, match="runs stages"):
        PipelineEngine({0: stages[0]}, lowered, 0, None, DataParallelStageComm({0: stages[0]}, None))
    engine = PipelineEngine({s.index: s for s in stages}, lowered, 0, None, DataParallelStageComm({}, None))
    with pytest.raises(ValueError, match="2 micro-batches"):
        engine.step([_data(case)])
    bad = [lowered[0][:-2]]  # drops the last backward: incomplete
    with pytest.raises(ScheduleError, match="incomplete"):
        PipelineEngine({s.index: s for s in stages}, bad, 0, None, DataParallelStageComm({}, None))


def _held_flat_bytes(engine: PipelineEngine, batches: list[tuple]) -> tuple[int, int]:
    """Run one step; (the most bytes the StageComm's buckets hold in flat buffers after a REDUCE, after the step)."""
    stage_comm = engine.comm
    assert isinstance(stage_comm, DataParallelStageComm)
    reduce, most = stage_comm.reduce, 0

    def held() -> int:
        return sum(b.held_bytes for b in stage_comm.buckets.values())

    def counting(stage: int) -> None:
        nonlocal most
        reduce(stage)
        most = max(most, held())

    stage_comm.reduce = counting  # the engine calls it at every REDUCE_MB
    engine.step(batches)
    return most, held()


def _flat_buffer_bytes(rank: int, world: int, ms: list[int]) -> dict[int, tuple[int, int, int]]:
    """Per m: (`_held_flat_bytes`, the stage's gradient bytes)."""
    layout = Layout(dp=2, pp=2)
    groups = build_groups(layout)
    out = {}
    for m in ms:
        case = Case(
            f"dp2_pp2_1f1b_df_m{m}", "1f1b", 2, m=m, dp=2, accumulation="depth_first", tie_embeddings=False
        )
        torch.manual_seed(SEED)
        model = build_model(_config(case).model)
        engine = _engine(case, model, layout, groups)
        x, y = _data(case)
        most, after = _held_flat_bytes(engine, _micro_batches(case, x, y, groups.coord(Axis.DATA)))
        out[m] = (most, after, sum(4 * p.numel() for s in engine.stages.values() for p in s.parameters()))
    return out


def test_plain_depth_first_holds_two_flat_buffers_whatever_the_micro_batches() -> None:
    """dp2 × pp2, depth-first 1F1B, untied embeddings (tied ones reduce once): a REDUCE_MB per micro-batch,
    each all-reduce waited at the next launch and added into the stage's running total. The flat buffers held
    at once: the total and the one just launched (2× the stage's gradient bytes), the same for m = 2 and m = 8
    (before: m copies until the step's end); none after the step (the gradients written back are copies).
    The allocator's view of the same: tests/unit/test_peak_vs_dryrun.py."""
    torch.set_num_threads(1)
    for per_m in run_distributed(_flat_buffer_bytes, 4, [2, 8], timeout=120):
        most = {m: most for m, (most, _, _) in per_m.items()}
        (grads,) = {g for _, _, g in per_m.values()}
        assert most == {2: 2 * grads, 8: 2 * grads}, (most, grads)
        assert all(after == 0 for _, after, _ in per_m.values()), per_m
