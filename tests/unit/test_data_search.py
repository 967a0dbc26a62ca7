"""A small deterministic slice of benchmarks/data_search.py: drawn corpora in every input format, prepared by
`tessera prepare` in process, must equal the oracle's token stream, counts and held-out split; the bad inputs
must be messages with exit status 2. The full search (more corpora, training runs) is the benchmark."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "data_search.py"
_SPEC = importlib.util.spec_from_file_location("data_search", _PATH)
search = importlib.util.module_from_spec(_SPEC)
sys.modules["data_search"] = search  # dataclasses resolve their module by name
_SPEC.loader.exec_module(search)

SEED = 6  # a draw of all three tokenizer kinds (byte, tokenizer.json, folder) that runs in about a second
CORPORA = 8


def _stats() -> dict:
    return dict(
        cases=0, prepared=0, refused=0, records=0, bad=0, skipped=0, tokens=0, errors=0, tokenizers={}
    )


def test_drawn_corpora_match_the_oracle(tmp_path: Path) -> None:
    rng, stats = random.Random(SEED), _stats()
    found = []
    for i in range(CORPORA):
        (tmp_path / f"c{i}").mkdir()
        found += search.check_prepare(rng, tmp_path / f"c{i}", i, stats)
    assert not found, "\n".join(found)
    assert stats["prepared"] >= CORPORA // 2 and stats["bad"] > 0 and stats["tokens"] > 1000  # not vacuous


def test_bad_inputs_are_messages(tmp_path: Path) -> None:
    stats = _stats()
    found = search.check_errors(tmp_path, random.Random(SEED), 100, stats)
    assert not found, "\n".join(found)
    assert stats["errors"] >= 20
