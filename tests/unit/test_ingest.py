"""`tessera prepare` inputs: JSONL (plain and gzip), JSON arrays, Parquet, HF dataset folders and text files;
the end-of-text rules; bad records; the same token file for any number of workers. Fixtures are written here."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tessera.errors import DataError
from tessera.train import ingest
from tessera.train.data import TokenDataset, prepare

TEXTS = ["first document", "zweites Dokument — ü", "third\nwith a newline", "4"]


def _stream(meta: dict, out: Path) -> str:
    """The token file as text, NUL (the byte tokenizer's end-of-text) shown as '|'."""
    assert meta["eot"] == 0
    return bytes(TokenDataset(out).tokens.tolist()).decode().replace("\0", "|")


EXPECTED = "".join(t + "|" for t in TEXTS)


def _write_jsonl(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_jsonl_one_document_per_record(tmp_path):
    _write_jsonl(tmp_path / "c.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    meta = prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin")
    assert _stream(meta, tmp_path / "t.bin") == EXPECTED
    assert meta["n_documents"] == len(TEXTS) and meta["n_bad_records"] == 0


def test_jsonl_gz_json_array_and_text_key(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": t}) + "\n" for t in TEXTS[:2])
    (tmp_path / "b.json").write_text(json.dumps([{"body": t} for t in TEXTS[2:]]))
    meta = prepare([tmp_path / "a.jsonl.gz", tmp_path / "b.json"], tmp_path / "t.bin", text_key="body")
    assert _stream(meta, tmp_path / "t.bin") == EXPECTED


def _table(texts: list):
    pa = pytest.importorskip("pyarrow")
    return pa.table({"text": texts, "n": list(range(len(texts)))})


def test_parquet_row_groups(tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(_table(TEXTS), tmp_path / "c.parquet", row_group_size=3)
    assert len(ingest.find_units([tmp_path / "c.parquet"], "text")) == 2  # one unit per row group
    meta = prepare([tmp_path / "c.parquet"], tmp_path / "t.bin")
    assert _stream(meta, tmp_path / "t.bin") == EXPECTED
    with pytest.raises(DataError, match=r"no column 'body' \(columns: text, n\).*--text-key"):
        prepare([tmp_path / "c.parquet"], tmp_path / "t.bin", text_key="body")


def _save_to_disk(folder: Path, texts: list) -> None:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow stream files listed in state.json."""
    import pyarrow as pa

    folder.mkdir()
    table = _table(texts)
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, part in zip(names, (table.slice(0, 2), table.slice(2)), strict=True):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as writer:
            writer.write_table(part)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))


def test_hf_dataset_folder(tmp_path):
    _save_to_disk(tmp_path / "ds", TEXTS)
    meta = prepare([tmp_path / "ds"], tmp_path / "t.bin")
    assert _stream(meta, tmp_path / "t.bin") == EXPECTED
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match=r"DatasetDict with splits \['train', 'test'\]; pass one split"):
        prepare([tmp_path / "dd"], tmp_path / "t.bin")


def test_dataset_folders_inside_a_walked_folder(tmp_path):
    """Found by benchmarks/data_search.py: a walked folder read a save_to_disk folder inside it file by file (its
    state.json and dataset_info.json as bad records), and a DatasetDict inside it split by split, the test split
    included, into the training data. Now the dataset folder is read as one, where its files sort, in
    state.json's order, and the DatasetDict is refused by name."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("before")
    _save_to_disk(corpus / "b_ds", TEXTS)
    (corpus / "b_ds" / "state.json").write_text(  # state.json's order, not the names' order
        json.dumps({"_data_files": [{"filename": f"data-0000{i}-of-00002.arrow"} for i in (1, 0)]})
    )
    (corpus / "c.txt").write_text("after")
    meta = prepare([corpus], tmp_path / "t.bin")
    assert (
        _stream(meta, tmp_path / "t.bin")
        == "before|" + "".join(t + "|" for t in TEXTS[2:] + TEXTS[:2]) + "after|"
    )
    assert meta["n_bad_records"] == 0 and meta["n_documents"] == 2 + len(TEXTS)
    for split in ("train", "test"):
        (corpus / "dd").mkdir(exist_ok=True)
        _save_to_disk(corpus / "dd" / split, TEXTS)
    (corpus / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match=r"dd' is a Hugging Face DatasetDict with splits \['train', 'test'\]"):
        prepare([corpus], tmp_path / "t.bin")


def test_byte_order_mark_opening_json_and_jsonl(tmp_path, monkeypatch):
    """Found by benchmarks/data_search.py: a JSONL file opening with a UTF-8 BOM (as Windows tools write it) lost its
    first record as "not JSON", a JSON array file all of them; JSON allows ignoring the BOM (RFC 8259, 8.1). Only
    the file's first unit starts with it: a later JSONL unit keeps its bytes."""
    monkeypatch.setattr(ingest, "JSONL_CHUNK", 16)  # one unit per line
    bom = b"\xef\xbb\xbf"
    (tmp_path / "c.jsonl").write_bytes(bom + "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode())
    (tmp_path / "d.json").write_bytes(bom + json.dumps([{"text": t} for t in TEXTS]).encode())
    for name in ("c.jsonl", "d.json"):
        meta = prepare([tmp_path / name], tmp_path / "t.bin")
        assert _stream(meta, tmp_path / "t.bin") == EXPECTED and meta["n_bad_records"] == 0
    (tmp_path / "e.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    lines = pytest.warns(UserWarning, match=r"e.json: not a JSON file \(Extra data.*name the file .jsonl")
    with lines, pytest.raises(DataError, match="no text found"):
        prepare([tmp_path / "e.json"], tmp_path / "t.bin")


def test_a_broken_symbolic_link_in_a_folder_is_named(tmp_path):
    """Found by benchmarks/data_search.py: a link to a missing file inside a walked folder was left out without a
    word (a folder of only such links said "no text found in 0 input part(s)")."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text")
    (tmp_path / "corpus" / "b.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.warns(
        UserWarning, match=r"skipping .*b.txt: a symbolic link to .*gone.txt', which does not exist"
    ):
        meta = prepare([tmp_path / "corpus"], tmp_path / "t.bin")
    assert meta["n_documents"] == 1


def test_missing_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(DataError, match=r"needs the `pyarrow` package.*pip install 'tessera\[data\]'"):
        prepare([tmp_path / "c.parquet"], tmp_path / "t.bin")


def _bad_jsonl(path: Path) -> None:
    lines = [
        json.dumps({"text": "good one"}),
        json.dumps({"body": "no text field"}),
        json.dumps({"text": 42}),
        b'{"text": "caf\xe9"}'.decode("latin-1"),
        "{not json",
        json.dumps({"text": "has a \0 inside"}),
        json.dumps({"text": "good two"}),
    ]
    path.write_bytes("\n".join(lines).encode("latin-1") + b"\n")


def test_bad_records_are_counted_and_reported_by_line(tmp_path):
    _bad_jsonl(tmp_path / "c.jsonl")
    with pytest.warns(UserWarning, match="5 bad record") as record:
        meta = prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin")
    message = str(record[0].message)
    for line, why in [
        (2, "missing field 'text'"),
        (3, "field 'text' has type int, not a string"),
        (4, "invalid UTF-8"),
    ]:
        assert f"c.jsonl:{line}: {why}" in message
    assert "c.jsonl:5: not JSON" in message and "c.jsonl:6: contains the end-of-text token" in message
    assert meta["n_bad_records"] == 5 and meta["n_documents"] == 2
    assert _stream(meta, tmp_path / "t.bin") == "good one|good two|"


def test_strict_stops_at_the_first_bad_record(tmp_path):
    _bad_jsonl(tmp_path / "c.jsonl")
    with pytest.raises(DataError, match=r"--strict stops at the first\): .*c.jsonl:2: missing field 'text'"):
        prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin", strict=True)
    assert not (tmp_path / "t.bin").exists()


def _bpe(path: Path, special: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", *special])
    tok.train_from_iterator(TEXTS * 10, trainer)
    tok.save(str(path))


def test_tokenizer_without_end_of_text_needs_eot_token(tmp_path):
    pytest.importorskip("tokenizers")
    _bpe(tmp_path / "tok.json", ["<sep>"])
    _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    spec = str(tmp_path / "tok.json")
    with pytest.raises(DataError, match=r"has no end-of-text token.*--eot-token"):
        prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin", spec)
    with pytest.raises(DataError, match=r"--eot-token '<nope>' is not a token"):
        prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin", spec, eot_token="<nope>")
    meta = prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin", spec, eot_token="<sep>")
    ids = TokenDataset(tmp_path / "t.bin").tokens.tolist()
    assert meta["eot"] == 1 and ids.count(1) == len(TEXTS) and ids[-1] == 1


def test_eot_token_number_is_an_id_even_when_it_is_also_a_token(tmp_path):
    """Found by benchmarks/data_search.py: `--eot-token 0` with the byte tokenizer, or `--eot-token 2` (the fix
    the no-end-of-text error suggests) with a byte-level BPE, whose alphabet holds the token "2", ended every
    document with the digit's token (byte 48, ...), not with id 0 or 2. This BPE learnt "4" from its texts."""
    _write_jsonl(tmp_path / "c.jsonl", [{"text": "a b"}, {"text": "c"}])
    meta = prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin", eot_token="0")
    assert meta["eot"] == 0 and TokenDataset(tmp_path / "t.bin").tokens.tolist() == [97, 32, 98, 0, 99, 0]
    pytest.importorskip("tokenizers")
    _bpe(tmp_path / "tok.json", ["<sep>"])
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tmp_path / "tok.json")).token_to_id("4") not in (None, 4)  # the ambiguity
    assert (
        prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin", str(tmp_path / "tok.json"), eot_token="2")["eot"]
        == 2
    )
    with pytest.raises(DataError, match=r"--eot-token '300' is not an id"):
        prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin", str(tmp_path / "tok.json"), eot_token="300")


def test_eot_token_with_a_non_ascii_digit_is_a_message(tmp_path):
    """ "²".isdigit() is true but int("²") raises: was a ValueError traceback from `tessera prepare`."""
    _write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}])
    with pytest.raises(DataError, match=r"--eot-token '²' is not a token"):
        prepare([tmp_path / "c.jsonl"], tmp_path / "t.bin", eot_token="²")


def test_same_tokens_for_any_number_of_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest, "JSONL_CHUNK", 64)  # many small units out of one file
    records = [{"text": f"record {i} " * (i % 7 + 1)} for i in range(60)]
    _write_jsonl(tmp_path / "c.jsonl", [*records[:45], {"txt": "bad"}, *records[45:]])
    (tmp_path / "d.txt").write_text("a text file\n")
    inputs = [tmp_path / "c.jsonl", tmp_path / "d.txt"]
    units = ingest.find_units(inputs, "text")
    assert len(units) > 10 and units[0].first == 1 and units[1].first > 1
    with pytest.warns(UserWarning, match=r"c.jsonl:46: missing field 'text'"):  # line 46 of the file
        one = prepare(inputs, tmp_path / "one.bin", workers=1)
    with pytest.warns(UserWarning, match=r"c.jsonl:46: missing field 'text'"):
        two = prepare(inputs, tmp_path / "two.bin", workers=2)
    assert one["sha256"] == two["sha256"] and one["n_documents"] == 61
    expected = "".join(r["text"] + "|" for r in records) + "a text file\n|"
    assert _stream(one, tmp_path / "one.bin") == expected
    assert np.array_equal(
        TokenDataset(tmp_path / "two.bin").tokens, TokenDataset(tmp_path / "one.bin").tokens
    )
