"""Output of `tessera plan`: text tables, JSON, the chosen layout as a config TOML, and a breakdown picture.

`explain` re-times the top layouts of a search with the simulator (`steptime.simulated_breakdown`) when the
schedule is small enough (`SIM_ACTION_LIMIT`), re-ranks them, and attaches a one-sentence reason to every
runner-up: its largest loss component against the winner, with the layout choice that causes it.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tessera.config import load_config
from tessera.config.checks import Violation
from tessera.config.loading import toml_value
from tessera.errors import ConfigError
from tessera.execution import violations
from tessera.planner.cost.plan import Plan
from tessera.planner.run_settings import PLAN_KEYS, RunInputs, Setting, run_settings
from tessera.planner.search import Candidate, SearchResult, without_cycle_collection
from tessera.planner.steptime import StepBreakdown, p2p_hops, pipeline_costs, rank_blocks, simulated_breakdown

__all__ = [
    "COMPONENT_NAMES",
    "SIM_ACTION_LIMIT",
    "Explained",
    "config_toml",
    "data_problems",
    "explain",
    "mfu_warning",
    "render_picture",
    "render_text",
    "to_json",
    "write_config",
]

SIM_ACTION_LIMIT = 40_000
"""Re-time a layout with the simulator only if its schedule has at most this many compute actions (2·p·v·m);
bigger ones keep the closed form (same model, checked against the simulator in the tests)."""

COMPONENT_NAMES = {
    "compute": "compute",
    "tp_comm": "exposed tensor-parallel communication",
    "cp_comm": "exposed context-parallel communication",
    "bubble": "pipeline bubble",
    "pp_comm": "pipeline p2p communication",
    "dp_comm": "exposed data-parallel communication",
    "optimizer": "optimizer step",
}
_COLORS = {
    "compute": "#4c72b0",
    "tp_comm": "#dd8452",
    "cp_comm": "#da8bc3",
    "bubble": "#c7c7c7",
    "pp_comm": "#55a868",
    "dp_comm": "#c44e52",
    "optimizer": "#8172b3",
}


@dataclass(kw_only=True, slots=True, frozen=True)
class Explained:
    """A reported layout: the candidate (with its re-timed breakdown), how it was timed, and why it loses."""

    candidate: Candidate
    timed_by: str
    """"simulator" or "closed form"."""
    reason: str | None
    """For runner-ups: one sentence comparing its largest loss component to the winner's."""


def _retime(result: SearchResult, cand: Candidate) -> tuple[Candidate, str]:
    pl = cand.plan
    if 2 * pl.pp * pl.virtual_stages * pl.n_microbatches > SIM_ACTION_LIMIT:
        return cand, "closed form"
    bd = simulated_breakdown(result.shape, result.hardware, pl, cand.schedule)
    tokens = cand.global_batch * result.shape.seq_len / bd.step_time
    mfu = cand.mfu * cand.step_time / bd.step_time
    return replace(cand, breakdown=bd, tokens_per_s=tokens, mfu=mfu), "simulator"


def _objective(result: SearchResult, cand: Candidate) -> float:
    return cand.training_time if result.objective == "training_time" and cand.steps else cand.step_time


def _distinct(result: SearchResult, top: int) -> list[Candidate]:
    """The best candidate of each structural layout (d, p, tensor, schedule), best first: runner-ups that differ
    from the winner in more than v, the micro-batch or the checkpointing mode."""
    seen: set[tuple] = set()
    out: list[Candidate] = []
    for c in result.candidates:
        pl = c.plan
        key = (pl.dp, pl.pp, pl.cp, pl.tp, pl.tp_kind, c.schedule, pl.zero_dp)
        if key not in seen:
            seen.add(key)
            out.append(c)
        if len(out) == top:
            break
    return out


