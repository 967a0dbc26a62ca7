"""The dry run: one rank of a real-size job, built and stepped by the real runtime on fake tensors.

For each chosen rank, in this one process: join a fake process group of the real world size as that rank, build
its model with the trainer (`TrainingRun`) under fake tensors, and run training steps through the same path as
`tessera train` — forward, backward, pipeline schedule, ZeRO gathers and reduce-scatters, clipping, optimizer —
on random token batches. Nothing is allocated, so a 1T-parameter layout runs on a laptop; the shapes, the
schedule and every collective's size are the real ones. Reported per rank (docs/dryrun.md):

- memory, in bytes, from the allocator's view (`tessera.fake.FakeRank`): parameters, gradients and optimizer
  state (the distinct storages held by the runtime's own objects), activations saved for backward (the
  runtime's own counter), the peak of the step and the peak while building;
- communication: `comm.STATS`, bytes per collective kind and group, for one step.

One step is run; its peak is stated for a steady step (the optimizer's state, made by the first update, is
alive through every later step's forward and backward; see `dry_run`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera import comm
from tessera.axes import dim_of
from tessera.config import Config
from tessera.fake import FakeRank, LiveTensor, fake_process_group
from tessera.layout import Axis, Layout, default_ranks, parse_ranks
from tessera.model.documents import document_positions
from tessera.modes import REPLAYS_FORWARD_COLLECTIVES

__all__ = [
    "RankResult",
    "default_ranks",
    "dry_run",
    "estimated_memory",
    "format_peak_tensors",
    "format_rank",
    "formula_traffic",
    "measure_step",
    "parse_ranks",
]

Traffic = dict[tuple[str, str], int]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankResult:
    """What one rank holds and sends in one training step (bytes)."""

    rank: int
    coords: dict[str, int]
    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    build_peak: int
    comm: Traffic = field(default_factory=dict)
    seconds: float = 0.0
    peak_tensors: tuple[LiveTensor, ...] = ()
    """With ``dry_run(..., peak_tensors=True)``: every storage alive at the peak's moment, largest first."""
    peak_phase: str = ""
    """Where the peak is: "backward" (forward and backward; the optimizer state is added to it, see
    `measure_step`) or "update" (the optimizer step)."""


def _dry_config(cfg: Config) -> Config:
    """The config as the dry run executes it: on the fake CPU device, writing nothing, never resuming."""
    train = dataclasses.replace(cfg.train, device="cpu")
    log = dataclasses.replace(cfg.log, progress=False, tensorboard=False)
    ckpt = dataclasses.replace(cfg.checkpoint, resume=False)
    return dataclasses.replace(cfg, train=train, log=log, checkpoint=ckpt)


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and flat-buffer slices counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _state_tensors(run: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters, optimizer state) the run holds: the model's and, under ZeRO, the flat shards'."""
    params = [*run.model.parameters(), *run.stepper.state_module.parameters()]
    for group in run.optimizer.param_groups:
        params.extend(group["params"])
    state = [v for s in run.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params, state


def _grad_tensors(run: Any) -> list[torch.Tensor]:
    """Gradients held after the step's backward: every parameter's ``.grad`` and ZeRO's reduced shards."""
    params, _ = _state_tensors(run)
    zero = run.stepper.zero
    shards = list(zero.grad_shards()) if zero is not None else []
    return [p.grad for p in params if p.grad is not None] + shards


def _fake_batches(run: Any, cfg: Config) -> list[tuple[torch.Tensor, ...]]:
    """Random (tokens, targets) micro-batches; with data.document_mask also their positions within documents, as
    the trainer passes them (`TrainingRun.batches`), so the model builds and saves the document mask it would;
    with context parallelism this rank's part of each (`tessera.parallel.context.context_batch`)."""
    shape = (cfg.train.micro_batch, cfg.model.seq_len)
    v = cfg.model.vocab_size
    batches = [(torch.randint(0, v, shape), torch.randint(0, v, shape)) for _ in range(run.n_micro)]
    if cfg.data.document_mask:
        # token 0 stands in for the end-of-text token: the mask's size and dtype do not depend on where documents
        # end
        batches = [(x, y, document_positions(x, 0)) for x, y in batches]
    if run.layout.cp > 1:  # the context rank's chunks and positions, as `TrainingRun.batches` cuts them
        from tessera.parallel.context import context_batch

        batches = [context_batch(b, run.layout.cp, run.cp_rank) for b in batches]
    return batches


