"""ZeRO-1/2/3 with layered and depth-first accumulation against the single-device reference (gloo, fp32).

Each data-parallel case checks the loss, EVERY gradient (the reduced shards gathered back to full) and every
parameter after one AdamW step against one process running the whole global batch with torch.optim.AdamW. The
counter tests check that layered accumulation moves the same bytes for any micro-batch count m while depth-first
grows linearly in m, against ``tessera.planner.cost.dp_volume`` and the GATHER count of the lowered schedule.

One spawn per world size: every (ZeRO stage, accumulation) case runs inside the same worker.

``parallel.overlap_param_gather`` (ZeRO-1/2; `OVERLAP_CASES`: d = 2 with two stages on one rank and with a
pipeline of 2, tied embedding and head, layered and depth-first) trains 3 steps through the pipeline runtime
and must equal the same run without the overlap bit for bit (losses, every gradient, every parameter) and the
single-device run within the tolerances below; within it, every gather must still be in flight after the step
and until the first compute of a stage using its buffer, reading parameters meanwhile must raise, and evaluating
right after a step must give the next step's loss.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.config import ModelConfig
from tessera.model.build import build_model
from tessera.parallel.zero import ShardedAdamW
from tessera.pipeline.ir import ActionKind
from tessera.pipeline.passes import lower
from tessera.pipeline.schedules import breadth_first
from tessera.pipeline.stage import split_stages
from tessera.pipeline.stage_comm import ZeroStageComm
from tests.harness import run_distributed

LOSS_ATOL = 1e-5
"""fp32: data-parallel reduction changes only the summation order of the loss average."""
GRAD_ATOL, GRAD_RTOL = 2e-6, 1e-4
"""fp32 gradients of a tiny model: summation-order differences are ~1e-7 absolute."""
PARAM_ATOL = 2e-6
"""After one AdamW step (lr 1e-2): the update is lr·m/(sqrt(v)+eps), sign-stable; differences ~1e-7."""

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-6, 0.1
"""EPS well above the rounding level of a gradient: PARAM_ATOL's premise (a sign-stable update lr·g/(|g| + eps))
fails for an element whose gradient cancels to ~eps — with eps = 1e-8 one such element (|g| = 1.8e-8 among
gradients of median 8e-4) moved 2.7e-6 differently by the summation order alone."""
SEQ, MICRO = 8, 2


def _cfg(tied: bool = True) -> ModelConfig:
    return ModelConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=SEQ, tie_embeddings=tied)


def _model(cfg: ModelConfig) -> nn.Module:
    torch.manual_seed(0)
    return build_model(cfg)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 32, (MICRO, SEQ), generator=g), torch.randint(0, 32, (MICRO, SEQ), generator=g))
        for _ in range(n)
    ]


def run_layered(actions, stages, zero, batches, m: int, counter=None) -> float:
    """Execute one rank's lowered p = 1 schedule (F/B/REDUCE/GATHER/FREE) with each micro-batch loss divided by
    the step's micro-batch count ``m``; returns the summed scaled loss."""
    last = len(stages) - 1
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    grads: dict[tuple[int, int], torch.Tensor] = {}
    total = 0.0
    for a in actions:
        s, j = a.stage, a.microbatch
        if a.kind is ActionKind.GATHER_PARAMS:
            zero.gather(s)
            zero.wait_gather(s)
        elif a.kind is ActionKind.FREE_PARAMS:
            zero.free(s)
        elif a.kind is ActionKind.REDUCE_GRAD:
            zero.reduce(s)
        elif a.kind is ActionKind.FORWARD:
            x = batches[j][0] if s == 0 else saved[(s - 1, j)][1].detach().requires_grad_()
            with counter if counter is not None else contextlib.nullcontext():
                out = stages[s](x, batches[j][1] if s == last else None)
            if s == last:
                out = out / m
                total += out.item()
            saved[(s, j)] = (x, out)
        elif a.kind is ActionKind.BACKWARD:
            x, out = saved.pop((s, j))
            out.backward(None if s == last else grads.pop((s, j)))
            if s > 0:
                grads[(s - 1, j)] = x.grad
    return total


