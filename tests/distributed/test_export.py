"""`tessera export`: a checkpoint of any layout (tensor, pipeline, ZeRO) gives the plain model's weights, and
those equal the weights of the same training run on one device.

Each layout trains STEPS steps and checkpoints at the end; every rank then calls the export (rank 0 alone reads
the layout-free checkpoint); the reference trains the plain model on one process with the same data, seed and
optimizer. Parallel runs sum the same gradients in another order, so the weights agree to rounding amplified by
Adam (stated tolerance below), not bit for bit; a wrong merge (a missing stage, a shard in the wrong place,
padding left in) is off by the weights' own magnitude. The runs train at lr 1e-4, as test_reshard_resume.py
does: AdamW's update is about ±lr where a gradient is at rounding level, in a direction the summation order
decides, so the weights' rounding excess scales with lr (measured here at lr 1e-3: 0.032 of the tolerance; a
qwen3 weight 1.5e-5 off on an AVX-512 CPU in test_reshard_resume, over this 1e-5 atol), while a wrong merge
does not shrink with lr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tessera.config import from_dict
from tessera.errors import CheckpointError
from tessera.model.build import build_model
from tessera.train import checkpoint as ckpt
from tessera.train.export import export_weights
from tessera.train.generate import newest_weights
from tessera.train.trainer import TrainingRun, train
from tests.distributed.conftest import counting_draws, trainer_config
from tests.harness import run_distributed

STEPS = 2
LR = 1e-4  # see the module docstring
WEIGHT_RTOL, WEIGHT_ATOL = 1e-4, 1e-5

LAYOUTS = {  # name: (world size, model size, parallel section)
    "dp2_zero1": (2, "gpt2-tiny", {"data": 2, "zero": 1}),
    "dp2_zero3": (2, "gpt2-tiny", {"data": 2, "zero": 3}),
    "pp2_1f1b_tied": (2, "gpt2-tiny", {"pipeline": 2, "schedule": "1f1b"}),
    "tp1d_2": (2, "llama-tiny", {"tensor": 2}),
    "tp2x2": (4, "llama-tiny", {"tensor": "2x2"}),
    "pp2_tp1d_2": (4, "llama-tiny", {"pipeline": 2, "tensor": 2}),
    "dp2_pp2_zero3": (4, "gpt2-tiny", {"data": 2, "pipeline": 2, "zero": 3, "schedule": "breadth_first"}),
}
MODEL = {"gpt2-tiny": {"size": "gpt2-tiny"}, "llama-tiny": {"size": "llama-tiny", "n_kv_heads": 2}}


def _config(token_file: Path, run_dir: Path, size: str, parallel: dict) -> dict:
    return trainer_config(token_file, run_dir, MODEL[size], parallel, steps=STEPS, lr=LR)


def _train_and_export(rank: int, world: int, raw: dict) -> tuple[str, str | None]:
    """(what generate said before the export, the export folder on rank 0)."""
    run_dir = Path(raw["log"]["run_dir"])
    train(from_dict(raw))
    try:
        before = f"loadable: {newest_weights(run_dir)}"
    except CheckpointError as e:
        before = str(e)
    path = export_weights(run_dir)
    return before, str(path) if path is not None else None


def _weights(raw: dict, path: Path) -> dict[str, torch.Tensor]:
    model = build_model(from_dict(raw).model)
    ckpt.load_model_weights(path, model)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference(
    token_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], dict[str, torch.Tensor]]:
    """The single-device run's final weights per model size, trained once for the module (each layout of a size
    trained the same run: four gpt2-tiny, three llama-tiny)."""
    weights: dict[str, dict[str, torch.Tensor]] = {}

    def of(size: str) -> dict[str, torch.Tensor]:
        if size not in weights:
            run_dir = tmp_path_factory.mktemp(f"ref_{size}")
            ref_raw = _config(token_file, run_dir, size, {})
            train(from_dict(ref_raw))
            weights[size] = _weights(ref_raw, ckpt.latest_checkpoint(run_dir / "checkpoints"))
        return weights[size]

    return of


@pytest.mark.parametrize("name", LAYOUTS)
def test_export_equals_single_device_weights(
    token_file: Path, tmp_path: Path, name: str, reference: Callable[[str], dict[str, torch.Tensor]]
) -> None:
    world, size, parallel = LAYOUTS[name]
    expected = reference(size)
    raw = _config(token_file, tmp_path / name, size, parallel)
    # every rank calls export_weights: rank 0 alone reads the layout-free checkpoint, no rank waits (this hung
    # when one process's load was a collective the other ranks never joined)
    before, exported = run_distributed(_train_and_export, world, raw, timeout=240)[0]
    trained = ckpt.latest_checkpoint(tmp_path / name / "checkpoints")
    assert before == f"loadable: {trained}", before  # layout-free: generate reads it without an export
    assert exported is not None and Path(exported).parent == tmp_path / name / "export"
    got = _weights(raw, Path(exported))
    direct = _weights(raw, trained)
    assert all(torch.equal(got[n], direct[n]) for n in got)  # the export is the checkpoint's weights, exactly
    assert got.keys() == expected.keys()
    worst = max(float((got[n] - expected[n]).abs().max()) for n in got)
    print(f"{name}: largest |exported - single-device| = {worst:.2e}")
    for n in got:
        torch.testing.assert_close(got[n], expected[n], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=n)


# --- format 1 (rank-local) checkpoints --------------------------------------------------------------------------
# Their export rebuilds each rank's part of the run without initial values (the checkpoint overwrites them all)
# after checking that the checkpoint holds every tensor it loads. Reference: the same export building as it did
# before, drawing every initial value (`values=True` forced on the rebuild), which must give the same bytes.

FORMAT_1 = {  # name: (world size, model size, parallel section)
    "tp1d_2": (2, "llama-tiny", {"tensor": 2}),
    "dp2_zero3": (2, "gpt2-tiny", {"data": 2, "zero": 3}),
    "pp2_1f1b_tied": (2, "gpt2-tiny", {"pipeline": 2, "schedule": "1f1b"}),
}


def _write_format_1(rank: int, world: int, raw: dict) -> None:
    """One training step at the layout, saved as a rank-local (format 1) checkpoint as tessera did before
    checkpoints were layout-free, and the run's config.json as `tessera train` writes it."""
    run = TrainingRun(from_dict(raw), rank, world)
    run.step(0, None)
    ckpt.save_checkpoint(
        run.ckpt_dir,
        1,
        run.stepper.state_module,
        run.optimizer,
        {"step": 1, "samples": run.cfg.train.global_batch, "settings": run.settings},
        shard_id=run.stepper.shard_id,
        layout=run.layout.describe(),
    )
    if rank == 0:
        (run.run_dir / "config.json").write_text(json.dumps(run.cfg.to_dict()))
    dist.barrier()


