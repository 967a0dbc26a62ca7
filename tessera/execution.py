"""The one resolved execution plan: what a (config, world size) actually runs, decided once. No torch.

`resolve(cfg, world_size)` returns an `ExecutionPlan` or raises ConfigError listing every violation;
`violations(cfg, world_size)` returns the list. Everything that needs to know what runs consumes the plan and
re-derives nothing: `tessera validate` prints it, the trainer builds its stepper and pipeline from it, the memory
estimator (`tessera.memory`) and the planner's search price it, calibration predicts it.

Decisions made here (and only here):

- the runner: the schedule runtime for a pipeline, ZeRO, or layered accumulation of several micro-batches; else
  the direct loop (micro-batches one after another, bucketed all-reduce overlapped with the last backward);
- the schedule actually used: on a single pipeline rank the schedule runtime cuts the model into one stage per
  block and runs it breadth-first (layered accumulation, so ZeRO's gathers and reduce-scatters happen once per
  block per step; docs/zero.md) unless the config asks for several stages per rank itself;
- the stages: how many per pipeline rank, each global stage's blocks, and which pipeline rank holds it;
- accumulation order, checkpointing, ZeRO stage, micro-batch size and count, dtype, and the dtype of the
  gradient reduction (`train.grad_reduce_dtype`: ZeRO's reduce-scatter; plain data parallelism reduces fp32).

The cross-section rules (world size, tensor and pipeline divisibility, batch arithmetic, schedule constraints,
the gradient reduction's dtype against the ZeRO stage) live here; `tessera.config` keeps the per-section field
checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial

from tessera.axes import DIMS
from tessera.config import (
    ARITHMETIC_RULES,
    Config,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    Violation,
    even_split,
)
from tessera.config.checks import divisors_near, multiple_near, multiples_around
from tessera.errors import ConfigError, DataError
from tessera.layout import Layout
from tessera.modes import BREADTH_FIRST, DEPTH_FIRST, LAYERED, reduces_every_microbatch
from tessera.pipeline.build import lowered_schedule
from tessera.pipeline.ir import Schedule, ScheduleError, stage_to_rank
from tessera.pipeline.passes import tied_across, tied_stages

__all__ = [
    "DIRECT",
    "RUNNERS",
    "SCHEDULE_CHECK_LIMIT",
    "SCHEDULE_RUNTIME",
    "ExecutionPlan",
    "StagePlan",
    "context_violations",
    "decide",
    "resolve",
    "tensor_violations",
    "violations",
]

DIRECT, SCHEDULE_RUNTIME = "direct", "schedule"
RUNNERS = (DIRECT, SCHEDULE_RUNTIME)
"""Which stepper runs a step: the direct loop or the schedule IR runtime (tessera.train.steppers)."""
SCHEDULE_CHECK_LIMIT = 200_000
"""Build and validate the lowered schedule at validate time when it has at most this many compute actions
(2·p·v·m); a larger one is only checked against the schedule rules (the runtime still validates it at start)."""
_ONE_STAGE_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One global pipeline stage: its blocks, whether it holds the embedding / head, and its pipeline rank."""

    index: int
    rank: int
    first_block: int
    n_blocks: int
    embedding: bool
    head: bool

    def describe(self) -> str:
        blocks = (
            f"blocks {self.first_block}-{self.first_block + self.n_blocks - 1}"
            if self.n_blocks > 1
            else (f"block {self.first_block}" if self.n_blocks == 1 else "no blocks")
        )
        extra = [name for name, has in (("embedding", self.embedding), ("head", self.head)) if has]
        return f"stage {self.index} ({', '.join([blocks, *extra])})"


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionPlan:
    """What one run executes on ``world_size`` ranks (see the module docstring for who decides what)."""

    world_size: int
    layout: Layout
    """The size of every parallel dimension (`tessera.axes.DIMS`); ``dp``, ``pp``, ``tp``, ``q`` read it."""
    sequence_parallel: bool
    tp_comm_overlap: bool = False
    """Tensor-parallel collectives (1D + SP) run as rings under their GEMM chunks (`parallel.tp_comm_overlap`)."""
    overlap_param_gather: bool = False
    """ZeRO-1/2's post-step parameter all-gather is waited for per stage at its next compute, not at the step."""
    runner: str
    """DIRECT or SCHEDULE_RUNTIME."""
    schedule: str | None
    """The schedule the runtime builds (a config name or a .csv path); None for the direct loop."""
    configured_schedule: str
    switched_to_breadth_first: bool
    """True when one pipeline rank runs breadth-first with one stage per block instead of the configured schedule."""
    stages_per_rank: int
    stage_layers: tuple[int, ...]
    """Blocks of each global stage (pp · stages_per_rank entries); the direct loop runs one stage of all blocks."""
    placement: str
    """Stage → pipeline rank map: "loop" (stage % pp) or "vshape" (a hand-written schedule's)."""
    accumulation: str
    """layered or depth_first: the order the runner accumulates micro-batches in (the direct loop: depth-first)."""
    checkpointing: str
    """Activation checkpointing of every stage's blocks."""
    zero: int
    zero_shard: int
    """Ranks of one ZeRO shard group (with context parallelism: the data × context ranks, the ones that average
    gradients, as torchtitan and Megatron-Core shard over dp × cp): consecutive data-parallel ranks (the inner part of the data axis,
    `tessera.layout.Layout.data_shard_groups`) that shard the model state; the data-parallel size / zero_shard
    replica groups all-reduce the gradient shards (hybrid sharding, `parallel.zero_shard_size`). The whole
    data-parallel size when the config leaves it unset."""
    micro_batch: int
    micro_batches: int
    global_batch: int
    dtype: str
    grad_reduce_dtype: str
    """dtype of the data-parallel gradient reduction, "fp32" or "bf16" (ZeRO's reduce-scatter; a bf16 one halves
    its bytes). Plain data parallelism all-reduces fp32 gradients, so bf16 there is a violation; with one data
    rank nothing is reduced and the gradients stay fp32 (no rounding without traffic to save)."""
    n_layers: int
    tied: bool
    """The token embedding is the head's output projection (model.tie_embeddings): stage 0 and the last stage
    share it (`tied_across`)."""
    document_mask: bool = False
    """Attention stops at document boundaries (data.document_mask): every layer's SDPA gets the micro-batch's
    [b, 1, s, s] additive mask, one tensor shared by the layers, which they keep for backward
    (`tessera.planner.cost.rank_memory.shared_mask_bytes`)."""
    schedule_checked: bool = field(default=False, compare=False)
    """The lowered schedule was built and validated at resolve time (see SCHEDULE_CHECK_LIMIT)."""

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        """Context-parallel size c: each rank holds 1/c of every sequence (docs/context-parallel.md)."""
        return self.layout.cp

    @property
    def batch_ranks(self) -> int:
        """Ranks that split a global batch's tokens and average its gradients: data × context."""
        return self.layout.batch_ranks

    @property
    def zero_replicas(self) -> int:
        """ZeRO shard groups that replicate each other (1 without hybrid sharding): each gradient shard is
        all-reduced over this many ranks."""
        return self.batch_ranks // self.zero_shard

    @property
    def tp(self) -> int:
        """1D tensor-parallel size t (1 with a 2D grid)."""
        return self.layout.tp

    @property
    def q(self) -> int:
        """Side of the 2D tensor grid q×q (1 for 1D)."""
        return self.layout.q

    @property
    def tensor_ranks(self) -> int:
        return self.layout.tensor_size

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank holding global ``stage``."""
        return stage_to_rank(stage, self.pp, self.placement)

    def rank_stages(self, rank: int) -> list[int]:
        """Global stages held by pipeline rank ``rank``, ascending."""
        if self.placement == "loop":  # stage % pp, without asking every stage
            return list(range(rank, self.n_stages, self.pp))
        return [s for s in range(self.n_stages) if self.stage_rank(s) == rank]

    def stages(self) -> list[StagePlan]:
        """Every global stage with its blocks and pipeline rank."""
        starts = [sum(self.stage_layers[:s]) for s in range(self.n_stages)]
        return [
            StagePlan(
                index=s,
                rank=self.stage_rank(s),
                first_block=starts[s],
                n_blocks=n,
                embedding=s == 0,
                head=s == self.n_stages - 1,
            )
            for s, n in enumerate(self.stage_layers)
        ]

    def tied_across(self) -> tuple[tuple[int, int], ...]:
        """The pairs of stages sharing a parameter on different pipeline ranks (`passes.tied_across`): each
        rank's list ends with their EXCHANGE and their one REDUCE of the step."""
        return _tied_across(self.tied, self.n_stages, self.pp, self.placement)

    def exchanged_stages(self, rank: int) -> tuple[int, ...]:
        """Pipeline rank ``rank``'s stages of `tied_across` pairs, in the order its list exchanges them."""
        return _exchanged_stages(self.tied, self.n_stages, self.pp, self.placement, rank)

    def lowered(self) -> Schedule:
        """The validated per-pipeline-rank action lists the schedule runtime executes: fresh lists per call of a build
        `lowered_schedule` memoises (the one `resolve` made, when it checked the schedule)."""
        if self.schedule is None:
            raise ValueError("the direct loop runs no schedule")
        return self._lower()[0]

    def _lower(self) -> tuple[Schedule, str]:
        """Build, lower and validate this plan's schedule: the one call `lowered` and `resolve` share."""
        assert self.schedule is not None
        return lowered_schedule(
            self.schedule,
            self.pp,
            self.micro_batches,
            self.stages_per_rank,
            zero3=self.zero == 3,
            accumulation=self.accumulation,
            reduce_every_microbatch=reduces_every_microbatch(self.accumulation, self.zero),
            tied=tied_stages(self.tied, self.n_stages),
        )

    def describe(self) -> str:
        """Several lines for `tessera validate`: runner, schedule (and any switch), stages by rank, the rest."""
        lines = [f"runner: {_RUNNER_TEXT[self.runner]}"]
        if self.schedule is not None:
            lines.append(
                f"schedule: {self.schedule}, {self.stages_per_rank} stage(s) per pipeline rank, "
                f"{self.placement} placement"
                + ("" if self.schedule_checked else " (too large to pre-build; the runtime validates it)")
            )
        if self.switched_to_breadth_first:
            lines.append(
                f"  switched from {self.configured_schedule!r}: one pipeline rank runs breadth-first with one "
                "stage per block, so each block's gradients are final (and reduced) after one backward sweep"
            )
        by_rank: dict[int, list[str]] = {}
        for st in self.stages():
            by_rank.setdefault(st.rank, []).append(st.describe())
        for rank in sorted(by_rank):
            lines.append(f"pipeline rank {rank}: " + "; ".join(by_rank[rank]))
        if self.cp > 1:
            lines.append(
                f"context: {self.cp} ranks, each holding chunks i and {2 * self.cp - 1}-i of {2 * self.cp} per "
                "sequence; K/V all-gathered per attention layer; gradients averaged"
                + (" and ZeRO state sharded" if self.zero else "")
                + f" over data × context = {self.batch_ranks} ranks"
            )
        if self.tp_comm_overlap:
            lines.append(
                "tensor-parallel all-gathers / reduce-scatters: rings under their GEMM chunks (tp_comm_overlap)"
            )
        lines.append(
            f"accumulation: {self.accumulation}; checkpointing: {self.checkpointing} (every stage); "
            f"ZeRO: {self.zero}"
            + (
                f" sharded over {self.zero_shard} data-parallel ranks, replicated {self.zero_replicas}×"
                if self.zero and self.zero_replicas > 1
                else ""
            )
            + f"; dtype: {self.dtype}"
            + (f"; gradient reduce-scatter: {self.grad_reduce_dtype}" if self.zero else "")
            + ("; parameter all-gather: under the next forward" if self.overlap_param_gather else "")
        )
        lines.append(
            f"micro-batches: {self.micro_batches} of {self.micro_batch} sequences per data-parallel rank "
            f"(global batch {self.global_batch})"
        )
        return "\n".join(lines)