@without_cycle_collection()  # as the search: its re-timing allocates ~1e5 short-lived objects
def explain(result: SearchResult, top: int = 5) -> list[Explained]:
    """The best layout and the best of the next `top − 1` distinct layouts (`_distinct`), re-timed with the
    simulator where small enough, re-ranked, with a reason for each runner-up."""
    timed = [_retime(result, c) for c in _distinct(result, max(top, 1))]
    timed.sort(key=lambda ct: _objective(result, ct[0]))
    if not timed:
        return []
    winner = timed[0][0]
    out = [Explained(candidate=timed[0][0], timed_by=timed[0][1], reason=None)]
    out += [Explained(candidate=c, timed_by=how, reason=_reason(result, winner, c)) for c, how in timed[1:]]
    return out


def _reason(result: SearchResult, win: Candidate, run: Candidate) -> str:
    slower = _objective(result, run) / _objective(result, win) - 1
    wp, rp = win.breakdown.parts, run.breakdown.parts
    part = max(rp, key=lambda k: rp[k] - wp[k])
    delta = rp[part] - wp[part]
    head = f"{slower:+.1%} {'training time' if result.objective == 'training_time' else 'step time'}"
    if (
        result.objective == "training_time"
        and run.steps
        and win.steps
        and run.global_batch != win.global_batch
    ):
        head += f" (batch {run.global_batch} vs {win.global_batch} sequences: {run.steps:,.0f} vs {win.steps:,.0f} steps)"
    if delta <= 0:
        return f"{head}: ties the winner on every component"
    return (
        f"{head}: its {COMPONENT_NAMES[part]} is {rp[part]:.3g} s vs {wp[part]:.3g} s (+{delta:.3g} s), "
        f"{_why(part, win, run, result)}"
    )


def _compute_parts(result: SearchResult, cand: Candidate) -> dict[str, float]:
    """The critical rank's compute per step split by cause: "blocks" (the transformer blocks it runs: time per
    whole sequence-block's work × the whole sequence-blocks' work it does), "output layer" (the head and loss,
    once per micro-batch on the last stage) and "embedding" (first stage); plus the factors of "blocks" for the
    explanation. A rank does 1/(tensor × context ranks) of each sequence-block it runs, so two layouts that split
    the same work differently (t 8 over twice the blocks of t 4) do the same whole sequence-blocks' work, and
    what sets them apart is the time per unit of it (the GEMMs' efficiency at their shapes, the recomputation)."""
    pl = cand.plan
    pc = pipeline_costs(result.shape, result.hardware, pl)
    rank = pc.critical_rank(pl.pp)
    b, m = pc.block, pl.n_microbatches
    seq_blocks = m * rank_blocks(pc.counts, pl.pp)[rank] * pl.micro_batch
    share = 1 / (pl.tp * pl.cp)  # of each sequence-block's work, on this rank
    per = (b.fwd_compute + b.bwd_compute) / pl.micro_batch
    return {
        "blocks": per * seq_blocks,
        "output layer": m * (b.out_fwd + b.out_bwd) if rank == pl.pp - 1 else 0.0,
        "embedding": m * (pc.emb.forward + pc.emb.backward) if rank == 0 else 0.0,
        "per_whole_block": per / share,
        "whole_blocks": seq_blocks * share,
        "sequence_blocks": seq_blocks,
    }


def _why_compute(result: SearchResult, win: Candidate, run: Candidate) -> str:
    """Name the largest of: more recompute or less efficient GEMMs (time per whole sequence-block's work), more
    of that work on the critical rank (blocks × sequences / the tensor and context ranks sharing each), the output
    layer or the embedding run for more micro-batches."""
    w, r = _compute_parts(result, win), _compute_parts(result, run)
    wp, rp = win.plan, run.plan
    effects = {
        "work": (r["per_whole_block"] - w["per_whole_block"]) * r["whole_blocks"],
        "count": w["per_whole_block"] * (r["whole_blocks"] - w["whole_blocks"]),
        "output layer": r["output layer"] - w["output layer"],
        "embedding": r["embedding"] - w["embedding"],
    }
    cause = max(effects, key=lambda k: effects[k])
    amount = f"{effects[cause]:+.3g} s"
    if cause == "work" and rp.recompute != wp.recompute:
        return f"because checkpointing '{rp.recompute}' recomputes more of the forward ({amount}; winner: '{wp.recompute}')"
    if cause == "work":
        return (
            f"because each block's GEMMs run less efficiently ({amount}): micro-batch {rp.micro_batch}, tensor "
            f"{rp.tp} {rp.tp_kind} vs the winner's micro-batch {wp.micro_batch}, tensor {wp.tp} {wp.tp_kind}"
        )
    if cause == "count":
        return (
            f"because its busiest pipeline rank does {_block_work(r, rp)} per step vs {_block_work(w, wp)} "
            f"({amount})"
        )
    return (
        f"because its {cause} runs on the critical rank for {rp.n_microbatches} micro-batches vs "
        f"{wp.n_microbatches} ({amount})"
    )