def _export_counting_draws(rank: int, world: int, run_dir: str, drawing: bool) -> tuple[str | None, int, int]:
    """(the export folder on rank 0, calls of normal_ on real tensors, calls of init's stream_seed) of
    `export_weights`; ``drawing`` builds the run with initial values, as the export did before."""
    import tessera.train.export as export

    training_run = export.TrainingRun
    if drawing:  # the call's own values=False is overridden
        export.TrainingRun = lambda *args, **kwargs: training_run(*args, **{**kwargs, "values": True})
    try:
        with counting_draws() as calls:
            path = export_weights(Path(run_dir))
    finally:
        export.TrainingRun = training_run
    return str(path) if path is not None else None, calls["normal_"], calls["stream_seed"]


def _two_exports(rank: int, world: int, raw: dict) -> list[tuple[str | None, int, int]]:
    """Write the format 1 checkpoint, export it drawing (moved aside to RUN/drawn), then as export does now."""
    _write_format_1(rank, world, raw)
    run_dir = Path(raw["log"]["run_dir"])
    drawn = _export_counting_draws(rank, world, str(run_dir), drawing=True)
    if rank == 0:
        Path(drawn[0]).parent.rename(run_dir / "drawn")
    dist.barrier()
    return [drawn, _export_counting_draws(rank, world, str(run_dir), drawing=False)]


