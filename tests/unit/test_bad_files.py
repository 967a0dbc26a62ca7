"""Bad files and arguments of `prepare`, `plot`, `schedule show`, `generate`, `export` and `model.init` get one
`error:` line naming the problem and the fix (exit status 2), never a traceback, and leave no partial output.

Every fixture is made here: corrupt gzip, Parquet, Arrow and safetensors files, tokenizer folders with damaged
JSON, random-weight HF models (tests/hf_models.py); nothing is downloaded.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.config import load_config
from tessera.errors import CheckpointError, ConfigError, DataError
from tessera.hf.export import save_hf
from tessera.hf.weights import load_init
from tessera.model.build import build_model
from tessera.train import checkpoint as ckpt
from tessera.train.data import TokenDataset, prepare
from tests.hf_models import make_hf, train_bpe

TEXT = "def add(a, b):\n    return a + b\n" * 20


def _tessera(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "tessera", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def _refused(out: subprocess.CompletedProcess, message: str) -> None:
    """Exit status 2 with ``message`` in an `error:` line, and no traceback."""
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "error: " in out.stderr and message in out.stderr, out.stderr


# --- prepare ---------------------------------------------------------------------------------------------------


def _tokenizer_folder(folder: Path, name: str, content: bytes) -> Path:
    folder.mkdir()
    train_bpe(folder / "tokenizer.json", TEXT)
    (folder / name).write_bytes(content)
    return folder


def _bad_inputs(root: Path) -> dict[str, Path]:
    """One damaged input of each kind `prepare` reads."""
    records = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(100)).encode()
    packed = gzip.compress(records)
    (root / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])  # a download that stopped halfway
    (root / "text.parquet").write_bytes(b"a text file named .parquet")
    ds = root / "ds"  # a save_to_disk folder whose Arrow file did not come along
    ds.mkdir()
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (ds / "dataset_info.json").write_text("{}")
    torn_ds = root / "torn_ds"  # an Arrow file that is not one
    torn_ds.mkdir()
    (torn_ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    (torn_ds / "dataset_info.json").write_text("{}")
    (torn_ds / "data.arrow").write_bytes(b"not arrow")
    dd = root / "dd"  # a DatasetDict whose dataset_dict.json is torn
    dd.mkdir()
    (dd / "dataset_dict.json").write_text('{"splits": ["tr')
    return {
        "cut": root / "cut.jsonl.gz",
        "parquet": root / "text.parquet",
        "ds": ds,
        "torn_ds": torn_ds,
        "dd": dd,
    }


PREPARE_CASES = [
    (["{cut}"], "skipping {cut}: truncated or corrupt gzip file"),
    (["{cut}", "--strict"], "truncated or corrupt gzip file"),
    (["{parquet}"], "skipping {parquet}: not a readable Parquet file"),
    (["{torn_ds}"], "not a readable Arrow file"),
    (["{ds}"], "state.json' lists 1 file(s) the folder lacks (['data-00000-of-00001.arrow'])"),
    (["{dd}"], "is a Hugging Face DatasetDict"),
    (["{text}", "--tokenizer", "{tok_binary}"], "tokenizer_config.json is not valid JSON"),
    (["{text}", "--tokenizer", "{tok_list}"], "tokenizer_config.json holds a JSON list, not an object"),
    (["{text}", "--tokenizer", "{tok_eos}"], "declares end-of-text id 99999, outside its vocabulary"),
    (["{text}", "--workers", "0"], "--workers 0 must be at least 1"),
    (["{text}", "--workers", "-3"], "--workers -3 must be at least 1"),
    (["--default-mb", "nan"], "--default-mb nan must be a positive number"),
    (["--default-mb", "0"], "--default-mb 0.0 must be a positive number"),
]


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "a.txt").write_text(TEXT)
    found = _bad_inputs(tmp_path)
    found["text"] = tmp_path / "a.txt"
    found["tok_binary"] = _tokenizer_folder(tmp_path / "tok_binary", "tokenizer_config.json", b"\xff\xfe{")
    found["tok_list"] = _tokenizer_folder(tmp_path / "tok_list", "tokenizer_config.json", b'["</s>"]')
    found["tok_eos"] = _tokenizer_folder(tmp_path / "tok_eos", "config.json", b'{"eos_token_id": 99999}')
    return found


@pytest.mark.parametrize(("args", "message"), PREPARE_CASES)
def test_prepare_bad_input_is_a_message_and_writes_nothing(
    args: list[str], message: str, inputs: dict[str, Path], tmp_path: Path
) -> None:
    names = {k: str(v) for k, v in inputs.items()}
    out = tmp_path / "out" / "tokens.bin"
    result = _tessera("prepare", *[a.format(**names) for a in args], "--out", out, cwd=tmp_path)
    _refused(result, message.format(**names))
    assert not out.parent.exists() or not list(out.parent.iterdir()), list(out.parent.iterdir())


def test_prepare_that_fails_keeps_the_earlier_token_file(inputs: dict[str, Path], tmp_path: Path) -> None:
    """A failed preparation leaves the token file already at --out whole, with its metadata: no text to write
    (the cut gzip is skipped) used to delete the file and leave its metadata behind."""
    out = tmp_path / "tokens.bin"
    prepare([inputs["text"]], out)
    before = out.read_bytes(), out.with_suffix(".json").read_bytes()
    _refused(_tessera("prepare", inputs["cut"], "--out", out, cwd=tmp_path), "no text found")
    assert (out.read_bytes(), out.with_suffix(".json").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.glob(".tokens*")) == []  # no temp file left
    TokenDataset(out).verify()


def test_prepare_of_empty_documents_only_is_no_text(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"no text found in 1 input part\(s\) \(1 empty document"):
        prepare([tmp_path / "empty.txt"], tmp_path / "t.bin")
    assert not (tmp_path / "t.bin").exists()


def test_prepare_into_a_path_under_a_file_names_the_file(inputs: dict[str, Path], tmp_path: Path) -> None:
    out = inputs["text"] / "tokens.bin"  # a.txt is a file, not a folder
    _refused(
        _tessera("prepare", inputs["text"], "--out", out, cwd=tmp_path),
        f"{inputs['text']} is a file, not a folder",
    )


# --- token files of training -----------------------------------------------------------------------------------


def test_token_metadata_with_values_of_the_wrong_type_is_a_message(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "t.bin"
    meta = prepare([tmp_path / "a.txt"], out)
    for key, value in [("n_tokens", str(meta["n_tokens"])), ("max_token_id", "x"), ("eot", 70000)]:
        out.with_suffix(".json").write_text(json.dumps({**meta, key: value}))
        with pytest.raises(DataError, match=f"is not tessera token metadata \\({key} = "):
            TokenDataset(out)


def test_a_token_id_above_the_recorded_maximum_is_named_when_sampled(tmp_path: Path) -> None:
    """A token file changed after `prepare` (its metadata records its largest id) would index past the embedding
    deep inside the model (IndexError on a CPU, a device-side assert on a GPU); sampling names the file."""
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "t.bin"
    prepare([tmp_path / "a.txt"], out)
    tokens = np.fromfile(out, dtype="<u2")
    tokens[::7] = 5000
    tokens.tofile(out)
    data = TokenDataset(out)
    with pytest.raises(
        DataError, match=rf"holds id 5000 near token \d+, above the largest id {max(TEXT.encode())} "
    ):
        data.sample(0, 32, seed=0)


# --- plot and schedule pictures --------------------------------------------------------------------------------


def _metrics_run(run: Path, extra_lines: str = "") -> Path:
    run.mkdir()
    lines = "".join(json.dumps({"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0}) + "\n" for s in range(3))
    (run / "metrics.jsonl").write_text(extra_lines + lines)
    return run


def test_plot_skips_records_whose_step_is_not_an_integer(tmp_path: Path) -> None:
    """Hand-edited or foreign lines ({"step": "a"}, {"step": null}, {"step": [1]}) could be neither merged nor
    ordered (TypeError); they are skipped like torn lines."""
    bad = '{"step": "a", "loss": 1.0}\n{"step": null, "loss": 1.0}\n{"step": [1], "loss": 1.0}\n'
    run = _metrics_run(tmp_path / "run", bad)
    out = _tessera("plot", run, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (run / "curves.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("out", "message"),
    [
        ("{file}/curves.png", "{file} is a file, not a folder"),
        ("{run}/curves.jpeg2", "does not end in .png, .svg, .pdf"),
        ("{run}/curves", "does not end in .png, .svg, .pdf"),
        ("{run}", "does not end in .png, .svg, .pdf"),
    ],
)
def test_plot_to_a_bad_out_is_a_message(out: str, message: str, tmp_path: Path) -> None:
    run = _metrics_run(tmp_path / "run")
    (tmp_path / "file").write_text("x")
    names = {"file": str(tmp_path / "file"), "run": str(run)}
    _refused(_tessera("plot", run, "--out", out.format(**names), cwd=tmp_path), message.format(**names))
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_schedule_picture_under_a_file_is_a_message(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    args = (
        "schedule",
        "show",
        "1f1b",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--out",
        tmp_path / "file" / "s.png",
    )
    _refused(_tessera(*args, cwd=tmp_path), f"{tmp_path / 'file'} is a file, not a folder")


def test_schedule_file_that_is_not_utf8_is_a_problem_of_the_config(tmp_path: Path) -> None:
    (tmp_path / "s.csv").write_bytes(b"\xff\xferank,step,action\n")
    out = _tessera(
        "validate", "--world-size", "2", "--parallel.pipeline=2", f"--parallel.schedule={tmp_path / 's.csv'}",
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "s.csv' is not UTF-8 text" in out.stdout, out.stdout


# --- checkpoints and HF folders --------------------------------------------------------------------------------


@pytest.fixture
def weights(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A tessera weights checkpoint (as `tessera export` writes) of a tiny model."""
    cfg = load_config(None, ["model.size=gpt2-tiny"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    return ckpt.save_model_weights(tmp_path / "export", 1, model, {"test": True}), model


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_weights_with_a_damaged_data_file_are_a_checkpoint_error(
    damage: str, weights: tuple[Path, torch.nn.Module]
) -> None:
    """`tessera generate` reads weights with `load_model_weights`: a truncated or missing .distcp was torch's
    RuntimeError or FileNotFoundError; now the checkpoint and its damaged file are named."""
    path, model = weights
    data = next(path.glob("*.distcp"))
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:1000])
    else:
        data.unlink()
    with pytest.raises(CheckpointError, match=rf"could not be read: .*the files are damaged: {data.name}"):
        ckpt.load_model_weights(path, model)


