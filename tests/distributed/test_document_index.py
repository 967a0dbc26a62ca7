"""data.window_start = "document" on two ranks: the index of each file's document starts is built and cached by
rank 0 alone, before a barrier, and read back by the other rank (no second scan, no second writer); a later
launch reads it on every rank. The cache itself (hit, stale, damaged): tests/unit/test_document_windows.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import tessera.train.data as data_module
from tessera.config import from_dict
from tessera.train.data import prepare
from tests.harness import run_distributed


def _files(root: Path) -> list[Path]:
    """Two small text token files (training, validation) of documents of varied length."""
    out = []
    for name, n in (("train", 300), ("valid", 80)):
        text = "".join(f"document {i} " + "word " * (i % 23) + "\n\n" for i in range(n))
        (root / f"{name}.txt").write_text(text)
        prepare([root / f"{name}.txt"], root / f"{name}.bin", "byte", workers=1)
        out.append(root / f"{name}.bin")
    return out


def _open_on_rank(rank: int, world: int, raw: dict) -> dict[str, Any]:
    """The trainer's opening of the data on this rank: how often it scanned a file and wrote a cache, and the
    starts it then holds."""
    from tessera.train.trainer import _open_data

    scans, writes = [], []
    scan, write = data_module._document_starts, data_module._write_index
    data_module._document_starts = lambda tokens, *a: scans.append(len(tokens)) or scan(tokens, *a)
    data_module._write_index = lambda path, *a: writes.append(path.name) or write(path, *a)
    data, valid = _open_data(from_dict(raw), rank)
    starts = [data.document_starts.tolist(), valid.document_starts.tolist()]
    return {"scans": len(scans), "writes": sorted(writes), "starts": starts}


def test_rank_0_alone_writes_the_index_and_the_others_read_it(tmp_path: Path) -> None:
    train_file, valid_file = _files(tmp_path)
    raw = {
        "model": {"size": "gpt2-tiny", "n_layers": 1, "seq_len": 32},
        "data": {"path": str(train_file), "valid_path": str(valid_file), "window_start": "document"},
        "log": {"run_dir": str(tmp_path / "run")},
    }
    first = run_distributed(_open_on_rank, 2, raw)
    assert first[0]["scans"] == 2 and first[0]["writes"] == ["train.bin.doc-starts", "valid.bin.doc-starts"]
    assert first[1]["scans"] == 0 and first[1]["writes"] == []  # read rank 0's cache after the barrier
    walked = [
        [0, *(np.flatnonzero(np.fromfile(f, dtype="<u2")[:-1] == 0) + 1).tolist()]
        for f in (train_file, valid_file)
    ]
    assert first[0]["starts"] == first[1]["starts"] == walked
    again = run_distributed(_open_on_rank, 2, raw)  # a later launch: every rank reads the cache
    assert [(r["scans"], r["writes"]) for r in again] == [(0, []), (0, [])]
    assert again[0]["starts"] == again[1]["starts"] == walked
