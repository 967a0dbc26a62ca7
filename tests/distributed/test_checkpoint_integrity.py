"""Checkpoint checksums: written at save by every rank, verified at load; a damaged newest checkpoint makes the
trainer fall back to the newest one that verifies, loudly; `checkpoint.load_step` picks one explicitly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tessera.config import from_dict
from tessera.errors import CheckpointError
from tessera.train.checkpoint import (
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    verify_checkpoint,
)
from tessera.train.trainer import TrainingRun, train
from tests.distributed.conftest import trainer_config
from tests.harness import run_distributed

MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16}


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _opt(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _flip(path: Path, offset: int = 64, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    offset = min(offset, len(data) - count)
    data[offset : offset + count] = bytes(b ^ 0xFF for b in data[offset : offset + count])
    path.write_bytes(bytes(data))


def _distcp(folder: Path) -> Path:
    return sorted(folder.glob("__0_*.distcp"))[0]


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])  # pickled values and raw tensor bytes alike
def test_flipped_bytes_are_detected_not_loaded(tmp_path: Path, where: float) -> None:
    model = _model()
    path = save_checkpoint(tmp_path, 1, model, _opt(model), {})
    files = json.loads((path / "meta.json").read_text())["files"]
    assert {".metadata", "rng_rank0.pt", _distcp(path).name} <= set(files)
    assert verify_checkpoint(path) == []
    _flip(_distcp(path), offset=int(_distcp(path).stat().st_size * where))
    fresh = _model(seed=1)
    with pytest.raises(CheckpointError, match=rf"{_distcp(path).name} does not match its checksum"):
        load_checkpoint(path, fresh, _opt(fresh))


def test_missing_file_and_damaged_rng_are_messages(tmp_path: Path) -> None:
    model = _model()
    path = save_checkpoint(tmp_path, 1, model, _opt(model), {})
    (path / "rng_rank0.pt").unlink()
    assert verify_checkpoint(path) == ["rng_rank0.pt is missing"]
    with pytest.raises(CheckpointError, match="RNG state cannot be restored"):
        restore_rng({"rng": {"torch": torch.zeros(3, dtype=torch.uint8)}})


def test_pruning_renames_before_deleting(tmp_path: Path) -> None:
    model = _model()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, _opt(model), {}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003"]


def _two_ranks(rank: int, world: int, root: str) -> list[str]:
    model = _model()
    with torch.no_grad():
        model[0].weight.add_(rank)
    path = save_checkpoint(Path(root), 1, model, _opt(model), {}, shard_id=f"tp{rank}")
    dist.barrier()
    if rank == 1:
        _flip(sorted(path.glob("__1_*.distcp"))[0])
    dist.barrier()
    return verify_checkpoint(path)  # every rank must hear about rank 1's file


def test_every_rank_checksums_its_files_and_hears_of_damage(tmp_path: Path) -> None:
    found = run_distributed(_two_ranks, 2, str(tmp_path), timeout=120)
    files = json.loads((tmp_path / "step_00000001" / "meta.json").read_text())["files"]
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= set(files)
    assert any(n.startswith("__1_") for n in files) and any(n.startswith("__0_") for n in files)
    assert found[0] == found[1] and len(found[0]) == 1 and "does not match its checksum" in found[0][0]


def _raw(token_file: Path, run_dir: Path, **checkpoint: object) -> dict:
    raw = trainer_config(token_file, run_dir, MODEL, {}, steps=4)
    raw["checkpoint"] = {"every": 1, "keep": 3, "resume": True, **checkpoint}
    return raw


def test_trainer_falls_back_loudly_and_load_step_chooses(
    token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    train(from_dict(_raw(token_file, tmp_path)))
    ckpts = tmp_path / "checkpoints"
    _flip(_distcp(ckpts / "step_00000004"))
    assert TrainingRun(from_dict(_raw(token_file, tmp_path)), 0, 1).resume() == 3
    err = capsys.readouterr().err
    assert (
        "WARNING: skipping checkpoint(s) step_00000004 (damaged:" in err
        and "resuming from step_00000003" in err
    )
    assert TrainingRun(from_dict(_raw(token_file, tmp_path, load_step=2)), 0, 1).resume() == 2
    with pytest.raises(CheckpointError, match=r"(?s)load_step = 7: .* use one of \[2, 3, 4\]"):
        TrainingRun(from_dict(_raw(token_file, tmp_path, load_step=7)), 0, 1).resume()
    with pytest.raises(CheckpointError, match="damaged"):  # chosen explicitly: no fallback
        TrainingRun(from_dict(_raw(token_file, tmp_path, load_step=4)), 0, 1).resume()
    for step in (2, 3):
        _flip(_distcp(ckpts / f"step_0000000{step}"))
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies"):
        TrainingRun(from_dict(_raw(token_file, tmp_path)), 0, 1).resume()


def test_a_full_disk_is_a_message_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from tessera.train import checkpoint as ckpt

    model = _model()
    first = save_checkpoint(tmp_path, 1, model, _opt(model), {})

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "_write_rank_files", full)
    with pytest.raises(CheckpointError, match="No space left on device; the previous checkpoint is intact"):
        save_checkpoint(tmp_path, 2, model, _opt(model), {})
    monkeypatch.undo()
    assert ckpt.latest_checkpoint(tmp_path) == first and verify_checkpoint(first) == []
