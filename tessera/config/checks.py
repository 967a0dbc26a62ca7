"""The rules of each config section on its own: allowed ranges of numbers, known mode names, paths the operating
system accepts, token files that exist. Each returns every `Violation` it finds, never raises.

The rules across sections (world size, divisibility, batch arithmetic, the schedule that will run) are in
`tessera.execution`, which also uses `ARITHMETIC_RULES`, `divisors_near` and `multiple_near` from here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.axes import DIMS
from tessera.errors import ConfigError
from tessera.model.family import FAMILIES, family_plan
from tessera.model.rope_scaling import scaling_problems
from tessera.modes import (
    ACCUMULATION,
    CHECKPOINTING,
    DTYPES,
    NONFINITE,
    SCHEDULES,
    STOP_SIGNALS,
    WINDOW_STARTS,
)

if TYPE_CHECKING:
    from tessera.config.sections import (
        CheckpointConfig,
        DataConfig,
        LogConfig,
        ModelConfig,
        ParallelConfig,
        TrainConfig,
    )

__all__ = [
    "ARITHMETIC_RULES",
    "MAX_MICRO_BATCHES",
    "Violation",
    "check_checkpoint",
    "check_data",
    "check_log",
    "check_model",
    "check_parallel",
    "check_train",
    "divisors_near",
    "multiple_near",
    "multiples_around",
]


@dataclass(kw_only=True, slots=True)
class Violation:
    """One broken rule: what is wrong, the values involved, and the nearest valid alternative."""

    rule: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.problem}\n    fix: {self.fix}"


@dataclass(frozen=True, slots=True)
class _Range:
    """Allowed values of one number: lo <= x < hi (open ends as flagged); NaN is never inside."""

    lo: float
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = True

    def holds(self, x: float) -> bool:
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def describe(self) -> str:
        lo = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
        if self.hi == math.inf:
            return f"a finite number {lo}" if self.lo_open or isinstance(self.lo, float) else lo
        return f"{lo} and {'<' if self.hi_open else '<='} {self.hi:g}"


_POSITIVE, _NON_NEGATIVE = _Range(1), _Range(0)
_POSITIVE_REAL, _NON_NEGATIVE_REAL = _Range(0.0, lo_open=True), _Range(0.0)
MAX_MICRO_BATCHES = 2**20
"""Micro-batches per step above which a config is refused: keeps every schedule built from it small."""

# Every number a run divides by, allocates or feeds to the optimizer, with its allowed range; None is allowed
# wherever the field's type allows it. Checked before any rule that does arithmetic with them.
_RANGES: dict[str, dict[str, _Range]] = {
    "model": {
        **dict.fromkeys(
            ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "vocab_size"),
            _POSITIVE,
        ),
        "seq_len": _POSITIVE,
        "norm_eps": _POSITIVE_REAL,
        "rope_theta": _POSITIVE_REAL,
        **dict.fromkeys(("query_pre_attn_scalar", "attn_softcap", "final_softcap"), _POSITIVE_REAL),
        **dict.fromkeys(("sliding_window", "sliding_window_pattern"), _POSITIVE),
        "rope_local_theta": _POSITIVE_REAL,
        "init_std": _NON_NEGATIVE_REAL,
    },
    "parallel": {  # every dimension's size (tessera.axes.DIMS; "tensor" is parsed by parse_tensor)
        **{d.key: _POSITIVE for d in DIMS if d.key != "tensor"},
        "stages_per_rank": _POSITIVE,
        "zero_shard_size": _POSITIVE,
    },
    "train": {
        **dict.fromkeys(("steps", "global_batch", "micro_batch"), _POSITIVE),
        "warmup_steps": _NON_NEGATIVE,
        "lr": _POSITIVE_REAL,
        "min_lr": _NON_NEGATIVE_REAL,
        "weight_decay": _NON_NEGATIVE_REAL,
        "beta1": _Range(0.0, 1.0),
        "beta2": _Range(0.0, 1.0),
        "eps": _POSITIVE_REAL,
        "grad_clip": _NON_NEGATIVE_REAL,
        "fp16_init_scale": _POSITIVE_REAL,
        "bucket_mb": _POSITIVE_REAL,
        "eval_every": _NON_NEGATIVE,
        "eval_batches": _POSITIVE,
        "max_skips": _POSITIVE,
        "fp16_max_overflows": _POSITIVE,
        "hang_timeout_s": _NON_NEGATIVE_REAL,
        "collective_timeout_s": _NON_NEGATIVE_REAL,
    },
    "data": {"default_corpus_mb": _POSITIVE_REAL},
    "checkpoint": {"every": _NON_NEGATIVE, "keep": _POSITIVE, "load_step": _NON_NEGATIVE},
    "log": {"every": _POSITIVE},
}
ARITHMETIC_RULES = frozenset(  # rules whose violation stops the cross-section checks (tessera.execution)
    [f"{s}.{n}" for s, fields in _RANGES.items() for n in fields] + ["parallel.tensor", "train.micro_batches"]
)


def _unknown_choice(
    section: str, obj: Any, name: str, allowed: tuple[str, ...], fix: str | None = None
) -> list[Violation]:
    """A violation when ``obj.name`` is not one of ``allowed`` (a mode, dtype or device name); else none."""
    value = getattr(obj, name)
    if value in allowed:
        return []
    return [
        Violation(
            rule=f"{section}.{name}",
            problem=f"{section}.{name} = {value!r} is unknown",
            fix=fix or f"use one of {', '.join(allowed)}",
        )
    ]


def _out_of_range(section: str, obj: Any) -> list[Violation]:
    """A violation for each number of ``section`` outside its `_RANGES` entry (NaN and infinity included)."""
    v = []
    for name, allowed in _RANGES[section].items():
        value = getattr(obj, name)
        if value is None or allowed.holds(value):
            continue
        default = next(f.default for f in dataclasses.fields(obj) if f.name == name)
        v.append(
            Violation(
                rule=f"{section}.{name}",
                problem=f"{section}.{name} = {value!r} must be {allowed.describe()}",
                fix=f"set {section}.{name} = {default!r} (the default)"
                if default is not None
                else f"set {section}.{name} to a value {allowed.describe()}, or leave it unset",
            )
        )
    return v


_MAX_PATH, _MAX_NAME = 4096, 255  # Linux's PATH_MAX and NAME_MAX


def _bad_path(rule: str, value: str | None) -> list[Violation]:
    """A path the operating system would refuse: a NUL byte, or a name longer than Linux allows."""
    if value is None:
        return []
    if "\0" in value:
        problem = f"{rule} contains a NUL byte, which no file name may hold"
    elif len(value.encode()) > _MAX_PATH or any(len(p.encode()) > _MAX_NAME for p in value.split("/")):
        problem = f"{rule} ({value[:40]!r}..., {len(value)} characters) is longer than a path may be"
    else:
        return []
    return [Violation(rule=rule, problem=problem, fix=f"set {rule} to an ordinary path")]


def check_model(m: ModelConfig) -> list[Violation]:
    """Every violated rule of [model] on its own (the rules across sections: `tessera.execution`)."""
    v = _out_of_range("model", m)
    v.extend(_unknown_choice("model", m, "family", FAMILIES))
    if v:
        return v  # the divisibility rules below need positive sizes
    plan = family_plan(m)
    if (m.head_dim is None or plan.heads_divide_hidden) and m.d_model % m.n_heads:
        why = (
            f" (family {m.family!r} needs it even with model.head_dim: transformers refuses such a config for it, "
            "so the model could not be exported to or imported from a Hugging Face folder)"
            if m.head_dim is not None
            else ""
        )
        v.append(
            Violation(
                rule="model.heads",
                problem=f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}{why}",
                fix=f"set model.n_heads to one of {divisors_near(m.d_model, m.n_heads)}",
            )
        )
    if m.n_heads % m.kv_heads:
        v.append(
            Violation(
                rule="model.kv_heads",
                problem=f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = {m.kv_heads}",
                fix=f"set model.n_kv_heads to one of {divisors_near(m.n_heads, m.kv_heads)}",
            )
        )
    if m.head_dim is not None and not plan.free_head_dim and m.head_dim * m.n_heads != m.d_model:
        v.append(
            Violation(
                rule="model.head_width",
                problem=f"model.head_dim = {m.head_dim} differs from model.d_model / model.n_heads = "
                f"{m.d_model}/{m.n_heads}: family {m.family!r} (GPT-2) has no separate head width",
                fix="remove model.head_dim, or use a family with RoPE (llama, qwen2, qwen3)",
            )
        )
    v.extend(_check_rope_scaling(m))
    v.extend(_check_softcaps(m))
    v.extend(_check_local_attention(m))
    if plan.rope and m.head_size % 2:
        given = f"model.head_dim = {m.head_dim}" if m.head_dim else f"{m.d_model}/{m.n_heads} = {m.head_size}"
        v.append(
            Violation(
                rule="model.rope",
                problem=f"RoPE needs an even head dim, got {given}",
                fix="set model.head_dim even" if m.head_dim else "choose d_model / n_heads even",
            )
        )
    return v


_SOFTCAP_KEYS = ("query_pre_attn_scalar", "attn_softcap", "final_softcap")


def _check_softcaps(m: ModelConfig) -> list[Violation]:
    """Gemma 2's attention scale and soft-caps belong to a family that declares them (`FamilyPlan.softcaps`):
    another family's Hugging Face config has no place for them, so its export would drop them."""
    if family_plan(m).softcaps:
        return []
    given = [k for k in _SOFTCAP_KEYS if getattr(m, k) is not None]
    return [
        Violation(
            rule=f"model.{key}",
            problem=f"model.{key} is set but model.family = {m.family!r} has no soft-capping or attention scalar",
            fix=f"remove model.{key}, or use family gemma2 or gemma3",
        )
        for key in given
    ]


