"""Checkpoints: round trips (1 process and 2 gloo ranks), crash safety, pruning, refusing pickled code."""

from __future__ import annotations

import io
import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from tessera.errors import CheckpointError
from tessera.train import checkpoint as ckpt
from tessera.train.checkpoint import latest_checkpoint, load_checkpoint, restore_rng, save_checkpoint
from tests.harness import run_distributed

EXACT = 0.0  # a restored run must continue bit for bit


def _model(width: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))


def _opt(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _sched(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, sched=None) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x = torch.randn(5, 4)  # draws from the global generator: checks RNG restore too
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
    return loss.item()


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def _extra(sched, step: int) -> dict:
    return {"scheduler": sched.state_dict(), "data": {"step": step, "samples": 5 * step}, "t": torch.ones(3)}


def test_round_trip_single_process(tmp_path: Path) -> None:
    model, opt = _model(), _opt(_model())
    opt = _opt(model)
    sched = _sched(opt)
    _train(model, opt, 3, sched)
    random.random(), np.random.rand()
    path = save_checkpoint(tmp_path, 3, model, opt, _extra(sched, 3))
    assert path == tmp_path / "step_00000003" and latest_checkpoint(tmp_path) == path
    assert (tmp_path / "latest").read_text().strip() == path.name
    expected_loss = _train(model, opt, 2, sched)
    expected_py, expected_np = random.random(), np.random.rand()

    model2 = _model(seed=1)
    opt2 = _opt(model2)
    sched2 = _sched(opt2)
    extra = load_checkpoint(tmp_path, model2, opt2)  # a directory resolves to its newest checkpoint
    sched2.load_state_dict(extra["scheduler"])
    restore_rng(extra)
    assert extra["step"] == 3 and extra["data"] == {"step": 3, "samples": 15}
    assert torch.equal(extra["t"], torch.ones(3))
    loss = _train(model2, opt2, 2, sched2)
    assert abs(loss - expected_loss) <= EXACT
    _assert_same(model, model2)
    for s1, s2 in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert (random.random(), np.random.rand()) == (expected_py, expected_np)


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    model = _model()
    opt = _opt(model)
    for step in (1, 2, 3, 4):
        _train(model, opt, 1)
        save_checkpoint(tmp_path, step, model, opt, {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004"]


@pytest.mark.parametrize("crash_at", ["dcp_write", "rank_files", "commit"])
def test_crash_mid_save_keeps_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at: str
) -> None:
    model = _model()
    opt = _opt(model)
    _train(model, opt, 2)
    good = save_checkpoint(tmp_path, 2, model, opt, {"n": 2})
    saved = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 1)

    def boom(*args, **kwargs):
        raise OSError("simulated crash")

    target = {"dcp_write": (FileSystemWriter, "finish"), "rank_files": (ckpt, "_write_rank_files")}
    target["commit"] = (ckpt, "_commit")
    with monkeypatch.context() as m:
        m.setattr(*target[crash_at], boom)
        with pytest.raises((OSError, CheckpointException), match="simulated crash"):
            save_checkpoint(tmp_path, 3, model, opt, {"n": 3})
    assert (tmp_path / "step_00000003.tmp").is_dir()  # the partial save is left behind ...
    assert latest_checkpoint(tmp_path) == good  # ... and ignored
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(tmp_path / "step_00000003.tmp", model, opt)
    fresh = _model(seed=5)
    assert load_checkpoint(tmp_path, fresh, _opt(fresh))["n"] == 2
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), saved, strict=True))
    save_checkpoint(tmp_path, 4, model, opt, {})
    assert not (tmp_path / "step_00000003.tmp").exists()  # cleaned by the next save


