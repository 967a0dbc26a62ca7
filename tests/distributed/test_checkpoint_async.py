"""checkpoint.async: DCP's async save under the same commit protocol as a synchronous save.

An async run resumes bit for bit like a synchronous one; a failure or a kill in the background write commits
nothing and leaves the previous checkpoint loadable; a save waits for the one before it. (The SIGTERM stop that
waits for the save in flight is in test_signals.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from tessera.config import from_dict
from tessera.errors import CheckpointWriteError
from tessera.train.async_save import AsyncSaves
from tessera.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tessera.train.trainer import train
from tests.distributed.conftest import train_losses, trainer_config
from tests.harness import run_distributed

EXACT = 0.0  # resuming continues bit for bit
MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 4, "seq_len": 16}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(5, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _raw(token_file: Path, run_dir: Path, steps: int, background: bool, world: int = 2) -> dict:
    parallel = {"data": 2, "zero": 1} if world == 2 else {}
    raw = trainer_config(token_file, run_dir, MODEL, parallel, steps=steps)
    raw["checkpoint"] = {"every": 2, "resume": True, "async": background}
    return raw


def _async_then_resumed(rank: int, world: int, token_file: Path, run_dir: Path) -> tuple[dict, dict]:
    """Losses of a 6-step async run (saves at 2, 4, 6 while training goes on), then of steps 4-5 again,
    resumed from its step-4 checkpoint."""
    whole = train_losses(rank, world, _raw(token_file, run_dir, 6, True))
    again = _raw(token_file, run_dir, 6, True)
    again["checkpoint"]["load_step"] = 4
    return whole, train_losses(rank, world, again)


def test_an_async_run_resumes_bit_identically_to_a_sync_one(token_file: Path, tmp_path: Path) -> None:
    sync = run_distributed(train_losses, 2, _raw(token_file, tmp_path / "sync", 6, False), timeout=240)[0]
    ranks = run_distributed(_async_then_resumed, 2, token_file, tmp_path / "async", timeout=240)
    (whole, resumed), (whole1, resumed1) = ranks
    assert sorted(sync) == sorted(whole) == list(range(6)) and sorted(resumed) == [4, 5]
    for step, loss in sync.items():
        assert abs(whole[step] - loss) <= EXACT and whole1[step] == whole[step], step
    for step, loss in resumed.items():
        assert abs(loss - sync[step]) <= EXACT and resumed1[step] == loss, step
    ckpts = tmp_path / "async" / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("superseded_"))
    assert names == ["latest", "step_00000004", "step_00000006"]  # every save committed, then pruned (keep 2)
    # the first run's step 6, replaced by the resumed run's, was set aside when that run started at step 4
    assert [p.name for p in ckpts.glob("superseded_*_from_step_00000004/*")] == ["step_00000006"]


def test_each_save_waits_for_the_one_before_and_copies_the_state(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saves = AsyncSaves.new()
    expected = {}
    for step in (1, 2, 3):
        _step(model, opt)
        expected[step] = _params(model)
        save_checkpoint(tmp_path, step, model, opt, {"n": step}, keep=3, background=saves)
        assert saves.in_flight
        _step(model, opt)  # training goes on while the copy is written: the checkpoint holds the copy
    assert saves.wait() == tmp_path / "step_00000003" and not saves.in_flight
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000003"
    for step, params in expected.items():
        fresh = _model(seed=1)
        assert load_checkpoint(tmp_path / f"step_{step:08d}", fresh, torch.optim.AdamW(fresh.parameters()))[
            "n"
        ]
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), params, strict=True)), step


def test_a_failed_background_write_is_reported_and_never_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    saves = AsyncSaves.new()
    save_checkpoint(tmp_path, 1, model, opt, {"n": 1}, background=saves)
    saves.wait()
    good = _params(model)
    _step(model, opt)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "finish", full)  # runs in DCP's worker thread, after the data files
    save_checkpoint(tmp_path, 2, model, opt, {"n": 2}, background=saves)
    with pytest.raises(
        CheckpointWriteError, match=r"step 2 .*No space left on device; the previous checkpoint"
    ):
        saves.wait()
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert (tmp_path / "step_00000002.tmp").is_dir()  # uncommitted: ignored, and removed by the next save
    fresh = _model(seed=1)
    assert load_checkpoint(tmp_path, fresh, torch.optim.AdamW(fresh.parameters()))["n"] == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), good, strict=True))
    save_checkpoint(tmp_path, 3, model, opt, {}, background=saves)
    saves.wait()
    assert not (tmp_path / "step_00000002.tmp").exists()


KILLED_MID_SAVE = """
import os, signal, sys, torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from tessera.train.async_save import AsyncSaves
from tessera.train.checkpoint import save_checkpoint

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters())
saves = AsyncSaves.new()
save_checkpoint(sys.argv[1], 1, model, opt, {"n": 1}, background=saves)
saves.wait()
torch.save([p.detach().clone() for p in model.parameters()], sys.argv[2])
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
write = FileSystemWriter.write_data

def write_then_die(self, *args, **kwargs):  # the background thread, with step 2 half written
    out = write(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
    return out

FileSystemWriter.write_data = write_then_die
save_checkpoint(sys.argv[1], 2, model, opt, {"n": 2}, background=saves)
saves.wait()
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "kill.py"
    script.write_text(textwrap.dedent(KILLED_MID_SAVE))
    ckpts, params = tmp_path / "ckpt", tmp_path / "params.pt"
    done = subprocess.run([sys.executable, str(script), str(ckpts), str(params)], env=os.environ, timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert (ckpts / "step_00000002.tmp").is_dir()  # the kill came in the middle of step 2's save
    assert latest_checkpoint(ckpts) == ckpts / "step_00000001"
    fresh = _model(seed=1)
    assert load_checkpoint(ckpts, fresh, torch.optim.AdamW(fresh.parameters()))["n"] == 1
    saved = torch.load(params, weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), saved, strict=True))


def test_the_config_key_is_checkpoint_async(token_file: Path, tmp_path: Path) -> None:
    cfg = from_dict(_raw(token_file, tmp_path, 2, True, world=1))
    assert cfg.checkpoint.async_ is True and cfg.to_dict()["checkpoint"]["async"] is True


def test_training_returns_once_its_last_save_is_committed(token_file: Path, tmp_path: Path) -> None:
    raw = _raw(token_file, tmp_path, 3, True, world=1)
    raw["checkpoint"]["every"] = 1
    result = train(from_dict(raw))
    assert latest_checkpoint(result.checkpoint_dir) == result.checkpoint_dir / "step_00000003"
    assert not list(result.checkpoint_dir.glob("*.tmp"))
