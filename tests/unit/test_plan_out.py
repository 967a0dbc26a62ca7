"""`tessera plan --out` writes a complete run: data, steps, learning-rate schedule, evaluation, checkpointing and
the run directory (tessera/planner/run_settings.py), each derivation against hand-computed numbers, and the
precedence flag > the model's config file > derived."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.config import load_config
from tessera.planner.hardware import DEFAULT_GPU_MTBF_HOURS, DEFAULT_STORAGE_WRITE_BANDWIDTH, save_hardware
from tessera.planner.report import config_toml
from tessera.planner.run_settings import (
    checkpoint_bytes,
    checkpoint_every,
    eval_every,
    job_mtbf_seconds,
    peak_lr,
    steps_for_tokens,
    warmup_steps,
    young_daly_interval,
)
from tessera.planner.search import search
from tests.planner_hardware import TWO_CPUS

TINY_PARAMS = 34_688
"""gpt2-tiny's parameters by hand: per block qkv 32·96 + 96, proj 32·32 + 32, fc 32·128 + 128, fc2 128·32 + 32,
two LayerNorms 2·64 (12,704; two blocks 25,408) + token embedding 256·32 (tied head) + positions 32·32 + final
LayerNorm 64 (9,280)."""


# --- the derivations, by hand -------------------------------------------------------------------------------


def test_steps_for_tokens_rounds_up_to_whole_steps() -> None:
    assert steps_for_tokens(5 * 8 * 1024, 8, 1024) == 5  # exactly five steps of 8 × 1024 tokens
    assert steps_for_tokens(1e6, 8, 1024) == 123  # 1e6 / 8192 = 122.07 -> 123
    assert steps_for_tokens(1, 8, 1024) == 1


def test_peak_lr_is_gpt3s_at_its_rows_log_interpolated_between_and_clamped_outside() -> None:
    rows = {125e6: 6.0e-4, 350e6: 3.0e-4, 760e6: 2.5e-4, 1.3e9: 2.0e-4, 2.7e9: 1.6e-4, 6.7e9: 1.2e-4}
    rows |= {13e9: 1.0e-4, 175e9: 0.6e-4}
    for params, lr in rows.items():
        assert peak_lr(params) == pytest.approx(lr, rel=1e-12), params
    # halfway in log(params) between two rows: the mean of their rates
    assert peak_lr(math.sqrt(125e6 * 350e6)) == pytest.approx(4.5e-4, rel=1e-12)
    assert peak_lr(math.sqrt(6.7e9 * 13e9)) == pytest.approx(1.1e-4, rel=1e-12)
    # a quarter of the way from 13B to 175B in log: 1e-4 - 0.25 * 0.4e-4
    assert peak_lr(13e9 * (175 / 13) ** 0.25) == pytest.approx(0.9e-4, rel=1e-12)
    assert peak_lr(1e6) == 6.0e-4 and peak_lr(1e12) == 0.6e-4


def test_warmup_is_375m_tokens_capped_at_a_tenth_of_the_run() -> None:
    assert warmup_steps(2**20, 100_000) == 358  # 375e6 / 1,048,576 = 357.6 -> 358
    assert warmup_steps(2**20, 1000) == 100  # capped: 10 % of 1000 steps
    assert warmup_steps(2**20, 9) == 0


def test_young_daly_interval_and_its_steps() -> None:
    assert young_daly_interval(10.0, 20_000.0) == pytest.approx(632.4555, rel=1e-6)  # sqrt(2 · 10 · 20000)
    assert checkpoint_every(632.4555, 2.0, 10_000) == 316  # 316.2 steps of 2 s
    assert checkpoint_every(0.1, 2.0, 100) == 1  # at least every step
    assert checkpoint_every(1e6, 1.0, 50) == 50  # at most the run


def test_job_mtbf_from_llama3s_interruptions() -> None:
    """419 unexpected interruptions in 54 days on 16,384 H100s: one every 3.09 h for the whole job."""
    assert pytest.approx(50_677.0, rel=1e-4) == DEFAULT_GPU_MTBF_HOURS
    assert job_mtbf_seconds(DEFAULT_GPU_MTBF_HOURS, 16_384) == pytest.approx(54 * 86400 / 419, rel=1e-12)
    assert pytest.approx(122.07e6, rel=1e-4) == DEFAULT_STORAGE_WRITE_BANDWIDTH  # 2 TB/s over 16,384 GPUs


def test_eval_every_is_a_hundred_evaluations_unless_they_cost_more_than_2_percent() -> None:
    assert eval_every(100_000, 4) == 1000  # 100 evaluations
    assert eval_every(1000, 4) == 67  # each costs 4/3 steps: at most 2 % -> every ceil(66.7) steps
    assert eval_every(4, 4) == 4  # at most the run (the trainer evaluates at the end too)


@pytest.fixture(scope="module")
def tiny():
    """gpt2-tiny on two CPU ranks at 4 sequences of 32 tokens."""
    result = search("gpt2-tiny", 2, TWO_CPUS, 4)
    assert result.shape.n_params() == TINY_PARAMS
    return result


def test_checkpoint_bytes_are_each_ranks_share_of_weights_and_adam_moments(tiny) -> None:
    """12 bytes per parameter (fp32 weight, two fp32 moments) written once, split over the two data ranks: by
    ZeRO's shards, or by DCP's deduplication of the replicas under ZeRO-0."""
    for zero in (0, 1, 2, 3):
        cand = next(c for c in tiny.candidates if c.plan.dp == 2 and c.plan.zero_stage == zero)
        assert checkpoint_bytes(cand) == pytest.approx(12 * TINY_PARAMS / 2, rel=1e-12), zero


def test_checkpoint_interval_follows_the_storage_bandwidth(tiny, tmp_path) -> None:
    """sqrt(2·C·M): 100 times the bandwidth is a tenth of the write time C and of the interval."""
    cand = tiny.best
    slow = dataclasses.replace(TWO_CPUS, storage_write_bandwidth=1e6, gpu_mtbf_hours=1e-3)
    fast = dataclasses.replace(slow, storage_write_bandwidth=1e8)
    every = {}
    for name, hw in (("slow", slow), ("fast", fast)):
        path = tmp_path / f"{name}.toml"
        path.write_text(config_toml(dataclasses.replace(tiny, hardware=hw), cand))
        every[name] = load_config(path).checkpoint.every
    # by hand: C = 208,128 B / 1 MB/s = 0.2081 s (fast: 2.081 ms), M = 3.6 s / 2 GPUs = 1.8 s
    assert every["slow"] == round(math.sqrt(2 * 0.208128 * 1.8) / cand.step_time)  # 0.8656 s in steps
    assert every["fast"] == round(math.sqrt(2 * 0.00208128 * 1.8) / cand.step_time)  # 86.56 ms in steps
    assert every["fast"] < every["slow"] < 5420


def test_storage_gbps_replaces_the_hardware_files_bandwidth(tmp_path) -> None:
    """--storage-gbps at 100 × the default bandwidth: a tenth of the interval (gpt2-124m on 2 H100s, a run long
    enough that neither is cut to it)."""
    every = []
    for flags in ([], ["--storage-gbps", str(100 * DEFAULT_STORAGE_WRITE_BANDWIDTH / 1e9)]):
        out = tmp_path / f"p{len(flags)}.toml"
        args = ["plan", "--model", "gpt2-124m", "--gpus", "2", "--hardware", "h100", "--global-batch", "16"]
        assert main([*args, "--top", "1", "--steps", "100000000", "--out", str(out), *flags]) == 0
        every.append(load_config(out).checkpoint.every)
    assert every[0] / every[1] == pytest.approx(10, rel=1e-4)  # sqrt(100); whole steps of ~1e5 round by 1e-5


# --- what the file holds, and where from --------------------------------------------------------------------


def _hardware(tmp_path: Path) -> str:
    path = tmp_path / "two-cpus.toml"
    save_hardware(TWO_CPUS, path)
    return str(path)


def _plan(tmp_path: Path, model: str, *flags: str, batch: str = "4") -> Path:
    out = tmp_path / "plan.toml"
    args = ["plan", "--model", model, "--gpus", "2", "--hardware", _hardware(tmp_path), "--top", "1"]
    if batch:
        args += ["--global-batch", batch]
    assert main([*args, "--out", str(out), *flags]) == 0
    return out


def test_a_model_name_gets_compute_optimal_steps_and_gpt3s_schedule(tmp_path, capsys) -> None:
    cfg = load_config(_plan(tmp_path, "gpt2-tiny"))
    tr = cfg.train
    assert tr.steps == 5420  # 20 · 34,688 tokens / 128 per step, exactly
    assert (tr.lr, tr.min_lr) == (6e-4, 6e-5)  # below GPT-3's smallest model: its 125M row
    assert tr.warmup_steps == 542  # 375M tokens = 2.9M steps, capped at 10 % of 5420
    assert tr.eval_every == 0  # no validation data
    assert (
        cfg.log.run_dir == "runs/gpt2-tiny-2gpu" and cfg.checkpoint.dir == "runs/gpt2-tiny-2gpu/checkpoints"
    )
    assert cfg.checkpoint.keep == 2 and 1 <= cfg.checkpoint.every <= 5420
    assert cfg.data.path is None and "embedded demo corpus" in capsys.readouterr().out
    text = (tmp_path / "plan.toml").read_text()
    for source in ("arXiv 2203.15556", "arXiv 2005.14165", "Young 1974; Daly 2006", "gpu_mtbf_hours"):
        assert source in text


def test_every_written_key_says_where_it_comes_from(tmp_path) -> None:
    """Each key sits under a comment (keys from one source share it): the line above a key is a comment or a key
    of the same source, never its section's header."""
    lines = _plan(tmp_path, "gpt2-tiny").read_text().splitlines()
    keys = [i for i, line in enumerate(lines) if " = " in line and not line.startswith("#")]
    assert len(keys) > 20
    for i in keys:
        assert lines[i - 1].startswith("#") or i - 1 in keys, lines[i]


