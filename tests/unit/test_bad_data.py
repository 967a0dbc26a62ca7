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
from tessera.execution import violations
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


# --- too little data for the config: `validate` refuses what the trainer's sampling and hold-out would -------


def _documents(tmp_path: Path, lengths: list[int]) -> Path:
    """A byte token file of one document per length (that many letters, then the end-of-text token)."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": "ab"[i % 2] * n}) + "\n" for i, n in enumerate(lengths)))
    out = tmp_path / "docs.bin"
    prepare([src], out, workers=1)
    return out


def _rules(overrides: list[str]) -> list[str]:
    return [v.rule for v in violations(load_config(None, overrides), 1)]


def test_a_file_shorter_than_one_window_is_refused_as_sampling_would(tokens: Path) -> None:
    n = TokenDataset(tokens).n_tokens  # 321: one window of seq_len n - 1 fits, of seq_len n does not
    fits, short = (load_config(None, [f'data.path="{tokens}"', f"model.seq_len={s}"]) for s in (n - 1, n))
    assert violations(fits, 1) == []
    TokenDataset(tokens).sample(0, n - 1, seed=1)
    (v,) = violations(short, 1)
    assert (
        v.rule == "data.seq_len" and f"holds {n} tokens" in v.problem and f"model.seq_len <= {n - 1}" in v.fix
    )
    with pytest.raises(DataError, match="too few for sequences"):
        TokenDataset(tokens).sample(0, n, seed=1)


def test_train_refuses_a_file_shorter_than_one_window_before_starting(
    tokens: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = [f'--data.path="{tokens}"', "--model.seq_len=400", f'--log.run_dir="{tmp_path / "run"}"']
    (v,) = violations(load_config(None, [o[2:] for o in overrides]), 1)
    assert main(["validate", "--world-size", "1", *overrides]) == 1
    assert str(v) in capsys.readouterr().out
    assert main(["train", *overrides]) == 2
    assert str(v) in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.2, 0.5, 0.9])
def test_valid_fraction_is_refused_exactly_where_the_hold_out_fails(tmp_path: Path, fraction: float) -> None:
    path = _documents(tmp_path, [30, 200, 30, 300])
    base = [f'data.path="{path}"', "model.seq_len=16", f"data.valid_fraction={fraction}"]
    try:
        TokenDataset(path).split_documents(fraction)
        holds_out = True
    except DataError:
        holds_out = False
    assert ("data.valid_fraction" not in _rules(base)) == holds_out


def test_one_document_cannot_be_held_out(tokens: Path) -> None:
    (v,) = violations(load_config(None, [f'data.path="{tokens}"', "data.valid_fraction=0.1"]), 1)
    assert v.rule == "data.valid_fraction" and "data.valid_path" in v.fix
    with pytest.raises(DataError, match="no document boundary"):
        TokenDataset(tokens).split_documents(0.1)


def test_held_out_part_must_hold_a_window_only_when_evaluated(tmp_path: Path) -> None:
    path = _documents(tmp_path, [300, 20])  # 0.1 holds out the second document: 21 tokens
    held = [f'data.path="{path}"', "data.valid_fraction=0.1", "model.seq_len=32"]
    assert _rules(held) == []  # never sampled without train.eval_every
    problems = violations(load_config(None, [*held, "train.eval_every=1"]), 1)
    assert [v.rule for v in problems] == ["data.seq_len"] and "holds 21 tokens" in problems[0].problem
    assert "train.eval_every = 0" in problems[0].fix
    _, valid = TokenDataset(path).split_documents(0.1)
    with pytest.raises(DataError, match="too few"):
        valid.sample(0, 32, seed=1)
    with_file = [f'data.path="{path}"', f'data.valid_path="{path}"', "model.seq_len=400"]
    assert _rules(with_file) == ["data.seq_len"]  # the training file; the validation file is not sampled
    assert _rules([*with_file, "train.eval_every=1"]) == ["data.seq_len", "data.seq_len"]


def test_default_corpus_too_small_for_any_file_names_the_key() -> None:
    (v,) = violations(load_config(None, ["data.default_corpus_mb=0.00001"]), 1)
    assert v.rule == "data.default_corpus_mb" and "takes no file" in v.problem
    enough = v.fix.split(">= ")[1].split(" ")[0]
    assert "data.default_corpus_mb" not in _rules([f"data.default_corpus_mb={enough}", "model.seq_len=8"])


def test_default_corpus_shorter_than_one_window_is_refused() -> None:
    from tessera.train.corpus import default_corpus_documents

    mb = 0.001
    n = sum(default_corpus_documents(int(mb * 2**20)))
    assert _rules([f"data.default_corpus_mb={mb}", f"model.seq_len={n - 1}"]) == []
    assert _rules([f"data.default_corpus_mb={mb}", f"model.seq_len={n}"]) == ["data.seq_len"]


def test_a_vocabulary_below_the_default_corpus_bytes_is_refused_for_training_only(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The default corpus is byte tokens (ids 0-255): `validate` refuses a smaller model.vocab_size with the
    trainer's own reason, `train` stops before its run directory, and an estimate (memory, dry run) that reads no
    data still prices the model."""
    from tessera.execution import resolve
    from tessera.memory import estimate

    overrides = ["--model.vocab_size=255", f'--log.run_dir="{tmp_path / "run"}"']
    cfg = load_config(None, [o[2:] for o in overrides])
    (v,) = violations(cfg, 1)
    assert v.rule == "data.vocab" and "model.vocab_size = 255" in v.problem and ">= 256" in v.fix
    assert main(["validate", "--world-size", "1", *overrides]) == 1
    assert str(v) in capsys.readouterr().out
    assert main(["train", *overrides]) == 2
    assert str(v) in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert violations(cfg, 1, training=False) == []
    assert resolve(cfg, 1, training=False).layout.world_size == 1
    assert estimate(cfg, 1).total > 0
    assert _rules(["model.vocab_size=256"]) == []


