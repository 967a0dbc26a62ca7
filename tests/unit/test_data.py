"""Tokenizers, token files and deterministic, layout-independent sampling."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from tessera.errors import DataError
from tessera.train.data import (
    TokenDataset,
    batch_indices,
    default_corpus_files,
    ensure_default_corpus,
    get_batch,
    prepare,
    window_start,
)
from tessera.train.tokenizer import ByteTokenizer, load_tokenizer

DOCS = {"a.txt": "hello world\n", "sub/b.md": "ünïcödé — 漢字 ✓\n", "sub/c.py": "print('x' * 3)\n" * 20}


@pytest.fixture
def corpus(tmp_path):
    src = tmp_path / "src"
    for name, text in DOCS.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text, encoding="utf-8")
    out = tmp_path / "data" / "tokens.bin"
    meta = prepare([src], out)
    return out, meta


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Grüße, 世界! \t\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode(ids[:-9]).endswith("\ufffd")  # cut mid-character: replaced, not an exception
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_hf_tokenizer_missing_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    with pytest.raises(DataError, match=r"pip install 'tessera\[hf\]'"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_prepare_writes_tokens_and_metadata(corpus):
    out, meta = corpus
    on_disk = json.loads(out.with_suffix(".json").read_text())
    assert on_disk == meta
    expected = "".join(DOCS[n] + "\0" for n in sorted(DOCS))  # sorted relative paths, NUL after each document
    assert meta["n_tokens"] == len(expected.encode()) and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "byte" and meta["n_sources"] == len(DOCS)
    ds = TokenDataset(out)
    assert ds.n_tokens == meta["n_tokens"] and ds.vocab_size == 256
    assert ByteTokenizer().decode(ds.tokens.tolist()) == expected
    ds.verify()
    assert not list(out.parent.glob("*.tmp"))  # temp files were renamed, none left behind


def test_prepare_skips_binary_files_with_a_warning(tmp_path):
    (tmp_path / "ok.txt").write_text("text")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.warns(UserWarning, match="skipping") as record:
        meta = prepare([tmp_path], tmp_path / "out" / "t.bin")
    assert len(record) == 2
    assert meta["n_sources"] == 1 and meta["n_skipped"] == 2 and meta["n_tokens"] == len("text") + 1


def test_prepare_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        prepare([tmp_path / "missing.txt"], tmp_path / "t.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text found"):
        prepare([tmp_path / "empty"], tmp_path / "t.bin")
    assert not (tmp_path / "t.bin").exists()


def test_sample_is_deterministic_and_shifted(corpus):
    out, _ = corpus
    ds = TokenDataset(out)
    x, y = ds.sample(5, seq_len=16, seed=3)
    assert x.dtype == np.int64 and x.shape == y.shape == (16,)
    assert np.array_equal(x[1:], y[:-1])
    x2, y2 = TokenDataset(out).sample(5, seq_len=16, seed=3)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    starts = {window_start(i, 3, ds.n_tokens - 16) for i in range(50)}
    assert len(starts) > 25  # different indices land on different windows
    assert window_start(5, 3, 10**6) != window_start(5, 4, 10**6)


def test_sample_too_short_for_seq_len(corpus):
    out, meta = corpus
    with pytest.raises(DataError, match="too few for sequences"):
        TokenDataset(out).sample(0, seq_len=meta["n_tokens"], seed=0)


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_batch_indices_tile_the_step(dp, micro_batch):
    global_batch, step = 8, 3
    n_micro = global_batch // (dp * micro_batch)
    seen = [
        i
        for r in range(dp)
        for m in range(n_micro)
        for i in batch_indices(step, global_batch, r, dp, m, micro_batch)
    ]
    assert sorted(seen) == list(range(step * global_batch, (step + 1) * global_batch))


def test_batch_indices_rejects_bad_layout():
    with pytest.raises(ValueError, match="not a positive multiple"):
        batch_indices(0, 6, 0, 4, 0, 1)
    with pytest.raises(ValueError, match="micro"):
        batch_indices(0, 8, 0, 2, 4, 1)


def test_dp1_and_dp2_see_the_same_samples(corpus):
    out, _ = corpus
    ds = TokenDataset(out)
    global_batch, seq, seed, step = 8, 8, 11, 2

    def rows(dp: int, micro_batch: int) -> set[tuple[int, ...]]:
        got = set()
        for r in range(dp):
            for m in range(global_batch // (dp * micro_batch)):
                x, y = get_batch(ds, step, m, r, dp, micro_batch, global_batch, seq, seed)
                assert x.dtype == torch.long and x.shape == y.shape == (micro_batch, seq)
                got |= {tuple(row) for row in torch.cat((x, y[:, -1:]), dim=1).tolist()}
        return got

    assert rows(1, 8) == rows(2, 2) == rows(4, 1)


def test_truncated_or_corrupt_file_is_a_clear_error(corpus):
    out, _ = corpus
    data = out.read_bytes()
    out.write_bytes(data[:-2])
    with pytest.raises(DataError, match=r"truncated.*re-run `tessera prepare`"):
        TokenDataset(out)
    out.write_bytes(data[:-2] + b"\x41\x00")  # same size, different last token
    with pytest.raises(DataError, match="checksum"):
        TokenDataset(out).verify()
    out.with_suffix(".json").unlink()
    with pytest.raises(DataError, match=r"metadata .* is missing"):
        TokenDataset(out)
    with pytest.raises(DataError, match="does not exist"):
        TokenDataset(out.parent / "nope.bin")


def test_default_corpus_files():
    max_bytes = 200_000
    files = default_corpus_files(max_bytes)
    sizes = [f.stat().st_size for f in files]
    assert files and all(s > 0 for s in sizes) and sum(sizes) <= max_bytes
    assert all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "idlelib", "site-packages"} & set(f.parts) for f in files)
    assert files == default_corpus_files(max_bytes)


def test_default_corpus_documents_are_what_prepare_writes(tmp_path):
    """`tessera validate` judges the default corpus by its files' sizes (tessera.train.corpus) without preparing
    it: each file's bytes and its end-of-text token, in order, are exactly the prepared token file."""
    from tessera.train.corpus import default_corpus_documents

    mb = 0.05
    lengths = default_corpus_documents(int(mb * 2**20))
    data = TokenDataset(ensure_default_corpus(tmp_path, max_mb=mb))
    assert len(lengths) > 3 and data.n_tokens == sum(lengths)
    ends = np.flatnonzero(np.asarray(data.tokens) == data.meta["eot"]) + 1
    assert ends.tolist() == np.cumsum(lengths).tolist()


def test_ensure_default_corpus_prepares_once(tmp_path):
    path = ensure_default_corpus(tmp_path, max_mb=0.1)
    mtime = path.stat().st_mtime_ns
    assert TokenDataset(path).n_tokens > 0
    assert ensure_default_corpus(tmp_path, max_mb=0.1) == path
    assert path.stat().st_mtime_ns == mtime  # reused, not rewritten
    path.write_bytes(path.read_bytes()[:-1])  # damaged: prepared again
    assert TokenDataset(ensure_default_corpus(tmp_path, max_mb=0.1)).n_tokens > 0
