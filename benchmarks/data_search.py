"""Seeded search for disagreements between `tessera prepare` / training and independent oracles of the data path.

Every corpus is generated on disk here (nothing downloaded): random documents (empty, whitespace-only, very long,
non-ASCII, emoji and CJK, NUL characters, ``\\r\\n``, a BOM, the end-of-text token's own text; text files with
invalid UTF-8 or NUL bytes) in every input format of docs/data.md — text folders with nested and hidden
entries, JSONL, JSONL.gz, JSON arrays, Parquet with other columns, nulls and list columns in small row groups,
and ``datasets.Dataset.save_to_disk`` folders (written as ``datasets`` writes them: Arrow IPC streams listed in
``state.json``; ``datasets`` itself is not installed) — with a drawn ``--text-key`` and bad records of every
documented kind. Tokenizers: byte; a ``tokenizers`` BPE or WordLevel ``tokenizer.json`` trained on the fly
(end-of-text names drawn from the documented list, sometimes two of them); a ``save_pretrained`` folder written
by ``transformers.PreTrainedTokenizerFast`` whose EOS is drawn (also one that is not first in the list, and one
given only by config.json's ``eos_token_id``).

Oracles, none of them tessera's code:

- **token stream**: the documents each record was generated as, in the documented order (inputs as given,
  folders by sorted relative path, hidden entries skipped, Arrow files in ``state.json`` order), encoded by the
  tokenizer's own ``encode`` (``tokenizers``, or ``transformers.AutoTokenizer`` for a folder; no automatic
  BOS/EOS, docs/huggingface.md), each followed by the documented end-of-text id; a document whose ids hold that
  id, a record without the key or with a non-string value, invalid JSON or UTF-8 are bad records; a text file
  with NUL or invalid UTF-8 is skipped. The token file must equal it byte for byte (uint16 below 65,536 ids,
  else uint32) and the metadata must count the same documents, bad records, skipped files, tokens, largest id,
  and its sha256; each warning location (``file:line``, ``file:row N``, ``file:record N``) must be a bad
  record's, and each file's first bad record must be named. With ``--strict`` a corpus with any bad input must
  fail (exit 2) naming the first. JSONL units are cut at a drawn small byte size (`ingest.JSONL_CHUNK`), so
  line numbers and documents must survive the cut; ``--workers`` is drawn 1 or 2.
- **held-out split**: the cut is the first end-of-text at or after round(n · (1 - fraction)), plus one
  (docs/data.md); `open_data` must give exactly ``stream[:cut]`` and ``stream[cut:]``.
- **validation loss**: a tiny GPT trained 2 steps (``tessera train``, one process) with ``train.eval_every = 1``
  on a drawn corpus, held out by ``valid_fraction`` or ``valid_path``; its last ``val_loss`` must equal the mean
  next-token cross-entropy that ``transformers.GPT2LMHeadModel`` computes from the run's exported weights
  (``tessera export --format hf``) over the validation windows, which are placed by an independent
  splitmix64 (window of sample i at mix(mix(seed) + (i + 1)·golden) mod (n - seq_len)) over the oracle's
  held-out tokens; relative 1e-5.
- **bad inputs**: a key no record has, a Parquet file without the column or with a non-string column, a save_to_disk
  folder lacking a file or a DatasetDict, a file that cannot be read, an empty corpus, a corrupt tokenizer file,
  an unknown ``--eot-token``, a model whose vocabulary is smaller than the tokenizer's: exit 2 with an
  ``error:`` line naming the file or key, no traceback, and no token file.

    python benchmarks/data_search.py --seed 0 [--corpora 40] [--errors 20] [--runs 3]

Prints one line per disagreement and a summary; the results are in benchmarks/results/data_search.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tessera.cli import main as cli_main
from tessera.train import ingest

EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")  # docs/data.md, in order
PIECES = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "zweites Dokument — ü ö ä ß",
    "日本語のテキストです。",
    "中文文本，测试。",
    "한국어 문장",
    "emoji 😀🎉 👩‍👩‍👧 🏳️‍🌈",
    "tab\tseparated\tvalues",
    "windows\r\nline\r\nends",
    "def f(x):\n    return x * 2\n",
    "\u2028line separator\u2029",
    "  spaced  out  ",
    "math ∑ ∫ √ ≠",
    "<|endoftext|>",
    "</s>",
    "zero\u0000char",
    "\ufeffbom",
]
LOSS_RTOL = 1e-5


# --- tokenizers --------------------------------------------------------------------------------------------


@dataclass
class Tok:
    """A tokenizer as the oracle sees it: its spec for `tessera prepare`, its own encode, its EOT and vocab."""

    kind: str
    spec: str
    eot: int
    vocab: int
    encode: Any
    eot_arg: str | None = None  # --eot-token, when drawn


def make_tokenizer(rng: random.Random, root: Path, corpus: list[str]) -> Tok:
    kind = rng.choice(["byte", "byte", "json", "json", "folder"])
    if kind == "byte":  # its end of text is byte 0, also when named as id "0"
        return Tok("byte", "byte", 0, 256, lambda t: list(t.encode("utf-8")), rng.choice([None, None, "0"]))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    names = rng.sample(EOT_NAMES, rng.choice([1, 1, 2]))
    specials = [*names, "<unk>", "<pad>"]
    rng.shuffle(specials)  # the EOT's id is not the first
    big = kind == "json" and rng.random() < 0.15  # more than 65,535 ids: a uint32 token file
    if big or rng.random() < 0.4:
        words = sorted({w for text in corpus for w in text.split()})
        vocab = {s: i for i, s in enumerate(specials)}
        for w in words + ([f"w{i}" for i in range(70_000)] if big else []):
            vocab.setdefault(w, len(vocab))
        tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        for s in specials:
            tk.add_special_tokens([s])
        kind += "-wordlevel"
    else:
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=rng.choice([300, 400, 600]),
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tk.train_from_iterator(corpus, trainer)
        kind += "-bpe"
    vocab = tk.get_vocab()
    first = next(vocab[n] for n in EOT_NAMES if n in vocab)
    if kind.startswith("json"):
        path = root / "tokenizer.json"
        tk.save(str(path))
        own = Tokenizer.from_file(str(path))
        eot, eot_arg = first, None
        if rng.random() < 0.2:  # name another special token as end of text, by name or by id
            other = rng.choice(specials)
            eot, eot_arg = vocab[other], rng.choice([other, str(vocab[other])])
        return Tok(
            kind,
            str(path),
            eot,
            own.get_vocab_size(),
            lambda t: own.encode(t, add_special_tokens=False).ids,
            eot_arg,
        )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = root / "tok"
    eos = rng.choice(names)  # also one that is not first in the documented list: the folder's EOS wins
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(folder)
    if rng.random() < 0.25:  # EOS only in the model's config.json (a folder saved without it)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg.pop("eos_token", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        (folder / "config.json").write_text(json.dumps({"eos_token_id": vocab[eos]}))
        kind += "-configjson"
    auto = AutoTokenizer.from_pretrained(folder)
    eot = vocab[eos]
    return Tok(kind, str(folder), eot, len(auto), lambda t: auto.encode(t, add_special_tokens=False))


# --- documents and corpora ---------------------------------------------------------------------------------


def random_text(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.08:
        return ""
    if r < 0.14:
        return rng.choice([" ", "\n", "\t \n", "\r\n\r\n", "\u3000"])
    n = rng.choice([1, 2, 3, 5]) if r < 0.95 else rng.randint(300, 1500)  # very long: tens of KB
    return rng.choice(["", " ", "\n"]).join(rng.choice(PIECES) for _ in range(n))


@dataclass
class Rec:
    """One generated record: its text when it is a document (None: a bad record), where it is, and its file."""

    file: str
    where: str  # the location tessera must name for a bad record
    text: str | None


@dataclass
class Corpus:
    inputs: list[str]
    records: list[Rec] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # files skipped whole
    units: int = 0
    kinds: list[str] = field(default_factory=list)


class Gen:
    def __init__(self, rng: random.Random, root: Path, key: str) -> None:
        self.rng, self.root, self.key, self.n = rng, root, key, 0

    def name(self, suffix: str) -> str:
        self.n += 1
        stem = self.rng.choice(["doc", "Doc", "ü-file", "a.b", "a-b", "data", "z"])
        return f"{stem}{self.n}{suffix}"

    def record_value(self) -> tuple[Any, str | None]:
        """(JSON object, its document or None when it is a bad record)."""
        rng, key = self.rng, self.key
        r = rng.random()
        other = {"id": rng.randint(0, 99), "meta": {"lang": "x"}, "tags": ["a", "b"]}
        if r < 0.07:
            return {k: v for k, v in other.items()}, None  # no text key
        if r < 0.12:
            return {key: rng.choice([7, 1.5, None, True, ["a"], {"t": "x"}]), **other}, None
        text = random_text(rng)
        return {**dict(rng.sample(sorted(other.items()), rng.randint(0, 3))), key: text}, text

    # each writer returns the records it wrote, in the order tessera must read them

    def text_file(self, path: Path, rel: str) -> list[Rec]:
        text = random_text(self.rng)
        r = self.rng.random()
        data = text.encode("utf-8")
        if r < 0.08:
            data = b"\xef\xbb\xbf" + data  # a BOM: part of the text (U+FEFF)
            text = "\ufeff" + text
        elif r < 0.14:
            data += b"\xff\xfe bad"  # invalid UTF-8: skipped whole
            text = None
        elif r < 0.18:
            data += b"\x00"
            text = None
        if text is not None and "\0" in text:
            text = None  # NUL: a binary file, skipped whole
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return [Rec(rel, "skip", text)]

    def jsonl(self, path: Path, rel: str, gz: bool) -> list[Rec]:
        rng = self.rng
        lines: list[bytes] = []
        recs: list[Rec] = []
        for _ in range(rng.randint(0, 25)):
            line_no = len(lines) + 1
            r = rng.random()
            if r < 0.05:
                lines.append(rng.choice([b"", b"   ", b"\r"]))  # blank: no document, no bad record
                continue
            if r < 0.09:
                lines.append(b'{"' + self.key.encode() + b'": "trunc')
                recs.append(Rec(rel, f"{rel}:{line_no}", None))
                continue
            if r < 0.12:
                lines.append(b'{"' + self.key.encode() + b'": "bad \xff utf8"}')
                recs.append(Rec(rel, f"{rel}:{line_no}", None))
                continue
            if r < 0.15:
                lines.append(json.dumps(rng.choice([[1, 2], "str", 3])).encode())
                recs.append(Rec(rel, f"{rel}:{line_no}", None))
                continue
            value, text = self.record_value()
            raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode("utf-8")
            lines.append(raw + (b"\r" if rng.random() < 0.1 else b""))
            recs.append(Rec(rel, f"{rel}:{line_no}", text))
        data = b"\n".join(lines) + (b"\n" if lines and rng.random() < 0.8 else b"")
        data = (b"\xef\xbb\xbf" if rng.random() < 0.1 else b"") + data  # a BOM: ignored (docs/data.md)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(data) if gz else data)
        return recs

    def json_array(self, path: Path, rel: str) -> list[Rec]:
        rng = self.rng
        recs, values = [], []
        for i in range(rng.randint(0, 12)):
            if rng.random() < 0.05:
                values.append(rng.choice([[1], "s", 2, None]))
                recs.append(Rec(rel, f"{rel}:record {i + 1}", None))
                continue
            value, text = self.record_value()
            values.append(value)
            recs.append(Rec(rel, f"{rel}:record {i + 1}", text))
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(values, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        path.write_bytes((b"\xef\xbb\xbf" if rng.random() < 0.1 else b"") + text.encode("utf-8"))
        return recs

    def table(self) -> tuple[Any, list[str | None]]:
        """A pyarrow table with the text column (string, large_string or dictionary; nulls) and others."""
        import pyarrow as pa

        rng = self.rng
        n = rng.randint(0, 20)
        texts = [None if rng.random() < 0.1 else random_text(rng) for _ in range(n)]
        typ = rng.choice([pa.string(), pa.large_string(), "dict"])
        col = pa.array(texts, pa.string()).dictionary_encode() if typ == "dict" else pa.array(texts, typ)
        cols = {"id": pa.array(list(range(n)), pa.int64()), self.key: col}
        if rng.random() < 0.5:
            cols["tokens"] = pa.array([[rng.randint(0, 9)] * rng.randint(0, 3) for _ in range(n)])
        if rng.random() < 0.5:
            cols["other_text"] = pa.array([None if rng.random() < 0.3 else "x" for _ in range(n)])
        names = list(cols)
        rng.shuffle(names)
        return pa.table({k: cols[k] for k in names}), texts

    def parquet(self, path: Path, rel: str) -> list[Rec]:
        import pyarrow.parquet as pq

        table, texts = self.table()
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, row_group_size=self.rng.choice([1, 3, 7, 100]))
        return [Rec(rel, f"{rel}:row {i + 1}", t) for i, t in enumerate(texts)]

    def hf_folder(self, folder: Path, rel: str) -> list[Rec]:
        """A folder as `datasets.Dataset.save_to_disk` writes it: Arrow IPC streams listed in state.json."""
        import pyarrow as pa

        folder.mkdir(parents=True)
        n_files = self.rng.randint(1, 3)  # listed in state.json in a drawn order
        recs, files = [], []
        for k in range(n_files):
            table, texts = self.table()
            name = f"data-{k:05d}-of-{n_files:05d}.arrow"
            schema = table.schema.with_metadata({"huggingface": json.dumps({"info": {"features": {}}})})
            with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
                for batch in table.replace_schema_metadata(schema.metadata).to_batches(max_chunksize=5):
                    w.write_batch(batch)
            files.append(name)
            recs += [Rec(f"{rel}/{name}", f"{rel}/{name}:row {i + 1}", t) for i, t in enumerate(texts)]
        order = files[:]
        self.rng.shuffle(order)
        recs = [r for f in order for r in recs if r.file == f"{rel}/{f}"]
        (folder / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": f} for f in order], "_fingerprint": "x", "_split": None})
        )
        (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
        return recs

    def file(self, path: Path, rel: str, kind: str) -> list[Rec]:
        if kind == "text":
            return self.text_file(path, rel)
        if kind in ("jsonl", "jsonl.gz"):
            return self.jsonl(path, rel, kind == "jsonl.gz")
        if kind == "json":
            return self.json_array(path, rel)
        return self.parquet(path, rel)

    def suffix(self, kind: str) -> str:
        if kind == "text":
            return self.rng.choice([".txt", ".md", "", ".py", ".TXT"])
        return "." + kind

    def folder(self, folder: Path, rel: str) -> list[Rec]:
        """A folder of mixed files in nested sub-folders and hidden entries (skipped); walked in sorted order."""
        files: dict[str, str] = {}
        folder.mkdir(parents=True)
        for _ in range(self.rng.randint(0, 8)):
            kind = self.rng.choice(["text", "text", "jsonl", "jsonl.gz", "json", "parquet", "hf"])
            parts = [self.rng.choice(["a", "b", "sub", "ü", "A"]) for _ in range(self.rng.randint(0, 2))]
            if self.rng.random() < 0.1:
                parts.insert(0, ".hidden")
            name = self.name("_ds" if kind == "hf" else self.suffix(kind))
            files["/".join([*parts, name]) + ("/" if kind == "hf" else "")] = kind
        recs = []
        for relpath in sorted(files):  # sorted relative posix paths, a dataset folder where its files sort
            kind, relpath = files[relpath], relpath.rstrip("/")
            path = folder / relpath
            if kind == "hf":
                got = self.hf_folder(path, f"{rel}/{relpath}")
            else:
                got = self.file(path, f"{rel}/{relpath}", kind)
            if not any(p.startswith(".") for p in relpath.split("/")):
                recs += got
        return recs


def make_corpus(rng: random.Random, root: Path, key: str) -> Corpus:
    gen = Gen(rng, root, key)
    corpus = Corpus(inputs=[])
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["folder", "folder", "jsonl", "jsonl.gz", "json", "parquet", "hf", "text"])
        corpus.kinds.append(kind)
        if kind == "folder":
            rel = gen.name("")
            corpus.records += gen.folder(root / rel, str(root / rel))
        elif kind == "hf":
            rel = gen.name("_ds")
            corpus.records += gen.hf_folder(root / rel, str(root / rel))
        else:
            rel = gen.name(gen.suffix(kind))
            corpus.records += gen.file(root / rel, str(root / rel), kind)
        corpus.inputs.append(str(root / rel))
    return corpus


# --- the oracle --------------------------------------------------------------------------------------------


@dataclass
class Expected:
    stream: np.ndarray
    docs: int
    bad: list[str]  # locations of bad records
    skipped: list[str]  # files skipped whole
    bad_by_file: dict[str, list[str]]


def expect(corpus: Corpus, tok: Tok) -> Expected:
    ids: list[int] = []
    docs, bad, skipped = 0, [], []
    by_file: dict[str, list[str]] = {}
    for rec in corpus.records:
        if rec.where == "skip":
            if rec.text is None:
                skipped.append(rec.file)
                continue
            where = rec.file
        else:
            where = rec.where
        enc = tok.encode(rec.text) if rec.text is not None else None
        if enc is None or tok.eot in enc:
            bad.append(where)
            by_file.setdefault(rec.file, []).append(where)
            continue
        ids += [*enc, tok.eot]
        docs += 1
    dtype = np.uint16 if tok.vocab < 2**16 else np.uint32
    return Expected(np.array(ids, dtype=dtype), docs, bad, skipped, by_file)


# --- running tessera ---------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> tuple[int | str, str]:
    """(exit status, or "traceback"; stdout + stderr) of `tessera ARGV` in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc: int | str = cli_main(argv)
        except SystemExit as e:
            rc = int(e.code or 0)
        except BaseException:
            rc = "traceback"
            out.write(traceback.format_exc())
    return rc, out.getvalue()