_LOCAL_DEFAULTS = {"sliding_window": None, "sliding_window_pattern": 6, "rope_local_theta": 10000.0}


def _check_local_attention(m: ModelConfig) -> list[Violation]:
    """Gemma 3's local layers (`FamilyPlan.local_attention`): another family has no window or second RoPE base, so
    the keys are refused there. (On gemma3, model.rope_scaling scales the global layers' RoPE only, as
    transformers' Gemma3RotaryEmbedding does: `_check_rope_scaling` checks the table.)"""
    if family_plan(m).local_attention:
        return []
    return [
        Violation(
            rule=f"model.{key}",
            problem=f"model.{key} = {getattr(m, key)!r} is set but model.family = {m.family!r} has no "
            "local (sliding-window) layers",
            fix=f"remove model.{key}, or use family gemma3",
        )
        for key, default in _LOCAL_DEFAULTS.items()
        if getattr(m, key) != default
    ]


def _check_rope_scaling(m: ModelConfig) -> list[Violation]:
    """model.rope_scaling: a family with RoPE, a type tessera computes, its keys in range."""
    if m.rope_scaling is None:
        return []
    if not family_plan(m).rope:
        return [
            Violation(
                rule="model.rope_scaling",
                problem=f"model.rope_scaling is set but model.family = {m.family!r} has no RoPE",
                fix="remove model.rope_scaling, or use a family with RoPE (llama, qwen2, qwen3, gemma2, gemma3)",
            )
        ]
    return [
        Violation(rule="model.rope_scaling", problem=problem, fix=fix)
        for problem, fix in scaling_problems(m.rope_scaling)
    ]


