"""Layout search: enumerate every valid layout for a model, a GPU count and a batch; prune what does not fit in
memory; rank the rest by step time (fixed batch) or by time to the target loss (critical batch).

Space: data × pipeline × context × tensor (1D t, or a 2D q×q grid; context c only at long context,
`CONTEXT_MIN_SEQ`, with one stage and 1D tensor parallelism), ZeRO stage 0–3, schedule (1F1B, GPipe, interleaved v,
breadth-first v), micro-batch size, checkpointing mode, sequence parallelism. Validity follows the config rules
(`tessera.config`): the tensor split as `tessera.execution.tensor_violations` decides for `tessera validate`
(heads, KV heads, d_model and ffn_hidden divisible by t or q, seq_len by t with sequence parallelism), the
micro-batch by q in 2D, layers by p·v or explicit uneven `stage_layers` (one chunk per rank: the
end stages lightened by the embedding's and head's work, `steptime.balanced_stage_layers`), the global batch by
micro-batch × d, m a multiple of p for interleaved. Each layout is a run config; its execution plan
(`tessera.execution.decide`: what the trainer runs, e.g. one pipeline rank with ZeRO runs breadth-first with one
stage per block) is priced by the one memory estimator (`tessera.memory.estimate_plan`, the same as
`tessera memory`); a layout fits when its fullest rank needs at most `memory_fraction` of the device. Step time is `steptime.fast_step` (closed forms checked against the simulator);
the top layouts are re-timed with the simulator by `tessera.planner.report`.

Pure Python, no torch: runs anywhere the planner is installed.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, fields, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from tessera.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from tessera.errors import TesseraError
from tessera.execution import ExecutionPlan, context_violations, decide, tensor_violations
from tessera.memory import (
    MemoryEstimate,
    cost_plan,
    estimate_plan,
    memory_floor,
    model_state_floor,
    model_state_mean,
)
from tessera.model.sizes import SIZES
from tessera.modes import BREADTH_FIRST, CHECKPOINTING, DEPTH_FIRST, LAYERED, SCHEDULES
from tessera.planner.cost import (
    MemoryBreakdown,
    ModelShape,
    Plan,
    cp_comm_time_per_layer,
    embedding_time,
    layer_time,
    layers_per_stage,
    logits_time,
    model_flops_per_token,
    p2p_time_per_microbatch,
    tp_comm_time_per_layer,
)
from tessera.planner.hardware import Hardware
from tessera.planner.megatron_table import MEGATRON_TABLE1
from tessera.planner.network import TESSERA_ORDER
from tessera.planner.scaling import ALPHA_N, ALPHA_S, critical_batch, loss_from_params, steps_for_batch
from tessera.planner.steptime import (
    StepBreakdown,
    _fast,
    balanced_stage_layers,
    pipeline_from_layer,
)

SEARCHED_CHECKPOINTING = CHECKPOINTING
"""The checkpointing modes the search tries: every mode tessera runs, op where it runs (not on the 2D grid, nor
with the rings: `tessera.execution.op_checkpointing_violations`), since its memory is counted (docs/memory.md,
"Op-level selective checkpointing")."""

__all__ = [
    "PLANNER_SIZES",
    "Candidate",
    "SearchResult",
    "SearchSpace",
    "default_jobs",
    "default_target_loss",
    "model_config",
    "search",
    "without_cycle_collection",
]

SCHEDULE_NAMES = SCHEDULES
"""Schedules the search tries (the config's names, tessera.modes)."""
HYBRID_NODE_MULTIPLES = 8
"""Largest shard group hybrid sharding's search tries, in multiples of one node's data ranks (powers of two up to
it: 1, 2, 4, 8). A shard group over several nodes is MiCS's partition group (Zhang et al. 2022, arXiv 2205.00119):
the fewest devices whose memory holds the model state, so its gathers leave the rest of the data-parallel ranks
alone. Up to 8 nodes it divides ZeRO-3's per-rank model state by up to 8 × the node shard's; the whole data group
(plain ZeRO-3, always tried) is the end beyond. Each multiple is one more ZeRO-3 variant per layout, most over
the memory limit and counted by `model_state_mean` before their configs are built."""
CONTEXT_MIN_SEQ = 8192
"""Sequence length from which the search tries context parallelism (`SearchSpace.context`). Below it a
sequence's activations are small beside the model state and each layer's K/V gathers cost more than the s/c
tokens save: at s = 2048 no layout of the models tried wins with it (docs/planner.md, "Context parallelism").
Shorter sequences are tried with it only when no layout fits without."""
MAX_CRITICAL_BATCH_FACTOR = 4.0
"""With the critical batch, a layout whose smallest batch (d × micro-batch) exceeds this × B_crit is skipped."""


def _megatron_sizes() -> dict[str, dict[str, Any]]:
    """GPT shapes of Narayanan 2021 Table 1 as planner model names: megatron-1.7b ... megatron-1t."""
    out = {}
    for row in MEGATRON_TABLE1:
        name = "megatron-1t" if row.params_b > 1000 else f"megatron-{row.params_b:g}b"
        out[name] = dict(
            family="gpt",
            n_layers=row.layers,
            d_model=row.hidden,
            n_heads=row.heads,
            vocab_size=row.vocab,
            seq_len=row.seq_len,
        )
    return out


PLANNER_SIZES: dict[str, dict[str, Any]] = {**SIZES, **_megatron_sizes()}
"""Model names the planner accepts: the training registry plus the GPT shapes of Megatron's Table 1."""


def model_config(model: str | ModelConfig) -> tuple[str | None, ModelConfig]:
    """(registry name or None, ModelConfig) from a name in `PLANNER_SIZES` or a ModelConfig."""
    if isinstance(model, ModelConfig):
        return None, model  # fields may override the registry entry: configs spell them out
    if model not in PLANNER_SIZES:
        raise ValueError(
            f"unknown model {model!r}; known: {', '.join(PLANNER_SIZES)} (or pass a config file)"
        )
    return model, ModelConfig(**PLANNER_SIZES[model])


def default_target_loss(shape: ModelShape) -> float:
    """Kaplan's compute-efficient stopping point: (1 + α_N/α_S)·L(N), 10 % above the converged loss."""
    return (1 + ALPHA_N / ALPHA_S) * loss_from_params(shape.n_params_non_embedding())


@dataclass(kw_only=True, slots=True)
class SearchSpace:
    """Which options the search may combine (defaults: all of them)."""

    tensor_1d: tuple[int, ...] | None = None
    """1D tensor sizes to try; None: every valid t ≤ max_tensor."""
    tensor_2d: tuple[int, ...] | None = None
    """2D grid sides q to try; None: every valid q with q² ≤ max_tensor_2d. Empty tuple: no 2D."""
    max_tensor: int | None = None
    """Largest 1D tensor size; None: the hardware's GPUs per node."""
    max_tensor_2d: int | None = None
    """Largest 2D grid q²; None: twice the GPUs per node."""
    pipeline: tuple[int, ...] | None = None
    """Pipeline sizes to try; None: every p dividing the layers (plus the others with `uneven_pipelines`)."""
    uneven_pipelines: bool | None = None
    """Also try pipeline sizes that do not divide the layers, with a balanced uneven split (one chunk per rank).
    None (the default): only when no layout whose pipeline size divides the layers fits, as for context
    parallelism (e.g. 46 layers on 96 GPUs, whose factor 3 no tensor size takes); always would grow every
    search, and such layouts idle the lighter ranks. False: never."""
    schedules: tuple[str, ...] = SCHEDULE_NAMES
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    hybrid_sharding: bool = True
    """Beside each ZeRO-3 layout, try hybrid sharding with shard groups of whole nodes: `parallel.zero_shard_size`
    = one node's data ranks (GPUs per node / (pipeline · tensor), or 1 when a data rank fills whole nodes) ×
    1, 2, 4 … `HYBRID_NODE_MULTIPLES` nodes' worth, each s ≥ 2 that divides d and is below it (`_hybrid_shards`)."""
    checkpointing: tuple[str, ...] = SEARCHED_CHECKPOINTING
    """Checkpointing modes to try (`SEARCHED_CHECKPOINTING`)."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    context: tuple[int, ...] | None = None
    """Context-parallel sizes c > 1 to try (`parallel.context`, with one pipeline stage and 1D tensor parallelism
    only, as `tessera.execution.context_violations` allows); None: powers of two up to `max_context` when the
    sequence has at least `CONTEXT_MIN_SEQ` tokens, or when no layout fits without; empty: never."""
    max_context: int = 16
    """Largest context size the default `context` tries (Llama 3 trained 128K tokens at 16)."""
    micro_batches: tuple[int, ...] | None = None
    """Micro-batch sizes to try; None: every divisor of the per-replica batch up to max_micro_batch."""
    max_micro_batch: int = 16
    max_virtual: int | None = None
    """Largest v (chunks per pipeline rank); None: up to one layer per chunk."""
    dtype: str = "bf16"
    flash_attention: bool = True
    document_mask: bool = False
    """Train with data.document_mask: each micro-batch's layers keep its [b, 1, s, s] attention mask for
    backward, one tensor shared by them, which the memory estimate counts
    (`tessera.planner.cost.rank_memory.shared_mask_bytes`)."""
    memory_fraction: float = 0.95
    """Usable fraction of device memory (headroom for fragmentation, CUDA context, NCCL buffers)."""
    comm_overlap: bool = True
    """Turn on the communication overlaps tessera runs where they apply: `parallel.tp_comm_overlap` (1D + SP) on
    a layout whose step prices faster with it (both are priced, `_evaluate`), and `parallel.overlap_param_gather`
    for ZeRO-1/2 with d > 1 where the layout still fits with its shard copies (never slower:
    `steptime._gathers`). False: neither."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Candidate:
    """One fitting layout with its predicted step, memory and (critical batch) training time."""

    plan: Plan
    schedule: str
    global_batch: int
    """Sequences per optimizer step."""
    breakdown: StepBreakdown
    memory: MemoryBreakdown
    """What the rank needing the most memory holds at its peak (`MemoryEstimate.breakdown`)."""
    memory_stage: int
    tokens_per_s: float
    mfu: float
    config: Config
    """The run configuration (model, parallel, train sections) that `tessera plan --out` writes."""
    execution: ExecutionPlan
    """What that configuration executes (`tessera.execution`); its memory is `memory`."""
    steps: float | None = None
    """Optimizer steps to the target loss (critical-batch mode)."""

    @property
    def step_time(self) -> float:
        return self.breakdown.step_time

    @property
    def training_time(self) -> float | None:
        """Seconds to the target loss (steps × step time), when steps are known."""
        return None if self.steps is None else self.steps * self.step_time

    @property
    def label(self) -> str:
        """One-line description, e.g. ``d64 p8 t8+SP | interleaved v2 | b1 m24 | ZeRO-1 | ckpt selective | overlap
        TP comm + param gather`` (the overlaps the layout runs, `parallel.tp_comm_overlap` / `overlap_param_gather`).
        Breadth-first is layered unless it says ``depth-first``."""
        pl = self.plan
        tensor = (
            f"{pl.q}x{pl.q}" if pl.tp_kind == "2d" else f"t{pl.tp}" + ("+SP" if pl.sequence_parallel else "")
        )
        sched = self.schedule + (f" v{pl.virtual_stages}" if pl.virtual_stages > 1 else "")
        if self.schedule == BREADTH_FIRST and pl.accumulation == DEPTH_FIRST and pl.n_microbatches > 1:
            # one pipeline rank under ZeRO runs one stage per block (`execution.decide`), accumulating either way
            # (with one micro-batch both orders are the same run)
            sched += " depth-first"
        if pl.stage_layers is not None:
            c = pl.stage_layers
            sched += " stages " + (",".join(map(str, c)) if len(c) <= 4 else f"{c[0]},{c[1]},…,{c[-1]}")
        overlaps = [
            name
            for name, on in (("TP comm", pl.tp_comm_overlap), ("param gather", pl.overlap_param_gather))
            if on
        ]
        context = f" c{pl.cp}" if pl.cp > 1 else ""
        return (
            f"d{pl.dp}{context} p{pl.pp} {tensor} | {sched} | b{pl.micro_batch} m{pl.n_microbatches} | "
            f"ZeRO-{pl.zero_stage}"
            + (f" hybrid {pl.zero_replicas}×{pl.zero_dp}" if pl.zero_replicas > 1 else "")
            + f" | ckpt {pl.recompute}"
            + (f" | overlap {' + '.join(overlaps)}" if overlaps else "")
        )

    @property
    def table_label(self) -> str:
        """`label` for a markdown table cell: its ``|`` separators escaped, so they do not split the cell."""
        return self.label.replace("|", "\\|")


@dataclass(kw_only=True, slots=True)
class SearchResult:
    """Ranked fitting layouts (best first, at most `keep`) and what the search looked at."""

    model: str | None
    model_config: ModelConfig
    shape: ModelShape
    gpus: int
    hardware: Hardware
    global_batch: int | None
    """Fixed batch in sequences, or None when each layout rounds the critical batch."""
    critical_batch_tokens: float | None
    target_loss: float | None
    objective: str
    """"step_time" (fixed batch) or "training_time" (critical batch)."""
    candidates: list[Candidate] = field(default_factory=list)
    enumerated: int = 0
    rejected_memory: int = 0
    seconds: float = 0.0
    """Wall-clock seconds of the search."""
    cpu_seconds: float = 0.0
    """CPU seconds of the search, this process's and its workers' (`search`'s ``jobs``; with one job it equals
    wall time on an idle core)."""
    uneven_fallback: bool = False
    """No layout whose pipeline size divides the layers fitted, so sizes that do not were tried too
    (`SearchSpace.uneven_pipelines` None)."""
    savings_searched: tuple[str, ...] = ()
    """The memory savings the search combined in its layouts (ZeRO-3, full checkpointing, uneven pipelines),
    named by the no-fit message so that it does not suggest what was already tried."""

    @property
    def best(self) -> Candidate:
        if not self.candidates:
            raise ValueError(self.no_fit_message())
        return self.candidates[0]

    def no_fit_message(self) -> str:
        batch = f"global batch {self.global_batch}" if self.global_batch else "the critical batch"
        if self.enumerated == 0:
            return (
                f"no valid layout of {self.model or 'the model'} on {self.gpus} GPUs with {batch}: the GPU count "
                "must factor into data × pipeline × tensor sizes the model divides; try a power-of-two GPU count "
                "or a batch that is a multiple of the data-parallel size"
            )
        *most, last = self.savings_searched or ("",)
        tried = f"{', '.join(most)} and {last}" if most else last
        even_with = f", even with {tried} (searched)" if tried else ""
        return (
            f"none of the {self.enumerated} valid layouts of {self.model or 'the model'} fits in "
            f"{self.hardware.memory_bytes / 1e9:.0f} GB on {self.gpus} GPUs{even_with}; use more GPUs or a "
            "device with more memory"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tensor_options(
    cfg: ModelConfig, gpus: int, hw: Hardware, space: SearchSpace
) -> list[tuple[str, int, bool]]:
    """(kind, tensor ranks, sequence parallel) triples of the search space that the GPU count allows and the
    config's tensor rules accept (`tessera.execution.tensor_violations`, which `tessera validate` applies: the
    planner never proposes a split validate refuses, nor leaves out one it accepts). Sequence parallelism over
    one rank splits nothing: not tried."""
    max_t = space.max_tensor or hw.gpus_per_node
    ts = space.tensor_1d or tuple(t for t in _divisors(max_t) if t <= max_t)
    out: list[tuple[str, int, bool]] = []
    for t in ts:
        if gpus % t:
            continue
        for sp in space.sequence_parallel:
            if not (t == 1 and sp) and not tensor_violations(cfg, t, 1, sp):
                out.append(("1d", t, sp))
    max_q2 = space.max_tensor_2d or 2 * hw.gpus_per_node
    qs = space.tensor_2d if space.tensor_2d is not None else tuple(q for q in range(2, 64) if q * q <= max_q2)
    for q in qs:
        if q > 1 and gpus % (q * q) == 0 and not tensor_violations(cfg, q * q, q, False):
            out.append(("2d", q * q, False))
    return out


def _pipeline_sizes(layers: int, ranks: int, uneven: bool) -> list[int]:
    """Pipeline sizes to try: every divisor of the layers (even stages), and with `uneven` every divisor of the
    ranks left after the tensor axis with at least two blocks per stage (`balanced_stage_layers`)."""
    extra = {p for p in _divisors(ranks) if 2 * p <= layers} if uneven else set()
    return sorted(set(_divisors(layers)) | extra)


def _schedule_options(space: SearchSpace, layers: int, p: int, m: int) -> list[tuple[str, int]]:
    if layers % p:  # uneven stages: one chunk per rank
        return [(name, 1) for name in space.schedules if name in ("1f1b", "gpipe")]
    per_rank = layers // p
    vs = [v for v in _divisors(per_rank) if space.max_virtual is None or v <= space.max_virtual]
    out: list[tuple[str, int]] = []
    one_per_block = (
        BREADTH_FIRST in space.schedules and per_rank > 1 and (space.max_virtual or per_rank) >= per_rank
    )
    for name in space.schedules:
        if p == 1:  # no pipeline: depth-first accumulation, or layered accumulation one layer at a time
            # with one micro-batch the two orders are the same run (`execution.decide`): only the layered one
            if name == "1f1b" and not (m == 1 and one_per_block):
                out.append(("1f1b", 1))
            elif name == BREADTH_FIRST and one_per_block:
                out.append((BREADTH_FIRST, per_rank))
        elif name in ("1f1b", "gpipe"):
            out.append((name, 1))
        elif name == "interleaved" and m % p == 0:
            out += [("interleaved", v) for v in vs if v > 1]
        elif name == "breadth_first":
            out += [("breadth_first", v) for v in vs]
    return out


@dataclass(slots=True)
class _Ctx:
    shape: ModelShape
    hw: Hardware
    space: SearchSpace
    limit: float
    flops_token: float
    peak_total: float
    gpus: int
    run: Config
    """The searched model with default parallel/train sections; each layout replaces them."""
    jobs: int = 1
    """Processes that price the layouts (`_price_layouts`)."""
    layer_cache: dict = field(default_factory=dict)


def _layer_parts(ctx: _Ctx, plan: Plan) -> tuple:
    """Per-layer compute, TP, output layer, embedding and context-parallel times: depend only on the
    tensor/context/micro-batch choices."""
    key = (
        plan.cp,
        plan.tp,
        plan.tp_kind,
        plan.sequence_parallel,
        plan.micro_batch,
        plan.recompute,
        plan.tp_comm_overlap,
    )
    if key not in ctx.layer_cache:
        base = replace(plan, dp=1, pp=1, zero_stage=0, n_microbatches=1, virtual_stages=1)
        ctx.layer_cache[key] = (
            layer_time(ctx.shape, ctx.hw, base),
            tp_comm_time_per_layer(ctx.shape, ctx.hw, base),
            logits_time(ctx.shape, ctx.hw, base),
            embedding_time(ctx.shape, ctx.hw, base),
            cp_comm_time_per_layer(ctx.shape, ctx.hw, base),
        )
    return ctx.layer_cache[key]


def _evaluate(
    ctx: _Ctx, run: Config, base: Plan, batch: int, p2p: float, defer_gather: bool = False
) -> Candidate | None:
    """Price one generated run config as the trainer would execute it: its execution plan's memory (the one
    estimator, `tessera.memory.estimate_plan`) and the step time of the schedule that plan runs. With
    `defer_gather`, `parallel.overlap_param_gather` is turned on where the layout still fits with it (its shard
    copies can raise the optimizer step's moment, `memory._temporaries`); it never prices slower."""
    execution = decide(run, ctx.gpus)
    # most layouts fail here, before the full estimate: the model state alone, then with the peak activations
    if (
        model_state_floor(ctx.shape, execution) > ctx.limit
        or memory_floor(ctx.shape, execution, stop_above=ctx.limit) > ctx.limit
    ):
        return None
    memory = estimate_plan(ctx.shape, execution, stop_above=ctx.limit)
    if memory.total > ctx.limit:
        return None
    if defer_gather:
        deferred = replace(run, parallel=replace(run.parallel, overlap_param_gather=True))
        deferred_execution = decide(deferred, ctx.gpus)
        deferred_memory = estimate_plan(ctx.shape, deferred_execution, stop_above=ctx.limit)
        if deferred_memory.total <= ctx.limit:
            run, execution, memory = deferred, deferred_execution, deferred_memory
    timed = cost_plan(execution)
    plan = replace(base, **{f: getattr(timed, f) for f in _EXECUTION_FIELDS})
    schedule = execution.schedule or "1f1b"  # the direct loop: one micro-batch after another
    bd = _step(ctx, plan, schedule, p2p)
    rung = _with_rings(ctx, plan, bd, execution, schedule, p2p)
    if rung is not None:
        plan, bd, execution, memory = rung
        run = replace(run, parallel=replace(run.parallel, tp_comm_overlap=True))
    tokens = batch * ctx.shape.seq_len / bd.step_time
    return Candidate(
        plan=plan,
        schedule=schedule,
        global_batch=batch,
        breakdown=bd,
        memory=memory.breakdown,
        memory_stage=memory.stage,
        tokens_per_s=tokens,
        mfu=tokens * ctx.flops_token / ctx.peak_total,
        config=run,
        execution=execution,
    )


def _with_rings(
    ctx: _Ctx, plan: Plan, bd: StepBreakdown, execution: ExecutionPlan, schedule: str, p2p: float
) -> tuple[Plan, StepBreakdown, ExecutionPlan, MemoryEstimate] | None:
    """The layout with `parallel.tp_comm_overlap` on, (its plan, step time, execution plan, memory), where the
    rings apply (`tessera_runs_rings`), are faster (their
    smaller GEMM chunks can cost more than the transfer they hide) and still fit: their backward holds more than
    the plain entry's (`rank_memory.ring_moment_bytes`), so the plan written is priced with them. None: the layout
    as it is, without the rings."""
    if not (ctx.space.comm_overlap and tessera_runs_rings(plan)):
        return None
    ringed = replace(plan, tp_comm_overlap=True)
    ring_bd = _step(ctx, ringed, schedule, p2p)
    if ring_bd.step_time >= bd.step_time:
        return None
    ring_execution = replace(execution, tp_comm_overlap=True)
    memory = estimate_plan(ctx.shape, ring_execution, stop_above=ctx.limit)
    if memory.total > ctx.limit:
        return None
    return ringed, ring_bd, ring_execution, memory


def tessera_runs_rings(plan: Plan) -> bool:
    """Whether tessera's runtime runs `plan`'s layout with `parallel.tp_comm_overlap`: where the rings fit the
    layout (`Plan.rings_fit_layout`) and without context parallelism, which `execution.context_violations`
    refuses with them in this version, nor op checkpointing (`execution.op_checkpointing_violations`)."""
    return plan.rings_fit_layout and plan.cp == 1 and plan.recompute != "op"


def _step(ctx: _Ctx, plan: Plan, schedule: str, p2p: float) -> StepBreakdown:
    """`steptime.fast_step` of `plan` from the cached per-layer parts."""
    lt, tp, lg, (emb, emb_tp), cp = _layer_parts(ctx, plan)
    counts = layers_per_stage(ctx.shape, plan)
    pc = pipeline_from_layer(counts, lt, tp, lg, p2p, emb, emb_tp, cp)
    return _fast(ctx.shape, ctx.hw, plan, schedule, pc)


_EXECUTION_FIELDS = (
    "tp_comm_overlap",
    "overlap_param_gather",
    "virtual_stages",
    "zero_stage",
    "zero_shard",
    "recompute",
    "accumulation",
    "stage_layers",
    "grad_reduce_bytes",
)
"""What the execution plan decides beyond the layout the search fixed in its base Plan."""


def _batches(
    fixed: int | None, crit_seq: float | None, dp: int, space: SearchSpace, q: int
) -> list[tuple[int, int]]:
    """(global batch, micro-batch) pairs for data-parallel size dp."""
    out = []
    if fixed is not None:
        if fixed % dp:
            return []
        per = fixed // dp
        options = space.micro_batches or tuple(b for b in _divisors(per) if b <= space.max_micro_batch)
        return [(fixed, b) for b in options if per % b == 0 and b % q == 0]
    assert crit_seq is not None
    options = space.micro_batches or tuple(b for b in range(1, space.max_micro_batch + 1) if b & (b - 1) == 0)
    for b in options:
        if b % q:
            continue
        unit = dp * b
        if unit > MAX_CRITICAL_BATCH_FACTOR * crit_seq:
            continue
        out.append((unit * max(1, round(crit_seq / unit)), b))
    return out


@contextmanager
def without_cycle_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, or the decorated call (restored after). The search
    and the report allocate about a million short-lived objects (configs, plans, schedule actions, timeline
    entries), which reference counting frees, beside tens of thousands of long-lived ones (the memory model's memo
    tables, the candidates): each of the collector's full passes rescans the long-lived ones, ~0.5 s of the
    1T/3072 plan's ~3 s of CPU, for no garbage (peak memory is the same with the collector off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@without_cycle_collection()
def search(
    model: str | ModelConfig,
    gpus: int,
    hw: Hardware,
    global_batch: int | None = None,
    *,
    space: SearchSpace | None = None,
    target_loss: float | None = None,
    keep: int = 1000,
    jobs: int = 1,
) -> SearchResult:
    """Enumerate, prune and rank layouts (module docstring). `global_batch` in sequences; None uses the critical
    batch B_crit(target_loss) (default target: `default_target_loss`), rounded per layout to a multiple of
    d × micro-batch, and ranks by training time = steps(B) × step time (Kaplan/McCandlish trade-off). ``jobs``:
    processes that price the layouts (`_price_layouts`; `default_jobs` is what `tessera plan` uses); the result
    is the same for any number."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    space = space or SearchSpace()
    name, cfg = model_config(model)
    shape = ModelShape.from_config(cfg)
    shape = replace(shape, n_kv_heads=cfg.kv_heads)
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    crit_tokens = crit_seq = None
    loss = target_loss
    if global_batch is None:
        loss = loss or default_target_loss(shape)
        crit_tokens = critical_batch(loss)
        crit_seq = crit_tokens / shape.seq_len
    result = SearchResult(
        model=name,
        model_config=cfg,
        shape=shape,
        gpus=gpus,
        hardware=hw,
        global_batch=global_batch,
        critical_batch_tokens=crit_tokens,
        target_loss=loss,
        objective="step_time" if global_batch is not None else "training_time",
    )
    ctx = _Ctx(
        shape=shape,
        hw=hw,
        space=space,
        limit=space.memory_fraction * hw.memory_bytes,
        flops_token=model_flops_per_token(shape),
        peak_total=hw.peak(space.dtype) * gpus,
        gpus=gpus,
        run=Config(
            model=cfg,
            train=TrainConfig(dtype=space.dtype),
            data=DataConfig(document_mask=space.document_mask),
        ),
        jobs=jobs,
    )
    contexts = _context_sizes(space, shape.seq_len, gpus)
    found = _search_sizes(ctx, result, cfg, [1, *contexts], global_batch, crit_seq)
    if not found and not contexts and space.context is None:  # short sequences: context only if nothing fits
        found = _search_sizes(
            ctx, result, cfg, _context_sizes(space, CONTEXT_MIN_SEQ, gpus), global_batch, crit_seq
        )
    if not found and space.uneven_pipelines is None and space.pipeline is None:
        uneven = _uneven_only(ctx)
        if uneven.space.pipeline:
            found = _search_sizes(uneven, result, cfg, [1, *contexts], global_batch, crit_seq)
            result.uneven_fallback = True
    result.savings_searched = _savings_searched(space, result.uneven_fallback, gpus)
    if crit_tokens is not None and loss is not None:
        found = [_with_steps(c, shape, loss, crit_tokens) for c in found]
    found.sort(key=lambda c: c.training_time if c.steps is not None else c.step_time)
    result.candidates = found[:keep]
    result.seconds = time.perf_counter() - start
    result.cpu_seconds = _cpu_seconds() - cpu_start
    return result


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its ended children (the search's workers, `_price_layouts`)."""
    times = os.times()
    return time.process_time() + times.children_user + times.children_system


MAX_DEFAULT_JOBS = 8
"""The most worker processes `default_jobs` gives. Each worker compiles the memory walks its layouts need for
itself (the memo tables are per process), so past a few workers the walks compiled twice eat the gain: the 1T
search on 3072 GPUs prices 273 layout groups, of uneven cost."""


def default_jobs() -> int:
    """Processes for `tessera plan`'s search: the cores this process may run on, at most `MAX_DEFAULT_JOBS`; 1
    where processes cannot be forked (the pool inherits the search's context instead of pickling it)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_JOBS, cores))


def _savings_searched(space: SearchSpace, uneven_tried: bool, gpus: int) -> tuple[str, ...]:
    """The memory savings of `SearchResult.savings_searched` (ZeRO-3 and pipelines need more than one GPU)."""
    named = [
        ("ZeRO-3", 3 in space.zero_stages and gpus > 1),
        ("full checkpointing", "full" in space.checkpointing),
        ("uneven pipelines", (bool(space.uneven_pipelines) or uneven_tried) and gpus > 1),
    ]
    return tuple(name for name, searched in named if searched)


def _uneven_only(ctx: _Ctx) -> _Ctx:
    """The search context for the uneven fallback (`SearchSpace.uneven_pipelines` None): only the pipeline sizes
    the even search left out, those that do not divide the layers, so no layout is enumerated twice."""
    layers = ctx.shape.n_layers
    uneven = tuple(p for p in _pipeline_sizes(layers, ctx.gpus, True) if layers % p)
    return replace(ctx, space=replace(ctx.space, uneven_pipelines=True, pipeline=uneven))


def _context_sizes(space: SearchSpace, seq_len: int, gpus: int) -> list[int]:
    """Context sizes c > 1 to try (`SearchSpace.context`): the given ones, or powers of two up to
    `SearchSpace.max_context` (and the GPU count) from `CONTEXT_MIN_SEQ` tokens on."""
    if space.context is not None:
        return [c for c in space.context if c > 1]
    if seq_len < CONTEXT_MIN_SEQ:
        return []
    top = min(space.max_context, gpus)
    return [2**i for i in range(1, top.bit_length()) if 2**i <= top]


def _search_sizes(
    ctx: _Ctx,
    result: SearchResult,
    cfg: ModelConfig,
    contexts: list[int],
    global_batch: int | None,
    crit_seq: float | None,
) -> list[Candidate]:
    """Every layout with a context size of `contexts` (1: none): tensor × context × pipeline × data, the
    combinations `tessera.execution.context_violations` refuses left out (a pipeline or a 2D grid with context
    parallelism, a sequence that does not cut into 2c (2c·t) chunks), as `tessera validate` refuses them."""
    gpus, space, shape = ctx.gpus, ctx.space, ctx.shape
    layouts: list[Layout] = []
    for kind, tp, sp in _tensor_options(cfg, gpus, ctx.hw, space):
        for c in contexts:
            if (gpus // tp) % c:
                continue
            for p in space.pipeline or _pipeline_sizes(
                shape.n_layers, gpus // (tp * c), space.uneven_pipelines
            ):
                if (gpus // (tp * c)) % p or (c > 1 and _context_refused(ctx, kind, tp, sp, p, c)):
                    continue
                dp = gpus // (tp * p * c)
                q = round(tp**0.5) if kind == "2d" else 1
                for batch, b in _batches(global_batch, crit_seq, dp, space, q):
                    layouts.append((kind, tp, sp, p, dp, batch, b, c))
    found: list[Candidate] = []
    for candidates, counts in _price_layouts(ctx, layouts):
        result.enumerated += counts.enumerated
        result.rejected_memory += counts.rejected_memory
        found += candidates
    return found


@dataclass
class _Counts:
    """What `_search_layout` counts of one layout's variants (`SearchResult`'s two counters)."""

    enumerated: int = 0
    rejected_memory: int = 0


Layout = tuple[str, int, bool, int, int, int, int, int]
"""`_search_layout`'s arguments after the counts: (kind, tp, sp, p, dp, batch, b, c)."""


def _price_layout(ctx: _Ctx, layout: Layout) -> tuple[list[Candidate], _Counts]:
    counts = _Counts()
    return _search_layout(ctx, counts, *layout), counts


_FORKED_CTX: _Ctx | None = None
"""The search context forked workers inherit (`_price_layouts`), so that it is not pickled with each layout."""


def _start_worker() -> None:
    """A worker's signals: Ctrl-C (SIGINT, sent to the whole process group) is the parent's to handle, which stops
    the workers (`tessera plan`: "interrupted", exit 130) without a traceback from each; SIGTERM ends a worker at
    once (not the parent's handler, inherited at the fork: `_price_layouts`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _Terminated(Exception):
    """SIGTERM arrived while the workers ran (`_price_layouts`)."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _serve_layouts(conn: Connection) -> None:
    """A worker: prices each (index, layout) its pipe brings until it brings None, and sends back (index, result,
    None), or (index, None, the traceback) where pricing raised."""
    _start_worker()
    assert _FORKED_CTX is not None, "set by _price_layouts before the fork"
    while (task := conn.recv()) is not None:
        index, layout = task
        try:
            conn.send((index, _price_layout(_FORKED_CTX, layout), None))
        except Exception:
            conn.send((index, None, traceback.format_exc()))


def _died(worker: multiprocessing.process.BaseProcess) -> TesseraError:
    code = worker.exitcode
    assert code is not None
    killed = f" (killed by signal {-code}: out of memory?)" if code < 0 else ""
    return TesseraError(
        f"a search worker process (pid {worker.pid}) died with exit code {code}{killed}; no plan was made. "
        "Rerun with --jobs 1 to search in this process."
    )


def _price_in_workers(layouts: list[Layout], jobs: int) -> list[tuple[list[Candidate], _Counts]]:
    """`_price_layouts` over ``jobs`` forked workers. Each has its own pipe and takes the next layout as it comes
    free, and the parent, single-threaded, waits on the pipes: a signal always reaches the thread that waits,
    and a worker killed alone (the kernel's out-of-memory killer) closes its pipe's end, an error, not a task
    lost. (multiprocessing's Pool does neither: it waits with helper threads, and a worker killed while holding
    its shared queue's lock hangs the pool, even its `terminate`.)"""
    fork = multiprocessing.get_context("fork")
    results: list[tuple[list[Candidate], _Counts] | None] = [None] * len(layouts)
    todo = list(enumerate(layouts))[::-1]  # popped from the end: in order
    workers: dict[Connection, multiprocessing.process.BaseProcess] = {}
    busy: set[Connection] = set()

    def give(conn: Connection) -> None:
        try:
            conn.send(todo.pop())
        except (BrokenPipeError, ConnectionResetError):  # it died idle
            workers[conn].join()
            raise _died(workers[conn]) from None
        busy.add(conn)

    try:
        for _ in range(jobs):
            conn, child_end = fork.Pipe()
            worker = fork.Process(target=_serve_layouts, args=(child_end,), daemon=True)
            worker.start()
            child_end.close()
            workers[conn] = worker
            give(conn)
        while busy:
            for conn in wait(list(busy)):
                assert isinstance(conn, Connection)
                try:
                    index, result, failure = conn.recv()
                except (EOFError, ConnectionResetError):  # it died with a layout and no result
                    workers[conn].join()
                    raise _died(workers[conn]) from None
                if failure is not None:
                    raise RuntimeError(f"a search worker failed pricing {layouts[index]}:\n{failure}")
                results[index] = result
                busy.discard(conn)
                if todo:
                    give(conn)
    finally:
        # Idle workers are told to end (not by closing the pipe: each holds its parent's end too, from the fork);
        # stopped early, a busy worker is not waited for.
        for conn, worker in workers.items():
            if conn in busy:
                worker.terminate()
            else:
                with suppress(BrokenPipeError, ConnectionResetError):  # it died idle
                    conn.send(None)
        for conn, worker in workers.items():
            worker.join()
            conn.close()
    return results  # type: ignore[return-value]  # every index was filled, or the loop raised


def _price_layouts(ctx: _Ctx, layouts: list[Layout]) -> list[tuple[list[Candidate], _Counts]]:
    """Each layout's candidates and counts, in the order given: in this process, or with ``ctx.jobs`` > 1 in
    that many forked workers (`_price_in_workers`), one layout at a time as each comes free (their costs differ
    by 100×). The same results: a layout is priced on its own, and the memo tables a worker fills return what
    they would compute (`memory.steady_walk`'s shared walks are equal walks: test_plan_speed)."""
    global _FORKED_CTX
    jobs = min(ctx.jobs, len(layouts))
    if jobs <= 1:
        return [_price_layout(ctx, layout) for layout in layouts]
    # SIGTERM to this process alone would leave the workers writing to a closed pipe (a traceback each): it is
    # raised here instead, the workers are stopped, and the signal is then taken as it would have been
    installed = threading.current_thread() is threading.main_thread()  # where a handler can be set
    if installed:
        # None: the handler was not set from Python (an embedding host's); the default stands in for it
        previous = signal.signal(signal.SIGTERM, _raise_terminated) or signal.SIG_DFL
    _FORKED_CTX = ctx
    try:
        return _price_in_workers(layouts, jobs)
    except _Terminated:  # the workers are stopped: the signal again, to the handler it was meant for
        signal.signal(signal.SIGTERM, previous)
        installed = False
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous)
        _FORKED_CTX = None