_RUNNER_TEXT = {
    DIRECT: "direct loop (micro-batches one after another; data-parallel all-reduce overlapped with the last "
    "backward)",
    SCHEDULE_RUNTIME: "schedule runtime (pipeline schedule IR: pipeline, ZeRO or layered accumulation)",
}


# --- resolving -----------------------------------------------------------------------------------------------


def violations(cfg: Config, world_size: int, *, training: bool = True) -> list[Violation]:
    """Every violated rule for this config and world size; empty when `resolve` would succeed."""
    return _resolve(cfg, world_size, training)[1]


def resolve(cfg: Config, world_size: int, *, training: bool = True) -> ExecutionPlan:
    """The plan ``cfg`` executes on ``world_size`` ranks; ConfigError listing every violation otherwise.

    ``training=False`` for an estimate of the plan (memory, dry run, calibration), which reads no data and logs
    nothing: whether the data files exist here, the rules of the data against the model (`_check_data`) and whether
    the logging packages [log] enables are installed here are left out, so a model can be priced before its data
    exists, on a machine without it or without the cluster's logging packages (a config `tessera plan` wrote for a
    cluster), or with a vocabulary no data of it fits. Everything else is the same plan."""
    plan, found = _resolve(cfg, world_size, training)
    if found:
        lines = "\n".join(f"  {i + 1}. {x}" for i, x in enumerate(found))
        raise ConfigError(f"{len(found)} configuration problem(s) for world size {world_size}:\n{lines}")
    assert plan is not None
    return plan