def check_parallel(p: ParallelConfig) -> list[Violation]:
    """Every violated rule of [parallel] on its own (the rules across sections: `tessera.execution`)."""
    v: list[Violation] = []
    try:
        p.tensor_shape()
    except ConfigError as e:
        v.append(Violation(rule="parallel.tensor", problem=str(e), fix='use an int such as 4, or "2x2"'))
    choices = {"accumulation": ACCUMULATION, "checkpointing": CHECKPOINTING}
    if not p.schedule.endswith(".csv"):  # a .csv file is a user's own schedule (tessera.pipeline.csvio)
        choices["schedule"] = SCHEDULES
    for name, allowed in choices.items():
        v.extend(_unknown_choice("parallel", p, name, allowed))
    if p.zero not in (0, 1, 2, 3):
        v.append(
            Violation(
                rule="parallel.zero",
                problem=f"parallel.zero = {p.zero} is not a ZeRO stage",
                fix="use 0, 1, 2 or 3",
            )
        )
    return v + _out_of_range("parallel", p)


def check_train(t: TrainConfig) -> list[Violation]:
    """Every violated rule of [train] on its own (the rules across sections: `tessera.execution`)."""
    v: list[Violation] = []
    v.extend(_unknown_choice("train", t, "dtype", DTYPES))
    v.extend(_unknown_choice("train", t, "grad_reduce_dtype", ("fp32", "bf16"), "use fp32 or bf16"))
    v.extend(_unknown_choice("train", t, "nonfinite", NONFINITE))
    if t.stop_signal and t.stop_signal not in STOP_SIGNALS:
        v.append(
            Violation(
                rule="train.stop_signal",
                problem=f"train.stop_signal = {t.stop_signal!r:.40} is not a signal tessera can catch",
                fix=f'use one of {", ".join(STOP_SIGNALS)}, or "" for none',
            )
        )
    v.extend(_unknown_choice("train", t, "device", ("auto", "cpu", "cuda"), "use auto, cpu or cuda"))
    v.extend(_out_of_range("train", t))
    v.extend(_check_skip_steps(t.skip_steps, t.steps))
    if not v and t.global_batch // t.micro_batch > MAX_MICRO_BATCHES:
        # bounds the schedule the estimator and the runtime build (p × m actions)
        v.append(
            Violation(
                rule="train.micro_batches",
                problem=f"train.global_batch / train.micro_batch = {t.global_batch // t.micro_batch} "
                f"micro-batches per step is more than {MAX_MICRO_BATCHES}",
                fix="raise train.micro_batch or lower train.global_batch",
            )
        )
    if any(x.rule in ("train.lr", "train.min_lr") for x in v):
        return v
    if t.min_lr > t.lr:
        v.append(
            Violation(
                rule="train.lr",
                problem=f"need 0 <= train.min_lr <= train.lr and lr > 0, got "
                f"lr = {t.lr}, min_lr = {t.min_lr}",
                fix=f"e.g. train.min_lr = {t.lr / 10:g}",
            )
        )
    return v