def test_critical_batch_steps_are_the_plans_rounded_up(tmp_path, capsys) -> None:
    out = _plan(tmp_path, "gpt2-tiny", "--json", batch="")
    steps = json.loads(capsys.readouterr().out)["layouts"][0]["steps"]
    assert steps and steps != int(steps)  # a fraction: rounding up is visible
    assert load_config(out).train.steps == math.ceil(steps)


MODEL_FILE = """
[model]
size = "gpt2-tiny"
n_heads = 2

[parallel]
tensor = 2

[train]
steps = 77
global_batch = 999
lr = 1e-3
weight_decay = 0.05

[data]
path = "{data}"
valid_fraction = 0.1

[checkpoint]
every = 5
keep = 3

[log]
run_dir = "runs/mine"
every = 10
"""


def _model_file(tmp_path: Path) -> Path:
    (tmp_path / "a.tokens").write_bytes(b"")
    path = tmp_path / "mine.toml"
    path.write_text(MODEL_FILE.format(data=tmp_path / "a.tokens"))
    return path


def test_a_model_file_keeps_its_own_settings(tmp_path) -> None:
    cfg = load_config(_plan(tmp_path, str(_model_file(tmp_path))))
    assert cfg.model.n_heads == 2  # its [model] table, n_heads over the size's 4
    assert (
        cfg.train.global_batch == 4
        and cfg.parallel.data * cfg.parallel.tensor_ranks * cfg.parallel.pipeline == 2
    )
    assert (cfg.train.steps, cfg.train.lr, cfg.train.weight_decay) == (77, 1e-3, 0.05)
    assert cfg.train.min_lr == 1e-4  # derived from the file's lr
    assert cfg.train.warmup_steps == 7  # 10 % of its 77 steps
    assert cfg.data.path == str(tmp_path / "a.tokens") and cfg.data.valid_fraction == 0.1
    assert cfg.train.eval_every == 67  # it holds out validation data: 4 batches at most 2 % of the time
    assert (cfg.checkpoint.every, cfg.checkpoint.keep) == (5, 3)
    assert (cfg.log.run_dir, cfg.log.every) == ("runs/mine", 10)
    assert cfg.checkpoint.dir == "runs/mine/checkpoints"