def zero_step(stages, zero, batches, accumulation: str, counter=None) -> float:
    """One accumulation step: layered = one breadth-first sweep over all m micro-batches; depth-first = m
    sweeps of one micro-batch each (REDUCE, GATHER, FREE per micro-batch)."""
    v, z3 = len(stages), zero.zero_stage == 3
    groups = [batches] if accumulation == "layered" else [[b] for b in batches]
    total = 0.0
    for group in groups:
        actions = lower(breadth_first(1, len(group), v), 1, zero3=z3)[0]
        total += run_layered(actions, stages, zero, group, len(batches), counter)
    zero.finish()
    return total


def _full_grads(zero: ZeroStageComm) -> dict[int, torch.Tensor]:
    """Every managed parameter's reduced gradient, gathered from the shards (id(param) -> grad)."""
    out = {}
    for flat in zero.flats.values():
        full = torch.empty(flat.padded)
        dist.all_gather_into_tensor(full, flat.grad_shard.contiguous(), group=zero.group)
        for p, off in zip(flat.params, flat.offsets, strict=True):
            out[id(p)] = full[off : off + p.numel()].view_as(p)
    return out


def _reference(cfg: ModelConfig, batches) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    losses, grads, params = _reference_steps(cfg, [batches])
    return losses[0], grads[0], params


