"""`tessera export`: a checkpoint of any layout (tensor, pipeline, ZeRO) gives the plain model's weights, and
those equal the weights of the same training run on one device.

Each layout trains STEPS steps and checkpoints at the end; every rank then calls the export (rank 0 alone reads
the layout-free checkpoint); the reference trains the plain model on one process with the same data, seed and
optimizer. Parallel runs sum the same gradients in another order, so the weights agree to rounding amplified by
Adam (stated tolerance below), not bit for bit; a wrong merge (a missing stage, a shard in the wrong place,
padding left in) is off by the weights' own magnitude.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config import from_dict
from tessera.errors import CheckpointError
from tessera.model.build import build_model
from tessera.train import checkpoint as ckpt
from tessera.train.export import export_weights
from tessera.train.generate import newest_weights
from tessera.train.trainer import train
from tests.distributed.conftest import trainer_config
from tests.harness import run_distributed

STEPS = 2
LR = 1e-3
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


@pytest.mark.parametrize("name", LAYOUTS)
def test_export_equals_single_device_weights(token_file: Path, tmp_path: Path, name: str) -> None:
    world, size, parallel = LAYOUTS[name]
    ref_raw = _config(token_file, tmp_path / "ref", size, {})
    train(from_dict(ref_raw))
    expected = _weights(ref_raw, ckpt.latest_checkpoint(tmp_path / "ref" / "checkpoints"))
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