def warned_locations(text: str) -> list[str]:
    """Locations named in `prepare`'s bad-record warnings."""
    found = []
    for line in text.splitlines():
        if "bad record(s) skipped:" not in line:
            continue
        body = line.split("bad record(s) skipped: ", 1)[1]
        found += [part.split(": ", 1)[0] for part in re.split(r"; (?=/)", body) if part.startswith("/")]
    return found


def check_prepare(rng: random.Random, root: Path, case: int, stats: dict) -> list[str]:
    """One corpus, one tokenizer, one `tessera prepare`, compared with the oracle; the disagreements."""
    key = rng.choice(["text", "text", "body", "content", "t x", "ü"])
    corpus = make_corpus(rng, root / "in", key)
    sample = [r.text for r in corpus.records if r.text] + PIECES
    tok = make_tokenizer(rng, root, sample)
    exp = expect(corpus, tok)
    strict = rng.random() < 0.15
    workers = rng.choice([1, 1, 1, 2])
    out = root / "out" / "t.bin"
    argv = ["prepare", *corpus.inputs, "--out", str(out), "--tokenizer", tok.spec, "--workers", str(workers)]
    argv += ["--text-key", key] if key != "text" or rng.random() < 0.5 else []
    argv += ["--eot-token", tok.eot_arg] if tok.eot_arg else []
    argv += ["--strict"] if strict else []
    chunk = rng.choice([37, 200, 4096, ingest.JSONL_CHUNK])
    saved, ingest.JSONL_CHUNK = ingest.JSONL_CHUNK, chunk
    try:
        rc, text = run_cli(argv)
    finally:
        ingest.JSONL_CHUNK = saved
    eot = f", --eot-token {tok.eot_arg}" if tok.eot_arg else ""
    tag = (
        f"case {case} ({tok.kind}{eot}, inputs {corpus.kinds}, key {key!r}, workers {workers}, chunk {chunk}"
    )
    tag += ", strict)" if strict else ")"
    stats["cases"] += 1
    stats["records"] += len(corpus.records)
    stats["bad"] += len(exp.bad)
    stats["skipped"] += len(exp.skipped)
    stats["tokenizers"][tok.kind.split("-")[0]] = stats["tokenizers"].get(tok.kind.split("-")[0], 0) + 1
    problems: list[str] = []
    if rc == "traceback":
        return [f"{tag}: traceback\n{text}"]
    empty = not any(int(t) != tok.eot for t in exp.stream)
    if strict and (exp.bad or exp.skipped):
        stats["refused"] += 1
        first = _first_problem(corpus, exp)
        if rc != 2 or "error:" not in text or first not in text or out.exists():
            problems.append(
                f"{tag}: --strict with bad input ({first}): exit {rc}, out {out.exists()}: {text[-400:]}"
            )
        return problems
    if empty:
        stats["refused"] += 1
        if rc != 2 or "no text found" not in text or out.exists():
            problems.append(f"{tag}: no text: expected exit 2 'no text found', got {rc}: {text[-400:]}")
        return problems
    if rc != 0:
        return [f"{tag}: exit {rc}: {text[-600:]}"]
    stats["prepared"] += 1
    meta = json.loads(out.with_suffix(".json").read_text())
    got = np.fromfile(out, dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
    stats["tokens"] += len(exp.stream)
    if meta["dtype"] != exp.stream.dtype.name or not np.array_equal(got, exp.stream):
        diff = _first_diff(got, exp.stream)
        problems.append(
            f"{tag}: token stream differs ({meta['dtype']} {len(got)} vs {exp.stream.dtype.name} "
            f"{len(exp.stream)}, first difference at {diff})"
        )
    want = {
        "n_tokens": len(exp.stream),
        "n_documents": exp.docs,
        "n_bad_records": len(exp.bad),
        "n_skipped": len(exp.skipped),
        "eot": tok.eot,
        "vocab_size": tok.vocab,
        "max_token_id": int(exp.stream.max()),
        "sha256": hashlib.sha256(exp.stream.astype(exp.stream.dtype.newbyteorder("<")).tobytes()).hexdigest(),
    }
    for k, v in want.items():
        if meta.get(k) != v:
            problems.append(f"{tag}: metadata {k} = {meta.get(k)!r}, expected {v!r}")
    shown = warned_locations(text)
    wrong = [w for w in shown if w not in exp.bad]
    if wrong:
        problems.append(f"{tag}: warnings name locations that are not bad records: {wrong[:3]}")
    for file, locs in exp.bad_by_file.items():
        if locs[0] not in shown:
            problems.append(f"{tag}: first bad record of {file} ({locs[0]}) not named in the warnings")
    for file in exp.skipped:
        if f"skipping {file}:" not in text:
            problems.append(f"{tag}: skipped file {file} not named")
    problems += check_split(tag, out, exp, tok, rng)
    return problems


def _first_problem(corpus: Corpus, exp: Expected) -> str:
    for rec in corpus.records:
        if rec.where == "skip" and rec.file in exp.skipped:
            return rec.file
        if rec.where in exp.bad:
            return rec.where
    raise AssertionError("no problem")


def _first_diff(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    d = np.flatnonzero(a[:n].astype(np.int64) != b[:n].astype(np.int64))
    return int(d[0]) if len(d) else n


def oracle_cut(stream: np.ndarray, eot: int, fraction: float) -> int | None:
    """docs/data.md: the last `fraction` of the tokens, the cut moved forward to the next end-of-text token."""
    n = len(stream)
    target = min(n - 1, round(n * (1 - fraction)))
    hits = np.flatnonzero(stream[target:] == eot)
    cut = target + int(hits[0]) + 1 if len(hits) else None
    return cut if cut is not None and cut < n else None


def check_split(tag: str, out: Path, exp: Expected, tok: Tok, rng: random.Random) -> list[str]:
    from tessera.errors import DataError
    from tessera.train.data import open_data

    fraction = rng.choice([0.01, 0.05, 0.1, 0.3, 0.5, 0.9])
    cut = oracle_cut(exp.stream, tok.eot, fraction)
    try:
        train, valid = open_data([(str(out), 1.0)], None, fraction)
    except DataError as e:
        return [] if cut is None else [f"{tag}: valid_fraction {fraction}: refused ({e}), oracle cut {cut}"]
    if cut is None:
        return [f"{tag}: valid_fraction {fraction}: accepted, but no whole document can be held out"]
    a, b = np.asarray(train.tokens), np.asarray(valid.tokens)
    if not (np.array_equal(a, exp.stream[:cut]) and np.array_equal(b, exp.stream[cut:])):
        return [f"{tag}: valid_fraction {fraction}: split at {len(a)}, oracle at {cut}"]
    return []


# --- bad inputs --------------------------------------------------------------------------------------------


def error_cases(root: Path) -> list[tuple[str, list[str], list[str]]]:
    """(name, argv, words the message must hold); every one must exit 2 with an `error:` line and no output."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cases = []

    def add(name: str, argv: list[str], words: list[str]) -> None:
        out = [] if "--out" in argv else ["--out", str(root / f"out{len(cases)}" / "t.bin")]
        cases.append((name, ["prepare", *argv, *out], words))

    j = root / "nokey.jsonl"
    j.write_text("".join(json.dumps({"body": f"doc {i}"}) + "\n" for i in range(4)))
    add("jsonl: no record has the key", [str(j)], [str(j), "'text'", "--text-key"])
    add(
        "jsonl: no record has --text-key",
        [str(j), "--text-key", "content"],
        [str(j), "'content'", "--text-key"],
    )
    p = root / "nocol.parquet"
    pq.write_table(pa.table({"body": ["a", "b"]}), p)
    add("parquet: no such column", [str(p)], [str(p), "'text'", "--text-key"])
    add("parquet: no such column, 2 workers", [str(p), "--workers", "2"], [str(p), "'text'", "--text-key"])
    p2 = root / "intcol.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), p2)
    add("parquet: integer text column", [str(p2)], [str(p2), "'text'"])
    p3 = root / "listcol.parquet"
    pq.write_table(pa.table({"text": [["a"], ["b"]]}), p3)
    add("parquet: list text column", [str(p3)], [str(p3), "'text'"])
    hf = root / "ds"
    hf.mkdir()
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (hf / "dataset_info.json").write_text("{}")
    add(
        "save_to_disk folder lacking its Arrow file",
        [str(hf)],
        [str(hf / "state.json"), "data-00000-of-00001"],
    )
    dd = root / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    add("DatasetDict folder", [str(dd)], [str(dd), "train"])
    outer = root / "outer"
    (outer / "splits").mkdir(parents=True)
    (outer / "a.txt").write_text("text")
    (outer / "splits" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    add("DatasetDict inside a walked folder", [str(outer)], [str(outer / "splits"), "train"])
    empty = root / "empty"
    empty.mkdir()
    add("empty folder", [str(empty)], ["no text found"])
    e2 = root / "empty.jsonl"
    e2.write_text("")
    add("empty JSONL file", [str(e2)], ["no text found"])
    gz = root / "trunc.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"text": "a"}\n' * 50)[:30])
    add("truncated gzip", [str(gz)], [str(gz), "no text found"])
    bad_pq = root / "bad.parquet"
    bad_pq.write_bytes(b"PAR1 not really")
    add("corrupt parquet", [str(bad_pq)], [str(bad_pq), "no text found"])
    d = root / "dir.jsonl"
    d.mkdir()
    add("unreadable: a folder named .jsonl that holds nothing", [str(d)], ["no text found"])
    fifo = root / "fifo_dir"
    fifo.mkdir()
    (fifo / "link.txt").symlink_to(root / "nowhere.txt")
    add("only a dangling symlink", [str(fifo)], [str(fifo / "link.txt"), "no text found"])
    add(
        "a file that cannot be read",
        ["/proc/self/mem"],
        ["/proc/self/mem", "cannot read it", "no text found"],
    )
    add("missing input", [str(root / "missing.jsonl")], [str(root / "missing.jsonl"), "does not exist"])
    tj = root / "broken_tokenizer.json"
    tj.write_text('{"model": ')
    ok = root / "ok.jsonl"
    ok.write_text('{"text": "fine"}\n')
    add("corrupt tokenizer.json", [str(ok), "--tokenizer", str(tj)], [str(tj)])
    add("unknown --eot-token", [str(ok), "--eot-token", "<nope>"], ["<nope>", "--eot-token"])
    add("--eot-token a non-ASCII digit", [str(ok), "--eot-token", "²"], ["²", "--eot-token"])
    add("--eot-token an id past the vocabulary", [str(ok), "--eot-token", "256"], ["256", "--eot-token"])
    arr = root / "obj.json"
    arr.write_text(json.dumps({"text": "not an array"}))
    add("JSON object, not array", [str(arr)], [str(arr), "array"])
    add("--out is a folder", [str(ok), "--out", str(root)], [str(root), "--out"])
    return cases


def check_errors(root: Path, rng: random.Random, n: int, stats: dict) -> list[str]:
    problems = []
    cases = error_cases(root)
    for name, argv, words in rng.sample(cases, min(n, len(cases))):
        out = Path(argv[argv.index("--out") + 1])
        rc, text = run_cli(argv)
        stats["errors"] += 1
        missing = [w for w in words if w not in text]
        if rc != 2 or "error:" not in text or "Traceback" in text or missing or (out.is_file()):
            problems.append(
                f"bad input '{name}': exit {rc}, missing {missing}, out {out.is_file()}: {text[-500:]}"
            )
    return problems


# --- training: val_loss against transformers -----------------------------------------------------------------

_MASK = (1 << 64) - 1
_GOLD = 0x9E3779B97F4A7C15


def _mix(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
    return z ^ (z >> 31)


def oracle_start(i: int, seed: int, n_starts: int) -> int:
    return _mix((_mix(seed & _MASK) + (i + 1) * _GOLD) & _MASK) % n_starts


def tessera_cmd(*args: str) -> tuple[int, str]:
    import tessera  # the checkout under test (PYTHONPATH), also for the subprocess

    repo = (
        Path(tessera.__file__).resolve().parents[1]
    )  # `python -m` puts the working folder first on the path
    env = dict(os.environ, PYTHONPATH=str(repo))
    p = subprocess.run(
        [sys.executable, "-m", "tessera", *args], capture_output=True, text=True, env=env, cwd=repo
    )
    return p.returncode, p.stdout + p.stderr


def check_training(rng: random.Random, root: Path, case: int, stats: dict) -> list[str]:
    """Prepare a corpus (byte or trained tokenizer), train 2 steps, compare val_loss with transformers."""
    for _attempt in range(20):  # a corpus large enough for the drawn windows
        sub = root / f"t{_attempt}"
        key = "text"
        corpus = make_corpus(rng, sub / "in", key)
        tok = make_tokenizer(rng, sub, [r.text for r in corpus.records if r.text] + PIECES)
        exp = expect(corpus, tok)
        if len(exp.stream) >= 400 and exp.docs >= 4:
            break
    else:
        return [f"train {case}: no corpus large enough in 20 draws"]
    seq = rng.choice([8, 16, 32])
    seed = rng.randint(0, 2**31)
    out = sub / "train.bin"
    eot_arg = ["--eot-token", tok.eot_arg] if tok.eot_arg else []
    rc, text = run_cli(["prepare", *corpus.inputs, "--out", str(out), "--tokenizer", tok.spec, *eot_arg])
    if rc != 0:
        return [f"train {case}: prepare failed: {text[-400:]}"]
    how = rng.choice(["fraction", "path"])
    data = {"path": str(out), "tokenizer": tok.spec, "seed": seed}
    if how == "fraction":
        fraction = rng.choice([0.1, 0.2, 0.3])
        cut = oracle_cut(exp.stream, tok.eot, fraction)
        if cut is None or len(exp.stream) - cut < seq + 1 or cut < seq + 1:
            return []
        held = exp.stream[cut:]
        data["valid_fraction"] = fraction
    else:
        vcorpus = make_corpus(rng, sub / "vin", key)
        vexp = expect(vcorpus, tok)
        if len(vexp.stream) < seq + 1 or not any(int(t) != tok.eot for t in vexp.stream):
            return []
        argv = [
            "prepare",
            *vcorpus.inputs,
            "--out",
            str(sub / "valid.bin"),
            "--tokenizer",
            tok.spec,
            *eot_arg,
        ]
        rc, text = run_cli(argv)
        if rc != 0:
            return [f"train {case}: prepare of the validation file failed: {text[-400:]}"]
        held = vexp.stream
        data["valid_path"] = str(sub / "valid.bin")
    vocab = tok.vocab + rng.choice([0, 3])
    batches, gb = rng.choice([1, 2]), rng.choice([2, 4])
    dp = 2 if gb == 4 and rng.random() < 0.4 else 1  # two gloo ranks: the same samples, split
    cfg = {
        "model": {"n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": seq, "vocab_size": vocab},
        "parallel": {"data": dp},
        "train": {
            "steps": 2,
            "global_batch": gb,
            "micro_batch": 2,
            "lr": 1e-2,
            "warmup_steps": 1,
            "eval_every": 1,
            "eval_batches": batches,
        },
        "data": data,
        "checkpoint": {"every": 0, "resume": False},
        "log": {"run_dir": str(sub / "run"), "progress": False, "tensorboard": False},
    }
    (sub / "cfg.json").write_text(json.dumps(cfg))
    toml = _toml(cfg)
    (sub / "cfg.toml").write_text(toml)
    tag = f"train {case} ({tok.kind}, {how}, seq {seq}, {len(held)} held-out tokens, vocab {vocab}, dp {dp})"
    stats["runs"] += 1
    rc, text = tessera_cmd("train", str(sub / "cfg.toml"), "--nproc", str(dp))
    if rc != 0:
        return [f"{tag}: train exit {rc}: {text[-800:]}"]
    records = [json.loads(line) for line in (sub / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r][-1]
    rc, text = tessera_cmd("export", str(sub / "run"), "--format", "hf", "--out", str(sub / "hf"))
    if rc != 0:
        return [f"{tag}: export exit {rc}: {text[-800:]}"]
    problems = []
    hf_cfg = json.loads((sub / "hf" / "config.json").read_text())
    if (hf_cfg.get("eos_token_id"), hf_cfg.get("bos_token_id")) != (tok.eot, tok.eot):  # docs/huggingface.md
        problems.append(
            f"{tag}: exported eos/bos_token_id {hf_cfg.get('eos_token_id')}/{hf_cfg.get('bos_token_id')}, "
            f"the data's end of text is {tok.eot}"
        )
    expected = hf_val_loss(sub / "hf", held, seq, seed, gb * batches)
    err = abs(val - expected) / abs(expected)
    stats["worst_loss_rel"] = max(stats["worst_loss_rel"], err)
    print(f"  {tag}: val_loss {val:.7f} vs transformers {expected:.7f} rel {err:.1e}", flush=True)
    if err > LOSS_RTOL:
        problems.append(f"{tag}: val_loss {val} vs oracle {expected} (rel {err:.1e})")
    small = dict(cfg, model=dict(cfg["model"], vocab_size=tok.vocab - 1), parallel={"data": 1})
    (sub / "small.toml").write_text(_toml(small))
    rc, text = run_cli(["train", str(sub / "small.toml")])
    stats["errors"] += 1
    if rc != 2 or "error:" not in text or "model.vocab_size" not in text or "Traceback" in text:
        problems.append(f"{tag}: model.vocab_size {tok.vocab - 1} < tokenizer's: exit {rc}: {text[-400:]}")
    return problems


def _toml(cfg: dict) -> str:
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def hf_val_loss(folder: Path, held: np.ndarray, seq: int, seed: int, n_samples: int) -> float:
    """Mean next-token cross-entropy of transformers' model over the validation windows of samples 0..n-1."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    n_starts = len(held) - seq
    windows = [held[s : s + seq + 1] for s in (oracle_start(i, seed, n_starts) for i in range(n_samples))]
    w = torch.tensor(np.stack(windows).astype(np.int64))  # [n, seq + 1]
    with torch.no_grad():
        logits = model(w[:, :-1]).logits  # [n, seq, vocab]
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)))