def test_data_tokenizer_must_be_the_one_that_made_the_data(tmp_path: Path, tokens: Path) -> None:
    """`generate` and the Hugging Face export decode with data.tokenizer: bytes read as BPE ids (or BPE ids read
    as bytes) would be garbage, so a tokenizer that cannot have made the data is refused."""
    from tests.hf_models import train_bpe

    text = "the quick brown fox jumps over the lazy dog\n" * 40
    train_bpe(tmp_path / "tok.json", text, vocab_size=300)
    (tmp_path / "t.txt").write_text(text)
    bpe_tokens = tmp_path / "bpe.bin"
    prepare([tmp_path / "t.txt"], bpe_tokens, str(tmp_path / "tok.json"))
    bpe, byte = f'data.tokenizer="{tmp_path / "tok.json"}"', f'data.path="{tokens}"'
    small = "model.seq_len=16"

    (v,) = violations(load_config(None, [bpe, small]), 1)  # the default corpus is bytes
    assert v.rule == "data.tokenizer" and "default corpus" in v.problem and "tessera prepare" in v.fix
    (v,) = violations(load_config(None, [bpe, byte, small]), 1)
    assert v.rule == "data.tokenizer" and str(tokens) in v.problem and "data.tokenizer = 'byte'" in v.fix
    (v,) = violations(load_config(None, [f'data.path="{bpe_tokens}"', small]), 1)
    assert v.rule == "data.tokenizer" and str(bpe_tokens) in v.problem
    assert _rules([f'data.path="{bpe_tokens}"', bpe, small]) == []
    assert _rules([byte, small]) == []
    _rewrite_meta(tokens, tokenizer=None)  # a file of a version that did not record its tokenizer: not judged
    assert _rules([bpe, byte, small]) == []


def test_files_missing_here_are_refused_for_training_only(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A config written for a cluster (`tessera plan --data /cluster/tokens.bin --out`) names files this machine
    lacks: `validate` and `train` refuse them by name, while `memory` (and every estimate, which reads no data)
    prices the run; a path no file may have is refused by both."""
    missing, valid = tmp_path / "cluster" / "tokens.bin", tmp_path / "cluster" / "valid.bin"
    overrides = [
        f'--data.path=["{missing}", {{path = "{missing}", weight = 2}}]',
        f'--data.valid_path="{valid}"',
    ]
    cfg = load_config(None, [o[2:] for o in overrides])
    assert sorted(v.rule for v in violations(cfg, 1)) == ["data.path[0]", "data.path[1]"]
    only_valid = load_config(None, [f'data.valid_path="{valid}"'])
    assert [v.rule for v in violations(only_valid, 1)] == ["data.valid_path"]
    assert violations(only_valid, 1, training=False) == []
    assert main(["validate", "--world-size", "1", *overrides]) == 1
    assert "does not exist" in capsys.readouterr().out
    assert violations(cfg, 1, training=False) == []
    assert main(["memory", "--world-size", "1", *overrides]) == 0
    assert "per-rank memory estimate" in capsys.readouterr().out
    assert main(["dryrun", "--world-size", "1", "--model.n_layers=1", *overrides]) == 0
    assert "dry run of" in capsys.readouterr().out
    bad = load_config(None, ['data.path="a\0b"'])
    assert [v.rule for v in violations(bad, 1, training=False)] == ["data.path"]


def test_logging_packages_missing_here_are_refused_for_training_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A config written for a cluster enables logging whose packages this machine may lack: `validate` and `train`
    refuse them by name with the fix, while `memory` and `dryrun` (which log nothing) price the run."""
    from tessera.config import checks

    monkeypatch.setattr(checks, "_importable", lambda package: False)
    overrides = ["--log.tensorboard=true", "--log.wandb=true"]
    cfg = load_config(None, [o[2:] for o in overrides])
    refused = violations(cfg, 1)
    assert sorted(v.rule for v in refused) == ["log.tensorboard", "log.wandb"]
    assert all("pip install" in v.fix for v in refused)
    assert violations(cfg, 1, training=False) == []
    assert main(["validate", "--world-size", "1", *overrides]) == 1
    assert "`tensorboard` package is not installed" in capsys.readouterr().out
    assert main(["memory", "--world-size", "1", *overrides]) == 0
    assert "per-rank memory estimate" in capsys.readouterr().out
    assert main(["dryrun", "--world-size", "1", "--model.n_layers=1", *overrides]) == 0
    assert "dry run of" in capsys.readouterr().out