def test_hf_export_to_a_file_or_under_one_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    cfg = load_config(None, ["model.size=gpt2-tiny"])
    model = build_model(cfg.model)
    params = dict(model.named_parameters())
    (tmp_path / "file").write_text("keep me")
    with pytest.raises(CheckpointError, match="file is a file; pass a new folder to --out"):
        save_hf(tmp_path / "file", cfg, lambda n: params[n])
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'file'} is a file, not a folder"):
        save_hf(tmp_path / "file" / "hf", cfg, lambda n: params[n])

    def fails(name: str) -> torch.Tensor:
        raise CheckpointError("read failed")

    with pytest.raises(CheckpointError, match="read failed"):
        save_hf(tmp_path / "hf", cfg, fails)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no half-written hf.tmp
    assert (tmp_path / "file").read_text() == "keep me"


def _hf_folder(tmp_path: Path) -> Path:
    make_hf(tmp_path / "hf", "gpt2")
    return tmp_path / "hf"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "header"])
def test_corrupt_safetensors_is_a_checkpoint_error(damage: str, tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "garbage": b"\0" * 64,
        "header": data[:8] + b"{garbage" + data[16:],
    }[damage]
    file.write_bytes(damaged)
    cfg = load_config(None, [f'model.init="hf:{folder}"'])
    with pytest.raises(CheckpointError, match=r"model\.safetensors cannot be read as safetensors"):
        load_init(cfg.model)


def test_torn_safetensors_index_is_a_checkpoint_error(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    cfg = load_config(None, [f'model.init="hf:{folder}"'])
    with pytest.raises(CheckpointError, match=r"index\.json is not a safetensors index"):
        load_init(cfg.model)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe{}", "config.json is not valid JSON"),
        (b"[1, 2]", "config.json holds a JSON list, not an object"),
        (None, "config.json: n_embd = '32' is not an integer"),
    ],
)
def test_hf_config_json_that_is_not_model_settings_is_a_config_error(
    content: bytes | None, message: str, tmp_path: Path
) -> None:
    folder = _hf_folder(tmp_path)
    config = folder / "config.json"
    if content is None:
        config.write_text(json.dumps({**json.loads(config.read_text()), "n_embd": "32"}))
    else:
        config.write_bytes(content)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        load_config(None, [f'model.init="hf:{folder}"'])
