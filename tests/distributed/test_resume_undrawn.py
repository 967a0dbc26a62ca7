"""Resuming builds the run without drawing initial values (`InitSource`'s ``values=False``): the checkpoint
overwrites every parameter, and the optimizer state and ZeRO's copies come from it or from the loaded weights.

Oracle: the same resume forced back onto the drawing build (``TrainingRun._value_source`` called with values),
as every resume built before. From one interrupted run's checkpoint, both resume in copies of its run folder;
their losses and every tensor of their last checkpoints (parameters and Adam moments) must be equal bit for
bit, and the resume that does not draw must call neither ``torch.Tensor.normal_`` on a real tensor nor the
init's ``stream_seed`` (counted as tests/distributed/test_export.py counts the export's draws).

A checkpoint that lacks a tensor of the run's model (a Llama checkpoint under a qwen2 config, whose q/k/v
biases a Llama never has) stops `tessera train` with exit status 2 before anything is loaded, naming every
missing tensor, and leaves the checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tessera.config import from_dict
from tessera.train import checkpoint as ckpt
from tessera.train.trainer import TrainingRun, train
from tests.distributed.conftest import Interrupt, counting_draws, trainer_config
from tests.distributed.test_export import _biases, _write_format_1
from tests.harness import run_distributed

STEPS = 4
CRASH_AT = 2  # after the checkpoint of step 2 (every 2 steps)
MODEL = {"gpt2-tiny": {"size": "gpt2-tiny"}, "llama-tiny": {"size": "llama-tiny", "n_kv_heads": 2}}

CASES = {  # name: (model, layout that writes the checkpoint, layout that resumes, train section, format 1)
    "tp1d_2": ("llama-tiny", {"tensor": 2}, {"tensor": 2}, {}, False),
    "dp2_zero3": ("gpt2-tiny", {"data": 2, "zero": 3}, {"data": 2, "zero": 3}, {}, False),
    "pp2_1f1b_tied": ("gpt2-tiny", *[{"pipeline": 2, "schedule": "1f1b"}] * 2, {}, False),
    "dp2_zero2_bf16": ("gpt2-tiny", *[{"data": 2, "zero": 2}] * 2, {"dtype": "bf16"}, False),
    # resharding: a layout-free checkpoint of tp 2 resumed at dp 2 ZeRO-3
    "tp2_to_dp2_zero3": ("llama-tiny", {"tensor": 2}, {"data": 2, "zero": 3}, {}, False),
    # a rank-local (format 1) checkpoint of step 1, resumed at its own layout
    "format_1_tp1d_2": ("llama-tiny", {"tensor": 2}, {"tensor": 2}, {}, True),
    "format_1_dp2_zero1": ("gpt2-tiny", *[{"data": 2, "zero": 1}] * 2, {}, True),
}


def _config(run_dir: Path, token_file: Path, model: str, parallel: dict, train_section: dict) -> dict:
    raw = trainer_config(token_file, run_dir, MODEL[model], parallel, steps=STEPS, **train_section)
    raw["checkpoint"] = {"every": CRASH_AT, "resume": True}
    return raw


def _interrupt(raw: dict, format_1: bool) -> None:
    """Leave a checkpoint in ``raw``'s run folder: a run stopped after step CRASH_AT's, or a format 1 one."""
    if format_1:
        _write_format_1(dist.get_rank(), dist.get_world_size(), raw)
        return

    def crash(step: int, model: torch.nn.Module) -> None:
        if step == CRASH_AT:
            raise Interrupt

    with contextlib.suppress(Interrupt):
        train(from_dict(raw), crash)


def _resume_counting_draws(raw: dict, drawing: bool, start: int) -> tuple[dict[int, float], int, int]:
    """(losses, calls of normal_ on real tensors, calls of init's stream_seed) of resuming ``raw``'s run from
    step ``start``; ``drawing`` forces the build's values on, as every resume built before."""
    value_source = TrainingRun._value_source

    def drawn(run: TrainingRun, overwritten: bool = False, values: bool = True) -> object:
        return value_source(run, overwritten, True)

    if drawing:
        TrainingRun._value_source = drawn
    try:
        with counting_draws() as calls:
            result = train(from_dict(raw))
    finally:
        TrainingRun._value_source = value_source
    assert result.resumed_from == start, result.resumed_from
    return result.losses, calls["normal_"], calls["stream_seed"]


def _both_resumes(rank: int, world: int, written: dict, resumed: dict, format_1: bool) -> list[tuple]:
    """Interrupt ``written``'s run, copy its folder to RUN/drawn and RUN/now, and resume each with ``resumed``'s
    config there: drawing, then as resume does now."""
    _interrupt(written, format_1)
    run_dir = Path(written["log"]["run_dir"])
    copies = {kind: run_dir.parent / f"{run_dir.name}_{kind}" for kind in ("drawn", "now")}
    if rank == 0:
        for copy in copies.values():
            shutil.copytree(run_dir, copy)
    dist.barrier()
    out = []
    for kind, copy in copies.items():
        raw = {**resumed, "log": {**resumed["log"], "run_dir": str(copy)}}
        out.append(_resume_counting_draws(raw, kind == "drawn", 1 if format_1 else CRASH_AT))
    return out


def _tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor of the run's newest checkpoint (layout-free), by global name."""
    path = ckpt.latest_checkpoint(run_dir / "checkpoints")
    metadata = ckpt.read_metadata_safely(path)
    names = [
        n
        for n, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and n.startswith(("model.", "optim."))
    ]
    return {n: ckpt.read_tensor(path, n, metadata) for n in names}


@pytest.mark.parametrize("name", CASES)
def test_resume_without_draws_equals_the_drawing_resume(token_file: Path, tmp_path: Path, name: str) -> None:
    model, written_at, resumed_at, train_section, format_1 = CASES[name]
    written = _config(tmp_path / "run", token_file, model, written_at, train_section)
    resumed = _config(tmp_path / "run", token_file, model, resumed_at, train_section)
    (drawn, *drawn_calls), (now, *now_calls) = run_distributed(
        _both_resumes, 2, written, resumed, format_1, timeout=300
    )[0]
    start = 1 if format_1 else CRASH_AT
    assert min(drawn_calls) > 0, drawn_calls  # the spies see the drawing build
    assert now_calls == [0, 0]  # no initial value drawn, no generator seeded
    assert sorted(now) == sorted(drawn) == list(range(start, STEPS))
    assert now == drawn, f"losses: {now} vs drawing {drawn}"  # bit for bit
    got, expected = _tensors(tmp_path / "run_now"), _tensors(tmp_path / "run_drawn")
    assert any(n.startswith("optim.state.") for n in got)  # the moments are compared too
    assert got.keys() == expected.keys()
    differ = [n for n in got if not torch.equal(got[n], expected[n])]
    assert not differ, f"differ from the drawing resume: {differ[:5]}"


# --- a checkpoint of another model ------------------------------------------------------------------------------


def _write_layout_free(raw: dict) -> None:
    """A layout-free checkpoint of step 1 without recorded settings (as an older run's), in this process."""
    run = TrainingRun(from_dict(raw), 0, 1, with_data=False)
    state = run.stepper.rank_state(run.model, run.specs)
    ckpt.save_checkpoint(run.ckpt_dir, 1, run.stepper.state_module, run.optimizer, {"step": 1}, state=state)


def _snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """{relative path: (sha256, mtime_ns)} of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("format_1", [False, True], ids=["layout_free", "format_1_tp2"])
def test_resume_of_a_checkpoint_lacking_tensors_stops_before_loading(
    token_file: Path, tmp_path: Path, format_1: bool
) -> None:
    run_dir = tmp_path / "run"
    parallel = {"tensor": 2} if format_1 else {}
    raw = _config(run_dir, token_file, "llama-tiny", parallel, {})
    if format_1:  # recorded settings would refuse the qwen2 config first: drop them, as an older run's
        run_distributed(_write_format_1, 2, raw, timeout=240)
        meta = run_dir / "checkpoints" / "step_00000001" / "meta.json"
        saved = json.loads(meta.read_text())
        del saved["extra"]["settings"]
        meta.write_text(json.dumps(saved))
    else:
        _write_layout_free(raw)
    before = _snapshot(run_dir / "checkpoints")
    argv = [
        sys.executable, "-m", "tessera", "train", "--nproc", "2" if format_1 else "1",
        f'--data.path="{token_file}"', f'--log.run_dir="{run_dir}"', "--log.progress=false",
        "--log.tensorboard=false", '--model.size="llama-tiny"', "--model.n_kv_heads=2", '--model.family="qwen2"',
        f"--train.steps={STEPS}", "--train.global_batch=8", "--train.micro_batch=2", "--train.warmup_steps=1",
        f"--parallel.tensor={2 if format_1 else 1}",
    ]  # fmt: skip
    out = subprocess.run(
        argv, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2, out.stderr + out.stdout
    biases, checkpoint = _biases(raw), run_dir / "checkpoints" / "step_00000001"
    count = 2 * len(biases) if format_1 else len(biases)
    assert f"checkpoint {checkpoint} holds no saved value for {count} tensor(s)" in out.stderr, out.stderr
    listed = [f"shard {s}: {', '.join(biases)}" for s in ("tp0", "tp1")] if format_1 else [", ".join(biases)]
    assert all(names in out.stderr for names in listed), out.stderr
    assert (
        "nothing was loaded" in out.stderr and "fix: this checkpoint was written by a different" in out.stderr
    )
    assert "resume it with the config of the run that wrote it" in out.stderr
    assert _snapshot(run_dir / "checkpoints") == before  # the checkpoint untouched, nothing new written