def _block_work(parts: dict[str, float], plan: Plan) -> str:
    """The whole sequence-blocks' work a rank does, with the ranks sharing each: e.g. "1,024 sequence-blocks / 8
    tensor ranks"."""
    split = [f"{n} {name} ranks" for n, name in ((plan.tp, "tensor"), (plan.cp, "context")) if n > 1]
    return f"{parts['sequence_blocks']:,.0f} sequence-blocks" + "".join(f" / {x}" for x in split)


def _why_bubble(win: Candidate, run: Candidate) -> str:
    """The runner-up's idle share of its step, from its own breakdown (not a schedule formula: breadth-first and
    looped schedules with fewer micro-batches than pipeline ranks idle far more than (p−1)/(v·m + p − 1))."""
    w, r = win.plan, run.plan
    idle = run.breakdown.bubble / run.step_time
    starved = (
        f"; with fewer micro-batches than pipeline ranks (m={r.n_microbatches} < p={r.pp}) each rank waits for the "
        "others"
        if r.n_microbatches < r.pp
        else ""
    )
    return (
        f"because {run.schedule} with p={r.pp}, m={r.n_microbatches}, v={r.virtual_stages} idles {idle:.0%} of "
        f"its step{starved} (winner: p={w.pp}, m={w.n_microbatches}, v={w.virtual_stages})"
    )


def _why(part: str, win: Candidate, run: Candidate, result: SearchResult) -> str:
    w, r = win.plan, run.plan
    if part == "bubble":
        return _why_bubble(win, run)
    if part == "compute":
        return _why_compute(result, win, run)
    if part == "tp_comm":
        return (
            f"from {r.tp_kind} tensor parallelism over {r.tp} ranks with micro-batch {r.micro_batch} "
            f"(winner: {w.tp_kind} over {w.tp})"
        )
    if part == "cp_comm":
        return (
            f"from all-gathering K and V (and reduce-scattering their gradients) over {r.cp} context ranks in "
            f"every block (winner: context {w.cp})"
        )
    if part == "pp_comm":
        hops = p2p_hops(run.schedule, r.pp, r.n_microbatches, r.virtual_stages)
        return f"from ≈{hops:.0f} pipeline transfers on the critical path ({run.schedule}, p={r.pp}, v={r.virtual_stages})"
    if part == "dp_comm":
        return (
            f"because ZeRO-{r.zero_stage} traffic over d={r.dp} with {r.accumulation.replace('_', '-')} "
            f"accumulation is not hidden behind the backward (winner: ZeRO-{w.zero_stage}, d={w.dp})"
        )
    return f"because ZeRO-{r.zero_stage} shards the optimizer state less (winner: ZeRO-{w.zero_stage})"


def _fmt_time(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds:.3g} s"


def mfu_warning(result: SearchResult, entries: list[Explained]) -> str | None:
    """A warning when a listed layout's predicted MFU exceeds the best MFU published for this hardware
    (`Hardware.best_published_mfu`, sources in docs/cost-model.md §1): the prediction is then optimistic."""
    best = result.hardware.best_published_mfu
    over = [i for i, e in enumerate(entries, 1) if best and e.candidate.mfu > best]
    if not over:
        return None
    return (
        f"WARNING: predicted MFU of #{', #'.join(map(str, over))} exceeds the best published MFU on "
        f"{result.hardware.name} ({best:.1%}); treat these step times as optimistic"
    )


