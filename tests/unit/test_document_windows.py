"""data.window_start = "document": every window opens at a document start, drawn from (index, seed) alone.

The data is prompt/completion records of varied lengths (byte tokens, a loss mask), a few longer than a window.
Document starts are found here by a plain Python walk over the tokens, independent of the library's chunked
scan. The dp2 run against the single device (loss and every gradient) is in tests/distributed/test_loss_mask.py,
as is a resumed run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tessera.cli import main
from tessera.config import from_dict
from tessera.errors import DataError
from tessera.execution import violations
from tessera.model.targets import IGNORE_INDEX
from tessera.train.data import (
    Blend,
    TokenDataset,
    _document_starts,
    get_batch,
    long_documents,
    open_data,
    prepare,
    target_count,
    window_start,
)
from tessera.train.trainer import train

SEQ = 48
EOT = 0  # the byte tokenizer's end-of-text token


def _records(seed: int, n: int, long_every: int = 0, words: int = 6) -> list[dict]:
    """Records of up to 2 * ``words`` words; every ``long_every``-th (if any) has a completion longer than a
    window."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices("etaoinshrdlu", k=rng.randint(1, 6))) for _ in range(40)]

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(vocabulary, k=rng.randint(lo, hi)))

    out = [{"q": text(1, words), "a": text(0, words)} for _ in range(n)]
    for i in range(0, n, long_every) if long_every else []:
        out[i]["a"] = "x" * (2 * SEQ + i % 7)
    return out


