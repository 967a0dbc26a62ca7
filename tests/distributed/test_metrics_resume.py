"""An interrupted run resumed from its checkpoint leaves one metrics record per step and continues its W&B run
(single process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tessera.train.metrics import WANDB_ID_FILE
from tests.distributed.conftest import interrupted_then_resumed, trainer_config

TINY = {"family": "gpt", "n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 16}


def test_resumed_run_logs_each_step_once(token_file: Path, tmp_path: Path) -> None:
    raw = trainer_config(token_file, tmp_path / "run", TINY, {}, steps=6)
    raw["checkpoint"] = {"every": 2, "resume": True}
    losses = interrupted_then_resumed(0, 1, raw, crash_at=3)  # steps 0-2 ran; the checkpoint holds step 2
    assert sorted(losses) == [2, 3, 4, 5]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == [0, 1, 2, 3, 4, 5]  # without truncation: 0, 1, 2, 2, 3, 4, 5


class _FakeRun:
    def __init__(self, run_id: str, logged: list[int]) -> None:
        self.id, self.logged = run_id, logged

    def log(self, scalars: dict, step: int) -> None:
        self.logged.append(step)

    def finish(self) -> None:
        pass


class _FakeWandb:
    """Stands in for `wandb` when it is not installed: a run per init, new ids unless one is given."""

    def __init__(self) -> None:
        self.logged: list[int] = []

    def init(self, **kwargs: object) -> _FakeRun:
        return _FakeRun(str(kwargs.get("id") or "fake0001"), self.logged)


def test_resumed_run_continues_its_wandb_run(
    token_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With log.wandb (offline), the resumed run calls wandb.init with the first run's id and resume="allow":
    one W&B run holds the whole history. The real wandb in offline mode when installed, else a stand-in."""
    try:
        import wandb

        monkeypatch.setenv("WANDB_SILENT", "true")
    except ImportError:
        wandb = _FakeWandb()
        monkeypatch.setitem(sys.modules, "wandb", wandb)
    inits: list[tuple[dict, str]] = []
    real_init = wandb.init

    def recording_init(**kwargs: object) -> object:
        run = real_init(**kwargs)
        inits.append((kwargs, run.id))
        return run

    monkeypatch.setattr(wandb, "init", recording_init)
    raw = trainer_config(token_file, tmp_path / "run", TINY, {}, steps=4)
    raw["checkpoint"] = {"every": 2, "resume": True}
    raw["log"].update(wandb=True, wandb_mode="offline")
    interrupted_then_resumed(0, 1, raw, crash_at=3)  # the resumed run starts at step 2
    (first, first_id), (resumed, resumed_id) = inits
    assert "id" not in first and resumed["id"] == first_id and resumed["resume"] == "allow"
    assert resumed_id == first_id
    assert (tmp_path / "run" / WANDB_ID_FILE).read_text().strip() == first_id
    if isinstance(wandb, _FakeWandb):
        assert wandb.logged == [0, 1, 2, 2, 3]  # steps 0-2, then the resumed run from its checkpoint's step 2