def measure_step(
    cfg: Config, world_size: int, rank: int, tracker: FakeRank | None = None, *, values: bool = True
) -> RankResult:
    """Build this rank's `TrainingRun` in the current process group and run one step on random tokens.

    Works on a real process group as on a fake one (the test compares the two); ``tracker`` supplies the
    allocator's peaks under fake tensors. The step's peak is that of a steady step: the optimizer's state, made
    by the first update, is added to the forward/backward phase's peak, as it is alive there from the second
    step on (everything else a step allocates is freed before the next one: gradients are set to None).
    ``values=False``: the parameters get no initial values (`dry_run`'s choice).
    """
    from tessera.train.trainer import TrainingRun  # torch-heavy: imported only when a dry run happens

    cfg = _dry_config(cfg)
    t0 = time.perf_counter()
    phase: dict[str, int] = {}
    peak = (lambda: tracker.peak) if tracker is not None else (lambda: 0)
    recording = tracker is not None and tracker.record
    if recording:
        tracker.phase = "build"
    run = TrainingRun(cfg, rank, world_size, with_data=False, values=values)
    phase["build_peak"] = peak()
    batches = _fake_batches(run, cfg)
    run.batches = lambda step: batches  # type: ignore[method-assign]  # random tokens, no corpus

    def after_backward(step: int, model: object) -> None:
        phase["backward_peak"], phase["grads"] = peak(), _storage_bytes(_grad_tensors(run))
        if tracker is not None:
            phase["backward_moment"] = tracker.peak_moment()
            tracker.reset_peak()

    if tracker is not None:
        tracker.reset_peak()
        tracker.phase = "step"
    comm.STATS.reset()
    run.step(0, after_backward)
    params, state = _state_tensors(run)
    optimizer = _storage_bytes(state)
    run.stepper.close()
    in_backward = phase["backward_peak"] + optimizer >= peak()
    at_peak: tuple[LiveTensor, ...] = ()
    if recording:
        at_peak = tuple(tracker.live_at(phase["backward_moment"] if in_backward else tracker.peak_moment()))
    return RankResult(
        rank=rank,
        coords={str(a): c for a, c in run.layout.coords(rank).items()},
        params=_storage_bytes(params),
        grads=phase["grads"],
        optimizer=optimizer,
        activations=run.saved_bytes,
        peak=max(phase["backward_peak"] + optimizer, peak()),
        build_peak=phase["build_peak"],
        comm=dict(comm.STATS.bytes),
        seconds=time.perf_counter() - t0,
        peak_tensors=at_peak,
        peak_phase="backward" if in_backward else "update",
    )


def dry_run(cfg: Config, world_size: int, rank: int, *, peak_tensors: bool = False) -> RankResult:
    """Rank ``rank`` of ``world_size``, built and stepped under fake tensors and a fake process group.

    The one place that decides that a dry run draws no initial values: fake tensors cannot hold them, and drawing
    them block by block was nearly half of the Llama-8B example's dry run. The build still allocates every buffer
    a drawing build does (`InitSource`'s ``values``), so the build peak stays the real run's.
    ``peak_tensors``: also keep every storage alive at the peak (`RankResult.peak_tensors`,
    `format_peak_tensors`). The ``tp_comm_overlap`` rings run on a CUDA run's lanes (`ring_1d.device_lanes`),
    one weight-gradient partial sum per lane, as on the GPUs the dry run stands for (a CPU process runs one lane).
    """
    from tessera.parallel.ring_1d import device_lanes  # torch-heavy, as measure_step's imports

    # the rings' lanes as on CUDA: their per-lane weight-gradient sums are a GPU rank's (docs/memory.md)
    with fake_process_group(rank, world_size), FakeRank(record=peak_tensors) as tracker, device_lanes():
        return measure_step(cfg, world_size, rank, tracker, values=False)


