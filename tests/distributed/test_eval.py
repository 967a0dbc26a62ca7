"""The validation loss on every kind of layout equals the single-device one, and evaluating changes nothing.

Each run trains 2 steps and evaluates after each (train.eval_every = 1) on 2 fixed global batches of a separate
validation file. The validation loss after step k depends on every earlier update, so it is compared with the
tolerance the trainer tests use for training losses (see `trainer_config`). Turning evaluation on must leave
training bit-identical: the forward-only pass touches no parameter, gradient, optimizer state or RNG.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config import from_dict
from tessera.train.data import prepare
from tessera.train.trainer import train
from tests.distributed.conftest import synthetic_corpus, trainer_config
from tests.harness import run_distributed

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
STEPS = 2
MODEL = {"size": "llama-tiny", "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "d_model": 32, "ffn_hidden": 64}

LAYOUTS = {  # name: (world size, parallel section)
    "dp2": (2, {"data": 2}),
    "dp2_z3": (2, {"data": 2, "zero": 3}),
    # evaluated right after each update, while the parameters' all-gathers are still in flight
    "dp2_z1_overlap_param_gather": (2, {"data": 2, "zero": 1, "overlap_param_gather": True}),
    "pp2_bf": (2, {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2}),
    "tp2x2": (4, {"tensor": "2x2"}),
}
BIT_IDENTICAL = ("dp2_z3", "pp2_bf")  # also trained with evaluation off


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("valid")
    (root / "valid.txt").write_text(synthetic_corpus(seed=99, sentences=300))
    prepare([root / "valid.txt"], root / "valid.bin")
    return root / "valid.bin"


def _config(token_file: Path, valid: Path, run_dir: Path, parallel: dict, evaluate: bool = True) -> dict:
    raw = trainer_config(token_file, run_dir, MODEL, parallel, steps=STEPS, grad_clip=0.5)
    raw["data"]["valid_path"] = str(valid)
    raw["train"].update(eval_every=1 if evaluate else 0, eval_batches=2)
    return raw


def _train_all(rank: int, world: int, configs: list[dict]) -> list[tuple[dict[int, float], dict[int, float]]]:
    """(training losses, validation losses) of every config in turn, in this process group."""
    out = []
    for raw in configs:
        result = train(from_dict(raw))
        out.append((result.losses, result.val_losses))
    return out


Trained = list[tuple[dict[int, float], dict[int, float]]]


@pytest.fixture(scope="module")
def references(token_file: Path, valid_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """The single-device run with evaluation on, then off, trained once for the module (each world size's test
    trained the same two)."""
    root = tmp_path_factory.mktemp("eval_refs")
    ref_on = _config(token_file, valid_file, root / "ref", {"accumulation": "depth_first"})
    ref_off = _config(token_file, valid_file, root / "ref_off", {"accumulation": "depth_first"}, False)
    return _train_all(0, 1, [ref_on, ref_off])


@pytest.mark.parametrize("world", sorted({w for w, _ in LAYOUTS.values()}))
def test_eval_loss_matches_single_device(
    token_file: Path, valid_file: Path, tmp_path: Path, world: int, references: Trained
) -> None:
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    (ref_losses, ref_val), (ref_losses_off, ref_val_off) = references
    assert sorted(ref_val) == list(range(STEPS)) and ref_val_off == {}
    assert ref_losses == ref_losses_off  # bit-identical with evaluation on and off
    configs = [_config(token_file, valid_file, tmp_path / n, LAYOUTS[n][1]) for n in names]
    off = [n for n in names if n in BIT_IDENTICAL]
    configs += [_config(token_file, valid_file, tmp_path / f"{n}_off", LAYOUTS[n][1], False) for n in off]
    results = run_distributed(_train_all, world, configs, timeout=600)
    for i, name in enumerate(names):
        losses, val = results[0][i]
        assert sorted(val) == list(range(STEPS)), name
        for step in range(STEPS):
            torch.testing.assert_close(val[step], ref_val[step], rtol=LOSS_RTOL, atol=LOSS_ATOL, msg=name)
            torch.testing.assert_close(
                losses[step], ref_losses[step], rtol=LOSS_RTOL, atol=LOSS_ATOL, msg=name
            )
        assert all(r[i][1] == val for r in results), f"{name}: every rank reports the same validation loss"
    for j, name in enumerate(off):
        losses_off, val_off = results[0][len(names) + j]
        assert val_off == {} and losses_off == results[0][names.index(name)][0], name