def _resolve(cfg: Config, world_size: int, training: bool) -> tuple[ExecutionPlan | None, list[Violation]]:
    found: list[Violation] = []
    for section in (cfg.model, cfg.parallel, cfg.train, cfg.checkpoint):
        found.extend(section.check())
    # an estimate reads no data and logs nothing: the files and the logging packages may exist only where it trains
    found.extend(cfg.data.check(files=training))
    found.extend(cfg.log.check(packages=training))
    if world_size < 1:
        found.append(
            Violation(
                rule="world_size",
                problem=f"world size {world_size} must be at least 1",
                fix="pass the number of processes, e.g. --world-size 8",
            )
        )
    if world_size < 1 or any(x.rule in ARITHMETIC_RULES for x in found):
        return None, found  # the cross-section rules divide by these numbers
    found.extend(_check_layout(cfg, world_size))
    if training:
        found.extend(_check_data(cfg))
    found.extend(_check_grad_reduction(cfg))
    if found:
        return None, found
    plan = decide(cfg, world_size)
    found = _check_schedule(plan)
    if found:
        return None, found
    if plan.schedule is not None and _compute_actions(plan) <= SCHEDULE_CHECK_LIMIT:
        try:
            _, placement = plan._lower()
        except (ScheduleError, ConfigError) as e:
            return None, [
                Violation(
                    rule="pipeline.schedule",
                    problem=f"the schedule this run executes ({_schedule_text(plan)}) cannot be built: {e}",
                    fix="change parallel.schedule, parallel.stages_per_rank or the micro-batches per step "
                    "(`tessera schedule show NAME --pp P --microbatches M` draws a schedule)",
                )
            ]
        plan = replace(plan, placement=placement, schedule_checked=True)
    return plan, []


def _compute_actions(plan: ExecutionPlan) -> int:
    return 2 * plan.pp * plan.stages_per_rank * plan.micro_batches


def _schedule_text(plan: ExecutionPlan) -> str:
    return (
        f"{plan.schedule}, pipeline {plan.pp}, {plan.stages_per_rank} stage(s) per rank, "
        f"{plan.micro_batches} micro-batches, {plan.accumulation} accumulation"
        + (", ZeRO-3" if plan.zero == 3 else "")
    )


def decide(cfg: Config, world_size: int) -> ExecutionPlan:
    """The plan of a config known to pass every rule, without checking it (module docstring: what is decided).

    For a caller that generates only valid configs and cannot afford the checks per config (the planner's search
    over thousands of layouts); everything else calls `resolve`, which checks and then calls this."""
    par, tr, n_layers = cfg.parallel, cfg.train, cfg.model.n_layers
    layout = _layout(tuple(par.layout_sizes(world_size).items()))  # = Layout.from_config(par, world_size)
    m = tr.micro_batches(layout.dp)
    layered = par.accumulation == LAYERED and m > 1
    runner = SCHEDULE_RUNTIME if (par.pipeline > 1 or par.zero > 0 or layered) else DIRECT
    schedule: str | None = par.schedule
    v, stage_layers, accumulation = par.stages_per_rank, par.stage_layers, par.accumulation
    switched = runner == SCHEDULE_RUNTIME and par.pipeline == 1 and v == 1
    if switched:  # one stage per block, breadth-first: layered accumulation (or depth-first block by block)
        schedule, v, stage_layers = BREADTH_FIRST, n_layers, None
    if runner == DIRECT:
        schedule, v, stage_layers, accumulation = None, 1, None, DEPTH_FIRST
    return ExecutionPlan(
        world_size=world_size,
        layout=layout,
        sequence_parallel=par.sequence_parallel,
        tp_comm_overlap=par.tp_comm_overlap,
        overlap_param_gather=par.overlap_param_gather,
        runner=runner,
        schedule=schedule,
        configured_schedule=par.schedule,
        switched_to_breadth_first=switched,
        stages_per_rank=v,
        stage_layers=tuple(stage_layers or _even_stages(n_layers, par.pipeline * v)),
        placement="loop",
        accumulation=accumulation,
        checkpointing=par.checkpointing,
        zero=par.zero,
        zero_shard=par.zero_shard_size or layout.batch_ranks,
        micro_batch=tr.micro_batch,
        micro_batches=m,
        global_batch=tr.global_batch,
        dtype=tr.dtype,
        grad_reduce_dtype=tr.grad_reduce_dtype if layout.batch_ranks > 1 else "fp32",
        n_layers=n_layers,
        tied=cfg.model.tie_embeddings,
        document_mask=cfg.data.document_mask,
    )


@lru_cache(maxsize=1024)  # the planner's search asks per layout; a few hundred distinct
def _tied_across(tied: bool, n_stages: int, p: int, placement: str) -> tuple[tuple[int, int], ...]:
    """`ExecutionPlan.tied_across` from the fields it reads (the tied pairs and the stages' ranks)."""
    return tied_across(tied_stages(tied, n_stages), partial(stage_to_rank, p=p, placement=placement))


@lru_cache(maxsize=1024)  # the planner's search asks per layout and rank; a few hundred distinct
def _exchanged_stages(tied: bool, n_stages: int, p: int, placement: str, rank: int) -> tuple[int, ...]:
    """`ExecutionPlan.exchanged_stages` from the fields it reads: `_tied_across`'s stages on ``rank``."""
    across = _tied_across(tied, n_stages, p, placement)
    return tuple(s for pair in across for s in pair if stage_to_rank(s, p, placement) == rank)


