"""What `tessera plan --out` writes beside the layout: data, steps, learning-rate schedule, evaluation,
checkpointing and the run directory, each with where it comes from.

Precedence, per key: a `tessera plan` flag, else the model's config file (`--model CONFIG.toml`: its [data],
[train], [checkpoint] and [log] keys), else a value derived here. The plan itself decides [parallel] and
train.global_batch, micro_batch and dtype (`report.config_toml`). Each derivation is one small function with its
source; docs/planner.md, "What `plan --out` writes", lists them.

Pure Python, no torch: runs wherever the planner does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.config import CheckpointConfig, TrainConfig
from tessera.planner.search import Candidate, SearchResult

__all__ = [
    "CHECKPOINT_BYTES_PER_ELEMENT",
    "EVALS_PER_RUN",
    "GPT3_LR_TABLE",
    "GPT3_WARMUP_TOKENS",
    "MAX_EVAL_SHARE",
    "MAX_WARMUP_FRACTION",
    "TOKENS_PER_PARAM",
    "RunInputs",
    "Setting",
    "checkpoint_bytes",
    "checkpoint_every",
    "eval_every",
    "job_mtbf_seconds",
    "peak_lr",
    "run_settings",
    "steps_for_tokens",
    "warmup_steps",
    "young_daly_interval",
]

TOKENS_PER_PARAM = 20
"""Compute-optimal training tokens per parameter (Hoffmann et al. 2022, "Training Compute-Optimal Large Language
Models", arXiv 2203.15556: Chinchilla, 70B parameters on 1.4T tokens): the default run length."""

GPT3_LR_TABLE: tuple[tuple[float, float], ...] = (
    (125e6, 6.0e-4),
    (350e6, 3.0e-4),
    (760e6, 2.5e-4),
    (1.3e9, 2.0e-4),
    (2.7e9, 1.6e-4),
    (6.7e9, 1.2e-4),
    (13e9, 1.0e-4),
    (175e9, 0.6e-4),
)
"""(parameters, peak learning rate) of GPT-3's eight models (Brown et al. 2020, "Language Models are Few-Shot
Learners", arXiv 2005.14165, Table 2.1), all trained with Adam β = (0.9, 0.95) as tessera's defaults."""

GPT3_MIN_LR_FRACTION = 0.1
"""GPT-3 decays the learning rate by a cosine "down to 10% of its value" (Brown et al. 2020, Appendix B)."""

GPT3_WARMUP_TOKENS = 375e6
"""GPT-3's "linear LR warmup over the first 375 million tokens" (Brown et al. 2020, Appendix B)."""

MAX_WARMUP_FRACTION = 0.1
"""A short run warms up for at most this fraction of its steps (GPT-3's 375M tokens were 0.1 % of its 300B; of a
compute-optimal 125M-parameter run's 2.5B they would be 15 %)."""

EVALS_PER_RUN = 100
"""With validation data: about this many validation losses over the run (a curve, not a point)..."""

MAX_EVAL_SHARE = 0.02
"""... unless that costs more than this share of the run: one evaluation is train.eval_batches global batches of
forward only, about a third of a step each (forward ≈ 1/3 of forward + backward)."""

CHECKPOINT_BYTES_PER_ELEMENT = 12
"""Bytes a checkpoint holds per parameter element: its fp32 value and Adam's two fp32 moments (tessera keeps fp32
weights under bf16/fp16 autocast; docs/checkpoints.md, "The layout-free format")."""

ADAM_BYTES_PER_ELEMENT = 8
"""Adam's two fp32 moments per element a rank updates: the plan's memory breakdown's ``optimizer`` / this is the
number of elements the rank owns."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RunInputs:
    """What the user chose for the run: `tessera plan` flags (None: not given) and the model's config file."""

    data: str | None = None
    """--data: data.path."""
    valid: str | None = None
    """--valid: data.valid_path."""
    steps: int | None = None
    """--steps: train.steps."""
    tokens: float | None = None
    """--tokens: train.steps = ceil(tokens / tokens per step)."""
    run_dir: str | None = None
    """--run-dir: log.run_dir (and checkpoint.dir = RUN_DIR/checkpoints)."""
    file: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The model's config file as read (its raw TOML tables); empty for a model name."""
    file_name: str | None = None
    """The model's config file's path, for the comments."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Setting:
    """One written key: its value and a short note of where it comes from (the comment above it)."""

    value: Any
    source: str


# --- the derivations ------------------------------------------------------------------------------------------


def steps_for_tokens(tokens: float, global_batch: int, seq_len: int) -> int:
    """Optimizer steps that train on at least `tokens` tokens at `global_batch` sequences of `seq_len` tokens."""
    return max(1, math.ceil(tokens / (global_batch * seq_len)))


def peak_lr(params: float) -> float:
    """GPT-3's peak learning rate for a model of `params` parameters: linear in log(params) between the rows of
    `GPT3_LR_TABLE`, the end rows' values outside it; rounded to 3 significant digits."""
    table = GPT3_LR_TABLE
    if params <= table[0][0]:
        return table[0][1]
    if params >= table[-1][0]:
        return table[-1][1]
    for (n0, lr0), (n1, lr1) in itertools.pairwise(table):
        if params <= n1:
            w = math.log(params / n0) / math.log(n1 / n0)
            return float(f"{lr0 + w * (lr1 - lr0):.3g}")
    raise AssertionError("unreachable: params is inside the table")


def warmup_steps(tokens_per_step: float, steps: int) -> int:
    """GPT-3's warmup (`GPT3_WARMUP_TOKENS`) in steps, at most `MAX_WARMUP_FRACTION` of the run's `steps`."""
    return min(math.ceil(GPT3_WARMUP_TOKENS / tokens_per_step), math.floor(MAX_WARMUP_FRACTION * steps))


def eval_every(steps: int, eval_batches: int) -> int:
    """Steps between validation losses: `EVALS_PER_RUN` over the run, or fewer where they would take more than
    `MAX_EVAL_SHARE` of it; at most the run (the trainer also evaluates at the end)."""
    by_count = math.ceil(steps / EVALS_PER_RUN)
    by_cost = math.ceil(eval_batches / 3 / MAX_EVAL_SHARE)
    return max(1, min(steps, max(by_count, by_cost)))


def checkpoint_bytes(cand: Candidate) -> float:
    """Bytes the rank with the most memory writes per checkpoint: `CHECKPOINT_BYTES_PER_ELEMENT` per element whose
    optimizer state it holds (the plan's memory breakdown: ``optimizer`` / `ADAM_BYTES_PER_ELEMENT`), shared with
    the ranks holding the same state (DCP writes each block once, from the replica with the least to write:
    ZeRO-0's data × context ranks, hybrid sharding's replicas)."""
    pl = cand.plan
    copies = pl.dp * pl.cp if pl.zero_stage == 0 else pl.zero_replicas
    return CHECKPOINT_BYTES_PER_ELEMENT * cand.memory.optimizer / ADAM_BYTES_PER_ELEMENT / copies


def job_mtbf_seconds(gpu_mtbf_hours: float, gpus: int) -> float:
    """The job's mean time between interruptions: any one of its `gpus` interrupts it."""
    return gpu_mtbf_hours * 3600 / gpus


def young_daly_interval(write_seconds: float, mtbf_seconds: float) -> float:
    """The checkpoint interval that loses the least time to writes and to recomputing after failures, sqrt(2·C·M)
    for a write of C seconds and a mean time between failures M (Young 1974, "A first order approximation to the
    optimum checkpoint interval", Commun. ACM 17(9):530-531; Daly 2006, "A higher order estimate of the optimum
    checkpoint interval for restart dumps", Future Gener. Comput. Syst. 22(3):303-312, its first-order term)."""
    return math.sqrt(2 * write_seconds * mtbf_seconds)


def checkpoint_every(interval_s: float, step_time: float, steps: int) -> int:
    """`interval_s` in whole steps of `step_time` seconds, at least 1 and at most the run."""
    return max(1, min(steps, round(interval_s / step_time)))


# --- choosing each key ------------------------------------------------------------------------------------------


class _Chooser:
    """Picks each key's value by precedence (a flag, the model's file, derived) and records where it came from."""

    def __init__(self, inputs: RunInputs) -> None:
        self.inputs = inputs
        self.out: dict[str, dict[str, Setting]] = {}

    def from_file(self, section: str, key: str) -> Any:
        return self.inputs.file.get(section, {}).get(key)

    def pick(
        self, section: str, key: str, derive: Callable[[], tuple[Any, str]], flag: Setting | None = None
    ) -> Any:
        """Set `section.key` to `flag` if given, else to the file's value, else to `derive()`'s (value, source)."""
        if flag is None and self.from_file(section, key) is not None:
            flag = Setting(value=self.from_file(section, key), source=f"from {self.inputs.file_name}")
        if flag is None:
            value, source = derive()
            flag = Setting(value=value, source=source)
        self.out.setdefault(section, {})[key] = flag
        return flag.value

    def carry(self, section: str, skip: tuple[str, ...] = ()) -> None:
        """The file's other keys of `section`, as written there."""
        chosen = self.out.setdefault(section, {})
        for key, value in self.inputs.file.get(section, {}).items():
            if key not in skip and key not in chosen:
                chosen[key] = Setting(value=value, source=f"from {self.inputs.file_name}")


PLAN_KEYS = ("global_batch", "micro_batch", "dtype")
"""train keys the plan decides (`report.config_toml` writes them): the file's values are replaced."""


def run_settings(
    result: SearchResult, cand: Candidate, inputs: RunInputs | None = None
) -> dict[str, dict[str, Setting]]:
    """{section: {key: Setting}} of everything `plan --out` writes beside [model], [parallel] and the plan's
    train keys, in the order written."""
    inputs = inputs or RunInputs()
    c = _Chooser(inputs)
    tokens_per_step = cand.global_batch * result.shape.seq_len
    flag = _steps_flag(inputs, cand.global_batch, result.shape.seq_len)
    steps = c.pick("train", "steps", lambda: _default_steps(result, cand), flag)
    lr = c.pick("train", "lr", lambda: _lr(result))
    c.pick("train", "min_lr", lambda: _min_lr(lr))
    c.pick("train", "warmup_steps", lambda: _warmup(tokens_per_step, steps))
    valid = _data(c, inputs)
    if valid:
        batches = c.from_file("train", "eval_batches") or TrainConfig().eval_batches
        c.pick("train", "eval_every", lambda: _eval_every(steps, batches))
    c.carry("train", skip=PLAN_KEYS)
    # --valid replaces a held-out fraction: the two together are refused
    c.carry("data", skip=("valid_fraction",) if inputs.valid is not None else ())
    run_dir = c.pick(
        "log", "run_dir", lambda: _default_run_dir(result, inputs), _flag(inputs.run_dir, "--run-dir")
    )
    c.pick("checkpoint", "dir", lambda: (f"{run_dir}/checkpoints", "RUN_DIR/checkpoints"))
    c.pick("checkpoint", "every", lambda: _checkpoint_every(result, cand, steps))
    c.pick("checkpoint", "keep", lambda: (CheckpointConfig().keep, "the default: the newest two"))
    c.carry("checkpoint")
    c.carry("log")
    return {s: c.out.get(s, {}) for s in ("train", "data", "checkpoint", "log")}


def _flag(value: Any, name: str) -> Setting | None:
    return None if value is None else Setting(value=value, source=name)


def _steps_flag(inputs: RunInputs, global_batch: int, seq_len: int) -> Setting | None:
    """--steps, or --tokens in steps."""
    if inputs.tokens is None:
        return _flag(inputs.steps, "--steps")
    steps = steps_for_tokens(inputs.tokens, global_batch, seq_len)
    return Setting(
        value=steps, source=f"--tokens {inputs.tokens:.4g} / ({global_batch} × {seq_len} per step)"
    )


def _data(c: _Chooser, inputs: RunInputs) -> bool:
    """data.path and data.valid_path from --data / --valid or the file; whether the run has validation data."""
    path = _flag(inputs.data, "--data")
    if path is not None or c.from_file("data", "path") is not None:
        c.pick("data", "path", lambda: (None, ""), path)
    valid = _flag(inputs.valid, "--valid")
    if valid is not None or c.from_file("data", "valid_path") is not None:
        c.pick("data", "valid_path", lambda: (None, ""), valid)
        return True
    return bool(c.from_file("data", "valid_fraction"))


def _default_steps(result: SearchResult, cand: Candidate) -> tuple[int, str]:
    seq, batch = result.shape.seq_len, cand.global_batch
    if cand.steps is not None:
        return math.ceil(cand.steps), (
            f"the critical batch's steps to loss {result.target_loss:.3f} (Kaplan/McCandlish; the plan's training "
            "time), rounded up"
        )
    params = result.shape.n_params()
    tokens = TOKENS_PER_PARAM * params
    return steps_for_tokens(tokens, batch, seq), (
        f"{TOKENS_PER_PARAM} tokens per parameter (compute-optimal, Hoffmann et al. 2022, arXiv 2203.15556): "
        f"{tokens:.3g} tokens / ({batch} × {seq} per step)"
    )


def _lr(result: SearchResult) -> tuple[float, str]:
    params = result.shape.n_params()
    return peak_lr(params), (
        f"GPT-3's peak lr for {params:.3g} parameters, interpolated in log(parameters) over Brown et al. 2020 "
        "(arXiv 2005.14165) Table 2.1, clamped to its 125M and 175B rows"
    )


def _min_lr(lr: float) -> tuple[float, str]:
    return float(f"{lr * GPT3_MIN_LR_FRACTION:.3g}"), "lr / 10: GPT-3 decays to 10 % of the peak (Appendix B)"


def _warmup(tokens_per_step: int, steps: int) -> tuple[int, str]:
    return warmup_steps(tokens_per_step, steps), (
        f"GPT-3's {GPT3_WARMUP_TOKENS / 1e6:.0f}M warmup tokens (Appendix B) at {tokens_per_step:,} per step, "
        f"at most {MAX_WARMUP_FRACTION:.0%} of the run"
    )


def _eval_every(steps: int, batches: int) -> tuple[int, str]:
    return eval_every(steps, batches), (
        f"~{EVALS_PER_RUN} validation losses per run, at most {MAX_EVAL_SHARE:.0%} of its time "
        f"({batches} forward-only batches each)"
    )


def _default_run_dir(result: SearchResult, inputs: RunInputs) -> tuple[str, str]:
    name = result.model or (Path(inputs.file_name).stem if inputs.file_name else "model")
    return f"runs/{name}-{result.gpus}gpu", "runs/<model>-<GPUs>gpu (--run-dir)"


def _checkpoint_every(result: SearchResult, cand: Candidate, steps: int) -> tuple[int, str]:
    hw = result.hardware
    size = checkpoint_bytes(cand)
    write = size / hw.storage_write_bandwidth
    mtbf = job_mtbf_seconds(hw.gpu_mtbf_hours, result.gpus)
    interval = young_daly_interval(write, mtbf)
    return checkpoint_every(interval, cand.step_time, steps), (
        f"Young/Daly optimum sqrt(2·C·M) = {_duration(interval)} (Young 1974; Daly 2006) in steps of "
        f"{cand.step_time:.3g} s; C = {_bytes(size)} per rank (its fp32 weights + Adam moments) / "
        f"{_bytes(hw.storage_write_bandwidth)}/s per GPU = {_duration(write)}; M = {_number(hw.gpu_mtbf_hours)} "
        f"GPU-hours MTBF / {result.gpus} GPUs = {_duration(mtbf)} (hardware storage_write_bandwidth, "
        "gpu_mtbf_hours)"
    )


def _number(x: float) -> str:
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g} B"


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.3g} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{seconds:.3g} s"
