"""Training-time analysis (Lamy-Poirier 2021, arXiv 2106.02679; docs/planner.md §4): the shortest time to train each model size with each family
of parallel methods, and the GPU count that achieves it.

Method, per model size:

1. Target loss L* = (1 + α_N/α_S)·L(N) (Kaplan's compute-efficient stopping point, `search.default_target_loss`);
   critical batch B_crit(L*) = B*/L*^(1/α_B) tokens (`scaling.critical_batch`).
2. For each GPU count N (powers of two up to `MAX_GPUS`), one full layout search at the critical batch: every
   layout rounds B_crit to a multiple of d × micro-batch; steps S = S_min(1 + B_crit/B) (McCandlish trade-off);
   training time = S × predicted step time; layouts that do not fit in memory are pruned.
3. Each method family is a filter on the searched layouts (`METHOD_FAMILIES`); its shortest time is the minimum
   over N and over its layouts, and the N that achieves it is reported. Time stops falling once d × b reaches
   the critical batch and the pipeline and tensor degrees cannot grow without large bubbles or communication:
   that is the "shortest possible training time" of the method.

Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.planner.cost import ModelShape
from tessera.planner.hardware import Hardware
from tessera.planner.scaling import critical_batch
from tessera.planner.search import Candidate, SearchSpace, default_target_loss, model_config, search

__all__ = [
    "ANALYSIS_MODELS",
    "DEFAULT_GPU_COUNTS",
    "MAX_GPUS",
    "METHOD_FAMILIES",
    "FamilyBest",
    "ModelAnalysis",
    "analyse_model",
    "analysis_table",
    "format_duration",
    "layouts_table",
]

MAX_GPUS = 65536
DEFAULT_GPU_COUNTS = tuple(2**k for k in range(3, 17))  # 8 .. 65536
ANALYSIS_MODELS = (
    "megatron-1.7b",
    "megatron-7.5b",
    "megatron-39.1b",
    "megatron-145.6b",
    "megatron-310.1b",
    "megatron-1t",
)
"""GPT shapes of Narayanan 2021 Table 1 (s = 2048, V = 51,200), 1.7B → 1T parameters. The 529.6B row (105 layers)
is left out: with power-of-two GPU counts its only pipeline size is p = 1 (the search needs p | L)."""

METHOD_FAMILIES: dict[str, Callable[[Candidate], bool]] = {
    "data parallel + ZeRO": lambda c: c.plan.pp == 1 and c.plan.tp == 1,
    "1D tensor + 1F1B": lambda c: c.plan.tp_kind == "1d" and c.schedule == "1f1b" and c.plan.zero_stage <= 1,
    "1D tensor + interleaved 1F1B": lambda c: (
        c.plan.tp_kind == "1d" and c.schedule in ("1f1b", "interleaved") and c.plan.zero_stage <= 1
    ),
    "2D tensor + 1F1B": lambda c: (
        (c.plan.tp_kind == "2d" or c.plan.tp == 1) and c.schedule == "1f1b" and c.plan.zero_stage <= 1
    ),
    "modular breadth-first + ZeRO-3": lambda c: (
        c.schedule == "breadth_first" and c.plan.zero_stage == 3 and c.plan.accumulation == "layered"
    ),
    "all methods": lambda c: True,
}
"""Method family → which searched layouts belong to it. 1D/2D families include t = 1 (no tensor parallelism);
Megatron-style families keep ZeRO ≤ 1 (distributed optimizer); breadth-first is layered accumulation on the
looping placement (any v, one layer per chunk included) with ZeRO-3."""


@dataclass(kw_only=True, slots=True, frozen=True)
class FamilyBest:
    """The shortest training time of one method family for one model, and where it is reached."""

    family: str
    gpus: int | None
    candidate: Candidate | None
    """None when no layout of the family fits at any GPU count."""

    @property
    def days(self) -> float | None:
        return None if self.candidate is None else (self.candidate.training_time or 0.0) / 86400


@dataclass(kw_only=True, slots=True)
class ModelAnalysis:
    """One model size: scaling-law numbers, the best of every family, and time vs GPUs per family."""

    model: str
    shape: ModelShape
    target_loss: float
    critical_batch_tokens: float
    best: dict[str, FamilyBest] = field(default_factory=dict)
    curve: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """family → [(GPUs, shortest days at that count)]."""
    search_seconds: float = 0.0


def analyse_model(
    model: str,
    hw: Hardware,
    *,
    gpu_counts: tuple[int, ...] = DEFAULT_GPU_COUNTS,
    families: dict[str, Callable[[Candidate], bool]] | None = None,
    space: SearchSpace | None = None,
) -> ModelAnalysis:
    """Search every GPU count at the critical batch and keep, per family, the shortest training time."""
    families = families or METHOD_FAMILIES
    _, cfg = model_config(model)
    shape = ModelShape.from_config(cfg)
    loss = default_target_loss(shape)
    out = ModelAnalysis(
        model=model, shape=shape, target_loss=loss, critical_batch_tokens=critical_batch(loss)
    )
    for gpus in gpu_counts:
        result = search(model, gpus, hw, None, space=space, target_loss=loss, keep=10**9)
        out.search_seconds += result.seconds
        for name, member in families.items():
            best = next((c for c in result.candidates if member(c)), None)
            if best is None:
                continue
            days = (best.training_time or 0.0) / 86400
            out.curve.setdefault(name, []).append((gpus, days))
            current = out.best.get(name)
            if current is None or current.candidate is None or days < (current.days or float("inf")):
                out.best[name] = FamilyBest(family=name, gpus=gpus, candidate=best)
    for name in families:
        out.best.setdefault(name, FamilyBest(family=name, gpus=None, candidate=None))
    return out


def format_duration(days: float) -> str:
    """Days as a short string: minutes, hours or days."""
    if days < 1 / 24:
        return f"{days * 1440:.0f} min"
    if days < 1:
        return f"{days * 24:.1f} h"
    return f"{days:.1f} d"


def analysis_table(analyses: list[ModelAnalysis]) -> str:
    """Markdown: one row per model, per family the shortest time in days and the GPU count reaching it."""
    families = list(analyses[0].best) if analyses else []
    head = "| model | params | target loss | B_crit (M tokens) | " + " | ".join(families) + " |"
    lines = [head, "|---" * (4 + len(families)) + "|"]
    for a in analyses:
        cells = []
        for name in families:
            fb = a.best[name]
            cells.append(
                "no fit" if fb.candidate is None else f"{format_duration(fb.days or 0.0)} @ {fb.gpus}"
            )
        lines.append(
            f"| {a.model} | {a.shape.n_params() / 1e9:,.1f}B | {a.target_loss:.3f} | "
            f"{a.critical_batch_tokens / 1e6:.2f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def layouts_table(analyses: list[ModelAnalysis], family: str = "all methods") -> str:
    """Markdown: the winning layout of `family` for every model, with its step, steps and MFU."""
    lines = [
        f"| model | GPUs | layout ({family}) | batch (seq) | steps | step time | MFU | memory/GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in analyses:
        fb = a.best[family]
        c = fb.candidate
        if c is None:
            lines.append(f"| {a.model} | – | no fit | | | | | |")
            continue
        lines.append(
            f"| {a.model} | {fb.gpus} | {c.table_label} | {c.global_batch} | {c.steps:,.0f} | {c.step_time:.3g} s | "
            f"{c.mfu:.0%} | {c.memory.total / 1e9:.0f} GB |"
        )
    return "\n".join(lines) + "\n"
