"""Metrics: the JSON-lines log, reading it back, the curves plot, progress lines, MFU and memory."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.errors import DataError
from tessera.train.metrics import (
    PEAK_FLOPS_ENV,
    MetricsLogger,
    Progress,
    memory_bytes,
    mfu,
    peak_flops_for,
    read_metrics,
)
from tessera.train.plot import plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REL = 1e-12  # MFU is one multiplication and one division


def _log_run(run_dir: Path, steps: int = 5, val_every: int = 2) -> None:
    with MetricsLogger(run_dir, rank=0, tensorboard=False) as log:
        for s in range(1, steps + 1):
            log.log({"step": s, "loss": 5.0 / s, "lr": 1e-3, "tokens_per_s": 1000.0 + s, "mfu": None})
            if s % val_every == 0:
                log.log({"val_loss": 6.0 / s}, step=s)


def test_logger_writes_and_reads_back(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, rank=0) as log:  # tensorboard=True: skipped silently if not installed
        log.log(
            {"loss": torch.tensor(2.5), "grad_norm": np.float32(0.5), "comm_bytes": 1 << 40, "mfu": None},
            step=1,
        )
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 1  # flushed before close
    rec = read_metrics(tmp_path)[0]
    assert rec["step"] == 1 and rec["loss"] == 2.5 and rec["grad_norm"] == 0.5
    assert rec["comm_bytes"] == 1 << 40 and rec["mfu"] is None and "time" in rec
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as log:  # a resumed run appends
        log.log({"loss": 2.0}, step=2)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_logger_is_silent_off_rank_zero(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path / "r1", rank=1) as log:
        log.log({"step": 1, "loss": 1.0})
    assert not (tmp_path / "r1").exists()


def test_logger_rejects_non_numbers(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as log:
        with pytest.raises(ValueError, match="needs a step"):
            log.log({"loss": 1.0})
        with pytest.raises(ValueError, match="'name'"):
            log.log({"step": 1, "name": "gpt"})


def test_read_metrics_errors_and_torn_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_metrics(tmp_path)
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 1.0}) + '\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]  # crash mid-write: last line dropped
    path.write_text('garbage\n{"step": 1}\n')
    with pytest.raises(DataError, match=":1 is not a JSON object"):
        read_metrics(tmp_path)


def test_plot_writes_png(tmp_path: Path) -> None:
    _log_run(tmp_path)
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    other = plot_run(tmp_path, tmp_path / "sub" / "c.png")
    assert other.read_bytes().startswith(PNG_MAGIC)


def test_plot_missing_or_empty_metrics(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(DataError, match="no loss records"):
        plot_run(tmp_path)
    assert not (tmp_path / "curves.png").exists()


def test_progress_plain_lines_when_not_a_tty() -> None:
    out = io.StringIO()  # StringIO.isatty() is False, like a CI log
    with Progress(10, enabled=True, every=5, stream=out) as p:
        for s in range(1, 11):
            p.update(s, {"loss": 1.0 / s, "tokens_per_s": 12345.0, "mfu": 0.25, "mem_bytes": 3 * 2**29})
    lines = out.getvalue().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == ["step 5/10", "step 10/10"]
    assert "loss 0.1000 | 12.3k tok/s | MFU 25.0% | mem 1.50 GiB | ETA " in lines[1]


def test_progress_disabled_and_mfu_unknown() -> None:
    out = io.StringIO()
    with Progress(4, enabled=False, every=1, stream=out) as p:
        p.update(1, {"loss": 1.0})
    assert out.getvalue() == ""
    with Progress(2, enabled=True, every=1, stream=out) as p:
        p.update(1, {"loss": 1.0, "mfu": None})
    assert "MFU n/a" in out.getvalue()


def test_progress_live_mode_renders() -> None:
    out = io.StringIO()
    with Progress(3, enabled=True, stream=out, live=True) as p:
        for s in range(1, 4):
            p.update(s, {"loss": 2.0, "tokens_per_s": 10.0})
    assert "3/3" in out.getvalue() and "loss 2.0000" in out.getvalue()


def test_mfu_and_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1000 tok/s × 6·1e9 FLOPs/token on a 312 TFLOP/s device
    assert mfu(1000.0, 6e9, 312e12) == pytest.approx(6e12 / 312e12, rel=REL)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1.0, 1.0, 0.0)
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    assert peak_flops_for(torch.device("cpu"), torch.float32) is None
    monkeypatch.setenv(PEAK_FLOPS_ENV, "2e12")
    assert peak_flops_for(torch.device("cpu"), torch.float32) == 2e12
    assert peak_flops_for("cpu", "bf16") == 2e12


def test_memory_bytes_cpu_is_peak_rss() -> None:
    before = memory_bytes(torch.device("cpu"))
    block = torch.ones(16 * 2**20, dtype=torch.uint8)  # 16 MiB touched
    after = memory_bytes(torch.device("cpu"))
    assert before > 2**20 and after >= before and block.sum() > 0


def test_logger_started_at_a_step_drops_later_records(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, rank=0, tensorboard=False, start=0) as log:
        for s in range(6):
            log.log({"step": s, "loss": 10.0 - s})
    with MetricsLogger(tmp_path, rank=0, tensorboard=False, start=3) as log:  # resumed from step 3
        assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
            0,
            1,
            2,
        ]
        for s in range(3, 5):
            log.log({"step": s, "loss": 1.0 - s / 10})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["loss"] for r in records[2:]] == [8.0, 0.7, 0.6]


def test_read_metrics_one_record_per_step_in_step_order(tmp_path: Path) -> None:
    lines = [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 2.0}, {"step": 1, "val_loss": 2.5}]
    lines += [{"step": 0, "loss": 2.9}, {"step": 1, "loss": 1.9}]  # a resume that did not truncate
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert read_metrics(tmp_path) == [{"step": 0, "loss": 2.9}, {"step": 1, "loss": 1.9, "val_loss": 2.5}]


def test_progress_says_resumed_and_keeps_the_validation_loss() -> None:
    out = io.StringIO()
    with Progress(6, enabled=True, every=1, stream=out) as p:
        p.resumed(3)
        p.update(4, {"loss": 1.0, "val_loss": 1.25})
        p.update(5, {"loss": 0.9})
    lines = out.getvalue().splitlines()
    assert lines[0] == "resumed from step 3"
    assert "loss 1.0000 | val 1.2500" in lines[1] and "loss 0.9000 | val 1.2500" in lines[2]


class _FakeWandb:
    """Stands in for the `wandb` module: records init arguments and every logged dict (no network)."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = False

    def init(self, **kwargs: object) -> _FakeWandb:
        self.inits.append(kwargs)
        return self

    def log(self, scalars: dict, step: int) -> None:
        self.logged.append((step, scalars))

    def finish(self) -> None:
        self.finished = True