def _context_refused(ctx: _Ctx, kind: str, tp: int, sp: bool, p: int, c: int) -> bool:
    """Whether `tessera validate` refuses context c with this tensor split and pipeline
    (`execution.context_violations`: the one rule the search and validate share)."""
    q = round(tp**0.5) if kind == "2d" else 1
    tensor = f"{q}x{q}" if kind == "2d" else tp
    parallel = ParallelConfig(tensor=tensor, sequence_parallel=sp, pipeline=p, context=c)
    return bool(context_violations(replace(ctx.run, parallel=parallel), tp if kind == "1d" else q, q))


def _search_layout(
    ctx: _Ctx,
    result: _Counts,
    kind: str,
    tp: int,
    sp: bool,
    p: int,
    dp: int,
    batch: int,
    b: int,
    c: int = 1,
) -> list[Candidate]:
    m = batch // (dp * b)
    out: list[Candidate] = []
    base = Plan(
        dp=dp,
        pp=p,
        cp=c,
        tp=tp,
        tp_kind=kind,
        sequence_parallel=sp,
        micro_batch=b,
        n_microbatches=m,
        dtype=ctx.space.dtype,
        autocast=True,  # tessera's mixed precision: fp32 master weights, fp32 residual stream
        flash_attention=ctx.space.flash_attention,
        document_mask=ctx.space.document_mask,
        rank_order=TESSERA_ORDER,  # the trainer lays ranks out with tessera.layout
    )
    p2p = p2p_time_per_microbatch(ctx.shape, ctx.hw, base)
    schedules = _schedule_options(ctx.space, ctx.shape.n_layers, p, m)
    zeros = [z for z in ctx.space.zero_stages if dp * c > 1 or z == 0] or [
        0
    ]  # ZeRO shards over data × context
    # (ZeRO stage, shard size): None shards over all d ranks; hybrid sharding only beside ZeRO-3
    # largest shard first, after plain ZeRO-3: a layout that does not fit with s does not fit with any smaller s
    # (hybrid sharding is refused with context parallelism: `execution.context_violations`)
    hybrid = sorted(_hybrid_shards(ctx, tp, p, dp), reverse=True) if 3 in zeros and c == 1 else []
    variants = [(z, None) for z in zeros] + [(3, s) for s in hybrid]
    train = replace(ctx.run.train, global_batch=batch, micro_batch=b)  # the same for every variant below
    # the configs below are built by keyword from these (what dataclasses.replace copies, without its field scan
    # per config: ~1e4 per search)
    run_fields = {**_init_fields(ctx.run), "train": train}
    # a ZeRO stage whose mean model state per pipeline rank is over the limit: every variant below fails
    # `model_state_floor` (`memory.model_state_mean` bounds it whatever the split, schedule or checkpointing),
    # so they are counted without building their configs
    over = {
        (z, s)
        for z, s in variants
        if model_state_mean(ctx.shape, replace(base, zero_stage=z, zero_shard=s or (dp * c if c > 1 else 0)))
        > ctx.limit
    }
    tensor = f"{base.q}x{base.q}" if kind == "2d" else tp
    for recompute in ctx.space.checkpointing:
        if recompute == "op" and kind == "2d":  # refused: a 2D Linear is q SUMMA products (tessera.execution)
            continue
        # each schedule's stage splits: they read the layout, v and the per-layer costs, not the ZeRO stage or
        # the schedule's name (1F1B and GPipe, or interleaved and breadth-first with one v, share theirs)
        shared: dict[tuple[int, str], list[tuple[int, ...] | None]] = {}  # (v, accumulation) -> splits
        splits_of = {}
        for schedule, v in schedules:
            accumulation = _accumulation(schedule)
            splits = shared.get((v, accumulation))
            if splits is None:
                splits = shared[v, accumulation] = _splits(ctx, base, recompute, zeros[0], v, accumulation)
            splits_of[schedule, v] = splits
        # (schedule, v, split) whose ZeRO-3 did not fit with a larger shard group: sharding the same model state
        # over fewer ranks holds more of it per rank and the same activations, so its smaller shards are counted
        # rejected unbuilt (`test_hsdp`: the search's answer is the same with every variant priced)
        zero3_over: set[tuple[str, int, tuple[int, ...] | None]] = set()
        for zero, shard in variants:
            deferred = ctx.space.comm_overlap and zero in (1, 2) and dp * c > 1  # where it fits (`_evaluate`)
            for schedule, v in schedules:
                splits = splits_of[schedule, v]
                if (zero, shard) in over:
                    result.enumerated += len(splits)
                    result.rejected_memory += len(splits)
                    continue
                for split in splits:
                    if shard is not None and (schedule, v, split) in zero3_over and _PRUNE_SMALLER_SHARDS:
                        result.enumerated += 1
                        result.rejected_memory += 1
                        continue
                    parallel = ParallelConfig(
                        data=dp,
                        tensor=tensor,
                        sequence_parallel=sp,
                        pipeline=p,
                        context=c,
                        schedule=schedule,
                        stages_per_rank=v,
                        stage_layers=None if split is None else list(split),
                        zero=zero,
                        zero_shard_size=shard,
                        accumulation=_accumulation(schedule),
                        checkpointing=recompute,
                    )
                    result.enumerated += 1
                    # = replace(ctx.run, parallel=parallel, train=train)
                    run = Config(**{**run_fields, "parallel": parallel})
                    cand = _evaluate(ctx, run, base, batch, p2p, defer_gather=deferred)
                    if cand is None:
                        result.rejected_memory += 1
                        if zero == 3:
                            zero3_over.add((schedule, v, split))
                    else:
                        out.append(cand)
    return out