@pytest.mark.parametrize("name", FORMAT_1)
def test_format_1_export_draws_nothing_and_writes_the_same_bytes(
    token_file: Path, tmp_path: Path, name: str
) -> None:
    world, size, parallel = FORMAT_1[name]
    raw = _config(token_file, tmp_path / name, size, parallel)
    (drawn, *drawn_calls), (now, *now_calls) = run_distributed(_two_exports, world, raw, timeout=240)[0]
    run_dir = tmp_path / name
    assert ckpt.checkpoint_meta(run_dir / "checkpoints")["format"] == 1
    assert min(drawn_calls) > 0, drawn_calls  # the spies see a drawing build
    assert now_calls == [0, 0]  # no initial value is drawn, nor its generator seeded
    before = run_dir / "drawn" / Path(drawn).name
    assert Path(now) == run_dir / "export" / before.name
    data = sorted(p.name for p in before.iterdir() if p.suffix == ".distcp")
    assert data and data == sorted(p.name for p in Path(now).iterdir() if p.suffix == ".distcp")
    for f in data:  # the same tensors, bit for bit, in the same order
        assert (before / f).read_bytes() == (Path(now) / f).read_bytes(), f
    got, expected = _weights(raw, Path(now)), _weights(raw, before)
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)


def _export_as_qwen2(run_dir: Path) -> subprocess.CompletedProcess:
    """`tessera export RUN_DIR` after config.json is made to say qwen2, whose q/k/v biases a Llama never has."""
    config = json.loads((run_dir / "config.json").read_text())
    config["model"]["family"] = "qwen2"
    (run_dir / "config.json").write_text(json.dumps(config))
    return subprocess.run(
        [sys.executable, "-m", "tessera", "export", str(run_dir)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _biases(raw: dict) -> list[str]:
    return [
        f"blocks.{i}.attn.{w}.bias" for i in range(from_dict(raw).model.n_layers) for w in ("wq", "wk", "wv")
    ]


def test_format_1_checkpoint_of_another_model_is_refused_before_anything_is_written(
    token_file: Path, tmp_path: Path
) -> None:
    """A format 1 checkpoint that lacks tensors of the run's model stops `tessera export` with every missing
    name, the checkpoint and the fix, exit status 2 and no export folder, instead of writing tensors that were
    never loaded."""
    run_dir = tmp_path / "run"
    raw = _config(token_file, run_dir, "llama-tiny", {"tensor": 2})
    run_distributed(_write_format_1, 2, raw, timeout=240)
    out = _export_as_qwen2(run_dir)
    assert out.returncode == 2, out.stderr + out.stdout
    biases, checkpoint = _biases(raw), run_dir / "checkpoints" / "step_00000001"
    assert f"checkpoint {checkpoint} holds no saved value for {2 * len(biases)} tensor(s)" in out.stderr
    for shard in ("tp0", "tp1"):
        assert f"shard {shard}: {', '.join(biases)}" in out.stderr, out.stderr
    assert "fix: this checkpoint was written by a different model config" in out.stderr
    assert not (run_dir / "export").exists()


def test_layout_free_checkpoint_of_another_model_is_refused_before_anything_is_written(
    token_file: Path, tmp_path: Path
) -> None:
    """The layout-free export builds nothing and draws nothing (the writer names tensors by the meta model), but
    the same coverage check stops it before writing: without it the writer stopped halfway, inside DCP, with a
    traceback, exit status 1 and a partial RUN/export/step_N.tmp."""
    run_dir = tmp_path / "run"
    raw = _config(token_file, run_dir, "llama-tiny", {})
    run = TrainingRun(from_dict(raw), 0, 1, with_data=False)
    state = run.stepper.rank_state(run.model, run.specs)
    ckpt.save_checkpoint(run.ckpt_dir, 1, run.stepper.state_module, run.optimizer, {"step": 1}, state=state)
    (run_dir / "config.json").write_text(json.dumps(run.cfg.to_dict()))
    assert ckpt.checkpoint_meta(run.ckpt_dir)["format"] == 2
    out = _export_as_qwen2(run_dir)
    assert out.returncode == 2, out.stderr + out.stdout
    biases, checkpoint = _biases(raw), run_dir / "checkpoints" / "step_00000001"
    assert f"checkpoint {checkpoint} holds no saved value for {len(biases)} tensor(s)" in out.stderr
    assert f"({', '.join(biases)})" in out.stderr, out.stderr
    assert "fix: this checkpoint was written by a different model config" in out.stderr
    assert not (run_dir / "export").exists()