@lru_cache(maxsize=256)  # the planner's search decides ~1e4 configs over a few dozen layouts
def _layout(sizes: tuple[tuple[str, int], ...]) -> Layout:
    """The Layout of these (field, size) pairs: built and checked once per distinct sizes (frozen: shared)."""
    return Layout(**dict(sizes))


@lru_cache(maxsize=256)  # as _layout: a few (layers, stages) pairs per search
def _even_stages(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """`even_split` as a tuple (immutable: shared between the plans that ask)."""
    return tuple(even_split(n_layers, n_stages))


def _check_schedule(plan: ExecutionPlan) -> list[Violation]:
    """The named schedules' own rules, with the config settings that fix them (the builder is the backstop)."""
    name, p, v, m = plan.schedule, plan.pp, plan.stages_per_rank, plan.micro_batches
    if name in _ONE_STAGE_SCHEDULES and v > 1:
        return [
            Violation(
                rule="pipeline.schedule",
                problem=f"parallel.schedule = {name!r} runs one stage per pipeline rank, but "
                f"parallel.stages_per_rank = {v}",
                fix="set parallel.stages_per_rank = 1, or parallel.schedule = 'interleaved' or 'breadth_first' "
                "for several stages per rank",
            )
        ]
    if name == "interleaved" and m % p:
        unit = plan.micro_batch * plan.dp * p
        near = " or ".join(str(b) for b in multiples_around(plan.global_batch, unit))
        return [
            Violation(
                rule="pipeline.schedule",
                problem=f"parallel.schedule = 'interleaved' needs the micro-batches per step (train.global_batch "
                f"{plan.global_batch} / (micro_batch {plan.micro_batch} × data {plan.dp}) = {m}) to be a "
                f"multiple of parallel.pipeline = {p}",
                fix=f"set train.global_batch = {near}, or parallel.schedule = 'breadth_first' (any count)",
            )
        ]
    return []


# --- cross-section rules (moved here from tessera.config: they need the world size and several sections) ---


def _check_layout(cfg: Config, world_size: int) -> list[Violation]:
    """Cross-section rules: world size, tensor and pipeline divisibility, batch arithmetic."""
    p = cfg.parallel
    try:
        t, q = p.tensor_shape()
    except ConfigError:
        return []  # already reported by ParallelConfig.check
    v: list[Violation] = []
    sizes = p.layout_sizes(world_size)
    dp, others = sizes["dp"], [d for d in DIMS if d.key != "data"]
    rest = math.prod(d.ranks(sizes) for d in others)  # ranks per data-parallel replica
    if dp * rest != world_size:
        others = [d for d in others if not (d.quiet and d.ranks(sizes) == 1)]  # "context 1" says nothing
        names = "·".join(d.key for d in others)
        fix = (
            f"set parallel.data = {world_size // rest}"
            if world_size % rest == 0
            else f"use a world size that is a multiple of {names} = {rest}, e.g. {multiple_near(world_size, rest)}"
        )
        factors = " × ".join(
            f"{d.key} {d.ranks(sizes)}" for d in DIMS if not (d.quiet and d.ranks(sizes) == 1)
        )
        v.append(
            Violation(
                rule="world_size",
                problem=f"world size {world_size} != {factors} = {dp * rest}",
                fix=fix,
            )
        )
    v.extend(tensor_violations(cfg.model, t, q, p.sequence_parallel))
    v.extend(context_violations(cfg, t, q))
    v.extend(_check_overlaps(p, t))
    v.extend(op_checkpointing_violations(p, q))
    v.extend(_check_zero_shard(p, dp))
    v.extend(_check_pipeline(cfg))
    interleaved = p.pipeline if p.schedule == "interleaved" else 1  # its micro-batch count rule
    v.extend(_check_batch(cfg.train, dp, q, interleaved))
    if q > 1 and cfg.train.micro_batch % q:
        # 2D partitions activations as [b/q, s, h/q]: the micro-batch splits over the grid's rows.
        v.append(
            Violation(
                rule="tensor.batch",
                problem=f"train.micro_batch = {cfg.train.micro_batch} is not divisible by the 2D grid side {q}",
                fix=f"set train.micro_batch = {multiple_near(cfg.train.micro_batch, q)}",
            )
        )
    return v


def tensor_violations(m: ModelConfig, t: int, q: int, sequence_parallel: bool) -> list[Violation]:
    """The rules a tensor split of model ``m`` must meet: t ranks (1D, q = 1) or a q×q grid (t = q²), with or
    without sequence parallelism. The one place that decides which splits a model takes: `tessera validate`
    (`_check_layout`) and the planner's search (`tessera.planner.search._tensor_options`) both ask it."""
    v: list[Violation] = []
    # 1D splits heads, KV heads and the MLP over t ranks and never the residual stream, so d_model need not divide
    # (Qwen2/3 take a head width free of it); 2D also splits the hidden dimension over the q columns of the grid.
    split, name = (t, f"tensor {t}") if q == 1 else (q, f"2D grid {q}x{q}")
    split_fields = [("n_heads", m.n_heads), ("n_kv_heads", m.kv_heads), ("ffn_hidden", m.ffn)]
    if q > 1:
        split_fields.insert(2, ("d_model", m.d_model))
    for field_name, value in split_fields:
        if split > 1 and value % split:
            v.append(
                Violation(
                    rule="tensor.divisibility",
                    problem=f"model.{field_name} = {value} is not divisible by {name} ({split})",
                    fix=f"make model.{field_name} a multiple of {split}, e.g. "
                    f"{multiple_near(value, split)}, or use a tensor size that divides it: "
                    f"{[d for d in divisors_near(value, split) if d > 1] or [1]}",
                )
            )
    if sequence_parallel and q > 1:
        v.append(
            Violation(
                rule="tensor.sequence_parallel",
                problem="parallel.sequence_parallel applies to 1D "
                "tensor parallelism only; 2D already partitions activations",
                fix="set parallel.sequence_parallel = false, or use a 1D tensor size",
            )
        )
    if sequence_parallel and t > 1 and m.seq_len % t:
        v.append(
            Violation(
                rule="tensor.sequence_parallel",
                problem=f"model.seq_len = {m.seq_len} is not divisible by tensor {t}",
                fix=f"set model.seq_len = {multiple_near(m.seq_len, t)}",
            )
        )
    return v


def context_violations(cfg: Config, t: int, q: int) -> list[Violation]:
    """What context parallelism (parallel.context = c > 1) runs with in this pass, and what it refuses, each
    with the fix (docs/context-parallel.md, "What is refused"): the sequence must cut into 2c equal chunks (2c·t
    with sequence parallelism, which splits each rank's s/c tokens again); not with a pipeline, a 2D grid,
    hybrid sharding or tp_comm_overlap, none of which its tests cover yet."""
    p, c, s = cfg.parallel, cfg.parallel.context, cfg.model.seq_len
    if c == 1:
        return []
    v: list[Violation] = []
    unit = 2 * c * (t if p.sequence_parallel else 1)
    if s % unit:
        split = f"2·context {c}" + (
            f" × tensor {t} (sequence parallelism)" if p.sequence_parallel and t > 1 else ""
        )
        v.append(
            Violation(
                rule="context.seq_len",
                problem=f"model.seq_len = {s} is not divisible by {split} = {unit}: context parallelism cuts each "
                f"sequence into {2 * c} equal chunks",
                fix=f"set model.seq_len = {multiple_near(s, unit)}",
            )
        )
    refused = (
        (
            p.pipeline > 1,
            f"parallel.pipeline = {p.pipeline}",
            "set parallel.pipeline = 1 (or parallel.context = 1)",
        ),
        (q > 1, f'parallel.tensor = "{q}x{q}" (2D)', "use 1D tensor parallelism (parallel.tensor = t)"),
        (
            p.zero_shard_size is not None,
            f"parallel.zero_shard_size = {p.zero_shard_size} (hybrid sharding)",
            "remove parallel.zero_shard_size: ZeRO shards over data × context",
        ),
        (p.tp_comm_overlap, "parallel.tp_comm_overlap", "set parallel.tp_comm_overlap = false"),
    )
    for hit, what, fix in refused:
        if hit:
            v.append(
                Violation(
                    rule="context.refused",
                    problem=f"parallel.context = {c} does not run with {what} in this version "
                    '(docs/context-parallel.md, "What is refused")',
                    fix=fix,
                )
            )
    return v


def op_checkpointing_violations(p: ParallelConfig, q: int) -> list[Violation]:
    """checkpointing = "op" replays every second matmul of a block (`parallel.checkpointing`), counted as the
    dispatcher sees them: one per Linear only where each Linear is one GEMM. A 2D grid runs each Linear as q SUMMA
    products and tp_comm_overlap as t ring chunks, so "every second" would split Linears arbitrarily: refused
    (docs/memory.md, "Op-level selective checkpointing")."""
    if p.checkpointing != "op":
        return []
    refused = (
        (q > 1, f'parallel.tensor = "{q}x{q}" (2D: each Linear is {q} SUMMA products)'),
        (p.tp_comm_overlap, "parallel.tp_comm_overlap (each Linear is a ring of GEMM chunks)"),
    )
    return [
        Violation(
            rule="checkpointing.op",
            problem=f'parallel.checkpointing = "op" saves every second matmul of a block, one per Linear; it does not '
            f"run with {what}",
            fix='set parallel.checkpointing = "selective" or "full", or use 1D tensor parallelism without '
            "tp_comm_overlap",
        )
        for hit, what in refused
        if hit
    ]


def _check_overlaps(p: ParallelConfig, t: int) -> list[Violation]:
    """The two communication overlaps exist only where their collectives do (Megatron asserts the same)."""
    v: list[Violation] = []
    if p.tp_comm_overlap and not (t > 1 and p.sequence_parallel):
        v.append(
            Violation(
                rule="tensor.tp_comm_overlap",
                problem="parallel.tp_comm_overlap overlaps sequence parallelism's all-gather / reduce-scatter with "
                f"the GEMMs; it needs 1D tensor parallelism with sequence_parallel (tensor = {p.tensor!r}, "
                f"sequence_parallel = {str(p.sequence_parallel).lower()})",
                fix="set parallel.sequence_parallel = true with a 1D tensor size > 1, or parallel.tp_comm_overlap = false",
            )
        )
    if p.overlap_param_gather and p.zero not in (1, 2):
        v.append(
            Violation(
                rule="zero.overlap_param_gather",
                problem=f"parallel.overlap_param_gather defers ZeRO-1/2's post-step parameter all-gather; with "
                f"parallel.zero = {p.zero} there is none ("
                + (
                    "ZeRO-3 already gathers each stage ahead of its compute)"
                    if p.zero == 3
                    else "plain data parallelism keeps full parameters)"
                ),
                fix="set parallel.zero = 1 or 2, or parallel.overlap_param_gather = false",
            )
        )
    return v


def _check_zero_shard(p: ParallelConfig, dp: int) -> list[Violation]:
    """parallel.zero_shard_size (hybrid sharding): ZeRO's shard groups must tile the data-parallel ranks, and
    there must be ZeRO state to shard and more than one rank to shard it over."""
    s = p.zero_shard_size
    if s is None:
        return []
    key = f"parallel.zero_shard_size = {s}"
    if p.zero == 0:
        return [
            Violation(
                rule="zero.shard_size",
                problem=f"{key} sets the group ZeRO shards over, but parallel.zero = 0 shards nothing "
                "(plain data parallelism all-reduces full gradients)",
                fix="set parallel.zero = 1, 2 or 3, or remove parallel.zero_shard_size",
            )
        ]
    if dp % s:
        sizes = [d for d in range(2, dp + 1) if dp % d == 0]
        return [
            Violation(
                rule="zero.shard_size",
                problem=f"{key} does not divide the data-parallel size {dp}: the shard groups would not tile "
                "the data-parallel ranks",
                fix=f"set parallel.zero_shard_size to one of {sizes}"
                if sizes
                else "remove parallel.zero_shard_size (one data-parallel rank: nothing to shard)",
            )
        ]
    if s == 1 and dp > 1:
        return [
            Violation(
                rule="zero.shard_size",
                problem=f"{key} shards nothing: every rank would hold the whole model state and all-reduce "
                "its gradients",
                fix=f"set parallel.zero_shard_size to a divisor >= 2 of the data-parallel size {dp} (e.g. the "
                "GPUs per node), or parallel.zero = 0 for plain data parallelism",
            )
        ]
    return []


def _check_pipeline(cfg: Config) -> list[Violation]:
    p, layers = cfg.parallel, cfg.model.n_layers
    stages = p.pipeline * p.stages_per_rank
    if p.stage_layers is not None:  # checked even for one stage: a split that cannot hold would be ignored
        if len(p.stage_layers) != stages or sum(p.stage_layers) != layers or min(p.stage_layers) < 0:
            return [
                Violation(
                    rule="pipeline.stage_layers",
                    problem=f"parallel.stage_layers = {p.stage_layers} "
                    f"must have pipeline × stages_per_rank = {stages} non-negative entries summing to "
                    f"model.n_layers = {layers}",
                    fix=f"e.g. {even_split(layers, stages)}",
                )
            ]
        return []
    if stages == 1:
        return []
    if layers < stages:
        return [
            Violation(
                rule="pipeline.layers",
                problem=f"model.n_layers = {layers} is fewer than pipeline "
                f"{p.pipeline} × stages_per_rank {p.stages_per_rank} = {stages} stages",
                fix=f"set parallel.pipeline·stages_per_rank <= {layers}, or model.n_layers >= {stages}",
            )
        ]
    if layers % stages:
        return [
            Violation(
                rule="pipeline.layers",
                problem=f"model.n_layers = {layers} is not divisible by {stages} stages",
                fix=f"set model.n_layers = {multiple_near(layers, stages)} or give "
                f"parallel.stage_layers explicitly, e.g. {even_split(layers, stages)}",
            )
        ]
    return []


def _check_batch(tr: TrainConfig, dp: int, q: int = 1, m_multiple: int = 1) -> list[Violation]:
    """global_batch must be whole micro-batches on every data-parallel rank. The fix names the multiples of
    micro_batch × dp around it (one value when it is below the first) and, when it is below one unit, also the
    smaller micro_batch that makes it valid: one that divides each rank's share, is a multiple of the 2D grid
    side ``q`` (the micro-batch splits over it) and leaves a micro-batch count that is a multiple of
    ``m_multiple`` (the interleaved schedule's pipeline size)."""
    unit = tr.micro_batch * dp
    if unit < 1 or tr.global_batch % unit == 0:
        return []
    # the interleaved schedule also needs whole rounds of micro-batches: propose values that pass both rules
    step, rounds = (
        unit * m_multiple,
        f" × pipeline {m_multiple}, as the interleaved schedule needs" * (m_multiple > 1),
    )
    batches = " or ".join(str(b) for b in multiples_around(tr.global_batch, step))
    fix = f"set train.global_batch = {batches} (a multiple of micro_batch {tr.micro_batch} × data {dp}{rounds}: {step})"
    smaller = _micro_batch_dividing(tr.global_batch, dp, q, m_multiple) if tr.global_batch < unit else None
    if smaller is not None:
        m = tr.global_batch // (smaller * dp)
        each = "one micro-batch" if m == 1 else f"{m} micro-batches"
        fix += f", or train.micro_batch = {smaller} to keep global_batch {tr.global_batch} ({each} per data rank)"
    return [
        Violation(
            rule="batch",
            problem=f"train.global_batch = {tr.global_batch} is not micro_batch "
            f"{tr.micro_batch} × micro-batches × data-parallel size {dp}",
            fix=fix,
        )
    ]


def _micro_batch_dividing(global_batch: int, dp: int, q: int, m_multiple: int) -> int | None:
    """The largest micro-batch that splits ``global_batch`` into whole micro-batches on each of ``dp`` ranks, is
    a multiple of ``q`` and leaves a multiple of ``m_multiple`` micro-batches; None when there is none."""
    per_rank, rest = divmod(global_batch, dp)
    if rest:
        return None
    # called when a rank's share is below one micro-batch: this counts down from below micro_batch
    fits = (b for b in range(per_rank, 0, -1) if per_rank % b == 0 and b % q == 0)
    return next((b for b in fits if (per_rank // b) % m_multiple == 0), None)


def _check_grad_reduction(cfg: Config) -> list[Violation]:
    """train.grad_reduce_dtype sets ZeRO's gradient reduce-scatter; plain data parallelism (the direct loop's
    bucketed all-reduce, `DataParallelStageComm`) reduces fp32 gradients as they are, so bf16 would be ignored."""
    if cfg.train.grad_reduce_dtype != "bf16" or cfg.parallel.zero != 0:
        return []
    return [
        Violation(
            rule="train.grad_reduce_dtype",
            problem="train.grad_reduce_dtype = 'bf16' sets the dtype of ZeRO's gradient reduce-scatter, but "
            "parallel.zero = 0 (plain data parallelism all-reduces fp32 gradients)",
            fix="set parallel.zero >= 1 (1, 2 or 3) to reduce-scatter in bf16, or train.grad_reduce_dtype = 'fp32'",
        )
    ]


def _document_mask_eot(eots: dict[str, int | None]) -> list[Violation]:
    """data.document_mask finds documents by their end-of-text token: every file must record one, the same."""
    missing = [path for path, eot in eots.items() if eot is None]
    if missing:
        return [
            Violation(
                rule="data.document_mask",
                problem=f"data.document_mask = true, but {', '.join(missing)} records no end-of-text token, "
                "so its document boundaries are unknown",
                fix="prepare it again with `tessera prepare` (--eot-token TOKEN for a tokenizer without one), "
                "or set data.document_mask = false",
            )
        ]
    if len(set(eots.values())) > 1:
        return [
            Violation(
                rule="data.document_mask",
                problem=f"the token files end documents with different tokens: {eots}",
                fix="prepare every file with the same tokenizer and --eot-token",
            )
        ]
    return []


def _window_start_eot(eots: dict[str, int | None]) -> list[Violation]:
    """data.window_start = "document" finds each file's document starts by its own end-of-text token."""
    missing = [path for path, eot in eots.items() if eot is None]
    if not missing:
        return []
    return [
        Violation(
            rule="data.window_start",
            problem=f'data.window_start = "document", but {", ".join(missing)} records no end-of-text token, '
            "so its document starts are unknown",
            fix="prepare it again with `tessera prepare` (--eot-token TOKEN for a tokenizer without one), "
            'or set data.window_start = "any"',
        )
    ]


def _loss_mask_file(path: str, meta: dict) -> list[Violation]:
    """A token file's loss mask, as its metadata describes it: present, one byte per token (its checksum is
    `validate --data`'s, which reads it whole)."""
    from tessera.train.data import mask_path

    if meta.get("loss_mask") is None:
        return []
    mask, n = mask_path(path), int(meta["n_tokens"])
    size = mask.stat().st_size if mask.is_file() else None
    if size == n:
        return []
    return [
        Violation(
            rule="data.loss_mask",
            problem=f"{path} records a loss mask, but {mask} "
            + ("is missing" if size is None else f"has {size} bytes for {n} tokens (one byte each)"),
            fix="copy the mask with its token file, or re-run `tessera prepare` to rebuild both",
        )
    ]


def _loss_mask_files(masks: dict[str, dict | None]) -> list[Violation]:
    """data.loss_mask trains on the targets a mask marks: every file needs one, with at least one target."""
    missing = [path for path, mask in masks.items() if mask is None]
    if missing:
        return [
            Violation(
                rule="data.loss_mask",
                problem=f"data.loss_mask = true, but {', '.join(missing)} has no loss mask",
                fix="prepare it from prompt/completion records with `tessera prepare --prompt-key KEY "
                "--completion-key KEY` or from chat records with `--messages-key KEY`, or set "
                "data.loss_mask = false to train on every token",
            )
        ]
    empty = [path for path, mask in masks.items() if mask is not None and mask["n_targets"] == 0]
    if empty:
        return [
            Violation(
                rule="data.loss_mask",
                problem=f"the loss mask of {', '.join(empty)} marks no target token, so no step could train",
                fix="re-run `tessera prepare --prompt-key KEY --completion-key KEY` (or `--messages-key KEY`) to "
                "rebuild it",
            )
        ]
    return []


def _check_data(cfg: Config) -> list[Violation]:
    """Data against the rest: a validation set for train.eval_every, every token file's vocabulary, dtype and
    tokenizer against the model (and each other), and enough tokens for a window of model.seq_len in every
    part a step or an evaluation samples (`_check_lengths`)."""
    v: list[Violation] = []
    d = cfg.data
    if cfg.train.eval_every and d.valid_path is None and not d.valid_fraction:
        v.append(
            Violation(
                rule="train.eval_every",
                problem=f"train.eval_every = {cfg.train.eval_every} but there is no validation data",
                fix="set data.valid_fraction (e.g. 0.05) or data.valid_path, or train.eval_every = 0",
            )
        )
    if d.check():
        return v  # malformed or missing files: DataConfig.check reports them
    files = [p for p, _ in d.sources()] + ([d.valid_path] if d.valid_path else [])
    if not files:
        # the default corpus: the trainer prepares it; its documents' lengths are its files' sizes. Importing the
        # reader (numpy, 0.1 s) would delay `tessera train --nproc N`, which validates before it starts the ranks
        if d.loss_mask:
            v.append(
                Violation(
                    rule="data.loss_mask",
                    problem="data.loss_mask = true, but data.path is unset: the default corpus has no loss mask",
                    fix="set data.path to a token file prepared with `tessera prepare --prompt-key KEY "
                    "--completion-key KEY` (or `--messages-key KEY`), or data.loss_mask = false",
                )
            )
        return v + _check_default_corpus(cfg)
    from tessera.train.data import read_token_meta  # torch-free; numpy only when files are named

    tokenizers: dict[str, str | None] = {}
    eots: dict[str, int | None] = {}
    masks: dict[str, dict | None] = {}
    readable = True
    for path in files:
        try:
            meta = read_token_meta(path)
        except DataError as e:
            v.append(Violation(rule="data.files", problem=str(e), fix="re-run `tessera prepare` for it"))
            readable = False
            continue
        vocab, dtype = int(meta["vocab_size"]), meta["dtype"]
        if vocab > cfg.model.vocab_size:
            v.append(
                Violation(
                    rule="data.vocab",
                    problem=f"{path} was tokenized with {vocab} tokens but model.vocab_size = "
                    f"{cfg.model.vocab_size}",
                    fix=f"set model.vocab_size >= {vocab}, or prepare the data with the model's tokenizer",
                )
            )
        if dtype != ("uint16" if vocab < 2**16 else "uint32"):
            v.append(
                Violation(
                    rule="data.dtype",
                    problem=f"{path} stores {dtype} tokens for a vocabulary of {vocab}",
                    fix="re-run `tessera prepare` for it",
                )
            )
        tokenizers[path] = meta.get("tokenizer")  # None: a file of a version that did not record it
        eots[path] = meta.get("eot")
        masks[path] = meta.get("loss_mask")
        broken = _loss_mask_file(path, meta)
        v.extend(broken)
        readable = readable and not broken  # the lengths' check would open it and name the mask again
    if d.document_mask:
        v.extend(_document_mask_eot(eots))
    if d.window_start == "document":
        v.extend(_window_start_eot(eots))
    if d.loss_mask:
        v.extend(_loss_mask_files(masks))
    if len(set(tokenizers.values())) > 1:
        v.append(
            Violation(
                rule="data.tokenizer",
                problem=f"the token files were made by different tokenizers: {tokenizers}",
                fix="prepare every file of a blend (and the validation file) with the same tokenizer",
            )
        )
    else:
        v.extend(_tokenizer_of_the_files(d.tokenizer, tokenizers))
    if readable:
        v.extend(_check_files_lengths(cfg))
    return v


def _tokenizer_of_the_files(configured: str, made_by: dict[str, str | None]) -> list[Violation]:
    """data.tokenizer against the one tokenizer every token file was made by (their metadata), as far as it can
    be told without loading a tokenizer: bytes or not (a file that records none is not judged). The run trains
    on the files either way; `generate` and the Hugging Face export decode and ship data.tokenizer. Two
    tokenizer files at different paths may be the same tokenizer (a copy on another machine): not compared."""
    from tessera.train.tokenizer import ByteTokenizer

    byte = ByteTokenizer.spec
    files = sorted(
        p for p, spec in made_by.items() if spec is not None and (spec == byte) != (configured == byte)
    )
    if not files:
        return []
    spec = made_by[files[0]]
    return [
        Violation(
            rule="data.tokenizer",
            problem=f"data.tokenizer = {configured!r}, but {', '.join(files)} were made by {spec!r}: `generate` "
            "and the Hugging Face export would decode the model's tokens with the wrong tokenizer",
            fix=f"set data.tokenizer = {spec!r} (the tokenizer `tessera prepare` used), or prepare the data "
            "again with data.tokenizer",
        )
    ]


def _check_default_corpus(cfg: Config) -> list[Violation]:
    """The default corpus (data.path unset) as the trainer will prepare it: byte tokens (a vocabulary of 256,
    which `TokenDataset.check_vocab` holds the model to), at least one file, and the lengths `_check_lengths`
    asks for, known from its files' sizes (`tessera.train.corpus`)."""
    from tessera.train.corpus import default_corpus_documents, document_cut, holdout_target
    from tessera.train.tokenizer import ByteTokenizer

    d = cfg.data
    if d.tokenizer != ByteTokenizer.spec:
        return [
            Violation(
                rule="data.tokenizer",
                problem=f"data.tokenizer = {d.tokenizer!r}, but the default corpus (data.path unset) is byte "
                "tokens: the run would train on bytes and `generate` and the Hugging Face export would use "
                "that tokenizer for them",
                fix=f"prepare the corpus with it (`tessera prepare --out corpus.bin --tokenizer {d.tokenizer}`, no "
                'inputs: the default corpus) and set data.path = "corpus.bin", or set data.tokenizer = "byte"',
            )
        ]
    if cfg.model.vocab_size < ByteTokenizer.vocab_size:
        return [
            Violation(
                rule="data.vocab",
                problem=f"the default corpus (data.path unset) is byte tokens, {ByteTokenizer.vocab_size} of them, "
                f"but model.vocab_size = {cfg.model.vocab_size}",
                fix=f"set model.vocab_size >= {ByteTokenizer.vocab_size}, or name token files prepared with the "
                "model's tokenizer in data.path",
            )
        ]
    mb = d.default_corpus_mb
    lengths = default_corpus_documents(int(mb * 2**20))
    if not lengths:
        smallest = min(default_corpus_documents(2**62), default=1) - 1  # every file's size (its bytes)
        enough = float(f"{smallest / 2**20:.2g}")
        while int(enough * 2**20) < smallest:  # rounded down: the next step of its last digit
            enough = float(f"{enough * 1.05:.2g}")
        return [
            Violation(
                rule="data.default_corpus_mb",
                problem=f"data.default_corpus_mb = {mb:g} ({int(mb * 2**20)} bytes) takes no file of the default "
                f"corpus: its smallest source file has {smallest} bytes",
                fix=f"set data.default_corpus_mb >= {enough:g} (the default is 8), or name token "
                "files in data.path",
            )
        ]
    n = sum(lengths)
    cut = document_cut(lengths, holdout_target(n, d.valid_fraction)) if d.valid_fraction else n
    name = f"the default corpus (data.default_corpus_mb = {mb:g}: {n} tokens, {len(lengths)} document(s))"
    return _check_lengths(cfg, name, n, cut, "set a larger data.default_corpus_mb")


def _check_files_lengths(cfg: Config) -> list[Violation]:
    """`_check_lengths` of every training file (cut where `TokenDataset.split_documents` will cut it) and of
    data.valid_path."""
    from tessera.train.data import TokenDataset

    d, v = cfg.data, []
    for path, _ in d.sources():
        try:
            data = TokenDataset(path)
            cut = data.holdout_cut(d.valid_fraction) if d.valid_fraction else data.n_tokens
        except DataError as e:
            v.append(Violation(rule="data.files", problem=str(e), fix="re-run `tessera prepare` for it"))
            continue
        v.extend(_check_lengths(cfg, str(path), data.n_tokens, cut, "use more data"))
    if d.valid_path is not None and cfg.train.eval_every:
        try:
            n_valid = TokenDataset(d.valid_path).n_tokens
        except DataError as e:
            return [*v, Violation(rule="data.files", problem=str(e), fix="re-run `tessera prepare` for it")]
        v.extend(_too_short(cfg, f"data.valid_path {d.valid_path}", n_valid, "set train.eval_every = 0"))
    return v


def _check_lengths(
    cfg: Config, source: str, n_tokens: int, cut: int | None, more_data: str
) -> list[Violation]:
    """One training source of ``n_tokens``: data.valid_fraction holds out [cut, n_tokens) (None: no document
    boundary to cut at); what is left, and the held-out part when train.eval_every samples it, must each hold a
    window of model.seq_len (`tessera.train.corpus.min_tokens`). ``more_data``: the fix that gives it more."""
    d = cfg.data
    if cut is None:
        no_cut = Violation(
            rule="data.valid_fraction",
            problem=f"data.valid_fraction = {d.valid_fraction} leaves no whole document of {source} to hold "
            "out: its last document starts before the held-out part would",
            fix="set a larger data.valid_fraction, use data.valid_path, or data with more documents",
        )
        # without a cut, training samples all of it: too short then, too short with any fraction
        return [*_too_short(cfg, source, n_tokens, more_data), no_cut]
    held = " (before data.valid_fraction's held-out part)" if d.valid_fraction else ""
    more = ", a smaller data.valid_fraction" if d.valid_fraction else ""
    v = _too_short(cfg, f"{source}{held}", cut, f"{more_data}{more}")
    if d.valid_fraction and cfg.train.eval_every:
        v.extend(
            _too_short(
                cfg,
                f"data.valid_fraction = {d.valid_fraction}'s held-out part of {source}",
                n_tokens - cut,
                "set a larger data.valid_fraction, or train.eval_every = 0",
            )
        )
    return v


def _too_short(cfg: Config, what: str, n_tokens: int, other_fix: str) -> list[Violation]:
    from tessera.train.corpus import min_tokens

    s = cfg.model.seq_len
    if n_tokens >= min_tokens(s):
        return []
    shorter = f"set model.seq_len <= {n_tokens - 1}, or " if n_tokens >= 2 else ""
    return [
        Violation(
            rule="data.seq_len",
            problem=f"{what} holds {n_tokens} tokens, too few for one window of model.seq_len = {s} "
            f"(needs {min_tokens(s)}: the inputs and their next-token targets)",
            fix=f"{shorter}{other_fix}",
        )
    ]
