"""Memory estimate per rank for a run configuration, and a plain-language explanation when it does not fit.

Pure Python (no torch): it reuses the cost model's formulas (``tessera.planner.cost``: `memory_per_rank`,
`model_state_bytes`, `activation_bytes_per_layer`) and the pipeline IR's simulator for the number of
micro-batches in flight, and adds what is specific to tessera's runtime (docs/memory.md):

- model state: tessera keeps fp32 parameters as master weights and autocasts compute, so per parameter
  4 (param) + 4 (grad) + 8 (Adam m, v) bytes, sharded by ZeRO-1/2/3 as in Rajbhandari 2020;
- activations: per-layer bytes (Korthikanti 2022, by checkpointing mode) × the peak number of
  (layer, micro-batch) pairs alive on the rank, read from ``simulate`` on the lowered schedule the runtime runs
  (layered accumulation keeps all m micro-batches); plus the head's input and fp32 logits of every in-flight
  micro-batch on the last stage;
- communication buffers: one stage's flattened gradients in flight (ZeRO reduce-scatter or all-reduce), with
  ZeRO-2/3 also the full gradients of the stage in backward, with ZeRO-3 the gathered parameters of one stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessera.config import Config, even_split
from tessera.pipeline.ir import ActionKind, rank_stages
from tessera.pipeline.passes import lower
from tessera.pipeline.schedules import build_schedule
from tessera.planner.cost import MemoryBreakdown, ModelShape, Plan, memory_per_rank, model_state_bytes
from tessera.sim.simulator import simulate

__all__ = ["COMPONENTS", "MemoryEstimate", "estimate", "plan_from_config", "stage_params"]

GIB = 2**30
COMPONENTS = ("params", "grads", "optimizer", "activations", "working", "comm_buffers")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Peak bytes of the fullest rank (pipeline position ``stage``), by component."""

    breakdown: MemoryBreakdown
    stage: int
    """Pipeline rank (position) the estimate is for: the one with the largest total."""
    inflight: float
    """Peak micro-batches in flight on that rank, in units of its whole share of layers."""
    plan: Plan
    device_memory: float | None = None

    @property
    def total(self) -> float:
        return self.breakdown.total

    def components(self) -> dict[str, float]:
        return {name: float(getattr(self.breakdown, name)) for name in COMPONENTS}

    def fits(self, device_bytes: float | None = None) -> bool:
        limit = device_bytes if device_bytes is not None else self.device_memory
        return limit is None or self.total <= limit

    def explain_overflow(self, device_bytes: float | None = None) -> str | None:
        """None if the estimate fits; else which component is too large and the settings that would fix it."""
        limit = device_bytes if device_bytes is not None else self.device_memory
        if limit is None or self.total <= limit:
            return None
        name, size = max(self.components().items(), key=lambda item: item[1])
        lines = [
            f"estimated peak {_fmt(self.total)} per rank exceeds the device's {_fmt(limit)}; "
            f"largest part: {name} {_fmt(size)} of {_fmt(limit)}",
            "  " + ", ".join(f"{k} {_fmt(v)}" for k, v in self.components().items()),
            f"  fix: {_fix_for(name, self.plan)}",
        ]
        return "\n".join(lines)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {_fmt(v)}" for k, v in self.components().items())
        return f"pipeline rank {self.stage}: total {_fmt(self.total)} ({parts})"