def render_text(result: SearchResult, entries: list[Explained]) -> str:
    """The human-readable plan: header, top layouts, per-layout breakdown, why the runner-ups lose."""
    hw, shape = result.hardware, result.shape
    lines = [
        f"plan for {result.model or 'model'} ({shape.n_params() / 1e9:.3g}B parameters) on {result.gpus} × "
        f"{hw.name}; searched {result.enumerated:,} valid layouts in {result.seconds:.2f} s, "
        f"{result.rejected_memory:,} did not fit in memory",
    ]
    if result.uneven_fallback:
        lines.append(
            f"no layout whose pipeline size divides the {shape.n_layers} layers fits, so sizes that do not were "
            "tried too (balanced stage_layers; docs/planner.md §2)"
        )
    if result.global_batch is not None:
        lines.append(
            f"global batch {result.global_batch} sequences × {shape.seq_len} tokens; ranked by step time"
        )
    else:
        lines.append(
            f"critical batch B_crit = {result.critical_batch_tokens / 1e6:.2f} M tokens at target loss "
            f"{result.target_loss:.3f} nats (Kaplan); ranked by training time = steps × step time"
        )
    lines += [
        "",
        "| # | layout | step time | MFU | tokens/s | memory/GPU | timed by |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, e in enumerate(entries, 1):
        c = e.candidate
        lines.append(
            f"| {i} | {c.table_label} | {c.step_time:.3g} s | {c.mfu:.1%} | {c.tokens_per_s:,.0f} | "
            f"{c.memory.total / 1e9:.1f} GB | {e.timed_by} |"
        )
    lines += ["", "Breakdown (seconds per step on the critical rank):", ""]
    names = _columns(entries)
    lines.append("| # | " + " | ".join(names) + " | total |")
    lines.append("|---" * (len(names) + 2) + "|")
    for i, e in enumerate(entries, 1):
        parts = e.candidate.breakdown.parts
        lines.append(
            f"| {i} | " + " | ".join(f"{parts[n]:.3g}" for n in names) + f" | {e.candidate.step_time:.3g} |"
        )
    if entries and entries[0].candidate.steps:
        best = entries[0].candidate
        lines += [
            "",
            f"training time of #1: {best.steps:,.0f} steps × {best.step_time:.3g} s = "
            f"{_fmt_time(best.training_time or 0.0)} at batch {best.global_batch} sequences",
        ]
    flag = mfu_warning(result, entries)
    if flag:
        lines += ["", flag]
    if len(entries) > 1:
        lines += ["", "Why the runner-ups lose:"]
        lines += [f"  #{i} {e.reason}" for i, e in enumerate(entries[1:], 2)]
    return "\n".join(lines)


def _columns(entries: list[Explained]) -> list[str]:
    """The breakdown's columns: every part, context-parallel communication only when a listed layout uses
    context parallelism (the tables of layouts without it are as before)."""
    cp = any(e.candidate.plan.cp > 1 for e in entries)
    return [n for n in COMPONENT_NAMES if n != "cp_comm" or cp]


def _candidate_json(c: Candidate, timed_by: str, reason: str | None) -> dict[str, Any]:
    pl = c.plan
    return {
        "label": c.label,
        "data": pl.dp,
        "pipeline": pl.pp,
        "context": pl.cp,
        "tensor": f"{pl.q}x{pl.q}" if pl.tp_kind == "2d" else pl.tp,
        "sequence_parallel": pl.sequence_parallel,
        "tp_comm_overlap": pl.tp_comm_overlap,
        "schedule": c.schedule,
        "stages_per_rank": pl.virtual_stages,
        "stage_layers": None if pl.stage_layers is None else list(pl.stage_layers),
        "zero": pl.zero_stage,
        "zero_shard_size": pl.zero_dp if pl.zero_replicas > 1 else None,
        "overlap_param_gather": pl.overlap_param_gather,
        "checkpointing": pl.recompute,
        "micro_batch": pl.micro_batch,
        "microbatches": pl.n_microbatches,
        "global_batch": c.global_batch,
        "step_time_s": c.step_time,
        "mfu": c.mfu,
        "tokens_per_s": c.tokens_per_s,
        "memory_per_gpu_bytes": c.memory.total,
        "memory_breakdown_bytes": {
            k: getattr(c.memory, k)
            for k in ("params", "grads", "optimizer", "activations", "working", "comm_buffers", "cast_cache")
        },
        "breakdown_s": c.breakdown.parts,
        "steps": c.steps,
        "training_time_s": c.training_time,
        "timed_by": timed_by,
        "why_it_loses": reason,
    }


def to_json(result: SearchResult, entries: list[Explained]) -> str:
    """Machine-readable plan."""
    doc = {
        "model": result.model,
        "params": result.shape.n_params(),
        "gpus": result.gpus,
        "hardware": result.hardware.name,
        "global_batch": result.global_batch,
        "critical_batch_tokens": result.critical_batch_tokens,
        "target_loss": result.target_loss,
        "objective": result.objective,
        "searched": result.enumerated,
        "rejected_memory": result.rejected_memory,
        "uneven_fallback": result.uneven_fallback,
        "search_seconds": result.seconds,
        "layouts": [_candidate_json(e.candidate, e.timed_by, e.reason) for e in entries],
    }
    return json.dumps(doc, indent=2)


def _model_table(result: SearchResult, inputs: RunInputs) -> dict[str, Any]:
    """[model]: the model file's own table (it resolves to the shape searched, every key it sets kept), the
    registry name, or the searched shape's fields."""
    if "model" in inputs.file:
        return dict(inputs.file["model"])
    if result.model is not None:
        return {"size": result.model}
    cfg = result.model_config
    model = {
        k: getattr(cfg, k)
        for k in ("family", "n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "tie_embeddings")
    }
    model |= {"n_kv_heads": cfg.kv_heads, "ffn_hidden": cfg.ffn}
    if cfg.head_dim is not None:  # TOML has no null: written only when set
        model["head_dim"] = cfg.head_dim
    return model


_PARALLEL_KEYS = (
    "data",
    "context",
    "tensor",
    "sequence_parallel",
    "tp_comm_overlap",
    "pipeline",
    "schedule",
    "stages_per_rank",
    "stage_layers",
    "zero",
    "zero_shard_size",
    "overlap_param_gather",
    "accumulation",
    "checkpointing",
)


def _parallel_table(cand: Candidate) -> dict[str, Any]:
    """[parallel]: the layout, the overlaps too (the file runs what was priced); unset keys left out."""
    par = cand.config.parallel
    parallel = {k: getattr(par, k) for k in _PARALLEL_KEYS}
    # even stages, ZeRO over all data ranks: nothing to write
    for unset in ("stage_layers", "zero_shard_size"):
        if parallel[unset] is None:
            del parallel[unset]
    if parallel["context"] == 1:  # no context parallelism: the default, not written
        del parallel["context"]
    return parallel


def _sections(result: SearchResult, cand: Candidate, inputs: RunInputs) -> dict[str, dict[str, Setting]]:
    """Every section written, each key with where it comes from (`run_settings` for the run's keys)."""
    tr = cand.config.train
    model = f"from {inputs.file_name}" if inputs.file_name else "the model searched"
    sections: dict[str, dict[str, Setting]] = {
        "model": {k: Setting(value=v, source=model) for k, v in _model_table(result, inputs).items()},
        "parallel": {
            k: Setting(value=v, source="the plan's layout") for k, v in _parallel_table(cand).items()
        },
        "train": {k: Setting(value=getattr(tr, k), source="the plan's batch and dtype") for k in PLAN_KEYS},
        "data": {},
    }
    for section, values in run_settings(result, cand, inputs).items():
        sections.setdefault(section, {}).update(values)
    if cand.config.data.document_mask and "document_mask" not in sections["data"]:
        # priced with the attention masks: the run must mask too
        sections["data"]["document_mask"] = Setting(value=True, source="the plan priced document masks")
    return sections


_UNSET_DATA = (
    "path unset: tessera train reads the embedded demo corpus (the Python standard library's sources); give the "
    "run's token files with `tessera plan --data PATH` or data.path"
)


def _comment(text: str) -> list[str]:
    return ["# " + line for line in textwrap.wrap(text, 114)]


def config_toml(result: SearchResult, cand: Candidate, inputs: RunInputs | None = None) -> str:
    """A runnable tessera config for `cand`: the model, the plan's parallel layout, batch and dtype, and the run's
    data, steps, learning-rate schedule, evaluation, checkpointing and directory (`run_settings`: the flags in
    `inputs`, the model file's own keys, else derived), each key under a comment saying where it comes from. Under
    `tessera validate` / `tessera memory` it resolves to the candidate's execution plan, so the memory figure is
    the one the search pruned with."""
    inputs = inputs or RunInputs()
    lines = [
        f"# Written by `tessera plan` for {result.gpus} × {result.hardware.name}: {cand.label}",
        f"# predicted step {cand.step_time:.4g} s, MFU {cand.mfu:.1%}, {cand.memory.total / 1e9:.1f} GB per GPU",
        "# Each key's comment says where it comes from; change any when running: tessera train FILE --train.lr=...",
    ]
    for section, values in _sections(result, cand, inputs).items():
        lines += ["", f"[{section}]"]
        if section == "data" and "path" not in values:
            lines += _comment(_UNSET_DATA)
        said = None
        for key, setting in values.items():
            if setting.source != said:
                lines += _comment(setting.source)
                said = setting.source
            lines.append(f"{key} = {toml_value(setting.value)}")
    return "\n".join(lines) + "\n"


def _problems(path: Path, gpus: int) -> tuple[list[Violation], list[Violation]]:
    """`tessera validate`'s problems with the written file for `gpus` ranks: (those of the plan, those only where
    it trains). The second are what an estimate leaves out (`resolve(training=False)`): the data files it names
    (missing here, another vocabulary, ...) and the logging packages it enables, which may exist only there."""
    cfg = load_config(path)
    everywhere = violations(cfg, gpus, training=False)
    return everywhere, [p for p in violations(cfg, gpus) if p not in everywhere]


def write_config(
    result: SearchResult, cand: Candidate, path: str | Path, inputs: RunInputs | None = None
) -> Path:
    """Write `config_toml` and check it loads and validates for the searched world size; problems only where it
    trains (the data files it names, logging packages) are left to `data_problems` (a note where it is planned)."""
    path = Path(path)
    path.write_text(config_toml(result, cand, inputs))
    problems, _ = _problems(path, result.gpus)
    if problems:
        raise ConfigError(
            f"the config written to {path} does not validate for {result.gpus} ranks:\n"
            + "\n".join(map(str, problems))
        )
    return path


def data_problems(path: str | Path, gpus: int) -> list[Violation]:
    """What `tessera validate` finds wrong here that an estimate leaves out: the data files a written config names,
    the logging packages it enables (empty: nothing)."""
    return _problems(Path(path), gpus)[1]


def render_picture(result: SearchResult, entries: list[Explained], path: str | Path) -> Path:
    """Stacked horizontal bars of each reported layout's step-time breakdown (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(10, 2.0 + 0.55 * len(entries)))
    labels = [f"#{i} {e.candidate.label}" for i, e in enumerate(entries, 1)]
    for row, e in enumerate(entries):
        left = 0.0
        parts = e.candidate.breakdown.parts
        for name in _columns(entries):
            value = parts[name]
            ax.barh(
                row, value, left=left, color=_COLORS[name], label=COMPONENT_NAMES[name] if row == 0 else None
            )
            left += value
    ax.set_yticks(range(len(entries)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title(f"{result.model or 'model'} on {result.gpus} × {result.hardware.name}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def breakdown_fractions(bd: StepBreakdown) -> dict[str, float]:
    """Each part as a fraction of the step."""
    return {k: v / bd.step_time for k, v in bd.parts.items()}
