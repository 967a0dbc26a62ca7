"""Reading a corpus into documents and tokenizing it on every core, with the same output whatever the core count.

Inputs, one document per:

- text file (any other suffix): the whole file; binary or non-UTF-8 files are skipped with a warning;
- ``.jsonl`` / ``.jsonl.gz`` line and ``.json`` array element: a JSON object's ``text_key`` field;
- ``.parquet`` row: its ``text_key`` column (needs pyarrow: ``pip install 'tessera[data]'``);
- row of a folder written by Hugging Face ``datasets.Dataset.save_to_disk`` (Arrow files listed in its
  ``state.json``, read with pyarrow; ``datasets`` itself is not needed).

The work is cut into units (a file, a ~16 MiB run of whole JSONL lines, a Parquet row group, an Arrow file) that
a process pool tokenizes; the results are written in unit order, so the token file does not depend on the number
of workers. A record without the field, with a non-string value, with invalid UTF-8 or containing the
end-of-text token is a bad record: it is counted and reported as ``file:line`` (or ``file:row``), or, with
``strict``, stops the preparation at the first one.

Prompt/completion records (``key`` a pair of field names, for fine-tuning with a loss mask): a document is the
prompt's tokens, then the completion's, then the end-of-text token, and its mask marks the completion's tokens
and the end-of-text token as targets (1), the prompt's as not (0). A record without either field is a bad
record naming it; a plain text file has no fields and is skipped with a warning.

Chat records (``key`` a `Messages`): a document is the record's conversation (and its tools, when it has the
tools field) rendered with the tokenizer folder's chat template, then the end-of-text token; its mask marks the
assistant turns' tokens (their tool calls too) and their end-of-turn tokens (`tessera.train.chat`). A record whose
field is not a list of system/user/assistant/tool messages with string content (or an assistant's tool calls),
that has no assistant turn, whose tools or tool calls the template does not render, or whose assistant tokens the
template does not let apart is a bad record naming it and the message. Each unit counts its records that have the
tools field and reports their field names (`UnitResult.tools_field`, `UnitResult.fields`), so `prepare` can name a
tools field that no record has, whatever the number of workers.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import sys
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import DataError
from tessera.train.chat import ChatError, ChatTemplate, Conversation, conversation
from tessera.train.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["Key", "Messages", "Unit", "UnitResult", "find_units", "tokenize_units"]


@dataclass(frozen=True, slots=True)
class Messages:
    """A record's document is the conversation in field ``key``, rendered with the tokenizer's chat template and
    the tools in field ``tools_key`` (when the record has it)."""

    key: str
    tools_key: str = "tools"


Key = str | tuple[str, str] | Messages
"""What a record's document is: one text field, (prompt field, completion field), or a conversation field."""

# Bytes of whole lines per JSONL unit: small enough to spread one big file over the cores.
JSONL_CHUNK = 16 * 2**20
# A worker takes ~0.5 s to start (an interpreter importing numpy): by default one per 8 MiB of input at most.
BYTES_PER_WORKER = 8 * 2**20
_HF_MARKERS = ("state.json", "dataset_info.json")


@dataclass(frozen=True, slots=True)
class Unit:
    """One piece of work: ``kind`` says how to read ``path``; ``start``/``end`` select a part of it."""

    path: str
    kind: str
    """text, jsonl, jsonl.gz, json, parquet (start = row group) or arrow."""
    start: int = 0
    end: int = -1
    first: int = 1
    """Number of the unit's first line (JSONL) or row (Parquet), for messages."""
    size: int = 0
    """Bytes, for the progress bar."""


