"""Typed run configuration: TOML files, dotted command-line overrides, and validation that lists every violation.

This module must import without torch: the planner, `tessera validate` and the tests of the layout use it on
machines with no PyTorch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError
from tessera.model.sizes import SIZES
from tessera.modes import ACCUMULATION, CHECKPOINTING, DTYPES, FAMILIES, NONFINITE, SCHEDULES, STOP_SIGNALS

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LogConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "Violation",
    "apply_overrides",
    "even_split",
    "load_config",
    "parse_tensor",
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
            ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"), _POSITIVE
        ),
        "seq_len": _POSITIVE,
        "norm_eps": _POSITIVE_REAL,
        "rope_theta": _POSITIVE_REAL,
        "init_std": _NON_NEGATIVE_REAL,
    },
    "parallel": {"data": _POSITIVE, "pipeline": _POSITIVE, "stages_per_rank": _POSITIVE},
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


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The model's shape. `size` names a registry entry whose fields fill in anything not set explicitly."""

    size: str | None = None
    """Registry name (see `tessera.model.sizes`), e.g. "gpt2-124m" or "llama-8b"."""
    family: str = "gpt"
    """"gpt" (LayerNorm, GELU MLP, learned positions) or "llama" (RMSNorm, SwiGLU, RoPE, grouped-query attention)."""
    n_layers: int = 2
    """Number of transformer blocks."""
    d_model: int = 64
    """Hidden size h."""
    n_heads: int = 4
    """Query heads; head dim = d_model / n_heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (multi-head attention)."""
    ffn_hidden: int | None = None
    """MLP hidden size; None means 4·d_model for GPT and the Llama rule (8/3·d rounded up to 64) for Llama."""
    vocab_size: int = 256
    """Vocabulary size; must cover the tokenizer's."""
    seq_len: int = 64
    """Training context length s."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base (Llama only)."""
    init_std: float = 0.02
    """Std of the normal initialisation of weights."""
    init: str | None = None
    """Initial weights: "hf:DIR", a Hugging Face `save_pretrained` folder; the shape fields are then derived
    from DIR/config.json (tessera/hf/config.py). None: random initialisation."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.family == "llama":
            return 64 * -(-(8 * self.d_model // 3) // 64)
        return 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def check(self) -> list[Violation]:
        v = _out_of_range("model", self)
        v.extend(_unknown_choice("model", self, "family", FAMILIES))
        if v:
            return v  # the divisibility rules below need positive sizes
        if self.d_model % self.n_heads:
            v.append(
                Violation(
                    rule="model.heads",
                    problem=f"model.d_model = {self.d_model} is not divisible by "
                    f"model.n_heads = {self.n_heads}",
                    fix=f"set model.n_heads to one of {_divisors_near(self.d_model, self.n_heads)}",
                )
            )
        if self.n_heads % self.kv_heads:
            v.append(
                Violation(
                    rule="model.kv_heads",
                    problem=f"model.n_heads = {self.n_heads} is not divisible "
                    f"by model.n_kv_heads = {self.kv_heads}",
                    fix=f"set model.n_kv_heads to one of {_divisors_near(self.n_heads, self.kv_heads)}",
                )
            )
        if self.family == "llama" and self.head_dim % 2:
            v.append(
                Violation(
                    rule="model.rope",
                    problem=f"RoPE needs an even head dim, got "
                    f"{self.d_model}/{self.n_heads} = {self.head_dim}",
                    fix="choose d_model and n_heads so that d_model / n_heads is even",
                )
            )
        return v


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How ranks are laid out: data × pipeline × tensor (1D size t, or a 2D grid "qxq"), tensor innermost."""

    data: int | None = None
    """Data-parallel size; None means whatever is left: world_size / (pipeline · tensor ranks)."""
    tensor: int | str = 1
    """Megatron 1D tensor parallelism of size t (an int), or Optimus 2D on a q×q grid (a string such as "2x2")."""
    sequence_parallel: bool = False
    """1D only: shard norm/dropout regions along the sequence (all-gather/reduce-scatter instead of all-reduce)."""
    pipeline: int = 1
    """Pipeline-parallel size p."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved, breadth_first, or a CSV file of your own (pipeline/csvio.py)."""
    stages_per_rank: int = 1
    """Virtual stages per pipeline rank v (interleaved and breadth_first)."""
    stage_layers: list[int] | None = None
    """Explicit layers per stage (p·v entries summing to n_layers), e.g. lighter first and last stages."""
    zero: int = 0
    """ZeRO stage over the data-parallel group: 0 (plain all-reduce), 1, 2 or 3."""
    accumulation: str = "layered"
    """Gradient accumulation order: layered (breadth-first) or depth_first."""
    checkpointing: str = "none"
    """Activation checkpointing: none, full (per block) or selective (attention core only)."""

    def tensor_shape(self) -> tuple[int, int]:
        """(t, q): the 1D size t, or the 2D grid side q; the other is 1."""
        t, q = parse_tensor(self.tensor)
        return t, q

    @property
    def tensor_ranks(self) -> int:
        t, q = self.tensor_shape()
        return t * q * q

    def data_size(self, world_size: int) -> int:
        # max(1, ...): stays defined while check() reports a zero pipeline size
        return (
            self.data
            if self.data is not None
            else max(1, world_size // max(1, self.pipeline * self.tensor_ranks))
        )

    def check(self) -> list[Violation]:
        v: list[Violation] = []
        try:
            self.tensor_shape()
        except ConfigError as e:
            v.append(Violation(rule="parallel.tensor", problem=str(e), fix='use an int such as 4, or "2x2"'))
        choices = {"accumulation": ACCUMULATION, "checkpointing": CHECKPOINTING}
        if not self.schedule.endswith(
            ".csv"
        ):  # a .csv file is a user's own schedule (tessera.pipeline.csvio)
            choices["schedule"] = SCHEDULES
        for name, allowed in choices.items():
            v.extend(_unknown_choice("parallel", self, name, allowed))
        if self.zero not in (0, 1, 2, 3):
            v.append(
                Violation(
                    rule="parallel.zero",
                    problem=f"parallel.zero = {self.zero} is not a ZeRO stage",
                    fix="use 0, 1, 2 or 3",
                )
            )
        return v + _out_of_range("parallel", self)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimisation: AdamW with linear warmup and cosine decay, clipping and gradient accumulation."""

    steps: int = 100
    """Optimizer steps to run."""
    global_batch: int = 8
    """Sequences per optimizer step = micro_batch × micro-batches × data-parallel size."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (applied to matrices only, not to norms and biases)."""
    beta1: float = 0.9
    """AdamW's decay rate of the first-moment (mean) estimate."""
    beta2: float = 0.95
    """AdamW's decay rate of the second-moment (uncentred variance) estimate."""
    eps: float = 1e-8
    """AdamW's term added to the denominator for numerical stability."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seeds initialisation and data order."""
    dtype: str = "fp32"
    """Compute dtype: fp32, bf16 (autocast where supported) or fp16."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    grad_reduce_dtype: str = "fp32"
    """dtype of the ZeRO gradient reduce-scatter: fp32 (exact accumulation) or bf16 (half the traffic)."""
    fp16_init_scale: float = 65536.0
    """Initial dynamic loss scale for train.dtype = 'fp16' (halved on overflow, doubled every 2000 good steps)."""
    bucket_mb: float = 25.0
    """Size of data-parallel gradient all-reduce buckets, in MiB."""
    eval_every: int = 0
    """Compute the validation loss every this many steps and at the end (0: never); needs data.valid_path or
    data.valid_fraction."""
    eval_batches: int = 4
    """Global batches of validation data per evaluation (always the same ones)."""
    nonfinite: str = "stop"
    """A NaN/inf loss or gradient norm: "stop" (save nothing, exit naming the step) or "skip" the update."""
    max_skips: int = 3
    """train.nonfinite = "skip": stop after this many consecutive skipped steps."""
    fp16_max_overflows: int = 32
    """fp16: stop after this many consecutive overflowing steps (the loss scale cannot recover)."""
    hang_timeout_s: float = 1800.0
    """A rank that finishes no step for this long (saves excluded) dumps its stack to RUN_DIR/stacks/ and
    exits 4 naming the ranks that stopped responding; 0 disables the watchdog."""
    collective_timeout_s: float = 0.0
    """Timeout of every collective, passed to torch.distributed.init_process_group; 0 keeps torch's (30 min)."""
    stop_signal: str = "SIGUSR1"
    """Signal that, like SIGTERM and SIGINT, makes every rank checkpoint at the next step and exit 75
    (pre-emption: Slurm's `--signal=USR1@120`); "" for none."""

    def micro_batches(self, dp: int) -> int:
        return self.global_batch // max(1, self.micro_batch * dp)

    def check(self) -> list[Violation]:
        v: list[Violation] = []
        v.extend(_unknown_choice("train", self, "dtype", DTYPES))
        v.extend(_unknown_choice("train", self, "grad_reduce_dtype", ("fp32", "bf16"), "use fp32 or bf16"))
        v.extend(_unknown_choice("train", self, "nonfinite", NONFINITE))
        if self.stop_signal and self.stop_signal not in STOP_SIGNALS:
            v.append(
                Violation(
                    rule="train.stop_signal",
                    problem=f"train.stop_signal = {self.stop_signal!r:.40} is not a signal tessera can catch",
                    fix=f'use one of {", ".join(STOP_SIGNALS)}, or "" for none',
                )
            )
        v.extend(_unknown_choice("train", self, "device", ("auto", "cpu", "cuda"), "use auto, cpu or cuda"))
        v.extend(_out_of_range("train", self))
        if not v and self.global_batch // self.micro_batch > MAX_MICRO_BATCHES:
            # bounds the schedule the estimator and the runtime build (p × m actions)
            v.append(
                Violation(
                    rule="train.micro_batches",
                    problem=f"train.global_batch / train.micro_batch = {self.global_batch // self.micro_batch} "
                    f"micro-batches per step is more than {MAX_MICRO_BATCHES}",
                    fix="raise train.micro_batch or lower train.global_batch",
                )
            )
        if any(x.rule in ("train.lr", "train.min_lr") for x in v):
            return v
        if self.min_lr > self.lr:
            v.append(
                Violation(
                    rule="train.lr",
                    problem=f"need 0 <= train.min_lr <= train.lr and lr > 0, got "
                    f"lr = {self.lr}, min_lr = {self.min_lr}",
                    fix=f"e.g. train.min_lr = {self.lr / 10:g}",
                )
            )
        return v


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Training data: prepared token files (one, or a weighted blend), or the embedded default corpus."""

    path: str | list[Any] | None = None
    """Token file written by `tessera prepare`, or a blend: a list of files and/or {path, weight} tables
    (weight 1 when omitted); None prepares the default corpus (the Python standard library)."""
    valid_path: str | None = None
    """A separate token file for the validation loss."""
    valid_fraction: float = 0.0
    """Hold out this fraction of every training file (its last whole documents) for the validation loss."""
    tokenizer: str = "byte"
    """"byte" (no files needed), a Hugging Face tokenizers JSON file, or a `save_pretrained` folder holding one
    (its EOS token separates documents)."""
    seed: int | None = None
    """Seed of the sample order; None means train.seed."""
    default_corpus_mb: float = 8.0
    """How many MiB of standard-library sources the default corpus takes (a deterministic subset)."""

    def sources(self) -> list[tuple[str, float]]:
        """(path, weight) of every training file; empty for the default corpus. Assumes `check` passed."""
        if self.path is None:
            return []
        entries = [self.path] if isinstance(self.path, str) else self.path
        return [(e, 1.0) if isinstance(e, str) else (e["path"], float(e.get("weight", 1.0))) for e in entries]

    def check(self) -> list[Violation]:
        v = (
            _out_of_range("data", self)
            + _check_sources(self.path)
            + _bad_path("data.valid_path", self.valid_path)
        )
        if self.tokenizer != "byte":
            v.extend(_bad_path("data.tokenizer", self.tokenizer))
        if self.valid_path is not None and self.valid_fraction:
            v.append(
                Violation(
                    rule="data.valid",
                    problem=f"both data.valid_path and data.valid_fraction = {self.valid_fraction} are set",
                    fix="keep one: a separate validation file, or a held-out fraction of the training data",
                )
            )
        if not 0 <= self.valid_fraction < 1:
            v.append(
                Violation(
                    rule="data.valid_fraction",
                    problem=f"data.valid_fraction = {self.valid_fraction} is not in [0, 1)",
                    fix="e.g. data.valid_fraction = 0.05",
                )
            )
        if not v and self.valid_path is not None and not Path(self.valid_path).exists():
            v.append(_missing_file("data.valid_path", self.valid_path))
        return v


def _missing_file(rule: str, path: str) -> Violation:
    return Violation(
        rule=rule,
        problem=f"{rule} = {path!r} does not exist",
        fix="run `tessera prepare INPUT --out FILE` first, or unset data.path to train on "
        "the embedded default corpus",
    )


def _check_sources(path: str | list[Any] | None) -> list[Violation]:
    """Every entry of data.path is an existing file or a {path, weight > 0} table."""
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
        elif not Path(entry).exists():
            v.append(_missing_file(where, entry))
    return v


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When and where to save; saves are atomic and resumable."""

    dir: str | None = None
    """Checkpoint directory; None means RUN_DIR/checkpoints."""
    every: int = 0
    """Save every this many steps (0: only at the end)."""
    keep: int = 2
    """How many most recent checkpoints to keep."""
    resume: bool = True
    """Resume from the newest checkpoint in dir that verifies against its checksums, if there is one."""
    load_step: int | None = None
    """Resume from exactly this step's checkpoint instead (it must exist and verify)."""

    def check(self) -> list[Violation]:
        return _out_of_range("checkpoint", self) + _bad_path("checkpoint.dir", self.dir)


@dataclass(kw_only=True, slots=True)
class LogConfig:
    """Metrics and progress display."""

    run_dir: str = "runs/default"
    """Where metrics.jsonl, the resolved config, checkpoints and plots go."""
    every: int = 1
    """Log metrics every this many steps."""
    progress: bool = True
    """Live progress display on rank 0 (rich)."""
    tensorboard: bool = True
    """Also write TensorBoard events to RUN_DIR/tensorboard."""
    wandb: bool = False
    """Also log the same scalars to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "tessera"
    """W&B project name."""
    wandb_mode: str = "offline"
    """W&B mode: offline (files under RUN_DIR/wandb, `wandb sync` later), online or disabled."""

    def check(self) -> list[Violation]:
        v = _out_of_range("log", self) + _bad_path("log.run_dir", self.run_dir)
        for name, package, enabled in (
            ("tensorboard", "tensorboard", self.tensorboard),
            ("wandb", "wandb", self.wandb),
        ):
            if enabled and not _importable(package):
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
                self,
                "wandb_mode",
                ("offline", "online", "disabled"),
                "use offline, online or disabled",
            )
        )
        return v


def _importable(package: str) -> bool:
    """Whether ``import package`` would find it, without importing it (config stays light)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    return importlib.util.find_spec(package) is not None


@dataclass(kw_only=True, slots=True)
class Config:
    """A whole run: model, layout, optimisation, data, checkpointing and logging."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self, world_size: int) -> list[Violation]:
        """Every violated rule, for this world size; an empty list means the config is valid.

        The per-section field rules live in each section's ``check``; the rules across sections (world size,
        divisibility, batch arithmetic, the schedule that will run) in `tessera.execution`, which resolves the
        config into the plan a run executes."""
        from tessera.execution import violations

        return violations(self, world_size)

    def validate(self, world_size: int) -> None:
        """Raise ConfigError listing every violation at once (`tessera.execution.resolve`)."""
        from tessera.execution import resolve

        resolve(self, world_size)


def parse_tensor(value: int | str) -> tuple[int, int]:
    """Parse parallel.tensor into (t, q): 4 → (4, 1) for 1D; "2x2" → (1, 2) for 2D."""
    if isinstance(value, bool):
        raise ConfigError(f"parallel.tensor = {value!r} is not a size")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"parallel.tensor = {value} must be at least 1")
        return value, 1
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", str(value))
    if m is None:
        if str(value).strip().isdigit():
            return parse_tensor(int(value))
        raise ConfigError(f'parallel.tensor = {value!r} is neither an int nor a grid like "2x2"')
    rows, cols = int(m.group(1)), int(m.group(2))
    if rows != cols or rows < 1:
        raise ConfigError(f"parallel.tensor = {value!r}: the 2D grid must be square (q×q), got {rows}×{cols}")
    return 1, rows


def _divisors_near(n: int, target: int, count: int = 3, tries: int = 4096) -> list[int]:
    """Up to ``count`` divisors of n closest to target; looks at most ``tries`` candidates each side of target
    (and always 1 and n), so a huge n answers at once."""
    found = {1, n}
    for d in range(max(1, target - tries), min(n, target + tries) + 1):
        if n % d == 0:
            found.add(d)
    return sorted(sorted(found, key=lambda d: (abs(d - target), d))[:count])


def _multiple_near(n: int, k: int) -> int:
    return max(k, k * round(n / k))


def even_split(n_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage for an even split; the first ``n_layers % n_stages`` stages get one more."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


# --- loading -------------------------------------------------------------------------------------------------

_SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML file (or the defaults), apply dotted overrides like ``train.lr=3e-4``, resolve model.size."""
    raw = _read_toml(Path(path)) if path is not None else {}
    apply_overrides(raw, overrides or [])
    return from_dict(raw)


