"""data.window_start = "document": every window opens at a document start, drawn from (index, seed) alone.

The data is prompt/completion records of varied lengths (byte tokens, a loss mask), a few longer than a window.
Document starts are found here by a plain Python walk over the tokens, independent of the library's chunked
scan. Every document opens windows, the last ones too: a window that reaches the end of the file reads on from
its first token, as if the file were a ring (`_ring_of` here). The dp2 run against the single device (loss and
every gradient) is in tests/distributed/test_loss_mask.py, as is a resumed run; the index cache written by rank 0
alone in tests/distributed/test_document_index.py.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import tessera.train.data as data_module
from tessera.cli import main
from tessera.config import from_dict
from tessera.errors import CheckpointError, DataError
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
from tessera.train.trainer import _open_data, train

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


def _ring_of(values: np.ndarray, start: int, length: int) -> np.ndarray:
    """``length`` entries of ``values`` from ``start``, going on from the first past the end."""
    return np.concatenate([values, values])[start : start + length]


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
    mask = np.asarray(data.mask)
    for i in range(400):
        start = data.start(i, SEQ, seed)
        assert start in starts, (i, start)
        x, y = data.sample(i, SEQ, seed)
        window = _ring_of(tokens, start, SEQ + 1)
        assert np.array_equal(x, window[:-1]) and np.array_equal(y, window[1:])
        # the loss mask's bytes are those of the same window's targets, and a window opens on a prompt
        assert np.array_equal(data.target_mask(i, SEQ, seed), _ring_of(mask, start + 1, SEQ) != 0)
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
        assert np.array_equal(x, _ring_of(np.asarray(source.tokens), start, SEQ))
        assert np.array_equal(blend.target_mask(i, SEQ, 7), source.target_mask(i, SEQ, 7))
        drawn[k] += 1
    assert min(drawn) > 100  # both sources sampled


def test_documents_are_drawn_uniformly_not_by_length(files):
    """Each document is equally likely to open a window: over many draws every one is drawn (the last ones,
    less than a window before the end, too), and the drawn documents' mean length is the documents' mean, not
    the length-weighted mean "any" gives."""
    data = TokenDataset(files[0], "document")
    starts = data.document_starts
    usable = starts
    assert usable[-1] > data.n_tokens - SEQ  # the last document is shorter than a window
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
    tokens = np.asarray(TokenDataset(files[0]).tokens)
    for i in range(200):
        # training windows hold training tokens only: past the cut they read on from the file's first token
        start = train_part.start(i, SEQ, 1)
        assert np.array_equal(train_part.sample(i, SEQ, 1)[0], _ring_of(tokens[:cut], start, SEQ))
        # and the held-out windows held-out tokens only, from the cut
        start = valid.start(i, SEQ, 1)
        assert start + cut in whole
        assert np.array_equal(valid.sample(i, SEQ, 1)[0], _ring_of(tokens[cut:], start, SEQ))
    built = TokenDataset(files[0], "document")
    assert len(built.document_starts) == len(whole)  # a file whose index is built already splits alike
    held = built.split_documents(0.2)[1]
    assert held.document_starts.tolist() == valid.document_starts.tolist()
    _, other = open_data([(str(files[0]), 1.0)], str(files[1]), window_start="document")
    assert other.window_start == "document"  # a separate validation file too


def test_target_counts_follow_the_document_windows(files):
    data = TokenDataset(files[0], "document")
    mask = np.asarray(data.mask)
    expected = sum(
        int(_ring_of(mask, s + 1, SEQ).sum()) for s in (data.start(i, SEQ, 4) for i in range(8, 16))
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
    assert f"their {lost:,} tokens past the first {SEQ + 1} tokens" in warning
    assert f"({100 * lost / data.n_tokens:.3g}% of the training tokens)" in warning
    assert f"model.seq_len >= {int(lengths.max()) - 1}" in warning  # the fix
    assert long_documents(data, int(lengths.max()) - 1) is None  # every document fits a window
    assert long_documents(TokenDataset(files[1], "document"), SEQ) is None
    blend = Blend([data, TokenDataset(files[1], "document")], [1.0, 1.0])
    assert f"{len(long):,} of the {len(lengths) + 150:,} documents" in long_documents(blend, SEQ)


def _lost_targets(data: TokenDataset, seq: int) -> tuple[int, int]:
    """(targets past the first seq + 1 tokens of their document, targets in all), by walking the tokens."""
    tokens, mask = np.asarray(data.tokens), np.asarray(data.mask)
    starts = _starts_by_walking(tokens)
    ends = [*starts[1:], len(tokens)]
    lost = sum(int(mask[a + seq + 1 : b].sum()) for a, b in zip(starts, ends, strict=True))
    return lost, int(mask.sum())


def test_with_a_loss_mask_the_warning_counts_targets(tmp_path):
    """data.loss_mask: what is lost is the long documents' targets past the window, as a share of all targets.
    Counting every token, prompts too, said 1,120 tokens (53.1% of the training tokens) here, where 760 targets
    (75.6% of the targets) are lost: long prompts before replies that end past the window, short records
    otherwise."""
    records = _records(5, 60, words=2)
    for i in range(0, 60, 6):
        records[i] = {
            "q": "p" * (SEQ + 10 + i),
            "a": "r" * (SEQ + i),
        }  # a long prompt, a reply past the window
    data = TokenDataset(_prepare(tmp_path, "prompts", records), "document")
    lost, targets = _lost_targets(data, SEQ)
    tokens_lost = int(re.search(r"their ([\d,]+) tokens", long_documents(data, SEQ))[1].replace(",", ""))
    assert abs(100 * lost / targets - 100 * tokens_lost / data.n_tokens) > 10  # the two shares differ here
    warning = long_documents(data, SEQ, loss_mask=True)
    assert (
        f"their {lost:,} targets past the first {SEQ + 1} tokens ({100 * lost / targets:.3g}% of the "
        in warning
    )
    assert warning.endswith("training targets) are never trained; set model.seq_len >= " + _fix(data))
    # a held-out split's training part: its own targets (not the whole file's, which its metadata records)
    part, held = open_data([(str(data.path), 1.0)], valid_fraction=0.3, window_start="document")
    assert part.n_targets + held.n_targets == targets == data.meta["loss_mask"]["n_targets"]
    assert held.n_targets == int(np.asarray(held.mask).sum()) > 0
    lost, targets = _lost_targets(part, SEQ)
    assert f"({100 * lost / targets:.3g}% of the training targets)" in long_documents(
        part, SEQ, loss_mask=True
    )
    # a blend: lost and all targets summed over the files
    other = TokenDataset(_prepare(tmp_path, "other", records[::-1][:30]), "document")
    both = [_lost_targets(f, SEQ) for f in (data, other)]
    lost, targets = sum(b[0] for b in both), sum(b[1] for b in both)
    warning = long_documents(Blend([data, other], [1.0, 3.0]), SEQ, loss_mask=True)
    assert f"their {lost:,} targets past the first {SEQ + 1} tokens ({100 * lost / targets:.3g}% " in warning


def _fix(data: TokenDataset) -> str:
    lengths = np.diff(np.append(_starts_by_walking(np.asarray(data.tokens)), data.n_tokens))
    return f'{int(lengths.max()) - 1} to train every document whole, or data.window_start = "any" to cut windows anywhere'


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
    """Both with data.loss_mask, so both count targets."""
    warning = long_documents(TokenDataset(files[0], "document"), SEQ, loss_mask=True)
    assert "% of the training targets)" in warning
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


# --- every document opens windows: the last ones too ------------------------------------------------------------

WINDOW = SEQ + 1


def _lengths(rng: random.Random, kind: str) -> list[int]:
    """Document lengths in tokens (each with its end-of-text token) for one file of the given kind."""
    if kind == "single":  # one document, longer than a window (a file needs a whole window)
        return [rng.randint(WINDOW, 3 * WINDOW)]
    if kind == "short":  # every document shorter than a window, the last a lone end-of-text token
        return [rng.randint(1, WINDOW - 1) for _ in range(rng.randint(8, 30))] + [1]
    if kind == "edges":  # lengths around the window's, in random order, the last tiny
        lengths = [WINDOW - 1, WINDOW, WINDOW + 1, 2, 1, 2 * WINDOW, 2 * WINDOW + 1]
        rng.shuffle(lengths)
        return [*lengths, rng.randint(1, 2)]
    if kind == "long_last":  # the last document longer than a window
        return [rng.randint(1, 3 * WINDOW) for _ in range(rng.randint(3, 20))] + [
            rng.randint(WINDOW + 1, 200)
        ]
    return [rng.randint(1, 3 * WINDOW) for _ in range(rng.randint(5, 40))] + [rng.randint(1, 3)]  # mixed


def _file_of(root: Path, lengths: list[int], rng: random.Random, masked: bool) -> Path:
    """A token file whose documents have exactly ``lengths`` tokens: text records, or prompt/completion ones
    split at a random point (the completion and the end-of-text token are the targets)."""
    records = []
    for n in lengths:
        text = "".join(rng.choices("abcdefgh", k=n - 1))
        cut = rng.randint(0, n - 1)
        records.append({"q": text[:cut], "a": text[cut:]} if masked else {"text": text})
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / "docs.bin"
    keys = {"prompt_key": "q", "completion_key": "a"} if masked else {}
    prepare([root / "docs.jsonl"], out, "byte", workers=1, **keys)
    return out


def _one_window_per_document(data: TokenDataset, seed: int) -> dict[int, int]:
    """{document start: the first sample index whose window opens there}, drawing indices until every document
    opened one (an epoch: each document's own window once)."""
    n_docs, first = len(_starts_by_walking(np.asarray(data.tokens))), {}
    for i in range(200 * n_docs):
        first.setdefault(data.start(i, SEQ, seed), i)
        if len(first) == n_docs:
            return first
    raise AssertionError(f"{n_docs - len(first)} of {n_docs} documents never open a window")


@pytest.mark.parametrize("masked", [False, True], ids=["tokens", "loss_mask"])
@pytest.mark.parametrize("case", range(12))
def test_every_document_is_a_target_once_per_epoch_up_to_the_window(tmp_path, case, masked):
    """Random documents (the kinds of `_lengths`: shorter and longer than a window, around its length, the last
    one tiny or long, a single one). Over one window opened at each document, drawn by the sampler, every token
    of every document but its first is a target of its own document's window exactly once, up to the window's
    length (seq_len + 1 tokens from its start), and never past it — the tokens the long-document warning
    counts. With a loss mask, the same holds for the tokens it marks. Before, the documents that start less
    than a window before the end opened none: e.g. the last document's tokens were trained only where an
    earlier window's fill reached them, or never."""
    rng = random.Random(case)
    kind = ["mixed", "short", "edges", "long_last", "single", "mixed"][case % 6]
    lengths = _lengths(rng, kind)
    if sum(lengths) < WINDOW:  # a file needs one window's tokens (refused otherwise, as ever)
        lengths.insert(0, WINDOW)
    data = TokenDataset(_file_of(tmp_path, lengths, rng, masked), "document")
    tokens = np.asarray(data.tokens)
    marked = np.asarray(data.mask) != 0 if masked else np.ones(len(tokens), dtype=bool)
    starts = _starts_by_walking(tokens)
    assert np.diff([*starts, len(tokens)]).tolist() == lengths
    ends = dict(zip(starts, [*starts[1:], len(tokens)], strict=True))
    trained = np.zeros(len(tokens), dtype=np.int64)  # how often each token is its own document's target
    for start, i in _one_window_per_document(data, seed=case).items():
        x, y = data.sample(i, SEQ, case)
        window = _ring_of(
            tokens, start, WINDOW
        )  # past the end: the file's first tokens, as any window's fill
        assert np.array_equal(x, window[:-1]) and np.array_equal(y, window[1:])
        keep = data.target_mask(i, SEQ, case) if masked else np.ones(SEQ, dtype=bool)
        assert np.array_equal(keep, _ring_of(marked, start + 1, SEQ))
        own = np.arange(start + 1, min(ends[start], start + WINDOW))  # its own document's targets
        trained[own] += keep[own - start - 1]
    offsets = np.concatenate(
        [np.arange(b - a) for a, b in ends.items()]
    )  # each token's place in its document
    expected = (offsets >= 1) & (offsets < WINDOW) & marked
    assert np.array_equal(trained, expected.astype(np.int64))
    # what is never trained is what the warning counts
    never = int(((offsets >= WINDOW) & marked).sum())
    warning = long_documents(data, SEQ, loss_mask=masked)
    assert (warning is None) == (never == 0)
    if warning:
        assert (
            f"their {never:,} {'targets' if masked else 'tokens'} past the first {WINDOW} tokens" in warning
        )


def test_the_window_order_changed_for_windows_at_document_starts(files):
    """Every document now opens windows, so the number the hash is reduced by is the number of documents, not
    of those a whole window before the end: the same sample index draws another start (a checkpoint of the
    earlier rule resumes only with checkpoint.new_data_order: test_a_checkpoint_of_the_earlier_rule_...)."""
    data = TokenDataset(files[0], "document")
    starts = data.document_starts
    earlier = int(np.searchsorted(starts, data.n_tokens - SEQ))  # the earlier rule's eligible starts
    assert earlier < len(starts)
    now = [data.start(i, SEQ, 9) for i in range(100)]
    assert now == [int(starts[window_start(i, 9, len(starts))]) for i in range(100)]
    assert now != [int(starts[window_start(i, 9, earlier)]) for i in range(100)]


# --- the index of document starts is cached beside the file ------------------------------------------------------


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the token arrays scanned for document starts from here on (one per cache miss)."""
    calls: list[int] = []
    real = data_module._document_starts

    def counting(tokens: np.ndarray, eot: int, *rest: int) -> np.ndarray:
        calls.append(len(tokens))
        return real(tokens, eot, *rest)

    monkeypatch.setattr(data_module, "_document_starts", counting)
    return calls


def test_the_index_is_cached_and_read_back_whatever_the_seq_len(tmp_path, scans):
    path = _prepare(tmp_path, "c", _records(3, 120, long_every=11))
    walked = _starts_by_walking(np.asarray(TokenDataset(path).tokens))
    first = TokenDataset(path, "document")
    assert first.document_starts.tolist() == walked and scans == [first.n_tokens]
    assert first.index_path == tmp_path / "c.bin.doc-starts" and first.index_path.is_file()
    again = TokenDataset(path, "document")
    assert again.document_starts.tolist() == walked and len(scans) == 1  # read back: no scan
    # the held-out split's parts take their starts from the file's index
    part, held = open_data([(str(path), 1.0)], valid_fraction=0.25, window_start="document")
    cut = part.n_tokens
    assert part.document_starts.tolist() == [s for s in walked if s < cut]
    assert held.document_starts.tolist() == [s - cut for s in walked if s >= cut]
    assert len(scans) == 1
    # the index holds every start, whatever the window: the cached one draws the windows a scan draws, at any
    # seq_len (each window's start, tokens and mask)
    first.index_path.unlink()
    scanned = TokenDataset(path, "document", write_index=False)
    for seq in (8, SEQ, 100):
        for i in range(0, 300, 7):
            assert again.start(i, seq, 3) == scanned.start(i, seq, 3)
            assert np.array_equal(again.sample(i, seq, 3)[1], scanned.sample(i, seq, 3)[1])
            assert np.array_equal(again.target_mask(i, seq, 3), scanned.target_mask(i, seq, 3))
    assert len(scans) == 2 and not first.index_path.exists()  # write_index=False: scanned, nothing written


def test_a_stale_index_is_rebuilt(tmp_path, scans):
    """The token file prepared again (other documents), or changed in place (a new modification time): the
    cache no longer describes it, so the file is scanned again and the cache rewritten."""
    path = _prepare(tmp_path, "c", _records(3, 120))
    TokenDataset(path, "document").document_starts  # noqa: B018
    _prepare(tmp_path, "c", _records(4, 90))
    data = TokenDataset(path, "document")
    assert data.document_starts.tolist() == _starts_by_walking(np.asarray(data.tokens)) and len(scans) == 2
    assert TokenDataset(path, "document").document_starts.tolist() == data.document_starts.tolist()
    assert len(scans) == 2  # rewritten: read back
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert TokenDataset(path, "document").document_starts.tolist() == data.document_starts.tolist()
    assert len(scans) == 3


def _damage(path: Path, how: str) -> None:
    raw = path.read_bytes()
    header = raw.index(b"\n") + 1
    middle = header + 8 * ((len(raw) - header) // 16)  # the lowest byte of the middle start
    damaged = {
        "truncated": raw[:-8],
        "longer": raw + raw[-8:],
        # a start moved by one: still an ascending index inside the file, caught by the checksum alone
        "flipped": raw[:middle] + bytes([raw[middle] ^ 1]) + raw[middle + 1 :],
        "header": b"{not json\n" + raw[header:],
        "other_format": raw.replace(data_module.INDEX_FORMAT.encode(), b"tessera-document-starts/0"),
        "empty": b"",
    }[how]
    path.write_bytes(damaged)


@pytest.mark.parametrize("how", ["truncated", "longer", "flipped", "header", "other_format", "empty"])
def test_a_damaged_index_is_rebuilt(tmp_path, scans, how):
    path = _prepare(tmp_path, "c", _records(3, 120))
    cached = TokenDataset(path, "document")
    walked = cached.document_starts.tolist()
    _damage(cached.index_path, how)
    assert TokenDataset(path, "document").document_starts.tolist() == walked and len(scans) == 2
    assert TokenDataset(path, "document").document_starts.tolist() == walked and len(scans) == 2  # rewritten


def test_an_index_that_cannot_be_written_is_a_warning(tmp_path, scans):
    path = _prepare(tmp_path, "c", _records(3, 60))
    data = TokenDataset(path, "document")
    data.index_path.mkdir()  # something in the way (a read-only folder fails the same way, but not as root)
    with pytest.warns(
        UserWarning, match=r"cannot be cached in .*c\.bin\.doc-starts.*scans the file for them again"
    ):
        starts = data.document_starts
    assert starts.tolist() == _starts_by_walking(np.asarray(data.tokens))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp file left


def test_only_rank_0_writes_the_index(files, tmp_path):
    """The trainer opens the data on every rank, and only rank 0's may write the cache (the other ranks read
    it after a barrier: tests/distributed/test_document_index.py)."""
    path = tmp_path / "copy.bin"
    for suffix in (".bin", ".json", ".mask"):
        path.with_suffix(suffix).write_bytes(files[1].with_suffix(suffix).read_bytes())
    cfg = from_dict(_config([path], tmp_path / "run"))
    data, _ = _open_data(cfg, 1)
    assert data.document_starts.tolist() == _starts_by_walking(np.asarray(data.tokens))
    assert not data.index_path.exists()
    data, _ = _open_data(cfg, 0)
    data.document_starts  # noqa: B018
    assert data.index_path.is_file()


def test_a_checkpoint_of_the_earlier_rule_resumes_only_with_a_new_data_order(files, tmp_path):
    """A checkpoint written before every document opened windows (its settings record no
    data.document_windows) drew other windows for the remaining sample indices: the resume is refused, naming
    the opt-in, and with checkpoint.new_data_order it continues from the checkpoint's step by the new rule."""
    raw = _config([files[0]], tmp_path / "run")
    raw["checkpoint"] = {"every": 1, "resume": True}
    train(from_dict(raw))
    meta = tmp_path / "run" / "checkpoints" / "step_00000001" / "meta.json"
    saved = json.loads(meta.read_text())
    assert saved["extra"]["settings"].pop("data.document_windows") == data_module.DOCUMENT_WINDOWS
    meta.write_text(json.dumps(saved))  # as the earlier version wrote it
    raw["train"]["steps"] = 2
    with pytest.raises(CheckpointError, match=r"data\.document_windows .*checkpoint\.new_data_order = true"):
        train(from_dict(raw))
    raw["checkpoint"]["new_data_order"] = True
    result = train(from_dict(raw))
    assert result.resumed_from == 1 and sorted(result.losses) == [1]