def _fmt(nbytes: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB so small runs read sensibly."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


def _fix_for(component: str, plan: Plan) -> str:
    if component in ("activations", "working"):
        fixes = []
        if plan.recompute != "full":
            fixes.append("set parallel.checkpointing = 'full'")
        if plan.micro_batch > 1:
            fixes.append("lower train.micro_batch")
        if plan.accumulation == "layered" and plan.n_microbatches > 1:
            fixes.append("use fewer micro-batches per step (layered accumulation keeps all of them)")
        fixes.append("raise parallel.pipeline or the tensor degree (fewer layers / smaller shards per rank)")
        return " or ".join(fixes)
    if component in ("optimizer", "grads", "params"):
        want = {"optimizer": 1, "grads": 2, "params": 3}[component]
        if plan.zero_stage < want and plan.dp > 1:
            return f"set parallel.zero = {want} (shards {component} over the {plan.dp} data-parallel ranks)"
        if plan.zero_stage < 3 and plan.dp > 1:
            return "set parallel.zero = 3"
        return "raise parallel.pipeline or parallel.tensor, or add data-parallel ranks with parallel.zero = 3"
    return "lower train.micro_batch or use fewer pipeline stages per rank (smaller stage buffers)"


def plan_from_config(cfg: Config, world_size: int) -> Plan:
    """The cost model's Plan for a run configuration on ``world_size`` ranks."""
    par, tr = cfg.parallel, cfg.train
    t, q = par.tensor_shape()
    dp = par.data_size(world_size)
    return Plan(
        dp=dp,
        pp=par.pipeline,
        tp=t * q * q,
        tp_kind="2d" if q > 1 else "1d",
        sequence_parallel=par.sequence_parallel,
        virtual_stages=par.stages_per_rank,
        zero_stage=par.zero,
        micro_batch=tr.micro_batch,
        n_microbatches=max(1, tr.micro_batches(dp)),
        recompute=par.checkpointing,
        accumulation=par.accumulation,
        dtype=tr.dtype,
        flash_attention=True,  # torch SDPA (flash / memory-efficient kernels) keeps no s×s score tensor
    )


def stage_params(shape: ModelShape, plan: Plan, stage_layers: list[int] | None = None) -> list[float]:
    """Parameters of each global stage (before tensor/ZeRO sharding are applied: divided by tp only).

    Stage 0 adds the embedding (+ learned positions), the last stage the final norm and an untied head (or,
    when the head's stage is on another pipeline rank, its own copy of the tied embedding).
    """
    n = plan.pp * plan.virtual_stages
    layers = stage_layers or even_split(shape.n_layers, n)
    h, V = shape.d_model, shape.vocab_size
    out = [count * shape.layer_params() for count in layers]
    out[0] += V * h + (0 if shape.swiglu else shape.seq_len * h)
    out[-1] += (h if shape.swiglu else 2 * h) + (0 if (shape.tied and plan.pp == 1) else V * h)
    return [x / plan.tp for x in out]


def _lowered(cfg: Config, plan: Plan):
    """The schedule the runtime executes (tessera.pipeline.runtime.lowered_schedule's rules, torch-free)."""
    name, options = cfg.parallel.schedule, {}
    if plan.accumulation == "depth_first" and name in ("breadth_first", "bf", "bfs"):
        options["consecutive"] = 1
    compute = build_schedule(name, plan.pp, plan.n_microbatches, plan.virtual_stages, **options)
    return lower(compute, plan.pp, zero3=plan.zero_stage == 3)


def _inflight_layers(cfg: Config, plan: Plan, layers: list[int]) -> tuple[list[float], list[int]]:
    """Per pipeline rank: peak in-flight (layer × micro-batch) count, and peak micro-batches of the last stage."""
    lowered = _lowered(cfg, plan)
    result = simulate(lowered, plan.pp, activation_bytes=dict(enumerate(layers)), check=False)
    last = len(layers) - 1
    live, peak_last = 0, 0
    for action in (a for actions in lowered for a in actions if a.stage == last):
        if action.kind is ActionKind.FORWARD:
            live += 1
            peak_last = max(peak_last, live)
        elif action.kind is ActionKind.BACKWARD:
            live -= 1
    return result.peak_activations, [
        peak_last if last in rank_stages(r, plan.pp, plan.virtual_stages) else 0 for r in range(plan.pp)
    ]


def estimate(
    cfg: Config, world_size: int, device_memory: float | None = None, *, stage: int | None = None
) -> MemoryEstimate:
    """Peak memory per rank for ``cfg`` on ``world_size`` ranks: the fullest pipeline rank's breakdown, or that
    of pipeline position ``stage`` when given (the dry run compares rank by rank)."""
    shape = ModelShape.from_config(cfg.model)
    plan = plan_from_config(cfg, world_size)
    n = plan.pp * plan.virtual_stages
    layers = cfg.parallel.stage_layers or even_split(shape.n_layers, n)
    per_stage = stage_params(shape, plan, layers)
    peaks, last_mb = _inflight_layers(cfg, plan, layers)
    best: MemoryEstimate | None = None
    for rank in range(plan.pp) if stage is None else [stage]:
        mine = rank_stages(rank, plan.pp, plan.virtual_stages)
        share = sum(layers[s] for s in mine) or 1
        # memory_per_rank multiplies by L/p layers; peaks[rank] already counts (layer × micro-batch) pairs
        inflight = peaks[rank] / (shape.n_layers / plan.pp)
        base = memory_per_rank(shape, plan, inflight_microbatches=inflight, stage=rank, precision="fp32")
        bd = _adjust(base, shape, plan, [per_stage[s] for s in mine], last_mb[rank])
        candidate = MemoryEstimate(
            breakdown=bd, stage=rank, inflight=peaks[rank] / share, plan=plan, device_memory=device_memory
        )
        if best is None or candidate.total > best.total:
            best = candidate
    assert best is not None  # pp >= 1
    return best


def _adjust(
    base: MemoryBreakdown, shape: ModelShape, plan: Plan, stage_psi: list[float], last_inflight: int
) -> MemoryBreakdown:
    """tessera-specific terms: exact per-rank parameters, the head's per-micro-batch activations, and the
    buffers of tessera's ZeRO implementation (see the module docstring)."""
    params, grads, optimizer = model_state_bytes(sum(stage_psi), plan.dp, plan.zero_stage, "fp32")
    sbh = shape.seq_len * plan.micro_batch * shape.d_model * plan.act_bytes
    logits = 4 * shape.seq_len * plan.micro_batch * shape.vocab_size / plan.tp
    head = last_inflight * (2 * sbh + logits)
    working = base.working - (
        logits if last_inflight else 0.0
    )  # the logits are counted per micro-batch above
    biggest = max(stage_psi, default=0.0) * 4.0
    buffers = (2 * sbh if plan.pp > 1 else 0.0) + (biggest if plan.dp > 1 or plan.zero_stage else 0.0)
    if plan.zero_stage >= 2:
        buffers += biggest  # the full gradients of the stage in backward, before its reduce-scatter
    if plan.zero_stage >= 3 and plan.dp > 1:
        buffers += biggest  # one stage's gathered parameters
    return replace(
        base,
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=base.activations + head,
        working=max(working, 0.0),
        comm_buffers=buffers,
    )
