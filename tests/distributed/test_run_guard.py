"""A run directory belongs to one run at a time, and a resumed run must use the model and tokenizer it saved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.config import from_dict
from tessera.errors import CheckpointError
from tessera.train.runlock import LOCK_FILE, RunDirLocked, run_dir_lock
from tessera.train.trainer import train
from tests.distributed.conftest import trainer_config

MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16}
HOLD = "import sys, time; from tessera.train.runlock import run_dir_lock\nwith run_dir_lock(sys.argv[1]):\n"
HOLD += "    print('held', flush=True); time.sleep(600)\n"


def test_a_second_run_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        refused = pytest.raises(RunDirLocked, match=rf"in use by another run \(pid {holder.pid} on ")
        with refused, run_dir_lock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    with run_dir_lock(tmp_path):  # the holder died: its lock died with it
        holder_now = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder_now["pid"] != holder.pid
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released cleanly: nothing stale left behind


def test_stale_lock_is_taken_over_and_announced(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "gone", "pid": 1, "started": "earlier"}))
    with run_dir_lock(tmp_path):
        pass
    assert "taking over" in capsys.readouterr().err


def _raw(token_file: Path, run_dir: Path, **model: object) -> dict:
    raw = trainer_config(token_file, run_dir, {**MODEL, **model}, {}, steps=2)
    raw["checkpoint"] = {"every": 1, "resume": True}
    return raw


@pytest.mark.parametrize(("key", "value"), [("n_layers", 1), ("n_heads", 8)])
def test_resume_with_a_changed_model_is_refused(
    token_file: Path, tmp_path: Path, key: str, value: int
) -> None:
    train(from_dict(_raw(token_file, tmp_path)))
    changed = _raw(token_file, tmp_path, **{key: value})
    changed["train"]["steps"] = 3
    with pytest.raises(CheckpointError, match=rf"model\.{key}: {MODEL[key]} in the checkpoint, {value} now"):
        train(from_dict(changed))


def test_config_history_is_kept(token_file: Path, tmp_path: Path) -> None:
    train(from_dict(_raw(token_file, tmp_path)))
    resumed = _raw(token_file, tmp_path)
    resumed["train"]["steps"] = 3
    train(from_dict(resumed))
    history = [json.loads(x) for x in (tmp_path / "config_history.jsonl").read_text().splitlines()]
    assert [h["resumed_from"] for h in history] == [0, 2]
    assert [h["config"]["train"]["steps"] for h in history] == [2, 3]
    assert json.loads((tmp_path / "config.json").read_text())["train"]["steps"] == 3