@dataclass(slots=True)
class UnitResult:
    """The tokens of a unit's documents (each followed by the end-of-text token) and what went wrong."""

    tokens: np.ndarray
    mask: np.ndarray | None = None
    """Prompt/completion and chat records: uint8 [len(tokens)], 1 where the token is a target (completion and end
    of text; assistant turns and their end-of-turn tokens)."""
    n_docs: int = 0
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None
    """Why the whole file was skipped (text files: binary, unreadable, not UTF-8)."""
    tools_field: int = 0
    """Chat records: how many have the tools field (`Messages.tools_key`), bad records included."""
    fields: set[str] = field(default_factory=set)
    """Chat records: their field names (at most `_FIELDS_KEPT`), to name them when none has the tools field."""


# --- finding the units -------------------------------------------------------------------------------------


def find_units(inputs: list[Path], text_key: Key) -> list[Unit]:
    """Units of work for files, directories (walked in sorted order, hidden entries skipped) and HF folders."""
    units: list[Unit] = []
    for item in map(Path, inputs):
        if item.is_dir() and _is_hf_folder(item):
            units.extend(_hf_units(item))
        elif item.is_dir():
            for f in _walk(item):
                units.extend(_hf_units(f) if f.is_dir() else _file_units(f, text_key))
        elif item.is_file():
            units.extend(_file_units(item, text_key))
        else:
            raise DataError(f"input {str(item)!r} does not exist; pass existing files or directories")
    return units


def _walk(root: Path) -> list[Path]:
    """The files under root and the ``save_to_disk`` folders among its sub-folders, in sorted order of their
    relative paths (a dataset folder where its files would be), hidden entries skipped. A dataset folder is read
    as one (its state.json's files, never its JSON files as records), and a DatasetDict is refused by name as at
    the top: walked file by file, every split, the test split too, was training data. Symbolic links to folders
    are not followed, as ``Path.rglob`` does not."""
    found: list[tuple[str, Path]] = []

    def visit(folder: Path) -> None:
        for p in folder.iterdir():
            if p.name.startswith("."):
                continue
            rel = p.relative_to(root).as_posix()
            if p.is_dir() and not p.is_symlink():
                if _is_hf_folder(p):
                    found.append((rel + "/", p))  # sorts where its files would
                else:
                    visit(p)
            elif p.is_file():
                found.append((rel, p))
            elif p.is_symlink() and not p.exists():  # named, as a file that cannot be read is
                warnings.warn(
                    f"skipping {p}: a symbolic link to {os.readlink(p)!r}, which does not exist", stacklevel=5
                )

    visit(root)
    return [p for _, p in sorted(found)]


def _kind(path: Path) -> str:
    name = path.name.lower()
    for suffix in ("jsonl.gz", "jsonl", "json", "parquet", "arrow"):
        if name.endswith("." + suffix):
            return suffix
    return "text"


def _file_units(path: Path, text_key: Key) -> list[Unit]:
    kind = _kind(path)
    if kind == "jsonl":
        return list(_jsonl_units(path))
    if kind == "parquet":
        return _parquet_units(path)
    return [Unit(str(path), kind, size=path.stat().st_size)]


def _jsonl_units(path: Path) -> Iterator[Unit]:
    """Runs of whole lines of about `JSONL_CHUNK` bytes, each knowing the number of its first line."""
    pos, line, chunk = 0, 1, JSONL_CHUNK
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            if not data:
                return
            if not data.endswith(b"\n"):
                data += f.readline()  # finish the line that straddles the boundary
            yield Unit(str(path), "jsonl", pos, pos + len(data), line, len(data))
            pos, line = pos + len(data), line + data.count(b"\n")


def _pyarrow(what: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            f"reading {what} needs the `pyarrow` package, which is not installed; run "
            "`pip install 'tessera[data]'` (or convert the data to JSONL)"
        ) from None
    return pyarrow


def _parquet_units(path: Path) -> list[Unit]:
    pa = _pyarrow(f"the Parquet file {str(path)!r}")
    try:
        meta = pa.parquet.ParquetFile(path).metadata
    except (pa.ArrowException, OSError):  # its reader meets the same error and skips the file, named
        return [Unit(str(path), "parquet", 0, 1, 1, path.stat().st_size)]
    units, first = [], 1
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        units.append(Unit(str(path), "parquet", g, g + 1, first, group.total_byte_size))
        first += group.num_rows
    return units