def test_flags_override_the_model_file(tmp_path) -> None:
    valid = tmp_path / "v.tokens"
    flags = [
        "--tokens",
        "1000",
        "--run-dir",
        str(tmp_path / "run"),
        "--data",
        "b.tokens",
        "--valid",
        str(valid),
    ]
    cfg = load_config(_plan(tmp_path, str(_model_file(tmp_path)), *flags))
    assert cfg.train.steps == 8  # 1000 tokens / 128 per step = 7.8 -> 8, over the file's 77
    assert cfg.log.run_dir == str(tmp_path / "run") and cfg.checkpoint.dir == str(
        tmp_path / "run/checkpoints"
    )
    assert cfg.data.path == "b.tokens" and cfg.data.valid_path == str(valid)
    assert cfg.data.valid_fraction == 0.0  # --valid replaces the file's held-out fraction
    assert cfg.train.eval_every == 8  # at most the run
    assert cfg.train.lr == 1e-3 and cfg.checkpoint.every == 5  # what no flag sets stays the file's
    cfg = load_config(_plan(tmp_path, str(_model_file(tmp_path)), "--steps", "12"))
    assert cfg.train.steps == 12


def test_data_that_is_not_here_is_a_note_not_an_error(tmp_path, capsys) -> None:
    """The token files may exist only where the run trains: the file is written, and the problem said."""
    out = _plan(tmp_path, "gpt2-tiny", "--data", "/nowhere/tokens.bin")
    assert load_config(out).data.path == "/nowhere/tokens.bin"
    assert "note: here, [data.path]" in capsys.readouterr().out


def test_logging_packages_not_here_are_a_note_not_an_error(tmp_path, capsys, monkeypatch) -> None:
    """The file enables TensorBoard (the default), whose package the planning machine may lack: the file is
    written and the problem said, as for data; `tessera memory` on it prices it."""
    from tessera.config import checks

    monkeypatch.setattr(checks, "_importable", lambda package: False)
    out = _plan(tmp_path, "gpt2-tiny")
    assert load_config(out).log.tensorboard
    assert "note: here, [log.tensorboard]" in capsys.readouterr().out
    assert main(["memory", str(out), "--world-size", "2"]) == 0


def test_run_flags_without_out_are_refused(capsys) -> None:
    assert main(["plan", "--model", "gpt2-tiny", "--gpus", "2", "--data", "x.tokens", "--steps", "3"]) == 2
    assert "--data, --steps set what `--out FILE` writes: add --out plan.toml" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "must be at least 1"),
        (["--steps", "3", "--tokens", "1e9"], "not allowed with argument"),
        (["--tokens", "lots"], "is not a number"),
        (["--storage-gbps", "-1"], "positive"),
    ],
)
def test_bad_flags_are_refused_by_name(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "gpt2-tiny", "--gpus", "2", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
