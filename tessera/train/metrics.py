"""Training metrics: a JSON-lines log (plus TensorBoard and W&B), a live progress display, MFU and memory.

Everything here is a no-op off rank 0, so the trainer can call it unconditionally.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch

from tessera.train.run_files import METRICS_FILE, read_metrics, read_records

__all__ = [
    "PEAK_FLOPS_ENV",
    "MetricsLogger",
    "Progress",
    "memory_bytes",
    "mfu",
    "peak_flops_for",
    "read_metrics",
]

PEAK_FLOPS_ENV = "TESSERA_PEAK_FLOPS"
"""Environment variable giving the peak FLOP/s of one device, e.g. ``2e12`` for a CPU; overrides the table."""

# Dense (no sparsity) peak FLOP/s per device from vendor datasheets: (bf16/fp16 tensor cores, fp32 without TF32).
# More specific names come first ("H100 PCIe" before "H100").
_PEAK_TABLE: tuple[tuple[str, float, float], ...] = (
    ("B200", 2250e12, 80e12),
    ("H200", 989e12, 67e12),
    ("H100 PCIe", 756e12, 51e12),
    ("H100", 989e12, 67e12),
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("A10G", 70e12, 31.2e12),
    ("V100", 125e12, 15.7e12),
)


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# --- numbers -----------------------------------------------------------------------------------------------------


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s (tokens/s × FLOPs per token) over the peak FLOP/s.

    ``peak_flops`` is for all devices that produced ``tokens_per_s`` together (per-device peak × devices).
    """
    if not peak_flops or peak_flops <= 0:
        raise ValueError(f"peak_flops = {peak_flops} must be positive; use peak_flops_for(device, dtype)")
    return tokens_per_s * flops_per_token / peak_flops


def peak_flops_for(device: torch.device | str, dtype: torch.dtype | str) -> float | None:
    """Peak dense FLOP/s of one ``device`` in ``dtype``, or None when unknown (CPUs, unlisted GPUs).

    ``TESSERA_PEAK_FLOPS`` overrides the table for any device. bf16/fp16 use tensor-core peaks; fp32 uses the
    non-TF32 peak because PyTorch does not enable TF32 matmuls by default.
    """
    override = os.environ.get(PEAK_FLOPS_ENV)
    if override:
        try:
            return float(override)
        except ValueError:
            raise ValueError(f"{PEAK_FLOPS_ENV} = {override!r} is not a number; use e.g. 2e12") from None
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if isinstance(dtype, str):  # train.dtype spelling
        dtype = _DTYPES.get(dtype, torch.float32)
    name = torch.cuda.get_device_name(device)
    for key, half, single in _PEAK_TABLE:
        if key in name:
            return half if dtype in (torch.bfloat16, torch.float16) else single
    return None