# --- main --------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpora", type=int, default=40)
    ap.add_argument("--errors", type=int, default=20)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    stats: dict[str, Any] = dict(
        cases=0,
        prepared=0,
        refused=0,
        records=0,
        bad=0,
        skipped=0,
        tokens=0,
        errors=0,
        runs=0,
        worst_loss_rel=0.0,
        tokenizers={},
        failing=0,
    )
    found: list[str] = []

    def report(got: list[str]) -> None:
        """One case's disagreements: counted as one failing case, each printed as found."""
        stats["failing"] += bool(got)
        for f in got:
            found.append(f)
            print("DISAGREEMENT", f, flush=True)

    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.corpora):
            root = Path(tmp) / f"c{i}"
            root.mkdir()
            # each case draws from its own generator, so that a case that stops early (a disagreement) leaves
            # the later cases as they are: runs of the same seed on two versions compare case by case
            report(check_prepare(random.Random(rng.getrandbits(64)), root, i, stats))
        eroot = Path(tmp) / "errors"
        eroot.mkdir()
        for f in check_errors(eroot, random.Random(rng.getrandbits(64)), args.errors, stats):
            report([f])  # each bad input is its own case
        for i in range(4 * args.runs):  # a draw whose held-out part is shorter than a window is not run
            if stats["runs"] == args.runs:
                break
            root = Path(tmp) / f"r{i}"
            root.mkdir()
            report(check_training(random.Random(rng.getrandbits(64)), root, i, stats))
    print(
        f"seed {args.seed}: {stats['cases']} corpora ({stats['prepared']} prepared, {stats['refused']} refused as "
        f"expected; tokenizers {stats['tokenizers']}), {stats['records']} records ({stats['bad']} bad), "
        f"{stats['skipped']} files skipped, {stats['tokens']:,} tokens compared; {stats['errors']} bad inputs; "
        f"{stats['runs']} training runs, worst val_loss rel {stats['worst_loss_rel']:.1e}; "
        f"{stats['failing']} case(s) disagreeing, {len(found)} disagreement(s); {time.time() - t0:.0f} s",
        flush=True,
    )
    if math.isnan(stats["worst_loss_rel"]):
        print("DISAGREEMENT val_loss NaN")


if __name__ == "__main__":
    main()
