"""Config loading, overrides and validation, for many world sizes, without torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.config import Config, apply_overrides, as_overrides, load_config, parse_tensor
from tessera.errors import ConfigError

BROKEN = """
[model]
size = "llama-tiny"
n_heads = 6          # 32 % 6 != 0
n_kv_heads = 4       # 6 % 4 != 0
[parallel]
tensor = 4
pipeline = 4         # 2 layers < 4 stages
[train]
global_batch = 10    # not a multiple of micro_batch 4 × dp
micro_batch = 4
"""


def test_config_imports_without_torch() -> None:
    code = "import sys, tessera.config, tessera.layout; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_single_process_train_rejects_a_wrong_config_before_torch_and_the_run_directory(
    tmp_path: Path,
) -> None:
    """`tessera train` in one process names the problem as `validate` does, without importing torch (seconds) or
    creating the run directory first (its lock would be left for the next run to meet)."""
    run_dir = tmp_path / "run"
    code = (
        "import sys\n"
        "from tessera.cli import main\n"
        f"code = main(['train', '--model.n_layers=2', '--parallel.pipeline=4', '--log.run_dir={run_dir}'])\n"
        "assert 'torch' not in sys.modules, 'train imported torch before rejecting the config'\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 2, out.stderr
    assert "pipeline" in out.stderr and "configuration problem" in out.stderr, out.stderr
    assert not run_dir.exists()


def test_nproc_launcher_imports_neither_torch_nor_numpy_before_starting_the_ranks(tmp_path: Path) -> None:
    """`tessera train --nproc N` validates the config and spawns the ranks; every module it imports first delays
    all of them. With the default corpus no token file is read, so numpy (0.1 s) is not needed either."""
    demo = Path(__file__).parents[2] / "configs" / "demo.toml"
    code = (
        "import sys\n"
        "import tessera.train.launch as launch\n"
        "def fake_launch(nproc, argv, **kw):\n"
        "    heavy = [m for m in ('torch', 'numpy') if m in sys.modules]\n"
        "    assert not heavy, f'the launcher imported {heavy} before starting the ranks'\n"
        "    return 0\n"
        "launch.launch_local = fake_launch\n"
        "from tessera.cli import main\n"
        f"sys.exit(main(['train', '{demo}', '--nproc', '2', '--log.run_dir={tmp_path / 'run'}']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr


def test_toml_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[model]\nsize = "gpt2-124m"\n[train]\nlr = 1e-3\n')
    cfg = load_config(f, ["train.lr=3e-4", "--parallel.tensor=2x2", "model.n_layers=6"])
    assert cfg.train.lr == 3e-4
    assert cfg.parallel.tensor_shape() == (1, 2)
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.vocab_size) == (6, 768, 50257)


@pytest.mark.parametrize(
    ("value", "expected"), [(1, (1, 1)), (4, (4, 1)), ("2x2", (1, 2)), ("3×3", (1, 3)), ("8", (8, 1))]
)
def test_parse_tensor(value: int | str, expected: tuple[int, int]) -> None:
    assert parse_tensor(value) == expected


@pytest.mark.parametrize("value", ["2x3", "abc", 0, True])
def test_parse_tensor_rejects(value: object) -> None:
    with pytest.raises(ConfigError):
        parse_tensor(value)  # type: ignore[arg-type]


def test_every_violation_listed_at_once(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(BROKEN)
    rules = {v.rule for v in load_config(f).check(world_size=6)}
    assert {"model.heads", "model.kv_heads", "world_size", "tensor.divisibility", "pipeline.layers"} <= rules


def test_batch_rule_suggests_multiples() -> None:
    cfg = load_config(None, ["train.global_batch=10", "train.micro_batch=2", "parallel.data=4"])
    (v,) = [v for v in cfg.check(world_size=4) if v.rule == "batch"]
    assert "8 or 16" in v.fix


@pytest.mark.parametrize("world", range(1, 17))
def test_default_config_valid_for_any_world_size(world: int) -> None:
    cfg = Config()
    cfg.train.global_batch = 16 * 9 * 5 * 7 * 11 * 13
    assert cfg.check(world) == []


@pytest.mark.parametrize(
    ("world", "tensor", "ok"), [(8, 2, True), (8, 3, False), (9, "3x3", True), (8, "2x2", True)]
)
def test_world_size_rule(world: int, tensor: int | str, ok: bool) -> None:
    cfg = load_config(
        None,
        [
            "model.n_heads=6",
            "model.d_model=72",
            "model.n_layers=2",
            "train.global_batch=144",
            "train.micro_batch=6",
        ],
    )
    cfg.parallel.tensor = tensor
    cfg.parallel.data = None if ok else 2
    assert (not [v for v in cfg.check(world) if v.rule == "world_size"]) == ok


def test_unknown_keys_and_types_are_reported(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[model]\nn_layer = 3\nd_model = "big"\n[trian]\nlr = 1\n')
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "model.n_layer; did you mean n_layers" in msg
    assert "model.d_model = 'big' should be of type int" in msg
    assert "unknown section [trian]" in msg


def test_validate_cli_lists_all_and_exits_nonzero(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(BROKEN)
    assert main(["validate", str(f), "--world-size", "6"]) == 1
    out = capsys.readouterr().out
    assert "Traceback" not in out
    assert out.count("fix:") >= 5


def test_validate_cli_ok(capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", "configs/demo.toml", "--world-size", "2"]) == 0
    assert "data 2 × pipeline 1 × tensor 1 = 2 ranks" in capsys.readouterr().out


def test_missing_config_file_is_a_message(capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", "nope.toml", "--world-size", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_as_overrides_is_the_inverse_of_apply_overrides() -> None:
    """A config built as dicts reaches `tessera train` as the same values: strings with quotes and backslashes,
    booleans, floats in exponent form, lists, inline tables (data.path entries); None as ``null`` (unset)."""
    raw = {
        "model": {"family": "llama", "n_layers": 2, "init": None},
        "parallel": {"tensor": "2x2", "stage_layers": [1, 3], "sequence_parallel": True},
        "train": {"lr": 3e-4, "min_lr": 0.0, "grad_clip": float("inf")},
        "data": {"path": ["a b.bin", {"path": 'c"d\\e.bin', "weight": 0.3}], "document_mask": False},
        "log": {"run_dir": "runs/ü"},
    }
    back: dict = {}
    apply_overrides(back, as_overrides(raw))
    assert back == raw
    assert as_overrides({"train": {"steps": 5}}) == ["--train.steps=5"]


def test_as_overrides_carries_an_unset_over_a_size_default() -> None:
    """A config built as dicts that clears a value its ``model.size`` sets (Gemma 2's soft-caps) reaches the run
    without it: left out of the overrides, the size's 30.0 came back."""
    raw = {"model": {"size": "gemma2-9b", "final_softcap": None}}
    assert load_config(None, [o.lstrip("-") for o in as_overrides(raw)]).model.final_softcap is None


def test_null_override_unsets_an_optional_key() -> None:
    """``model.final_softcap=null`` on the command line removes the soft-cap a size sets (before: "'null' should be
    of type float | None", with no way to unset it but writing the whole [model] table out); a key that has no
    unset value is reported with its type; the word "none" stays text (parallel.checkpointing = "none")."""
    cfg = load_config(None, ["model.size=gemma2-9b", "model.final_softcap=null", "model.attn_softcap=null"])
    assert cfg.model.final_softcap is None and cfg.model.attn_softcap is None
    assert load_config(None, ["model.size=gemma2-9b"]).model.final_softcap == 30.0
    with pytest.raises(ConfigError, match=re.escape("model.n_layers = None should be of type int")):
        load_config(None, ["model.size=gemma2-9b", "model.n_layers=null"])
    assert load_config(None, ["parallel.checkpointing=none"]).parallel.checkpointing == "none"


@pytest.mark.parametrize(
    ("overrides", "rule", "message"),
    [
        (["model.family=gpt", "model.head_dim=32"], "model.head_width", "(GPT-2) has no separate head width"),
        (
            ["model.family=llama", "model.head_dim=7"],
            "model.rope",
            "RoPE needs an even head dim, got model.head_dim = 7",
        ),
        (["model.family=qwen3", "model.head_dim=0"], "model.head_dim", "model.head_dim"),
        (  # transformers' LlamaConfig refuses hidden 30 with 4 heads whatever head_dim says; Qwen3 does not
            ["model.family=llama", "model.d_model=30", "model.head_dim=6"],
            "model.heads",
            "family 'llama' needs it even with model.head_dim: transformers refuses such a config for it",
        ),
    ],
)
def test_head_dim_rules(overrides: list[str], rule: str, message: str) -> None:
    """model.head_dim: positive, even with RoPE, and for GPT-2 (no head_dim key in transformers) only d / a."""
    v = {v.rule: v for v in load_config(None, overrides).check(world_size=1)}
    assert rule in v and message in v[rule].problem, v


def test_head_dim_other_than_d_over_heads_is_accepted_with_rope_and_sizes_the_attention() -> None:
    """d_model 64 with 4 heads of 32 (Qwen3-0.6B's shape in small): no divisibility rule on d_model / n_heads, and
    head_dim = d_model / n_heads is accepted for GPT too (the same model)."""
    cfg = load_config(
        None, ["model.family=qwen3", "model.d_model=60", "model.head_dim=32", "model.n_kv_heads=2"]
    )
    assert cfg.check(world_size=1) == []
    assert (cfg.model.head_size, cfg.model.attn_dim) == (32, 128)
    for family in (
        "qwen2",
        "qwen3",
    ):  # transformers' Qwen2Config and Qwen3Config accept hidden 30 with 4 heads
        assert (
            load_config(None, [f"model.family={family}", "model.d_model=30", "model.head_dim=6"]).check(1)
            == []
        )
    assert load_config(None, ["model.family=gpt", "model.head_dim=16"]).check(world_size=1) == []
    assert load_config(None, ["model.family=gpt"]).model.head_size == 16


def test_1d_tensor_does_not_need_d_model_divisible_but_2d_does() -> None:
    """1D splits heads, KV heads and the MLP, never the residual stream: Qwen3 with d_model 30 and head_dim 6
    validates at tensor 4 (tests/distributed/test_tensor_1d.py runs such shapes against one process); the 2D grid
    splits the hidden dimension over its columns, so a 4x4 grid still refuses d_model 30."""
    shape = [
        "model.family=qwen3",
        "model.d_model=30",
        "model.head_dim=6",
        "model.n_heads=8",
        "model.n_kv_heads=4",
    ]
    one_d = load_config(None, [*shape, "parallel.tensor=4", "parallel.sequence_parallel=true"])
    assert one_d.check(world_size=4) == []
    two_d = {v.rule: v for v in load_config(None, [*shape, "parallel.tensor=4x4"]).check(world_size=16)}
    assert "model.d_model = 30 is not divisible by 2D grid 4x4 (4)" in two_d["tensor.divisibility"].problem