class _Payload:
    """Unpickling this runs code that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def test_malicious_metadata_is_refused(tmp_path: Path) -> None:
    model = _model()
    opt = _opt(model)
    path = save_checkpoint(tmp_path / "ck", 1, model, opt, {})
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Payload(control)))  # the payload really runs under plain pickle
    assert control.exists()
    marker = tmp_path / "marker"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"builtins\.exec"):
        load_checkpoint(path, model, opt)
    assert not marker.exists()


def test_malicious_bytes_value_is_refused(tmp_path: Path) -> None:
    """Non-tensor values (optimizer hyper-parameters) are stored by torch.save; DCP loads them with
    weights_only=False, tessera with weights_only=True."""
    model = _model()
    opt = _opt(model)
    _train(model, opt, 1)
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    marker = tmp_path / "marker"
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["lr"] = _Payload(marker)
    dcp.save({"model": msd, "optim": osd, "extra": {}}, storage_writer=FileSystemWriter(path))
    with pytest.raises(CheckpointError, match="could not be read"):
        load_checkpoint(path, model, opt)
    assert not marker.exists()
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)  # control: plain DCP runs the payload
    assert marker.exists()


def test_shape_mismatch_names_parameter(tmp_path: Path) -> None:
    model = _model(width=8)
    save_checkpoint(tmp_path, 1, model, _opt(model), {})
    bigger = _model(width=16)
    with pytest.raises(CheckpointError, match=r"model\.0\.weight has shape \(8, 4\).*\(16, 4\)"):
        load_checkpoint(tmp_path, bigger, _opt(bigger))


def test_missing_and_incomplete(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", model, _opt(model))
    assert latest_checkpoint(tmp_path / "nope") is None
    path = save_checkpoint(tmp_path, 1, model, _opt(model), {})
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(path, model, _opt(model))
    assert latest_checkpoint(tmp_path) is None


def test_world_size_change_resumes_layout_free_and_refuses_format_1(tmp_path: Path) -> None:
    model = _model()
    opt = _opt(model)
    _train(model, opt, 2)
    path = save_checkpoint(tmp_path, 1, model, opt, {})
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "world_size": 2}))
    fresh = _model(seed=3)
    opt2 = _opt(fresh)
    extra = load_checkpoint(path, fresh, opt2)  # saved by "2 ranks", resumed by 1: weights and moments
    _assert_same(model, fresh)
    for s1, s2 in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert extra["rng"] is None  # the saved ranks' streams are not this rank's: the caller re-seeds
    (path / "meta.json").write_text(json.dumps({**meta, "world_size": 2, "format": 1}))
    with pytest.raises(
        CheckpointError, match=r"(?s)rank-local format 1.*2 rank.*this run has 1.*resume it once"
    ):
        load_checkpoint(path, model, _opt(model))


def test_extra_rejects_objects(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"extra\[a\] is a ndarray"):
        save_checkpoint(tmp_path, 1, model, _opt(model), {"a": np.zeros(2)})


def _two_rank_round_trip(rank: int, world: int, root: str) -> list[float]:
    torch.manual_seed(100 + rank)  # different RNG streams per rank
    model = _model()
    opt = _opt(model)
    with torch.no_grad():  # a rank-local shard: same names, different values on each rank
        model[0].weight.add_(rank)
    _train(model, opt, 2)
    save_checkpoint(Path(root), 2, model, opt, {"data": {"step": 2}}, shard_id=f"tp{rank}", layout="tp2")
    expected = _train(model, opt, 1)
    fresh = _model(seed=9)
    opt2 = _opt(fresh)
    extra = load_checkpoint(Path(root), fresh, opt2, shard_id=f"tp{rank}", layout="tp2")
    restore_rng(extra)
    got = _train(fresh, opt2, 1)
    _assert_same(model, fresh)
    gathered = [0.0] * world
    dist.all_gather_object(gathered, got)
    return [expected, got, *gathered]


def test_two_rank_gloo_round_trip(tmp_path: Path) -> None:
    results = run_distributed(_two_rank_round_trip, 2, str(tmp_path), timeout=120)
    for expected, got, *_ in results:
        assert abs(expected - got) <= EXACT
    assert results[0][0] != results[1][0]  # the ranks really held different state
    meta = json.loads((tmp_path / "step_00000002" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["shard_ids"] == ["tp0", "tp1"]
    assert sorted(p.name for p in (tmp_path / "step_00000002").glob("rng_rank*.pt")) == [
        "rng_rank0.pt",
        "rng_rank1.pt",
    ]


def test_rng_files_hold_no_objects(tmp_path: Path) -> None:
    model = _model()
    path = save_checkpoint(tmp_path, 1, model, _opt(model), {})
    state = torch.load(path / "rng_rank0.pt", weights_only=True)
    assert isinstance(state["torch"], torch.Tensor) and state["torch"].dtype == torch.uint8
    buf = io.BytesIO((path / "rng_rank0.pt").read_bytes())
    assert torch.equal(torch.load(buf, weights_only=True)["torch"], state["torch"])


def test_exported_weights_load_for_inference_but_refuse_resume(tmp_path: Path) -> None:
    model = _model()
    _train(model, _opt(model), 2)
    path = ckpt.save_model_weights(tmp_path / "export", 7, model, {"layout": "test"})
    assert latest_checkpoint(tmp_path / "export") == path and path.name == "step_00000007"
    assert ckpt.checkpoint_meta(path)["weights_only"] is True
    fresh = _model(seed=1)
    assert ckpt.load_model_weights(path, fresh) == 7
    _assert_same(model, fresh)
    with pytest.raises(CheckpointError, match="exported weights only"):
        load_checkpoint(path, fresh, _opt(fresh))
