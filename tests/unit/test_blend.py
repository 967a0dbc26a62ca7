"""Blends of token files by weight, held-out validation documents, and the checks `tessera validate` makes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tessera.config import from_dict
from tessera.errors import DataError
from tessera.pipeline.build import lowered_schedule
from tessera.pipeline.ir import ActionKind
from tessera.pipeline.run_order import forward_only
from tessera.train.data import Blend, TokenDataset, batch_indices, open_data, prepare


def _file(tmp_path: Path, name: str, letter: str, docs: int = 50) -> Path:
    """A token file whose documents are runs of one letter (so a sample's source is visible in its tokens)."""
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": letter * (20 + i % 9)}) + "\n" for i in range(docs)))
    prepare([src], tmp_path / f"{name}.bin", workers=1)
    return tmp_path / f"{name}.bin"


def _source(x: np.ndarray) -> str:
    letters = {chr(t) for t in x.tolist() if t}
    assert len(letters) == 1
    return letters.pop()


def test_blend_mix_is_within_two_percent_of_the_weights(tmp_path):
    files = [_file(tmp_path, n, letter) for n, letter in (("a", "a"), ("b", "b"), ("c", "c"))]
    blend = Blend([TokenDataset(f) for f in files], [5.0, 3.0, 2.0])
    n = 10_000
    counts = {"a": 0, "b": 0, "c": 0}
    for i in range(n):
        counts[_source(blend.sample(i, 8, seed=7)[0])] += 1
    for letter, weight in zip("abc", (0.5, 0.3, 0.2), strict=True):
        assert abs(counts[letter] / n - weight) < 0.02, counts


def test_blend_is_a_pure_function_of_seed_and_index(tmp_path):
    files = [TokenDataset(_file(tmp_path, n, n)) for n in "ab"]
    blend = Blend(files, [1.0, 1.0])
    picks = [blend.source_of(i, 3) for i in range(200)]
    assert picks == [Blend(files, [2.0, 2.0]).source_of(i, 3) for i in range(200)]  # only ratios matter
    assert picks != [blend.source_of(i, 4) for i in range(200)] and 50 < sum(picks) < 150
    # one global step seen by dp 1 or dp 4 (any micro split): the same samples in the same slots
    one = [blend.sample(i, 8, 3)[0].tolist() for i in batch_indices(5, 8, 0, 1, 0, 8)]
    four = [blend.sample(i, 8, 3)[0].tolist() for r in range(4) for i in batch_indices(5, 8, r, 4, 0, 2)]
    assert sorted(one) == sorted(four)


def test_valid_fraction_holds_out_whole_documents(tmp_path):
    path = _file(tmp_path, "a", "a", docs=40)
    full = TokenDataset(path)
    train, valid = full.split_documents(0.1)
    cut = train.n_tokens
    assert train.n_tokens + valid.n_tokens == full.n_tokens
    assert full.tokens[cut - 1] == 0 and valid.tokens[-1] == 0  # the cut follows an end-of-text token
    assert 0.08 < valid.n_tokens / full.n_tokens < 0.15
    assert np.array_equal(valid.tokens, full.tokens[cut:]) and np.array_equal(train.tokens, full.tokens[:cut])
    assert max(train.sample(i, 16, seed=1)[1].size for i in range(50)) == 16  # windows come from the view
    with pytest.raises(DataError, match="no document boundary"):
        TokenDataset(path).split_documents(0.001)
    train2, valid2 = open_data([(str(path), 1.0)], valid_fraction=0.1)
    assert train2.n_tokens == cut and valid2.n_tokens == valid.n_tokens


def _raw(path: object, vocab: int = 256, **data: object) -> dict:
    return {"model": {"vocab_size": vocab}, "data": {"path": path, **data}}


def test_config_accepts_lists_and_weighted_tables(tmp_path):
    a, b = _file(tmp_path, "a", "a"), _file(tmp_path, "b", "b")
    cfg = from_dict(_raw([str(a), {"path": str(b), "weight": 3}]))
    assert cfg.data.sources() == [(str(a), 1.0), (str(b), 3.0)] and cfg.check(1) == []
    train, valid = open_data(cfg.data.sources())
    assert isinstance(train, Blend) and valid is None
    bad = from_dict(_raw([{"path": str(a), "weight": 0}, {"file": "x"}, 3, str(tmp_path / "no.bin")]))
    problems = "\n".join(map(str, bad.check(1)))
    assert "data.path[0].weight = 0 is not a positive number" in problems
    assert "data.path[1] = {'file': 'x'} is not a {path, weight} table" in problems
    assert "data.path[2] = 3 is neither a file name" in problems and "data.path[3]" in problems


def test_validate_checks_every_files_vocabulary_dtype_and_tokenizer(tmp_path):
    a, b = _file(tmp_path, "a", "a"), _file(tmp_path, "b", "b")
    problems = "\n".join(map(str, from_dict(_raw([str(a), str(b)], vocab=128)).check(1)))
    assert problems.count("tokenized with 256 tokens but model.vocab_size = 128") == 2
    meta = json.loads(b.with_suffix(".json").read_text())
    b.with_suffix(".json").write_text(json.dumps({**meta, "dtype": "uint32", "tokenizer": "other.json"}))
    problems = "\n".join(map(str, from_dict(_raw([str(a), str(b)])).check(1)))
    assert "stores uint32 tokens for a vocabulary of 256" in problems
    assert "made by different tokenizers" in problems
    raw = _raw(str(a), valid_fraction=0.1)
    raw["train"] = {"eval_every": 5}
    assert from_dict(raw).check(1) == []
    raw["data"] = {"path": str(a)}
    assert [v.rule for v in from_dict(raw).check(1)] == ["train.eval_every"]


def test_forward_only_keeps_forwards_messages_and_forward_gathers():
    lowered, _ = lowered_schedule("breadth_first", 2, 4, 2, zero3=True)
    for actions in lowered:
        kept = forward_only(actions)
        forwards = [a for a in actions if a.kind is ActionKind.FORWARD]
        assert [a for a in kept if a.kind is ActionKind.FORWARD] == forwards  # same forwards, same order
        assert {a.kind for a in kept} <= {"F", "SEND_F", "RECV_F", "GATHER", "FREE"}
        open_stages: set[int] = set()
        for a in kept:  # every GATHER is closed by a FREE with a forward of that stage in between
            if a.kind is ActionKind.GATHER_PARAMS:
                open_stages.add(a.stage)
            elif a.kind is ActionKind.FREE_PARAMS:
                assert a.stage in open_stages
                open_stages.discard(a.stage)
        assert not open_stages