_SKIP_FIX = (
    "write each range as [first step, last step] of step numbers >= 0, e.g. train.skip_steps = [[1200, 1499]]"
)


def _check_skip_steps(ranges: list[Any], steps: int) -> list[Violation]:
    """train.skip_steps: [start, end] pairs of step numbers, start <= end, ranges apart, each starting before
    train.steps (else it skips nothing: a typo). Ranges before a resume's step are the resume check's
    (tessera/train/compat.py), which knows the checkpoint."""

    def bad(problem: str, fix: str = _SKIP_FIX) -> list[Violation]:
        return [Violation(rule="train.skip_steps", problem=f"train.skip_steps: {problem}", fix=fix)]

    pairs: list[tuple[int, int]] = []
    for r in ranges:
        ints = isinstance(r, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        if not ints or len(r) != 2:
            return bad(f"{r!r:.40} is not a range [first, last] of two whole step numbers")
        if min(r) < 0:
            return bad(f"[{r[0]}, {r[1]}] names a negative step")
        if r[0] > r[1]:
            return bad(f"[{r[0]}, {r[1]}] starts after it ends", f"write it as [{r[1]}, {r[0]}]")
        if r[0] >= steps:
            return bad(
                f"[{r[0]}, {r[1]}] starts at or after train.steps = {steps}, so it skips nothing",
                f"name steps below {steps} (metrics.jsonl's step numbers), or drop the range",
            )
        pairs.append((r[0], r[1]))
    pairs.sort()
    for (s0, e0), (s1, e1) in itertools.pairwise(pairs):
        if s1 <= e0:
            return bad(
                f"[{s0}, {e0}] and [{s1}, {e1}] overlap",
                f"merge them into one range [{s0}, {max(e0, e1)}]",
            )
    return []


def check_data(d: DataConfig, *, files: bool = True) -> list[Violation]:
    """Every violated rule of [data] on its own (the rules across sections: `tessera.execution`). ``files=False``
    leaves out whether the named files exist here: an estimate reads no data, and a config written for a cluster
    names files that may exist only there."""
    v = _out_of_range("data", d) + _check_sources(d.path, files) + _bad_path("data.valid_path", d.valid_path)
    if d.tokenizer != "byte":
        v.extend(_bad_path("data.tokenizer", d.tokenizer))
    v.extend(_unknown_choice("data", d, "window_start", WINDOW_STARTS, 'use "any" or "document"'))
    if d.valid_path is not None and d.valid_fraction:
        v.append(
            Violation(
                rule="data.valid",
                problem=f"both data.valid_path and data.valid_fraction = {d.valid_fraction} are set",
                fix="keep one: a separate validation file, or a held-out fraction of the training data",
            )
        )
    if not 0 <= d.valid_fraction < 1:
        v.append(
            Violation(
                rule="data.valid_fraction",
                problem=f"data.valid_fraction = {d.valid_fraction} is not in [0, 1)",
                fix="e.g. data.valid_fraction = 0.05",
            )
        )
    if files and not v and d.valid_path is not None and not Path(d.valid_path).exists():
        v.append(_missing_file("data.valid_path", d.valid_path))
    return v


def check_checkpoint(c: CheckpointConfig) -> list[Violation]:
    """Every violated rule of [checkpoint] on its own (the rules across sections: `tessera.execution`)."""
    v = _out_of_range("checkpoint", c) + _bad_path("checkpoint.dir", c.dir)
    if c.load_step is not None and not c.resume:  # the trainer reads load_step only when it resumes
        v.append(
            Violation(
                rule="checkpoint.load_step",
                problem=f"checkpoint.load_step = {c.load_step} names a checkpoint to resume from, but "
                "checkpoint.resume = false starts from step 0 without loading any",
                fix="set checkpoint.resume = true to resume from it, or unset checkpoint.load_step",
            )
        )
    return v


def check_log(lg: LogConfig, *, packages: bool = True) -> list[Violation]:
    """Every violated rule of [log] on its own (the rules across sections: `tessera.execution`). ``packages``:
    also whether the logging packages it enables are installed here, which only a run that logs needs."""
    v = _out_of_range("log", lg) + _bad_path("log.run_dir", lg.run_dir)
    for name, package, enabled in (
        ("tensorboard", "tensorboard", lg.tensorboard),
        ("wandb", "wandb", lg.wandb),
    ):
        if packages and enabled and not _importable(package):
            v.append(
                Violation(
                    rule=f"log.{name}",
                    problem=f"log.{name} = true but the `{package}` package is not installed",
                    fix=f"run `pip install {package}`, or set log.{name} = false",
                )
            )
    v.extend(
        _unknown_choice(
            "log",
            lg,
            "wandb_mode",
            ("offline", "online", "disabled"),
            "use offline, online or disabled",
        )
    )
    return v


def _missing_file(rule: str, path: str) -> Violation:
    return Violation(
        rule=rule,
        problem=f"{rule} = {path!r} does not exist",
        fix="run `tessera prepare INPUT --out FILE` first, or unset data.path to train on "
        "the embedded default corpus",
    )


def _check_sources(path: str | list[Any] | None, files: bool = True) -> list[Violation]:
    """Every entry of data.path is a file name or a {path, weight > 0} table, and (``files``) the file exists."""
    if path is None:
        return []
    entries = [path] if isinstance(path, str) else path
    if not entries:
        return [Violation(rule="data.path", problem="data.path = [] lists no file", fix="name at least one")]
    v: list[Violation] = []
    for i, entry in enumerate(entries):
        where = "data.path" if isinstance(path, str) else f"data.path[{i}]"
        if isinstance(entry, dict):
            extra = set(entry) - {"path", "weight"}
            weight = entry.get("weight", 1.0)
            if extra or not isinstance(entry.get("path"), str):
                v.append(
                    Violation(
                        rule="data.path",
                        problem=f"{where} = {entry!r} is not a {{path, weight}} table",
                        fix='write {path = "tokens.bin", weight = 2.0}',
                    )
                )
                continue
            if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
                v.append(
                    Violation(
                        rule="data.path",
                        problem=f"{where}.weight = {weight!r} is not a positive number",
                        fix="give every file a weight > 0 (they need not sum to 1)",
                    )
                )
            entry = entry["path"]
        if not isinstance(entry, str):
            v.append(
                Violation(
                    rule="data.path",
                    problem=f"{where} = {entry!r} is neither a file name nor a {{path, weight}} table",
                    fix='e.g. data.path = ["a.bin", {path = "b.bin", weight = 3}]',
                )
            )
        elif _bad_path(where, entry):
            v.extend(_bad_path(where, entry))
        elif files and not Path(entry).exists():
            v.append(_missing_file(where, entry))
    return v


def _importable(package: str) -> bool:
    """Whether ``import package`` would find it, without importing it (config stays light)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


def divisors_near(n: int, target: int, count: int = 3, tries: int = 4096) -> list[int]:
    """Up to ``count`` divisors of n closest to target; looks at most ``tries`` candidates each side of target
    (and always 1 and n), so a huge n answers at once."""
    found = {1, n}
    for d in range(max(1, target - tries), min(n, target + tries) + 1):
        if n % d == 0:
            found.add(d)
    return sorted(sorted(found, key=lambda d: (abs(d - target), d))[:count])


def multiple_near(n: int, k: int) -> int:
    return max(k, k * round(n / k))


def multiples_around(n: int, k: int) -> list[int]:
    """The positive multiples of ``k`` nearest ``n`` from below and from above, without repeats: one value when
    ``n`` is below ``k`` (or is a multiple itself), else two."""
    below = k * (n // k)
    above = below if below == n else below + k
    return sorted({m for m in (below, above) if m > 0})