def test_wandb_logs_the_same_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(tmp_path, rank=0, tensorboard=False, wandb={"project": "p", "mode": "offline"}) as log:
        log.log({"step": 2, "loss": 1.5, "mfu": None, "lr": 1e-3})
    assert fake.inits == [{"dir": str(tmp_path), "project": "p", "mode": "offline"}]
    assert fake.logged == [(2, {"loss": 1.5, "lr": 1e-3})] and fake.finished


def test_missing_tensorboard_or_wandb_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from tessera.config import LogConfig

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    rules = {v.rule: v for v in LogConfig(tensorboard=True, wandb=True).check()}
    assert set(rules) == {"log.tensorboard", "log.wandb"}
    assert (
        "pip install wandb" in rules["log.wandb"].fix
        and "log.tensorboard = false" in rules["log.tensorboard"].fix
    )
    assert LogConfig(tensorboard=False).check() == []


def test_progress_live_mode_says_resumed() -> None:
    out = io.StringIO()
    with Progress(6, enabled=True, stream=out, live=True) as p:
        p.resumed(4)
        p.update(5, {"loss": 2.0, "val_loss": 2.5})
    text = out.getvalue()
    assert "resumed from step 4" in text and "5/6" in text and "val 2.5000" in text


def test_tensorboard_forgets_the_steps_a_resume_redoes(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, rank=0, start=0) as log:
        for s in range(5):
            log.log({"step": s, "loss": 10.0 - s})
    with MetricsLogger(tmp_path, rank=0, start=3) as log:
        log.log({"step": 3, "loss": 0.5})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 10.0), (1, 9.0), (2, 8.0), (3, 0.5)]
