"""Non-finite losses and gradients: stop (the default) or skip by policy, fp16's overflow limit, and never a
non-finite checkpoint. One process, a tiny model; NaN is injected into one gradient by the trainer's hook."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tessera.cli import main
from tessera.config import from_dict
from tessera.errors import EXIT_DIVERGED, NonFiniteError
from tessera.train import checkpoint as ckpt
from tessera.train.trainer import TrainingRun, train
from tests.distributed.conftest import trainer_config

MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16}


def _raw(token_file: Path, run_dir: Path, **train: object) -> dict:
    raw = trainer_config(token_file, run_dir, MODEL, {}, **{"steps": 8, **train})
    raw["checkpoint"] = {"every": 1, "keep": 2, "resume": True}
    return raw


def _poison(steps: set[int], name: str = "blocks.0.mlp.fc.weight"):
    """A hook that puts a NaN into one gradient at the given steps."""

    def hook(step: int, model: torch.nn.Module) -> None:
        if step in steps:
            dict(model.named_parameters())[name].grad.view(-1)[0] = math.nan

    return hook


def _param_name(token_file: Path, tmp_path: Path) -> str:
    run = TrainingRun(from_dict(_raw(token_file, tmp_path / "probe")), 0, 1)
    return max(run.model.named_parameters(), key=lambda kv: kv[1].numel() if kv[1].dim() == 2 else 0)[0]


def test_stop_names_step_loss_and_parameter_and_saves_nothing(token_file: Path, tmp_path: Path) -> None:
    name = _param_name(token_file, tmp_path)
    raw = _raw(token_file, tmp_path / "run")
    with pytest.raises(NonFiniteError, match=rf"step 5: loss [\d.]+, gradient norm nan; .*{name} \(gradient"):
        train(from_dict(raw), _poison({5}, name))
    newest = ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert newest is not None and newest.name == "step_00000005"  # the state before the bad step
    run = TrainingRun(from_dict(raw), 0, 1)
    assert run.resume() == 5
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_skip_policy_skips_then_stops_after_max_skips(token_file: Path, tmp_path: Path) -> None:
    name = _param_name(token_file, tmp_path)
    raw = _raw(token_file, tmp_path / "skip", nonfinite="skip", max_skips=2)
    losses = train(from_dict(raw), _poison({3, 4}, name)).losses
    assert sorted(losses) == list(range(8)) and math.isfinite(losses[7])
    records = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["nonfinite_skipped"] == 2
    raw = _raw(token_file, tmp_path / "skip3", nonfinite="skip", max_skips=2)
    with pytest.raises(NonFiniteError, match=r"step 4: .* after 2 skipped step"):
        train(from_dict(raw), _poison({2, 3, 4}, name))


def test_skipped_step_leaves_weights_unchanged(token_file: Path, tmp_path: Path) -> None:
    name = _param_name(token_file, tmp_path)
    raw = _raw(token_file, tmp_path / "w", nonfinite="skip", steps=3)
    raw["checkpoint"] = {"every": 0, "resume": False}
    seen: list[dict[str, torch.Tensor]] = []
    poison = _poison({1}, name)

    def hook(step: int, model: torch.nn.Module) -> None:
        seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
        poison(step, model)

    train(from_dict(raw), hook)
    assert all(torch.equal(seen[1][n], seen[2][n]) for n in seen[1])  # step 1 applied nothing
    assert not all(torch.equal(seen[0][n], seen[1][n]) for n in seen[0])  # step 0 did


def test_fp16_stops_after_consecutive_overflows(token_file: Path, tmp_path: Path) -> None:
    # a loss scale of 1e300 overflows every step and halves too slowly to recover within the limit
    raw = _raw(token_file, tmp_path / "fp16", dtype="fp16", fp16_init_scale=1e300, fp16_max_overflows=4)
    with pytest.raises(NonFiniteError, match="overflowed in 4 consecutive steps"):
        train(from_dict(raw))
    newest = ckpt.latest_checkpoint(tmp_path / "fp16" / "checkpoints")
    assert newest is not None  # the skipped steps saved the (unchanged, finite) initial weights


def test_non_finite_weights_are_never_checkpointed(token_file: Path, tmp_path: Path) -> None:
    run = TrainingRun(from_dict(_raw(token_file, tmp_path / "save")), 0, 1)
    next(run.model.parameters()).data.view(-1)[0] = math.inf
    with pytest.raises(NonFiniteError, match="refusing to checkpoint non-finite weights"):
        run.save(1)
    assert ckpt.latest_checkpoint(run.ckpt_dir) is None


def test_cli_exit_status_for_divergence(
    token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[data]\npath = "{token_file}"\n')
    argv = ["train", str(config), f'--log.run_dir="{tmp_path / "cli"}"', "--log.progress=false"]
    argv += ["--log.tensorboard=false", "--train.steps=6", "--train.global_batch=2", "--train.lr=1e30"]
    argv += ["--model.seq_len=16", "--model.d_model=32", "--model.n_heads=2", "--train.grad_clip=0"]
    assert main(argv) == EXIT_DIVERGED
    assert "error: step" in capsys.readouterr().err