def _is_hf_folder(path: Path) -> bool:
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_bytes().decode("utf-8"))["splits"]
            splits = [str(x) for x in splits] if isinstance(splits, list) else [str(splits)]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):  # any damage: still a DatasetDict
            splits = []
        raise DataError(
            f"{str(path)!r} is a Hugging Face DatasetDict with splits {splits}; pass one split's folder, "
            f"e.g. {str(path / (splits[0] if splits else 'train'))!r}"
        )
    return all((path / m).is_file() for m in _HF_MARKERS)


def _hf_units(folder: Path) -> list[Unit]:
    """The Arrow files of a ``save_to_disk`` folder, in the order its state.json lists them."""
    try:
        files = [str(f["filename"]) for f in json.loads((folder / "state.json").read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{str(folder / 'state.json')!r} does not list the dataset's files ({e}); save the dataset again "
            "with datasets.Dataset.save_to_disk"
        ) from None
    missing = [f for f in files if not (folder / str(f)).is_file()]
    if missing:
        raise DataError(
            f"{str(folder / 'state.json')!r} lists {len(missing)} file(s) the folder lacks ({missing[:3]}); copy "
            "the whole folder again, or save the dataset again with datasets.Dataset.save_to_disk"
        )
    return [Unit(str(folder / f), "arrow", size=(folder / f).stat().st_size) for f in files]


# --- reading documents -------------------------------------------------------------------------------------

# A reader yields (where, text, problem, fields): the document's location for messages, its text (a prompt and a
# completion for a pair of keys, a Conversation for chat records) or what is wrong, and the record's field names
# (a JSON object's keys, a table's columns; none for a text file or what is not an object).
Doc = tuple[str, str | tuple[str, str] | Conversation | None, str | None, tuple[str, ...]]
_FIELDS_KEPT = 64  # field names a unit reports: enough to name them, bounded for records with data as keys


def _read_text(unit: Unit, text_key: Key) -> Iterator[Doc]:
    if isinstance(text_key, tuple):  # raised before reading: a text file has no prompt to leave untrained
        raise _Skip(
            "a plain text file has no prompt and completion fields (--prompt-key/--completion-key read JSONL, "
            "JSON, Parquet and HF dataset records)"
        )
    if isinstance(text_key, Messages):
        raise _Skip(
            "a plain text file has no messages field (--messages-key reads JSONL, JSON, Parquet and HF dataset "
            "records)"
        )
    path = Path(unit.path)
    raw = path.read_bytes()
    if b"\0" in raw:
        raise _Skip("binary file (contains NUL bytes)")
    try:
        yield unit.path, raw.decode("utf-8"), None, ()
    except UnicodeDecodeError:
        raise _Skip("not UTF-8 text") from None


class _Skip(Exception):
    """A whole text file is not text: skipped with a warning, as before structured formats existed."""


def _record_doc(where: str, record: Any, text_key: Key) -> Doc:
    """A JSON record's document, read by `_record_text`, with its field names."""
    return (where, *_record_text(record, text_key), tuple(record) if isinstance(record, dict) else ())


def _record_text(
    record: Any, text_key: Key
) -> tuple[str | tuple[str, str] | Conversation | None, str | None]:
    if isinstance(text_key, tuple):
        return _record_pair(record, text_key)
    if isinstance(text_key, Messages):
        return _record_messages(record, text_key)
    return _string_field(record, text_key, "--text-key")


def _field(record: Any, key: str, option: str) -> tuple[Any, str | None]:
    """A JSON record's field ``key``, or what is wrong: not an object, or no such field (naming ``option``, the
    flag that chooses it)."""
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object with a {key!r} field"
    if key not in record:
        return None, f"missing field {key!r} (fields: {', '.join(sorted(record)[:8])}); see {option}"
    return record[key], None


def _string_field(record: Any, key: str, option: str) -> tuple[str | None, str | None]:
    """`_field`, which must hold a string."""
    value, problem = _field(record, key, option)
    if problem is None and not isinstance(value, str):
        problem = f"field {key!r} has type {type(value).__name__}, not a string"
    return (None, problem) if problem else (value, None)


def _record_pair(record: Any, keys: tuple[str, str]) -> tuple[tuple[str, str] | None, str | None]:
    """(prompt, completion) of a record, or what is wrong, naming the option that chooses the missing field."""
    if not isinstance(record, dict):
        return None, f"a JSON {type(record).__name__}, not an object with {keys[0]!r} and {keys[1]!r} fields"
    texts = []
    for key, option in zip(keys, ("--prompt-key", "--completion-key"), strict=True):
        value, problem = _string_field(record, key, option)
        if problem:
            return None, problem
        texts.append(value)
    return (texts[0], texts[1]), None


def _record_messages(record: Any, key: Messages) -> tuple[Conversation | None, str | None]:
    """A record's conversation and tools (none without the tools field), or what is wrong with it, naming
    --messages-key when the field is missing."""
    value, problem = _field(record, key.key, "--messages-key")
    if problem is not None:
        return None, problem
    return conversation(value, record.get(key.tools_key), key.key, key.tools_key)


def _read_jsonl_lines(unit: Unit, lines: list[bytes], text_key: Key) -> Iterator[Doc]:
    for i, raw in enumerate(lines):
        where = f"{unit.path}:{unit.first + i}"
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield where, None, f"invalid UTF-8 at byte {e.start}", ()
            continue
        try:
            record = json.loads(text)
        except ValueError as e:
            yield where, None, f"not JSON ({e})", ()
            continue
        yield _record_doc(where, record, text_key)


def _read_jsonl(unit: Unit, text_key: Key) -> Iterator[Doc]:
    if unit.kind == "jsonl.gz":
        try:
            with gzip.open(unit.path, "rb") as f:
                data = f.read()
        except (EOFError, zlib.error) as e:  # not OSErrors, unlike a file that is not gzip at all
            raise _Skip(f"truncated or corrupt gzip file ({e})") from None
    else:
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            data = f.read(unit.end - unit.start)
    if unit.start == 0 and data.startswith(_BOM):  # as Windows tools write UTF-8; JSON allows ignoring it
        data = data[len(_BOM) :]
    yield from _read_jsonl_lines(unit, data.split(b"\n"), text_key)


_BOM = b"\xef\xbb\xbf"


def _read_json(unit: Unit, text_key: Key) -> Iterator[Doc]:
    try:
        records = json.loads(Path(unit.path).read_bytes().decode("utf-8-sig"))  # a leading BOM ignored
    except (ValueError, UnicodeDecodeError) as e:
        lines = (
            "; one JSON object per line is JSON Lines: name the file .jsonl" if "Extra data" in str(e) else ""
        )
        yield unit.path, None, f"not a JSON file ({e}){lines}", ()
        return
    if not isinstance(records, list):
        yield unit.path, None, "a .json input must hold an array of objects (or use .jsonl, one per line)", ()
        return
    for i, record in enumerate(records):
        yield _record_doc(f"{unit.path}:record {i + 1}", record, text_key)


def _column(table: Any, unit: Unit, text_key: str, what: str = "text", option: str = "--text-key") -> Any:
    if text_key not in table.column_names:
        raise DataError(
            f"{unit.path} has no column {text_key!r} (columns: {', '.join(table.column_names)}); pass the "
            f"{what} column with {option}"
        )
    return table.column(text_key)


def _read_rows(unit: Unit, table: Any, text_key: Key) -> Iterator[Doc]:
    fields = tuple(table.column_names)
    if isinstance(text_key, Messages):  # a list<struct<role, content>> column reads as lists of dicts
        column = _column(table, unit, text_key.key, "messages", "--messages-key").to_pylist()
        has_tools = text_key.tools_key in table.column_names
        tools = table.column(text_key.tools_key).to_pylist() if has_tools else [None] * len(column)
        for i, (value, schemas) in enumerate(zip(column, tools, strict=True)):
            yield (
                f"{unit.path}:row {unit.first + i}",
                *conversation(value, schemas, text_key.key, text_key.tools_key),
                fields,
            )
        return
    if isinstance(text_key, tuple):
        prompts = _column(table, unit, text_key[0], "prompt", "--prompt-key").to_pylist()
        completions = _column(table, unit, text_key[1], "completion", "--completion-key").to_pylist()
        for i, pair in enumerate(zip(prompts, completions, strict=True)):
            where = f"{unit.path}:row {unit.first + i}"
            texts = [_cell_text(value, key) for value, key in zip(pair, text_key, strict=True)]
            problem = next((p for _, p in texts if p is not None), None)
            yield where, None if problem else (texts[0][0], texts[1][0]), problem, fields
        return
    for i, value in enumerate(_column(table, unit, text_key).to_pylist()):
        text, problem = _cell_text(value, text_key)
        yield f"{unit.path}:row {unit.first + i}", text, problem, fields


def _cell_text(value: Any, column: str) -> tuple[Any, str | None]:
    """A Parquet or Arrow cell's string (UTF-8 bytes decoded), or what is wrong with it."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"invalid UTF-8 at byte {e.start}"
    if not isinstance(value, str):
        return None, f"column {column!r} is {type(value).__name__}, not a string"
    return value, None


def _read_parquet(unit: Unit, text_key: Key) -> Iterator[Doc]:
    pa = _pyarrow(f"the Parquet file {unit.path!r}")
    try:
        table = pa.parquet.ParquetFile(unit.path).read_row_group(unit.start)
    except pa.ArrowException as e:
        raise _Skip(f"not a readable Parquet file ({e})") from None
    yield from _read_rows(unit, table, text_key)


def _read_arrow(unit: Unit, text_key: Key) -> Iterator[Doc]:
    pa = _pyarrow(f"the Arrow file {unit.path!r}")
    with pa.memory_map(unit.path) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()  # what datasets writes
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowException as e:
                raise _Skip(f"not a readable Arrow file ({e})") from None
    yield from _read_rows(unit, table, text_key)


_READERS: dict[str, Callable[[Unit, Key], Iterator[Doc]]] = {
    "text": _read_text,
    "jsonl": _read_jsonl,
    "jsonl.gz": _read_jsonl,
    "json": _read_json,
    "parquet": _read_parquet,
    "arrow": _read_arrow,
}


# --- tokenizing --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Job:
    """What a worker needs besides the unit (picklable: the tokenizer is loaded again from its spec)."""

    tokenizer: str
    eot: int
    dtype: str
    text_key: Key


_WORKER: tuple[_Job, Tokenizer, ChatTemplate | None] | None = None


def _init_worker(job: _Job) -> None:
    global _WORKER
    chat = ChatTemplate(job.tokenizer) if isinstance(job.text_key, Messages) else None
    _WORKER = (job, load_tokenizer(job.tokenizer), chat)


def _encode(tok: Tokenizer, text: str) -> np.ndarray:
    if isinstance(tok, ByteTokenizer):
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)  # fast path, same ids as tok.encode
    return np.asarray(tok.encode(text), dtype=np.int64)


def _document(
    text: Any, job: _Job, tok: Tokenizer, chat: ChatTemplate | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """A record's tokens (without the end-of-text token) and, for masked records, its mask with one more byte for
    the end-of-text token that follows; ChatError for a conversation the template cannot split into turns."""
    if isinstance(job.text_key, str):
        return _encode(tok, text), None
    if chat is not None:  # the end-of-text token only separates conversations: no turn of one, not a target
        ids, mask = chat.encode(text)
        return ids, np.append(mask, np.uint8(0))
    # a pair's parts are encoded apart, so the prompt/completion boundary is a token boundary; the prompt is
    # context only, the completion and the end-of-text token are targets
    prompt, completion = (_encode(tok, t) for t in text)
    mask = np.concatenate((np.zeros(len(prompt), np.uint8), np.ones(len(completion) + 1, np.uint8)))
    return np.concatenate((prompt, completion)), mask


def _tokenize_unit(unit: Unit) -> UnitResult:
    assert _WORKER is not None, "worker not initialised"
    job, tok, chat = _WORKER
    masked = not isinstance(job.text_key, str)
    pieces: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    result = UnitResult(tokens=np.zeros(0, dtype=job.dtype), mask=np.zeros(0, np.uint8) if masked else None)
    try:
        for where, text, problem, fields in _READERS[unit.kind](unit, job.text_key):
            if isinstance(job.text_key, Messages):
                _count_fields(result, fields, job.text_key.tools_key)
            if problem is None:
                try:
                    ids, mask = _document(text, job, tok, chat)
                except ChatError as e:
                    problem = str(e)
                else:
                    if (ids == job.eot).any():
                        problem = f"contains the end-of-text token {job.eot}, which would split it in two"
            if problem is not None:
                result.problems.append(f"{where}: {problem}")
                continue
            pieces.extend((ids, np.array([job.eot])))
            if mask is not None:
                masks.append(mask)
            result.n_docs += 1
    except _Skip as e:
        result.skipped = str(e)
    except OSError as e:
        result.skipped = f"cannot read it ({e})"
    if pieces:
        result.tokens = np.concatenate(pieces).astype(job.dtype)
    if masks:
        result.mask = np.concatenate(masks)
    return result


def _count_fields(result: UnitResult, fields: tuple[str, ...], tools_key: str) -> None:
    """Count a chat record's tools field and keep its field names (up to `_FIELDS_KEPT` per unit)."""
    result.tools_field += tools_key in fields
    for name in fields:
        if len(result.fields) >= _FIELDS_KEPT:
            break
        result.fields.add(name)


def tokenize_units(
    units: list[Unit],
    tokenizer: str,
    eot: int,
    dtype: np.dtype,
    text_key: Key = "text",
    workers: int | None = None,
    progress: bool = False,
) -> Iterator[tuple[Unit, UnitResult]]:
    """Each unit with its tokens, in unit order, computed by ``workers`` processes (default: every core, but no
    more than one per `BYTES_PER_WORKER` of input)."""
    job = _Job(tokenizer, eot, np.dtype(dtype).str, text_key)
    total = sum(u.size for u in units)
    if workers is None:
        workers = min(os.cpu_count() or 1, -(-total // BYTES_PER_WORKER))
    workers = max(1, min(workers, len(units)))
    with _progress(total, progress) as advance:
        if workers == 1:
            _init_worker(job)
            for unit in units:
                yield unit, _tokenize_unit(unit)
                advance(unit.size)
            return
        # spawn, not fork: the parent may hold torch's threads, which a forked child can deadlock on
        chunk = max(1, len(units) // (4 * workers))  # several small files per message, still balanced
        with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (job,)) as pool:
            for unit, result in zip(units, pool.imap(_tokenize_unit, units, chunksize=chunk), strict=True):
                yield unit, result
                advance(unit.size)


class _progress:
    """A rich progress bar over bytes on a terminal (stderr); nothing otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.bar, self.task = total, None, None
        self.enabled = enabled and sys.stderr.isatty()

    def __enter__(self) -> Callable[[int], None]:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

            columns = (BarColumn(), DownloadColumn(), TimeRemainingColumn())
            self.bar = Progress("[bold]prepare", *columns, console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("prepare", total=self.total)
        return self._advance

    def _advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