_PRUNE_SMALLER_SHARDS = True
"""Skip a hybrid shard size where a larger one (or plain ZeRO-3) did not fit; False prices every one (the test
that the skip changes no answer)."""


def _hybrid_shards(ctx: _Ctx, tp: int, p: int, dp: int) -> list[int]:
    """Hybrid sharding's shard sizes for this layout: whole nodes' worth of data ranks. Data is outermost in
    tessera's rank order, so s consecutive data ranks span s · p · t consecutive ranks: one node's data ranks are
    G / (p · t) where p · t divides G, and a data rank already fills p · t / G whole nodes where G divides p · t
    (then each shard group holds one rank per node it spans). Their multiples by 1, 2, 4 … `HYBRID_NODE_MULTIPLES`
    keep every group on whole nodes no other group shares (`Layout.shard_groups_straddling` is None); each s ≥ 2
    that divides d and is below it (s = d is plain ZeRO-3, already tried)."""
    G, inner = ctx.hw.gpus_per_node, tp * p
    if not ctx.space.hybrid_sharding or (G % inner and inner % G):
        return []
    node = max(1, G // inner)
    sizes = (node * k for k in (2**i for i in range(HYBRID_NODE_MULTIPLES.bit_length())))
    return [s for s in sizes if 2 <= s < dp and dp % s == 0]


def _accumulation(schedule: str) -> str:
    """The accumulation the search runs a schedule with: layered for breadth-first, else depth-first."""
    return LAYERED if schedule == BREADTH_FIRST else DEPTH_FIRST


def _init_fields(obj: Any) -> dict[str, Any]:
    """A dataclass instance's constructor arguments: the fields `dataclasses.replace` copies."""
    return {f.name: getattr(obj, f.name) for f in fields(obj) if f.init}


def _splits(
    ctx: _Ctx, base: Plan, recompute: str, zero: int, v: int, accumulation: str
) -> list[tuple[int, ...] | None]:
    """Stage splits to try for layout ``base`` with checkpointing ``recompute`` and v chunks per rank: the even
    one (None) when p·v divides the layers, and with one chunk per rank the split that offloads the embedding's
    and the head's work from the end stages (`balanced_stage_layers`; priced on ``base`` with ``recompute``,
    ZeRO stage ``zero``, v and ``accumulation``, built only then)."""
    L, p = ctx.shape.n_layers, base.pp
    even = [None] if L % (p * v) == 0 else []
    if p == 1 or v > 1:
        return even
    plan = replace(base, recompute=recompute, zero_stage=zero, virtual_stages=v, accumulation=accumulation)
    lt, tp, lg, (emb, emb_tp), cp = _layer_parts(ctx, plan)
    block = lt.forward + lt.backward + lt.recompute + tp.forward + tp.backward + tp.recompute
    block += cp.forward + cp.backward + cp.recompute
    first = (emb.forward + emb.backward + emb_tp.forward) / block
    split = balanced_stage_layers(L, p, first, (lg.forward + lg.backward) / block)
    if even and split == (L // p,) * p:
        return even
    return [*even, split]


def _with_steps(c: Candidate, shape: ModelShape, loss: float, crit_tokens: float) -> Candidate:
    from tessera.planner.scaling import min_steps

    s_min = min_steps(shape.n_params_non_embedding(), loss)
    steps = steps_for_batch(s_min, c.global_batch * shape.seq_len, crit_tokens)
    return replace(c, steps=steps)
