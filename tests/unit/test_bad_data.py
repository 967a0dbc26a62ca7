"""Bad data gets a message naming the file and the fix: token ids past the vocabulary, empty files, bad paths,
torn metrics lines."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tessera.cli import main
from tessera.config import load_config
from tessera.errors import DataError
from tessera.train.data import TokenDataset, prepare
from tessera.train.metrics import MetricsLogger
from tessera.train.plot import plot_run
from tessera.train.trainer import TrainingRun


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_text("hello ~~~ world\n" * 20)
    out = tmp_path / "tokens.bin"
    prepare([tmp_path / "a.txt"], out)
    return out


def _rewrite_meta(path: Path, **changes: object) -> None:
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        meta.pop(key)
    meta_path.write_text(json.dumps(meta))


def test_prepare_records_the_largest_token_id(tokens: Path) -> None:
    assert json.loads(tokens.with_suffix(".json").read_text())["max_token_id"] == ord("~")


def test_token_ids_past_the_vocabulary_are_refused_before_training(tokens: Path, tmp_path: Path) -> None:
    # a tokenizer whose metadata under-reports its vocabulary: ids up to 126 but "vocab_size" 100
    _rewrite_meta(tokens, vocab_size=100)
    cfg = load_config(None, [f'data.path="{tokens}"', "model.vocab_size=120", f'log.run_dir="{tmp_path}"'])
    with pytest.raises(DataError, match=r"holds token id 126, but model\.vocab_size = 120"):
        TrainingRun(cfg, 0, 1)
    # a file prepared before max_token_id was recorded: found by reading the file
    _rewrite_meta(tokens, max_token_id=None)
    assert TokenDataset(tokens).max_token_id == ord("~")
    with pytest.raises(DataError, match="holds token id 126"):
        TrainingRun(cfg, 0, 1)


def test_empty_token_file_is_a_message(tmp_path: Path, tokens: Path) -> None:
    tokens.write_bytes(b"")
    _rewrite_meta(tokens, n_tokens=0)
    with pytest.raises(DataError, match="holds no tokens"):
        TokenDataset(tokens)


def test_prepare_into_a_directory_is_a_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a.txt").write_text("x" * 100)
    assert main(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_validate_data_verifies_the_checksum(tokens: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["validate", "--world-size", "1", "--data", f'--data.path="{tokens}"']
    assert main(argv) == 0
    assert "checksum verified" in capsys.readouterr().out
    data = np.fromfile(tokens, dtype="<u2")
    data[3] ^= 1
    data.tofile(tokens)
    assert main(argv) == 2
    assert "does not match the checksum" in capsys.readouterr().err


def test_plot_survives_a_torn_line_after_a_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "loss": 2.0}) + '\n{"step": 1, "lo')  # crashed mid-write
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as log:  # the resumed run appends
        log.log({"step": 1, "loss": 1.5})
    assert path.read_text().splitlines()[-1].startswith('{"step": 1, "loss"')  # not glued to the torn one
    assert plot_run(tmp_path).is_file()
    # an older file where the resumed record was glued to the torn one still plots
    path.write_text(
        '{"step": 0, "loss": 2.0}\n{"step": 1, "lo{"step": 1, "loss": 1.5}\n{"step": 2, "loss": 1}\n'
    )
    assert plot_run(tmp_path).is_file()