def memory_bytes(device: torch.device) -> int:
    """Peak memory in bytes: CUDA's max_memory_allocated on a GPU; on a CPU the process's peak resident set
    size (``ru_maxrss``, reported in KiB on Linux and bytes on macOS), which includes Python and libraries."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _number(key: str, value: Any) -> float | int | None:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, numbers.Number):  # numpy scalars
        return value.item() if hasattr(value, "item") else float(value)  # type: ignore[arg-type]
    raise ValueError(f"metric {key!r} = {value!r} is a {type(value).__name__}; log numbers only (flat dict)")


# --- log file ----------------------------------------------------------------------------------------------------


class MetricsLogger:
    """Append one JSON object per `log` call to ``run_dir/metrics.jsonl`` (rank 0 only), flushed each line.

    The file describes one training history: opening it for a run that starts (or resumes) at step ``start``
    first drops every record of step ``start`` or later, so steps redone after a resume are not there twice
    (``start = None`` appends to whatever is there).
    Also writes the same scalars to TensorBoard (``tensorboard``) and to Weights & Biases (``wandb``: a dict of
    ``wandb.init`` arguments); `tessera.config.LogConfig` has already checked that those packages import.
    """

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        tensorboard: bool = True,
        *,
        start: int | None = None,
        wandb: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = rank == 0
        self._file: IO[str] | None = None
        self._sinks: list[Any] = []
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if start is not None:
            _truncate(self.run_dir / METRICS_FILE, start)
        self._file = open(self.run_dir / METRICS_FILE, "a")  # noqa: SIM115 -- closed in close()
        if self._file.tell() and not _ends_with_newline(self.run_dir / METRICS_FILE):
            self._file.write("\n")  # a crash tore the last record: keep it on its own line, not glued to ours
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard, too, forgets the events of the steps a resumed run redoes
            writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=start or None)
            self._sinks.append(_TensorBoard(writer))
        if wandb is not None:
            self._sinks.append(_WandB(_wandb_run(self.run_dir, start, wandb)))

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Record one flat dict of numbers or None (loss, lr, grad_norm, tokens_per_s, mfu, mem_bytes, step_time,
        comm byte counters, ...); the step comes from ``step`` or ``metrics["step"]``."""
        if not self.enabled or self._file is None:
            return
        step = metrics.get("step") if step is None else step
        if step is None:
            raise ValueError("MetricsLogger.log needs a step: pass step=... or include 'step' in the metrics")
        record: dict[str, Any] = {k: _number(k, v) for k, v in metrics.items()}
        record["step"] = int(step)
        record.setdefault("time", time.time())
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {
            k: v
            for k, v in record.items()
            if k not in ("step", "time") and v is not None and math.isfinite(v)
        }
        for sink in self._sinks:
            sink.log(scalars, int(step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _TensorBoard:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, global_step=step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


WANDB_ID_FILE = "wandb_run_id"
"""RUN_DIR's file naming the W&B run that its history is logged to (a resumed run continues that run)."""


def _wandb_run(run_dir: Path, start: int | None, args: dict[str, Any]) -> Any:
    """``wandb.init`` for a run starting at step ``start``: a resumed run (``start`` > 0, or None: appending)
    continues the W&B run named by RUN_DIR/wandb_run_id (``resume="allow"``, which works offline too, and
    `wandb sync` then appends to that run); a run from step 0 starts a new W&B run and names it there, as its
    metrics.jsonl starts afresh. The steps a resume redoes are logged again under their own step numbers."""
    import wandb as wb

    id_file = run_dir / WANDB_ID_FILE
    if start != 0 and id_file.is_file():
        return wb.init(dir=str(run_dir), id=id_file.read_text().strip(), resume="allow", **args)
    run = wb.init(dir=str(run_dir), **args)
    run_id = getattr(run, "id", None)  # None in mode = "disabled" (a dummy run)
    if run_id:
        id_file.write_text(f"{run_id}\n")
    return run


def _truncate(path: Path, start: int) -> None:
    """Keep only the records of steps before ``start`` (atomically: a crash leaves the old file or the new)."""
    if not path.is_file():
        return
    keep = [r for r in read_records(path, skip_bad=True) if isinstance(r, dict) and r.get("step", 0) < start]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


# --- progress ----------------------------------------------------------------------------------------------------


class Progress:
    """Rank-0 progress: a live rich bar on a terminal, plain lines (every ``every`` steps) otherwise.

    Use as a context manager and call ``update(step, metrics)`` after each step; ``metrics`` may hold loss,
    tokens_per_s, mfu (a fraction or None) and mem_bytes.
    """

    def __init__(
        self,
        total_steps: int,
        enabled: bool,
        *,
        every: int | None = None,
        stream: IO[str] | None = None,
        live: bool | None = None,
    ) -> None:
        self.total = total_steps
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.live = self._isatty() if live is None else live
        self.every = every or max(1, total_steps // 20)  # about 20 lines per run in CI logs
        self._rich: Any = None
        self._task: Any = None
        self._start: tuple[float, int] | None = None
        self._val_loss: float | None = None  # the latest validation loss stays on every line after it

    def _isatty(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def __enter__(self) -> Progress:
        if self.enabled and self.live:
            self._start_rich()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._rich = RichProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=self.stream),
        )
        self._rich.start()
        self._task = self._rich.add_task("train", total=self.total, info="")

    def resumed(self, step: int) -> None:
        """Say that the run continues from a checkpoint at ``step`` (a line above the live bar, or plain)."""
        if not self.enabled:
            return
        self._start = (time.monotonic(), step)
        if self._rich is not None:
            self._rich.console.print(f"resumed from step {step}")
            self._rich.update(self._task, completed=step)
        else:
            print(f"resumed from step {step}", file=self.stream, flush=True)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Show ``step`` (1-based count of finished steps) of ``total_steps`` with the given metrics."""
        if not self.enabled:
            return
        now = time.monotonic()
        if self._start is None:
            self._start = (now, step - 1)  # resumed runs start counting from their first step
        if metrics.get("val_loss") is not None:
            self._val_loss = metrics["val_loss"]
        info = format_metrics({**metrics, "val_loss": self._val_loss})
        if self._rich is not None:
            self._rich.update(self._task, completed=step, info=info)
        elif step % self.every == 0 or step == self.total:
            line = f"step {step}/{self.total} | {info} | ETA {_eta(self._start, now, step, self.total)}"
            print(line, file=self.stream, flush=True)


def format_metrics(m: Mapping[str, Any]) -> str:
    """``loss 3.2100 | 12.3k tok/s | MFU 41.2% | mem 1.50 GiB``; MFU shows n/a when unknown."""
    parts = []
    if m.get("skipped_samples"):  # a step train.skip_steps names: no loss, throughput or memory to show
        return f"skipped ({m['skipped_samples']} samples passed over: train.skip_steps)"
    if m.get("target_tokens") == 0:  # data.loss_mask and an all-prompt global batch: skipped
        return "skipped (no target token in the global batch: data.loss_mask)"
    if m.get("loss") is not None:
        parts.append(f"loss {m['loss']:.4f}")
    if m.get("val_loss") is not None:
        parts.append(f"val {m['val_loss']:.4f}")
    if m.get("tokens_per_s") is not None:
        parts.append(f"{_si(m['tokens_per_s'])} tok/s")
    parts.append("MFU n/a" if m.get("mfu") is None else f"MFU {100 * m['mfu']:.1f}%")
    if m.get("mem_bytes") is not None:
        parts.append(f"mem {m['mem_bytes'] / 2**30:.2f} GiB")
    return " | ".join(parts)


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.1f}"


def _eta(start: tuple[float, int], now: float, step: int, total: int) -> str:
    t0, s0 = start
    done = step - s0
    if done <= 0 or now <= t0:
        return "?"
    seconds = (now - t0) / done * max(0, total - step)
    h, rem = divmod(int(seconds), 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"
