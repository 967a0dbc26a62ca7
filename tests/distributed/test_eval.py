"""The validation loss on every kind of layout equals the single-device one, and evaluating changes nothing.

Each run trains 2 steps and evaluates after each (train.eval_every = 1) on 2 fixed global batches of a separate
validation file. A layout's step 1 starts from the reference's state after step 0 (`record_layouts`' ``follow``,
as `tessera compare` runs: docs/parity.md), so the validation loss after step k is judged on step k's own
arithmetic, with the tolerance of training losses (docs/parity.md's fp32 tolerances, which also judge every
training loss, gradient and updated parameter). Turning evaluation on must leave training bit-identical: the
forward-only pass touches no parameter, gradient, optimizer state or RNG (its runs with evaluation on and off give
the same losses and, after every update, the same parameters and AdamW moments bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.config import from_dict
from tessera.parity import FP32
from tessera.train.data import prepare
from tessera.train.trainer import TrainingRun, train
from tests.distributed.conftest import (
    Recorded,
    assert_layout_matches_reference,
    follow_file,
    record_layouts,
    synthetic_corpus,
    trainer_config,
)
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


def _validation_loss(run: TrainingRun, step: int) -> float | None:
    """With evaluation on, the validation loss right after step ``step``'s update, as `train` evaluates it
    (`record_layouts`' ``observe``)."""
    return run.evaluate() if run.cfg.train.eval_every else None


def _record_all(rank: int, world: int, configs: list[dict], follow: Path) -> list[Recorded]:
    """Every config recorded following the reference, its states kept, with its validation losses."""
    return record_layouts(rank, world, configs, follow, keep_states=True, observe=_validation_loss)


@pytest.fixture(scope="module")
def reference(token_file: Path, valid_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """The single-device run with evaluation, its states to follow, recorded once for the module (each world size's
    test follows the same one); `train` evaluates as it does, with evaluation on and off bit for bit alike."""
    root = tmp_path_factory.mktemp("eval_refs")
    ref = _config(token_file, valid_file, root / "ref", {"accumulation": "depth_first"})
    recorded = record_layouts(0, 1, [ref], keep_states=True, observe=_validation_loss)[0]
    trained = train(
        from_dict(_config(token_file, valid_file, root / "trained", {"accumulation": "depth_first"}))
    )
    off = _config(token_file, valid_file, root / "trained_off", {"accumulation": "depth_first"}, False)
    trained_off = train(from_dict(off))
    assert trained.val_losses == dict(enumerate(recorded.seen)) and trained_off.val_losses == {}
    assert trained.losses == trained_off.losses == dict(enumerate(recorded.record.losses))
    return recorded


@pytest.mark.parametrize("world", sorted({w for w, _ in LAYOUTS.values()}))
def test_eval_loss_matches_single_device(
    token_file: Path, valid_file: Path, tmp_path: Path, world: int, reference: Recorded
) -> None:
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    configs = [_config(token_file, valid_file, tmp_path / n, LAYOUTS[n][1]) for n in names]
    off = [n for n in names if n in BIT_IDENTICAL]
    configs += [_config(token_file, valid_file, tmp_path / f"{n}_off", LAYOUTS[n][1], False) for n in off]
    follow = follow_file(tmp_path / "follow.pt", [reference.record] * len(configs))
    results = run_distributed(_record_all, world, configs, follow, timeout=600)
    for i, name in enumerate(names):
        got = results[0][i]
        assert_layout_matches_reference(
            got.record, reference.record, FP32, from_dict(configs[i]).model, world, STEPS
        )
        for step in range(STEPS):
            torch.testing.assert_close(
                got.seen[step], reference.seen[step], rtol=LOSS_RTOL, atol=LOSS_ATOL, msg=name
            )
        assert all(r[i].seen == got.seen for r in results), (
            f"{name}: every rank reports the same validation loss"
        )
    for j, name in enumerate(off):
        on, without = results[0][names.index(name)].record, results[0][len(names) + j]
        assert without.seen == [None] * STEPS and without.record.losses == on.losses, name
        for state, state_off in zip(on.states, without.record.states, strict=True):
            assert state.keys() == state_off.keys(), name
            assert all(torch.equal(t, state_off[k]) for k, t in state.items()), name