def format_peak_tensors(result: RankResult, n: int) -> str:
    """The ``n`` largest groups of storages alive at the rank's peak: storages of one shape and dtype made by the
    same operator, autograd node and code line are one group (a block's tensors made once per micro-batch, or
    per layer, add up there), largest total first, with what the rest and the whole hold."""
    groups: dict[tuple, list[int]] = {}
    for t in result.peak_tensors:
        key = (t.shape, t.dtype, t.op, t.node, t.line, t.phase)
        groups.setdefault(key, []).append(t.nbytes)
    ranked = sorted(groups.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    live = sum(t.nbytes for t in result.peak_tensors)
    unit, scale = _unit(max(live, 1))
    where = "the optimizer step" if result.peak_phase == "update" else "forward and backward"
    lines = [
        f"  peak tensors: {len(result.peak_tensors):,} storages, {live / scale:.3f} {unit} alive at the peak's "
        f"moment ({where}); the {min(n, len(ranked))} largest of {len(ranked):,} groups (same shape, dtype and "
        "origin):"
    ]
    lines.append(f"  {unit:>9} {'count':>6}  {'bytes each':>14}  {'dtype':<9} {'shape':<22} {'made by'}")
    for (shape, dtype, op, node, line, made), sizes in ranked[:n]:
        each = f"{sizes[0]:,}" if len(set(sizes)) == 1 else f"≤{max(sizes):,}"
        origin = f"{op} in {node}" if made == "step" else f"{op} while building"
        lines.append(
            f"  {sum(sizes) / scale:9.3f} {len(sizes):>6}  {each:>14}  {dtype:<9} {list(shape)!s:<22} "
            f"{origin}, {line}"
        )
    rest = live - sum(sum(sizes) for _, sizes in ranked[:n])
    lines.append(f"  {rest / scale:9.3f} in the other {max(len(ranked) - n, 0):,} groups")
    if result.peak_phase == "backward" and result.optimizer:
        lines.append(
            f"  + {result.optimizer / scale:.3f} {unit} of optimizer state, made by the step's update and alive "
            "at this moment in every later step (the reported peak counts it)"
        )
    return "\n".join(lines)


# --- comparison with the estimator and the cost model's traffic formulas ------------------------------------

_AXIS_OF_GROUP = {a.value: dim_of(a).name for a in Axis}
"""Mesh axis (a group's name in comm.STATS) → its dimension, the traffic tables' axis (2D row and column: tensor)."""


def estimated_memory(cfg: Config, world_size: int, rank: int) -> dict[str, float]:
    """`tessera memory`'s components for this rank's pipeline position (each at its own size: activations at
    their peak, gradients when backward is over), plus its ``peak`` (the total) and
    ``build_peak`` (the start-up estimate's build peak, `tessera.startup`, at this pipeline position)."""
    from tessera.memory import COMPONENTS, estimate
    from tessera.startup import startup_memory

    stage = Layout.from_config(cfg.parallel, world_size).coords(rank)[Axis.PIPE]
    est = estimate(cfg, world_size, stage=stage)
    own = {name: float(getattr(est.breakdown, name)) for name in COMPONENTS}
    own["grads"] = est.grads_after_backward  # what the dry run reads when backward is over
    build = startup_memory(cfg, world_size, stage=stage).build
    return {**own, "peak": est.total, "build_peak": build}


def formula_traffic(cfg: Config, world_size: int, rank: int) -> dict[tuple[str, str], float]:
    """Payload bytes per (collective kind, axis) that this rank's step should hand to collectives, by formula.

    - tensor: `tessera.traffic`'s collectives (the runtime's, which the planner prices) for this rank's blocks,
      with the embedding's and the head's where its stages hold them, per micro-batch; full and op checkpointing
      add each block's replayed forward collectives (`traffic.replayed_1d` / `replayed_2d`);
    - pipeline: the cost model's `pp_p2p_volume`, plus each EXCHANGE of the rank's list (a tied embedding's
      gradient swapped between the ranks of the embedding and the head, `ExecutionPlan.exchanged_stages`: send
      and receive of the fp32 table shard);
    - data: the cost model's `dp_volume` with fp32 master weights (`Plan.param_bytes`) and the execution plan's
      gradient-reduction width (`Plan.grad_reduce_width`), the stages exchanged reduced once; ZeRO-3 gathers each
      stage as often as the lowered schedule's GATHER actions say; with hybrid sharding these go to the shard
      group ("data_shard") and each stage's gradient shard is all-reduced over the replica group
      ("data_replicate", `_hybrid_traffic`);
    - the step's scalars: the loss summed over data ranks and broadcast over the pipeline, the gradient norm's
      sum of squares reduced over every group holding gradient shards (4 bytes each).

    The 2D row and column groups are summed under "tensor".
    """
    from tessera.execution import resolve
    from tessera.memory import cost_plan, stage_params
    from tessera.planner.cost import ModelShape

    execution = resolve(cfg, world_size, training=False)  # the stages and schedule the run executes
    shape, plan = ModelShape.from_config(cfg.model), cost_plan(execution)
    # context parallelism: the data × context ranks reduce gradients and the loss (`Groups.batch`), on their
    # group "data_context": the data formulas at dp·cp ranks, renamed below
    batch_plan = dataclasses.replace(plan, dp=plan.dp * plan.cp, cp=1) if plan.cp > 1 else plan
    stage = execution.layout.coords(rank)[Axis.PIPE]
    layers = execution.stage_layers
    mine = execution.rank_stages(stage)
    out: dict[tuple[str, str], float] = {}
    for part in (
        _tensor_traffic(cfg, plan, [layers[s] for s in mine], first=0 in mine, last=len(layers) - 1 in mine),
        _pipe_traffic(shape, plan, stage, execution.exchanged_stages(stage)),
        _data_traffic(cfg, execution, batch_plan, {s: stage_params(shape, plan, layers)[s] for s in mine}),
        _scalar_traffic(batch_plan),
        _context_traffic(cfg, plan),
    ):
        for key, nbytes in part.items():
            key = (key[0], "data_context") if plan.cp > 1 and key[1] == "data" else key
            out[key] = out.get(key, 0.0) + nbytes
    return {key: nbytes for key, nbytes in out.items() if nbytes}


def _context_traffic(cfg: Config, plan: Any) -> dict:
    """K/V all-gathered per block and micro-batch, dK/dV reduce-scattered (`traffic.context_traffic`); full and op
    checkpointing gather again in each block's replayed forward (op: SDPA's backward reads the gathered K/V)."""
    from tessera import traffic

    if plan.cp == 1:
        return {}
    per_micro = traffic.context_traffic(cfg.model, plan.micro_batch, plan.cp, plan.tp, plan.act_bytes)
    gathers = 2 if plan.recompute in REPLAYS_FORWARD_COLLECTIVES else 1
    m = plan.n_microbatches
    return {("all_gather", "context"): gathers * m * per_micro, ("reduce_scatter", "context"): m * per_micro}


_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send", "recv")


def _volume(vol: Any, axis: str) -> dict[tuple[str, str], float]:
    return {(k, axis): getattr(vol, k) for k in _KINDS if getattr(vol, k)}


def _tensor_traffic(cfg: Config, plan: Any, blocks: list[int], *, first: bool, last: bool) -> dict:
    """`tessera.traffic`'s collectives for this rank's blocks (and embedding / head), per micro-batch × m, plus
    what full checkpointing replays per block."""
    from tessera import traffic
    from tessera.planner.cost import ModelShape

    shape = ModelShape.from_config(cfg.model)
    block, replay = traffic.tensor_calls(shape, plan, "block"), traffic.tensor_calls(shape, plan, "replay")
    ends = (traffic.tensor_calls(shape, plan, "embedding") if first else []) + (
        traffic.tensor_calls(shape, plan, "head") if last else []
    )
    calls = traffic.times(block, sum(blocks)) + ends
    if plan.recompute in REPLAYS_FORWARD_COLLECTIVES:  # each block's forward runs again before its backward
        calls += traffic.times(replay, sum(blocks))
    out: dict[tuple[str, str], float] = {}
    for (kind, _), nbytes in traffic.bytes_by_group(calls).items():  # 2D: row and column groups summed
        out[(kind, "tensor")] = out.get((kind, "tensor"), 0.0) + plan.n_microbatches * nbytes
    return out


def _pipe_traffic(shape: Any, plan: Any, stage: int, exchanged: tuple[int, ...]) -> dict:
    """``exchanged``: the pipeline rank's stages whose tied gradient its list exchanges."""
    from tessera.planner.cost import pp_p2p_volume, tied_exchange_bytes

    out = _volume(pp_p2p_volume(shape, plan, stage), "pipe")
    if exchanged:
        swapped = tied_exchange_bytes(shape, plan) * len(exchanged)
        for kind in ("send", "recv"):
            out[(kind, "pipe")] = out.get((kind, "pipe"), 0.0) + swapped
    return out


def _data_traffic(cfg: Config, execution: Any, plan: Any, psi: dict[int, float]) -> dict:
    """``psi``: parameters of each of this rank's stages (before ZeRO sharding)."""
    from tessera.pipeline.ir import ActionKind
    from tessera.planner.cost import dp_volume

    tied = {s for pair in execution.tied_across() for s in pair}  # reduced once, after their EXCHANGE
    once = sum(n for s, n in psi.items() if s in tied)
    volume = dp_volume(
        sum(psi.values()),
        plan,
        grad_bytes=plan.grad_reduce_width,
        param_bytes=plan.param_bytes,
        reduced_once=once,
    )
    out = _volume(volume, "data")
    if plan.zero_stage == 3 and plan.dp > 1:  # a stage is gathered once per GATHER of the executed schedule
        lowered = execution.lowered()
        gathers = [a.stage for actions in lowered for a in actions if a.kind is ActionKind.GATHER_PARAMS]
        count = {s: gathers.count(s) for s in psi}
        last = execution.n_stages - 1
        if cfg.model.tie_embeddings and 0 in psi and last in psi and last != 0:
            count[0] += count[last]  # the head uses the tied table, which lives in stage 0's flat buffer
        out[("all_gather", "data")] = sum(plan.param_bytes * n * count[s] for s, n in psi.items())
    if plan.zero_stage and plan.zero_replicas > 1:
        return _hybrid_traffic(out, plan.zero_dp, psi, plan.grad_reduce_width)
    return out


def _hybrid_traffic(data: dict, shard: int, psi: dict[int, float], width: int) -> dict:
    """Hybrid sharding: ZeRO's collectives run on the shard group ("data_shard", the same bytes: an all-gather's
    output and a reduce-scatter's input are whole stages whatever the group size), plus once per step each
    stage's gradient shard all-reduced over the replica group ("data_replicate"): its flat buffer padded to a
    multiple of the shard size, / shard, ``width`` bytes per element (the gradient-reduction dtype, as the
    reduce-scatter: `FlatStage.launch_replica_reduce`)."""
    out = {(kind, "data_shard"): nbytes for (kind, _), nbytes in data.items()}
    out[("all_reduce", "data_replicate")] = sum(width * math.ceil(n / shard) for n in psi.values() if n)
    return out


def _scalar_traffic(plan: Any) -> dict:
    out: dict[tuple[str, str], float] = {}
    if plan.dp > 1:
        out[("all_reduce", "data")] = 4  # the loss
    if plan.zero_stage and plan.zero_dp > 1:  # ZeRO's norm over the shards (hybrid sharding: its shard group)
        axis = "data_shard" if plan.zero_replicas > 1 else "data"
        out[("all_reduce", axis)] = out.get(("all_reduce", axis), 0) + 4
    if plan.pp > 1:
        out[("broadcast", "pipe")] = 4  # the loss, from the last stage
        out[("all_reduce", "pipe")] = 4  # the gradient norm
    if plan.tp > 1:
        out[("all_reduce", "tensor")] = 4 * (
            2 if plan.tp_kind == "2d" else 1
        )  # the norm (2D: row and column)
    return out


def measured_by_axis(result: RankResult) -> dict[tuple[str, str], int]:
    """The dry run's bytes per (kind, axis): 2D row and column groups summed under "tensor"."""
    out: dict[tuple[str, str], int] = {}
    for (kind, group), nbytes in result.comm.items():
        key = (kind, _AXIS_OF_GROUP.get(group, group))
        out[key] = out.get(key, 0) + nbytes
    return out


def _unit(nbytes: float) -> tuple[str, int]:
    """GiB for real sizes, MiB below 1 GiB so that test-sized runs read sensibly."""
    return ("GiB", 2**30) if nbytes >= 2**30 else ("MiB", 2**20)


def _pct(measured: float, other: float) -> str:
    return f"{100 * (other - measured) / measured:+7.1f}%" if measured else "      —"


def format_rank(result: RankResult, estimate: dict[str, float], traffic: dict[tuple[str, str], float]) -> str:
    """A text report of one rank: memory dry run vs estimate, traffic (bytes) dry run vs formula; a diff is
    (other − dry run) / dry run."""
    where = ", ".join(f"{a} {c}" for a, c in result.coords.items())
    lines = [
        f"rank {result.rank} ({where}), {result.seconds:.1f} s",
    ]
    unit, scale = _unit(result.peak)
    lines.append(f"  {'memory, ' + unit:<16}{'dry run':>10}{'estimate':>10}{'diff':>9}")
    rows = [
        ("params", result.params, estimate["params"]),
        ("grads", result.grads, estimate["grads"]),
        ("optimizer", result.optimizer, estimate["optimizer"]),
        ("activations", result.activations, estimate["activations"]),
        ("peak", result.peak, estimate["peak"]),
    ]
    lines += [f"  {name:<16}{m / scale:10.3f}{e / scale:10.3f}{_pct(m, e):>9}" for name, m, e in rows]
    if estimate.get("cast_cache"):  # alive in the peak, saved by no backward: the dry run has no row for it
        lines.insert(-1, f"  {'cast cache':<16}{'—':>10}{estimate['cast_cache'] / scale:10.3f}")
    build_est = estimate["build_peak"]
    lines.append(
        f"  {'build peak':<16}{result.build_peak / scale:10.3f}{build_est / scale:10.3f}"
        f"{_pct(result.build_peak, build_est):>9}"
    )
    measured = measured_by_axis(result)
    keys = sorted(set(measured) | set(traffic))
    rows = [(f"{k[0]}/{k[1]}", f"{measured.get(k, 0):,}", f"{round(traffic.get(k, 0.0)):,}") for k in keys]
    # a column as wide as its widest number plus a space (a 1T rank moves 1.5e12 bytes: 17 characters)
    w = 1 + max([16, *(len(c) for _, m, f in rows for c in (m, f))])
    lines.append(f"  {'traffic, bytes':<26}{'dry run':>{w}}{'formula':>{w}}{'diff':>9}")
    for key, (name, m, f) in zip(keys, rows, strict=True):
        lines.append(f"  {name:<26}{m:>{w}}{f:>{w}}{_pct(measured.get(key, 0), traffic.get(key, 0.0)):>9}")
    return "\n".join(lines)