def _reference_steps(
    cfg: ModelConfig, steps: list[list], clip: tuple[float, list[float]] | None = None
) -> tuple[list[float], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process, torch.optim.AdamW, one step per entry of ``steps`` (a global batch's micro-batches): every
    step's mean loss and gradients (by every name, tied aliases too), then the parameters. ``clip`` = (max norm,
    a list): each step's gradients are clipped by torch's ``clip_grad_norm_`` after they are recorded, and the
    norm it returns is appended to the list."""
    model = _model(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        foreach=False,
    )
    losses, grads = [], []
    for batches in steps:
        total = 0.0
        for x, y in batches:
            loss = model(x, y) / len(batches)
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        if clip is not None:
            clip[1].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip[0])))
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _check_case(rank: int, world: int, zero_stage: int, accumulation: str, m: int) -> None:
    cfg = _cfg()
    batches = _batches(world * m)
    ref_loss, ref_grads, ref_params = _reference(cfg, batches)
    model = _model(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    stages = split_stages(model, cfg.n_layers)
    zero = ZeroStageComm(stages, None, zero_stage, accumulation)
    opt = ShardedAdamW(zero, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    mine = batches[rank * m : (rank + 1) * m]  # this data-parallel rank's micro-batches
    loss = torch.tensor(zero_step(stages, zero, mine, accumulation))
    comm.all_reduce(loss, None)
    case = f"dp{world} z{zero_stage} {accumulation}"
    assert abs(loss.item() / world - ref_loss) < LOSS_ATOL, (
        f"{case}: loss {loss.item() / world} vs {ref_loss}"
    )
    for pid, g in _full_grads(zero).items():
        torch.testing.assert_close(
            g,
            ref_grads[names[pid]],
            atol=GRAD_ATOL,
            rtol=GRAD_RTOL,
            msg=lambda e, n=names[pid]: f"{case} grad {n}: {e}",
        )
    opt.step()
    zero.gather_all()
    for n, p in model.named_parameters():
        torch.testing.assert_close(
            p.detach(), ref_params[n], atol=PARAM_ATOL, rtol=0, msg=lambda e, n=n: f"{case} param {n}: {e}"
        )
    zero.free_all()


def _matrix(rank: int, world: int) -> int:
    for zero_stage in (1, 2, 3):
        for accumulation in ("layered", "depth_first"):
            _check_case(rank, world, zero_stage, accumulation, m=2)
    return 0


def _step_bytes(zero_stage: int, accumulation: str, m: int) -> tuple[int, int, dict[int, int]]:
    """(reduce-scatter bytes, all-gather bytes, {stage: flat-buffer bytes}) of one step with m micro-batches."""
    cfg = _cfg(tied=False)
    stages = split_stages(_model(cfg), cfg.n_layers)
    zero = ZeroStageComm(stages, None, zero_stage, accumulation)
    opt = ShardedAdamW(zero, lr=LR)
    comm.STATS.reset()
    zero_step(stages, zero, _batches(m), accumulation)
    opt.step()
    sizes = {s: f.nbytes for s, f in zero.flats.items()}
    return comm.STATS.total("reduce_scatter"), comm.STATS.total("all_gather"), sizes


def _counters(rank: int, world: int) -> dict:
    return {
        (z, acc, m): _step_bytes(z, acc, m)
        for z in (1, 2, 3)
        for acc in ("layered", "depth_first")
        for m in (1, 2, 4, 8)
    }


def _matrix_and_counters(rank: int, world: int) -> tuple[dict, int]:
    _matrix(rank, world)
    return _counters(rank, world), _overlap_cases(rank, world)


def test_zero_dp2_matches_reference_and_counts_bytes() -> None:
    """dp2 × ZeRO 1/2/3 × layered/depth-first against the reference, then the byte counters, then the
    overlap_param_gather cases of two ranks (one spawn: starting gloo workers costs ~10 s on two cores)."""
    got, overlap_cases = run_distributed(_matrix_and_counters, 2, timeout=180)[0]
    _check_counters(got)
    assert overlap_cases == sum(w == 2 for w, _ in OVERLAP_CASES.values())


def _check_counters(got: dict) -> None:
    """Layered: one reduce-scatter per stage per step and (ZeRO-3) one gather per phase, for every m;
    depth-first: ZeRO-2/3 reduce-scatter and ZeRO-3 gather per micro-batch, so bytes = m × bytes(m = 1).
    ZeRO-1 keeps full gradients and reduce-scatters once per step in either order."""
    v = _cfg(tied=False).n_layers
    for z in (1, 2, 3):
        sizes = got[(z, "layered", 1)][2]
        psi = sum(sizes.values())  # padded flat bytes of all stages: Ψ·4 of cost.dp_volume
        sweep = lower(breadth_first(1, 1, v), 1, zero3=True)[0]  # GATHERs per sweep (same for any m)
        gathered = sum(sizes[a.stage] for a in sweep if a.kind is ActionKind.GATHER_PARAMS)
        for m in (1, 2, 4, 8):
            rs_l, ag_l, _ = got[(z, "layered", m)]
            rs_d, ag_d, _ = got[(z, "depth_first", m)]
            assert rs_l == psi, f"z{z} layered m={m}: reduce-scatter {rs_l} B, expected {psi}"
            assert rs_d == (psi if z == 1 else m * psi), f"z{z} depth-first m={m}: reduce-scatter {rs_d} B"
            if z < 3:  # one all-gather of the updated parameters per step
                assert ag_l == ag_d == psi, f"z{z} m={m}: all-gather {ag_l}/{ag_d} B, expected {psi}"
            else:
                assert ag_l == gathered, f"z3 layered m={m}: all-gather {ag_l} B, expected {gathered}"
                assert ag_d == m * gathered, (
                    f"z3 depth-first m={m}: all-gather {ag_d} B, expected {m * gathered}"
                )


def test_zero_dp4_matches_reference() -> None:
    run_distributed(_matrix, 4, timeout=120)


def test_sharded_adamw_on_one_rank_equals_torch_adamw_exactly() -> None:
    """d = 1: the shard is the whole flat buffer and the update is torch.optim.AdamW's, bit for bit."""
    cfg = _cfg()
    ref, model = _model(cfg), _model(cfg)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    other = [p for p in ref.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}]
    torch_opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)
    zero = ZeroStageComm([model], None, 2)
    opt = ShardedAdamW(zero, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for x, y in _batches(3):
        ref(x, y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
        model(x, y).backward()
        zero.reduce(0)
        zero.finish()
        opt.step()
        opt.zero_grad()
        for (n, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), f"{n} differs from torch.optim.AdamW"


def _pp2_zero3(rank: int, world: int) -> float:
    from tessera.config import Config, ParallelConfig, TrainConfig
    from tessera.groups import build_groups
    from tessera.layout import Layout
    from tessera.pipeline.runtime import build_pipeline

    cfg = Config(
        model=_cfg(),
        parallel=ParallelConfig(pipeline=2, schedule="breadth_first", zero=3, accumulation="layered"),
        train=TrainConfig(global_batch=2 * 2 * MICRO, micro_batch=MICRO),
    )
    layout = Layout.from_config(cfg.parallel, world)
    groups = build_groups(layout)
    dp = layout.dp
    m = cfg.train.micro_batches(dp)
    batches = _batches(dp * m)
    ref_loss, ref_grads, ref_params = _reference(cfg.model, batches)
    model = _model(cfg.model)
    holder: dict[str, ZeroStageComm] = {}

    def make(stages):
        holder["zero"] = ZeroStageComm(stages, groups.dp, 3, "layered")
        return holder["zero"]

    engine = build_pipeline(model, layout, groups, cfg, stage_comm=make)
    zero = holder["zero"]
    opt = ShardedAdamW(zero, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    from tessera.layout import Axis

    d = groups.coord(Axis.DATA)
    loss = torch.tensor(engine.step(batches[d * m : (d + 1) * m]))
    comm.all_reduce(loss, groups.dp)
    assert abs(loss.item() / dp - ref_loss) < LOSS_ATOL, f"pp2 dp2 z3: loss {loss.item() / dp} vs {ref_loss}"
    names = {id(p): n for s in engine.stages.values() for n, p in s.named_parameters()}
    grads = _full_grads(zero)
    for pid, g in grads.items():
        n = names[pid]
        torch.testing.assert_close(
            g, ref_grads[n], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda e, n=n: f"rank {rank} {n}: {e}"
        )
    opt.step()
    zero.gather_all()
    for s in engine.stages.values():
        for n, p in s.named_parameters():
            torch.testing.assert_close(p.detach(), ref_params[n], atol=PARAM_ATOL, rtol=0)
    return len(grads)


def _pp2_cases(rank: int, world: int) -> tuple[int, int]:
    return _pp2_zero3(rank, world), _overlap_cases(rank, world)


def test_dp2_pp2_zero3_and_overlapped_zero12_match_reference() -> None:
    """ZeRO-3 layered, then the overlap_param_gather cases of four ranks (pipeline 2, tied across it)."""
    counts = run_distributed(_pp2_cases, 4, timeout=120)
    assert all(c > 0 for c, _ in counts)
    assert all(n == sum(w == 4 for w, _ in OVERLAP_CASES.values()) for _, n in counts)


def test_dynamic_loss_scaler_skips_on_overflow_and_grows() -> None:
    from tessera.parallel.precision import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    grads = [torch.tensor([8.0, 16.0])]
    assert scaler.unscale_and_check(grads)
    assert torch.equal(grads[0], torch.tensor([1.0, 2.0]))  # unscaled in place
    scaler.update(True)
    assert scaler.scale == 8.0
    scaler.update(True)
    assert scaler.scale == 16.0  # grown after growth_interval clean steps
    bad = [torch.tensor([1.0, float("inf")])]
    assert not scaler.unscale_and_check(bad)
    scaler.update(False)
    assert scaler.scale == 8.0 and scaler.good_steps == 0 and scaler.skipped == 1
    assert not scaler.unscale_and_check([torch.tensor([float("nan")])])
    state = scaler.state_dict()
    other = DynamicLossScaler()
    other.load_state_dict(state)
    assert other.scale == scaler.scale


# --- parallel.overlap_param_gather: ZeRO-1/2's post-step all-gather waited for at each stage's first compute ----

OVERLAP_STEPS = 3
"""Step k's loss and gradients depend on step k-1's update: a stage computing before its gather completed would
show in steps 1 and 2 (its other rank's half of every buffer is one update old)."""
OVERLAP_M = 4
OVERLAP_CASES = {  # name: (world size, parallel section); every model ties its embedding and head
    "dp2_z1_two_stages": (2, {"zero": 1, "schedule": "breadth_first", "stages_per_rank": 2}),
    "dp2_z2_two_stages_depth_first": (
        2,
        {"zero": 2, "schedule": "breadth_first", "stages_per_rank": 2, "accumulation": "depth_first"},
    ),
    "dp2_pp2_z1_1f1b": (4, {"pipeline": 2, "schedule": "1f1b", "zero": 1}),
    "dp2_pp2_z2_bf_depth_first": (
        4,
        {"pipeline": 2, "schedule": "breadth_first", "zero": 2, "accumulation": "depth_first"},
    ),
}


def _record_waits(zero: ZeroStageComm) -> list[tuple[int, set[int]]]:
    """From now on: before every ``wait_gather(stage)`` the runtime makes, (stage, the buffers still in flight)."""
    log: list[tuple[int, set[int]]] = []
    wait = zero.wait_gather

    def recording(stage: int) -> None:
        log.append((stage, {o for o, f in zero.flats.items() if f.gather_pending}))
        wait(stage)

    zero.wait_gather = recording  # type: ignore[method-assign]
    return log


def _check_deferred(zero: ZeroStageComm, log: list[tuple[int, set[int]]], case: str) -> None:
    """Every buffer's post-step gather stayed in flight until the first compute of a stage using it, and the
    stages are first computed in ascending order (the order `gather_updated_params` launches them in)."""
    assert log and log[0][1] == set(zero.flats), f"{case}: waited for before the first compute: {log[:1]}"
    for owner in zero.flats:
        first = next(i for i, (s, _) in enumerate(log) if owner in zero.uses[s])
        assert owner in log[first][1], (
            f"{case}: stage {owner}'s gather was waited for before its first compute"
        )
    firsts = list(dict.fromkeys(s for s, _ in log))
    assert firsts == sorted(firsts), f"{case}: stages first computed in the order {firsts}"
    assert not any(f.gather_pending for f in zero.flats.values()), f"{case}: a gather outlived the step"


def _check_in_flight(zero: ZeroStageComm, engine, case: str) -> None:
    """Right after the optimizer step every buffer's gather is still in flight, and reading a stage's
    parameters outside the runtime raises instead of seeing the old slices."""
    assert all(f.gather_pending for f in zero.flats.values()), f"{case}: the step waited for its gathers"
    try:
        next(iter(engine.stages.values())).state_dict()
    except RuntimeError as e:
        assert "finish_param_gathers" in str(e), e
    else:
        raise AssertionError(f"{case}: reading parameters with their gather in flight did not raise")


def _train_engine(cfg, layout, groups, steps: list[list], case: str):
    """``cfg``'s layout through the pipeline runtime with ShardedAdamW: per step the data-parallel mean loss
    and every reduced gradient by name, then every parameter by name. With overlap_param_gather it also checks
    the gathers are deferred (step 1) and that evaluating right after a step sees the update (step 2)."""
    from tessera.layout import Axis
    from tessera.pipeline.runtime import build_pipeline

    holder: dict[str, ZeroStageComm] = {}
    par, overlap = cfg.parallel, cfg.parallel.overlap_param_gather

    def make(stages):
        holder["zero"] = ZeroStageComm(
            stages, groups.dp, par.zero, par.accumulation, overlap_param_gather=overlap
        )
        return holder["zero"]

    engine = build_pipeline(_model(cfg.model), layout, groups, cfg, stage_comm=make)
    zero = holder["zero"]
    opt = ShardedAdamW(zero, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    names = {id(p): n for st in engine.stages.values() for n, p in st.named_parameters()}
    d, m = groups.coord(Axis.DATA), engine.m
    losses, grads = [], []
    for k, batches in enumerate(steps):
        mine = batches[d * m : (d + 1) * m]
        log = _record_waits(zero) if overlap and k == 1 else None
        evaluated = engine.evaluate(mine) if overlap and k == 2 else None
        loss = engine.step(mine)
        if log is not None:
            del zero.wait_gather  # the class's method again
            _check_deferred(zero, log, case)
        if evaluated is not None:
            assert evaluated == loss, f"{case}: evaluated {evaluated} right after step 1, trained {loss}"
        total = torch.tensor(loss)
        comm.all_reduce(total, groups.dp)
        losses.append(total.item() / layout.dp)
        grads.append({names[pid]: g.clone() for pid, g in _full_grads(zero).items()})
        opt.step()
        if overlap:
            _check_in_flight(zero, engine, case)
        opt.zero_grad()
    zero.close()
    params = {n: p.detach().clone() for st in engine.stages.values() for n, p in st.named_parameters()}
    return losses, grads, params


def _overlap_cases(rank: int, world: int) -> int:
    """This world size's overlap cases: each trained with and without the overlap (bit-identical: the same
    collectives on the same data, only waited for later) and against the single-device reference."""
    from tessera.config import Config, ParallelConfig, TrainConfig
    from tessera.groups import build_groups
    from tessera.layout import Layout

    names = [n for n, (w, _) in OVERLAP_CASES.items() if w == world]
    first = ParallelConfig(**OVERLAP_CASES[names[0]][1])
    layout = Layout.from_config(first, world)
    groups = build_groups(layout)  # one set of groups: every case of a world size has the same layout
    dp = layout.dp
    steps = [_batches(dp * OVERLAP_M * OVERLAP_STEPS)[k::OVERLAP_STEPS] for k in range(OVERLAP_STEPS)]
    ref_losses, ref_grads, ref_params = _reference_steps(_cfg(), steps)
    for name in names:
        runs = {}
        for overlap in (False, True):
            parallel = ParallelConfig(**OVERLAP_CASES[name][1], overlap_param_gather=overlap)
            cfg = Config(
                model=_cfg(),
                parallel=parallel,
                train=TrainConfig(global_batch=dp * OVERLAP_M * MICRO, micro_batch=MICRO),
            )
            assert Layout.from_config(parallel, world) == layout, name
            runs[overlap] = _train_engine(cfg, layout, groups, steps, name)
        (losses, grads, params), (sync_losses, sync_grads, sync_params) = runs[True], runs[False]
        assert losses == sync_losses, f"{name}: losses {losses} vs {sync_losses} without the overlap"
        for k in range(OVERLAP_STEPS):
            assert abs(losses[k] - ref_losses[k]) < LOSS_ATOL, (
                f"{name} step {k}: {losses[k]} vs {ref_losses[k]}"
            )
            for n, g in grads[k].items():
                assert torch.equal(g, sync_grads[k][n]), (
                    f"{name} step {k} grad {n} differs without the overlap"
                )
                torch.testing.assert_close(
                    g,
                    ref_grads[k][n],
                    atol=GRAD_ATOL,
                    rtol=GRAD_RTOL,
                    msg=lambda e, n=n, k=k, c=name: f"{c} step {k} grad {n}: {e}",
                )
        for n, p in params.items():
            assert torch.equal(p, sync_params[n]), f"{name} param {n} differs without the overlap"
            torch.testing.assert_close(
                p, ref_params[n], atol=PARAM_ATOL, rtol=0, msg=lambda e, n=n, c=name: f"{c} param {n}: {e}"
            )
    return len(names)