def _read_toml(p: Path) -> dict[str, Any]:
    name = f"{str(p)[:80]!r}" + ("..." if len(str(p)) > 80 else "")
    try:
        data = p.read_bytes()
    except (OSError, ValueError) as e:  # missing, a directory, a name too long, a NUL byte
        reason = (
            "does not exist"
            if isinstance(e, FileNotFoundError)
            else f"cannot be read ({e.__class__.__name__})"
        )
        raise ConfigError(
            f"config file {name} {reason}; pass a TOML file such as configs/demo.toml"
        ) from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {name} is not UTF-8 text (byte {e.start}: {data[e.start : e.start + 1]!r}); "
            "TOML files must be UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {name} is not valid TOML: {e}") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> None:
    """Apply ``section.key=value`` overrides in place; values parse as TOML (3e-4, true, "2x2", [1,2]) or text."""
    for item in overrides:
        key, sep, text = item.lstrip("-").partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.lr=3e-4")
        section, name = key.split(".", 1)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {item[:80]!r}: [{section}] in the config file is not a table")
        table[name] = _parse_value(text)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections and keys with the valid names."""
    unknown = set(raw) - set(_SECTION_TYPES)
    problems: list[str] = [
        f"unknown section [{s}]; valid sections: {', '.join(_SECTION_TYPES)}" for s in unknown
    ]
    sections: dict[str, Any] = {}
    for name, cls in _SECTION_TYPES.items():
        section = raw.get(name, {})
        if not isinstance(section, dict):
            problems.append(f"[{name}] must be a table of keys, got {name} = {section!r:.60}")
            section = {}
        values = dict(section)
        if name == "model":
            values = _resolve_init(_resolve_size(values, problems), problems)
        valid = {f.name for f in dataclasses.fields(cls)}
        for key in sorted(set(values) - valid):
            close = [k for k in valid if k.startswith(key[:3])]
            problems.append(
                f"unknown key {name}.{key}"
                + (
                    f"; did you mean {' or '.join(close)}?"
                    if close
                    else f"; valid keys: {', '.join(sorted(valid))}"
                )
            )
            values.pop(key)
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        for key, value in list(values.items()):
            if key in fields and not _type_ok(value, str(fields[key])):
                problems.append(f"{name}.{key} = {value!r:.60} should be of type {fields[key]}")
                values.pop(key)
            elif _too_big(value):
                problems.append(f"{name}.{key} = {value!r:.60} is outside TOML's 64-bit integer range")
                values.pop(key)
        sections[name] = cls(**values)
    if problems:
        raise ConfigError("configuration problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return Config(**sections)


_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool, "None": type(None)}


def _type_ok(value: Any, annotation: str) -> bool:
    """Check a TOML value against a field annotation such as ``int | None`` or ``list[int] | None``."""
    for option in annotation.replace(" ", "").split("|"):
        if option.startswith("list[") and isinstance(value, list):
            inner = _TYPES.get(option[5:-1], object)
            if all(isinstance(x, inner) and not isinstance(x, bool) for x in value):
                return True
        elif (
            option in _TYPES
            and isinstance(value, _TYPES[option])
            and (option == "bool" or not isinstance(value, bool))
        ):
            return True
    return False


def _too_big(value: Any) -> bool:
    """An integer TOML could not hold (tomllib accepts any size): it would overflow float() and torch."""
    items = value if isinstance(value, list) else [value]
    return any(isinstance(x, int) and not -(2**63) <= x < 2**63 for x in items)


def _resolve_size(values: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    size = values.get("size")
    if size is None:
        return values
    if not isinstance(size, str) or size not in SIZES:
        problems.append(f"unknown model.size {size!r:.60}; known sizes: {', '.join(SIZES)}")
        return {k: v for k, v in values.items() if k != "size"}
    return {**SIZES[size], **values}


def _resolve_init(values: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Fill the model's shape from ``model.init = "hf:DIR"``; explicit keys that contradict it are problems."""
    init = values.get("init")
    if not isinstance(init, str):
        return values
    if values.get("size") is not None:
        problems.append("model.size and model.init both give the model's shape; set only one of them")
        return values
    from tessera.hf.config import derive_model  # torch-free

    derived, found = derive_model(init, values)
    problems.extend(found)
    return {**derived, **values}