def _prepare(root: Path, name: str, records: list[dict]) -> Path:
    (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / f"{name}.bin"
    prepare([root / f"{name}.jsonl"], out, "byte", prompt_key="q", completion_key="a", workers=1)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two masked token files: 400 records with some longer than a window, and 150 shorter than one."""
    root = tmp_path_factory.mktemp("sft")
    return _prepare(root, "long", _records(1, 400, long_every=37)), _prepare(
        root, "short", _records(2, 150, words=3)
    )


def _starts_by_walking(tokens: np.ndarray) -> list[int]:
    """Document starts by definition: offset 0 and each offset after an end-of-text token, inside the file."""
    ids = tokens.tolist()
    return [0] + [i + 1 for i, t in enumerate(ids[:-1]) if t == EOT]


def test_the_start_index_is_every_document_start(files):
    for path in files:
        data = TokenDataset(path, "document")
        starts = data.document_starts
        assert starts.dtype == np.int64 and starts.tolist() == _starts_by_walking(np.asarray(data.tokens))
        assert (
            len(starts) == data.meta["n_documents"]
        )  # prepare ends every document with one end-of-text token
        assert data.document_starts is starts  # built once
    tokens = np.asarray(TokenDataset(files[0]).tokens)
    for block in (1, 7, 64, 1000):  # the chunked scan does not depend on where its blocks are cut
        assert _document_starts(tokens, EOT, block).tolist() == _starts_by_walking(tokens)


@pytest.mark.parametrize("seed", [0, 1, 1234, 2**63 + 5])
def test_every_window_starts_at_a_document_start(files, seed):
    data = TokenDataset(files[0], "document")
    tokens = np.asarray(data.tokens)
    starts = set(_starts_by_walking(tokens))
    for i in range(400):
        start = data.start(i, SEQ, seed)
        assert start in starts and start + SEQ + 1 <= data.n_tokens, (i, start)
        x, y = data.sample(i, SEQ, seed)
        assert np.array_equal(x, tokens[start : start + SEQ]) and np.array_equal(
            y, tokens[start + 1 : start + SEQ + 1]
        )
        # the loss mask's bytes are those of the same window's targets, and a window opens on a prompt
        assert np.array_equal(data.target_mask(i, SEQ, seed), data.mask[start + 1 : start + SEQ + 1] != 0)
        assert data.mask[start] == 0


def test_blend_windows_start_at_each_sources_document_starts(files):
    blend = Blend([TokenDataset(p, "document") for p in files], [1.0, 2.0])
    walked = [set(_starts_by_walking(np.asarray(s.tokens))) for s in blend.sources]
    drawn = [0, 0]
    for i in range(600):
        k = blend.source_of(i, 7)
        source = blend.sources[k]
        start = source.start(i, SEQ, 7)
        assert start in walked[k]
        x, _ = blend.sample(i, SEQ, 7)
        assert np.array_equal(x, np.asarray(source.tokens[start : start + SEQ]))
        assert np.array_equal(blend.target_mask(i, SEQ, 7), source.target_mask(i, SEQ, 7))
        drawn[k] += 1
    assert min(drawn) > 100  # both sources sampled


def test_documents_are_drawn_uniformly_not_by_length(files):
    """Each document with a whole window is equally likely to open one: over many draws every one is drawn, and
    the drawn documents' mean length is the documents' mean, not the length-weighted mean "any" gives."""
    data = TokenDataset(files[0], "document")
    starts = data.document_starts
    usable = starts[starts < data.n_tokens - SEQ]
    lengths = dict(zip(starts.tolist(), np.diff(np.append(starts, data.n_tokens)).tolist(), strict=True))
    drawn = [data.start(i, SEQ, 3) for i in range(20 * len(usable))]
    assert set(drawn) == set(usable.tolist())
    mean = np.mean([lengths[s] for s in usable.tolist()])
    weighted = sum(lengths[s] ** 2 for s in usable.tolist()) / sum(lengths[s] for s in usable.tolist())
    got = np.mean([lengths[s] for s in drawn])
    assert abs(got - mean) < 0.05 * mean and weighted > 1.25 * mean  # the two are far apart here


def test_the_same_index_and_seed_give_the_same_window(files):
    """A pure function of (index, seed): again, on a new opening of the file (another process, a resumed run),
    and in get_batch's micro-batches of any data-parallel layout."""
    first, again = TokenDataset(files[0], "document"), TokenDataset(files[0], "document")
    for i in range(0, 300, 7):
        assert first.start(i, SEQ, 5) == first.start(i, SEQ, 5) == again.start(i, SEQ, 5)
    assert len({first.start(i, SEQ, 5) for i in range(50)}) > 30  # indices land on different documents
    assert [first.start(i, SEQ, 5) for i in range(20)] != [first.start(i, SEQ, 6) for i in range(20)]
    whole_x, whole_y = get_batch(first, 3, 0, 0, 1, 8, 8, SEQ, 5, loss_mask=True)
    for dp in (2, 4):
        parts = [
            get_batch(again, 3, m, r, dp, 1, 8, SEQ, 5, loss_mask=True)
            for m in range(8 // dp)
            for r in range(dp)
        ]
        assert torch.equal(torch.cat([x for x, _ in parts]), whole_x)
        assert torch.equal(torch.cat([y for _, y in parts]), whole_y)


def test_the_default_any_samples_as_before(files):
    """window_start = "any" (the default) draws hash(seed, i) mod (n - seq_len), the formula of every earlier
    version, with no index built; the masked batch is those windows' targets with the mask applied."""
    default, explicit = TokenDataset(files[0]), TokenDataset(files[0], "any")
    tokens, mask = np.asarray(default.tokens, dtype=np.int64), np.asarray(default.mask)
    for i in range(300):
        start = window_start(i, 11, default.n_tokens - SEQ)
        assert default.start(i, SEQ, 11) == explicit.start(i, SEQ, 11) == start
    x, y = get_batch(default, 2, 0, 0, 1, 4, 4, SEQ, 11, loss_mask=True)
    starts = [window_start(i, 11, default.n_tokens - SEQ) for i in range(8, 12)]
    expected_y = np.stack(
        [np.where(mask[s + 1 : s + SEQ + 1] != 0, tokens[s + 1 : s + SEQ + 1], IGNORE_INDEX) for s in starts]
    )
    assert torch.equal(x, torch.from_numpy(np.stack([tokens[s : s + SEQ] for s in starts])))
    assert torch.equal(y, torch.from_numpy(expected_y))
    assert default._document_starts is None and explicit._document_starts is None
    anywhere = {default.start(i, SEQ, 11) for i in range(300)}
    assert not anywhere <= set(_starts_by_walking(tokens))  # "any" does open windows mid-document


def test_each_side_of_the_held_out_split_starts_at_its_own_documents(files):
    train_part, valid = open_data([(str(files[0]), 1.0)], valid_fraction=0.2, window_start="document")
    whole = _starts_by_walking(np.asarray(TokenDataset(files[0]).tokens))
    cut = train_part.n_tokens
    assert cut in whole  # the cut is a document start, so is the held-out part's first token
    assert train_part.document_starts.tolist() == [s for s in whole if s < cut]
    assert valid.document_starts.tolist() == [s - cut for s in whole if s >= cut]
    for i in range(200):
        assert train_part.start(i, SEQ, 1) + SEQ + 1 <= cut  # training windows stay before the cut
        assert valid.start(i, SEQ, 1) + cut in whole
    built = TokenDataset(files[0], "document")
    assert len(built.document_starts) == len(whole)  # a file whose index is built already splits alike
    held = built.split_documents(0.2)[1]
    assert held.document_starts.tolist() == valid.document_starts.tolist()
    _, other = open_data([(str(files[0]), 1.0)], str(files[1]), window_start="document")
    assert other.window_start == "document"  # a separate validation file too


def test_target_counts_follow_the_document_windows(files):
    data = TokenDataset(files[0], "document")
    expected = sum(
        int(data.mask[s + 1 : s + SEQ + 1].sum()) for s in (data.start(i, SEQ, 4) for i in range(8, 16))
    )
    assert target_count(data, 1, 8, SEQ, 4) == expected


def test_long_documents_warning_counts_the_untrained_tails(files):
    data = TokenDataset(files[0], "document")
    starts = _starts_by_walking(np.asarray(data.tokens))
    lengths = np.diff([*starts, data.n_tokens])
    long = lengths[lengths > SEQ + 1]
    lost = int((long - (SEQ + 1)).sum())
    assert 0 < len(long) < len(lengths)
    warning = long_documents(data, SEQ)
    assert f"{len(long):,} of the {len(lengths):,} documents" in warning
    assert f"their {lost:,} tokens past the first {SEQ + 1}" in warning
    assert f"({100 * lost / data.n_tokens:.3g}% of the training tokens)" in warning
    assert f"model.seq_len >= {int(lengths.max()) - 1}" in warning  # the fix
    assert long_documents(data, int(lengths.max()) - 1) is None  # every document fits a window
    assert long_documents(TokenDataset(files[1], "document"), SEQ) is None
    blend = Blend([data, TokenDataset(files[1], "document")], [1.0, 1.0])
    assert f"{len(long):,} of the {len(lengths) + 150:,} documents" in long_documents(blend, SEQ)


def _config(paths: list[Path], run_dir: Path, **data: object) -> dict:
    return {
        "model": {"size": "gpt2-tiny", "n_layers": 1, "seq_len": SEQ},
        "train": {"steps": 1, "global_batch": 2, "micro_batch": 2, "warmup_steps": 0},
        "data": {"path": [str(p) for p in paths], "loss_mask": True, "window_start": "document", **data},
        "checkpoint": {"every": 0, "resume": False},
        "log": {"run_dir": str(run_dir), "progress": False, "tensorboard": False},
    }


def _validate(path: Path) -> int:
    args = [f'--data.path="{path}"', "--data.loss_mask=true", '--data.window_start="document"']
    return main(["validate", "--world-size", "1", "--model.size=gpt2-tiny", f"--model.seq_len={SEQ}", *args])


def test_validate_and_the_trainer_warn_about_long_documents(files, tmp_path, capsys):
    warning = long_documents(TokenDataset(files[0], "document"), SEQ)
    assert _validate(files[0]) == 0
    assert f"warning: {warning}" in capsys.readouterr().out
    train(from_dict(_config([files[0]], tmp_path / "run")))
    assert f"WARNING: {warning}" in capsys.readouterr().err
    assert _validate(files[1]) == 0
    assert "window_start" not in capsys.readouterr().out  # no document longer than a window: no warning


def test_a_file_without_an_end_of_text_token_is_refused(files, tmp_path):
    """No recorded end-of-text token: no document starts. The trainer's opening and `validate` say so, with
    the fix; "any" still reads the file."""
    bad = tmp_path / "old.bin"
    bad.write_bytes(files[1].read_bytes())
    meta = json.loads(files[1].with_suffix(".json").read_text())
    del meta["eot"], meta["loss_mask"]
    bad.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"no end-of-text token.*--eot-token.*window_start = \"any\""):
        TokenDataset(bad, "document")
    TokenDataset(bad).sample(0, SEQ, 0)
    raw = _config([files[0], bad], tmp_path / "run", loss_mask=False)
    (v,) = violations(from_dict(raw), 1)
    assert v.rule == "data.window_start" and str(bad) in v.problem and "--eot-token" in v.fix
    raw["data"]["window_start"] = "documents"
    (v,) = violations(from_dict(raw), 1)
    assert v.rule == "data.window_start" and "'documents' is unknown" in v.problem and '"document"' in v.fix
    with pytest.raises(ValueError, match="window_start"):
        TokenDataset(files[0], "documents")
