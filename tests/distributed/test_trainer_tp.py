"""The trainer with tensor parallelism (1D, 2D, and with data parallelism) against the single-device reference.

The layer-by-layer checks live in test_tensor_1d.py and test_tensor_2d.py; this file checks the whole training
step as a user runs it: data slicing, gradient synchronisation, clipping over shards (the global norm it clips
by is compared every step), recomputation, ZeRO on top of tensor parallelism and the optimizer update.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.train.metrics import read_metrics
from tests.distributed.conftest import train_losses, train_recording, trainer_config
from tests.harness import run_distributed

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
STEPS = 2

LAYOUTS = {  # name: (world size, parallel section)
    "tp1d_2": (2, {"tensor": 2}),
    "dp2_tp1d_2_sp": (4, {"tensor": 2, "data": 2, "sequence_parallel": True}),
    "tp2x2": (4, {"tensor": "2x2"}),
    # recomputation replays the blocks' collectives in backward: every rank must replay the same ones
    "tp1d_2_sp_full_ckpt": (2, {"tensor": 2, "sequence_parallel": True, "checkpointing": "full"}),
    # tp_comm_overlap: the all-gathers / reduce-scatters as rings under the GEMMs, replayed by recomputation too
    "tp1d_2_sp_overlap_full_ckpt": (
        2,
        {"tensor": 2, "sequence_parallel": True, "tp_comm_overlap": True, "checkpointing": "full"},
    ),
    "tp2x2_full_ckpt": (4, {"tensor": "2x2", "checkpointing": "full"}),
    "tp2x2_selective_ckpt": (4, {"tensor": "2x2", "checkpointing": "selective"}),
}


def _config(token_file: Path, run_dir: Path, parallel: dict) -> dict:
    model = {"size": "llama-tiny", "n_heads": 4, "n_kv_heads": 2, "d_model": 32, "ffn_hidden": 64}
    # a low clip threshold makes clipping fire, so the sharded global norm is exercised
    return trainer_config(token_file, run_dir, model, parallel, steps=STEPS, grad_clip=0.5)


Reference = tuple[dict[int, float], list[dict[str, torch.Tensor]], Path]


@pytest.fixture(scope="module")
def reference(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The single-device run every layout is compared with, trained once for the module (each test trained the
    same one): its losses, its full gradients per step and its run folder (metrics.jsonl's clipping norms)."""
    run_dir = tmp_path_factory.mktemp("tp_reference") / "ref"
    losses, grads = train_recording(0, 1, _config(token_file, run_dir, {"accumulation": "depth_first"}))
    return losses, grads, run_dir


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_parallel_training_matches_reference(
    token_file: Path, tmp_path: Path, name: str, reference: Reference
) -> None:
    world, parallel = LAYOUTS[name]
    ref_losses, ref_grads, ref_dir = reference
    losses, grads = run_distributed(
        train_recording, world, _config(token_file, tmp_path / name, parallel), timeout=240
    )[0]
    for step in range(STEPS):
        torch.testing.assert_close(losses[step], ref_losses[step], rtol=LOSS_RTOL, atol=LOSS_ATOL)
        assert grads[step].keys() == ref_grads[step].keys()
        for n, g in grads[step].items():
            torch.testing.assert_close(
                g,
                ref_grads[step][n],
                rtol=GRAD_RTOL,
                atol=GRAD_ATOL,
                msg=lambda m, n=n, step=step: f"{n}, step {step}: {m}",
            )
    _assert_same_grad_norms(tmp_path / name, ref_dir)


def _assert_same_grad_norms(run_dir: Path, ref_dir: Path) -> None:
    """The global gradient norm the trainer clipped by (metrics.jsonl), every step: shards counted once each,
    replicated tensors once in all. Adam is nearly invariant to a common gradient scale, so a wrong clipping
    norm hardly moves the losses; it is checked directly."""
    got = {m["step"]: m["grad_norm"] for m in read_metrics(run_dir)}
    ref = {m["step"]: m["grad_norm"] for m in read_metrics(ref_dir)}
    assert sorted(got) == sorted(ref) == list(range(STEPS))
    for step in ref:
        torch.testing.assert_close(
            got[step], ref[step], rtol=GRAD_RTOL, atol=0.0, msg=f"grad norm, step {step}"
        )


ZERO_LAYOUTS = {  # ZeRO-2/3 keep only reduced gradient shards: compared by loss and the clipped global norm
    "dp2_tp1d_2_zero1": (4, {"tensor": 2, "data": 2, "zero": 1}),
    "dp2_tp1d_2_sp_zero3": (4, {"tensor": 2, "data": 2, "zero": 3, "sequence_parallel": True}),
}


@pytest.mark.parametrize("name", ZERO_LAYOUTS)
def test_tensor_parallel_with_zero_matches_reference(
    token_file: Path, tmp_path: Path, name: str, reference: Reference
) -> None:
    world, parallel = ZERO_LAYOUTS[name]
    ref_losses, _, ref_dir = reference
    losses = run_distributed(
        train_losses, world, _config(token_file, tmp_path / name, parallel), timeout=240
    )[0]
    for step in range(STEPS):
        torch.testing.assert_close(losses[step], ref_losses[step], rtol=LOSS_RTOL, atol=LOSS_ATOL)
    _assert_same_grad_norms(tmp_path / name, ref_dir)
