"""Token files, held-out splits, blends and deterministic sampling.

A token file is a flat little-endian array of token ids (uint16 when the vocabulary fits, else uint32) next to
a JSON metadata file of the same stem (`corpus.bin` + `corpus.json`). Both are written atomically. Every
document ends with the end-of-text token named in the metadata (`eot`). Prompt/completion and chat data also have
a loss mask of the same stem (`corpus.mask`: one uint8 per token, 1 where the token is a target), described by the
metadata's ``loss_mask`` entry (its sha256 and number of targets).

Sampling is stateless: the window of global sample `i` starts at hash(seed, i) mod (n_tokens - seq_len) (with
``data.window_start = "document"``: at document start number hash(seed, i) mod the number of document starts, from
each file's index of document starts, cached beside the file; a window that reaches the end of the file continues at
its first token), and step `k` uses global samples
[k·B, (k+1)·B) for global batch B (shifted by an offset when a resume changed B).
A resumed run, or one with a different data-parallel size or micro-batch split, therefore trains on exactly the
same samples in every step. A step that ``train.skip_steps`` names draws nothing, so its samples are passed over
(tessera/train/skips.py). A `Blend` keeps that property: which file sample `i` comes from is another hash of (seed, i), compared with the weights.

Importing this module does not import torch (`tessera validate` reads token metadata through it).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import DataError, why_unwritable
from tessera.files import temp_beside
from tessera.modes import WINDOW_STARTS
from tessera.train.chat import SEPARATORS, ChatTemplate
from tessera.train.corpus import default_corpus_files, holdout_target, min_tokens
from tessera.train.ingest import Key, Messages, Unit, UnitResult, find_units, tokenize_units
from tessera.train.tokenizer import load_tokenizer, resolve_eot

__all__ = [
    "Blend",
    "PrepareNote",
    "TokenDataset",
    "batch_indices",
    "default_corpus_files",
    "ensure_default_corpus",
    "get_batch",
    "index_documents",
    "long_documents",
    "mask_path",
    "open_data",
    "prepare",
    "read_token_meta",
    "target_count",
    "window_start",
]

FORMAT = "tessera-tokens/1"
INDEX_FORMAT = "tessera-document-starts/1"
INDEX_SUFFIX = ".doc-starts"
"""The cache of a token file's document starts: ``corpus.bin`` + ``.doc-starts`` (`TokenDataset.index_path`)."""
DOCUMENT_WINDOWS = "every document, reading past the end from the start"
"""Which document starts open a window with data.window_start = "document" (a checkpoint records it: earlier
versions drew only starts a whole window before the end, so the same sample index drew another start)."""
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio


# --- the default corpus ------------------------------------------------------------------------------------


def _corpus_fingerprint(files: list[Path]) -> str:
    """Identity of a default corpus: Python version plus every file's path and size."""
    h = hashlib.sha256(sys.version.encode())
    for f in files:
        h.update(f"{f}:{f.stat().st_size}\n".encode())
    return h.hexdigest()


def ensure_default_corpus(cache_dir: Path, max_mb: float) -> Path:
    """Token file of the default corpus (byte tokenizer) in cache_dir, prepared once and reused afterwards.

    Reused when its metadata names the same corpus (same Python, same files) and the file validates. The
    trainer calls this on rank 0 and then barriers; concurrent calls are still safe because every write is a
    temp file plus `os.replace` of identical content.
    """
    max_bytes = int(max_mb * 2**20)
    out = Path(cache_dir) / f"default-corpus-{max_bytes}.bin"
    files = default_corpus_files(max_bytes)
    fingerprint = _corpus_fingerprint(files)
    if out.exists():
        try:
            if TokenDataset(out).meta.get("corpus") == fingerprint:
                return out
        except DataError:
            pass  # stale or damaged: prepare again
    prepare(files, out, "byte", extra_meta={"corpus": fingerprint})
    return out


# --- preparing token files ---------------------------------------------------------------------------------


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size < 2**16 else np.dtype("<u4")


def _atomic_write(out: Path, chunks: Iterator[bytes]) -> None:
    """Write chunks to a temp file in out's directory, then rename it over out (readers never see half). An
    exception from ``chunks`` or a failed write leaves out as it was (and no temp file)."""
    _make_folder(out)
    try:
        fd, tmp = temp_beside(out)
    except OSError as e:
        raise _unwritable(out, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                try:
                    f.write(chunk)
                except OSError as e:  # disk full, quota, I/O error
                    raise _unwritable(out, e) from None
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _make_folder(out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a path component is a file, or no permission
        raise _unwritable(out, e) from None


def _unwritable(out: Path, e: OSError) -> DataError:
    return DataError(
        f"cannot write {str(out)!r}: {why_unwritable(out, e)}; pass an output path (--out) in a writable "
        "folder with free space"
    )


class PrepareNote(UserWarning):
    """A choice `prepare` made for the user that they may want to override (`tessera prepare` prints it as a
    note, not a warning)."""


def mask_path(path: str | Path) -> Path:
    """The loss mask file of token file ``path``: the same stem with ``.mask``."""
    return Path(path).with_suffix(".mask")


def prepare(
    inputs: list[Path],
    out: Path,
    tokenizer_spec: str = "byte",
    extra_meta: dict[str, Any] | None = None,
    *,
    text_key: str = "text",
    prompt_key: str | None = None,
    completion_key: str | None = None,
    messages_key: str | None = None,
    tools_key: str | None = None,
    eot_token: str | None = None,
    workers: int | None = None,
    strict: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize files and directories (text, JSONL, JSON, Parquet, HF dataset folders: `tessera.train.ingest`)
    into the token file `out` and metadata `out.with_suffix(".json")`.

    Documents are concatenated in input order, each followed by the end-of-text token (`resolve_eot`). Skipped
    files and bad records are reported as warnings naming file and line, or, with `strict`, raise at the first.
    The output is identical for any number of `workers` (default: every core). Returns the metadata written.

    With ``prompt_key`` and ``completion_key`` a record's document is its prompt then its completion, and the
    loss mask `mask_path(out)` marks the completion's tokens and the end-of-text token after them as targets.

    With ``messages_key`` a record's document is its conversation rendered with the chat template of the tokenizer
    folder, and the mask marks its assistant turns and their end-of-turn tokens (`tessera.train.chat`); a record's
    ``tools_key`` field (default ``tools``), when it has one, is the tools the template is given. A ``tools_key``
    that no record has is a warning (`strict`: an error). When the tokenizer's EOS ends the template's turns and no
    ``eot_token`` is given, conversations are separated by a special token the template never writes
    (`_chat_template`), with a `PrepareNote` naming it.
    """
    out = Path(out)
    if out.is_dir():
        raise DataError(
            f"--out {str(out)!r} is a directory; pass a file name such as {str(out / 'tokens.bin')!r}"
        )
    if workers is not None and workers < 1:
        raise DataError(f"--workers {workers} must be at least 1; leave it out to use every core")
    key = _record_key(text_key, prompt_key, completion_key, messages_key, tools_key, out)
    tok = load_tokenizer(tokenizer_spec)
    eot = resolve_eot(tok, eot_token)
    chat = None
    if isinstance(key, Messages):
        chat, eot = _chat_template(tok.spec, eot, eot_token)
    units = find_units(list(inputs), key)
    dtype = _token_dtype(tok.vocab_size)
    sha, mask_sha = hashlib.sha256(), hashlib.sha256()
    counts = dict.fromkeys(("tokens", "skipped", "documents", "bad", "max_id", "targets", "tools_field"), 0)
    sources: set[str] = set()
    fields: set[str] = set()  # chat records' field names, to name them when none has the tools field
    mask_file = _TempBeside(mask_path(out)) if not isinstance(key, str) else None

    def chunks() -> Iterator[bytes]:
        for unit, result in tokenize_units(units, tok.spec, eot, dtype, key, workers, progress):
            _report(unit, result, strict)
            if (
                mask_file is not None and result.mask is not None
            ):  # one mask byte per token, in the same order
                mask_file.write(result.mask.tobytes())
                mask_sha.update(result.mask.tobytes())
                counts["targets"] += int(result.mask.sum())
            counts["skipped"] += result.skipped is not None
            counts["bad"] += len(result.problems)
            counts["documents"] += result.n_docs
            counts["tools_field"] += result.tools_field
            fields.update(result.fields)
            if result.skipped is None:
                sources.add(unit.path)
            data = result.tokens.tobytes()
            sha.update(data)
            counts["tokens"] += len(result.tokens)
            if len(result.tokens):
                counts["max_id"] = max(counts["max_id"], int(result.tokens.max()))
            yield data
        if counts["tokens"] == counts["documents"]:  # nothing but end-of-text tokens (empty documents)
            # raised inside the write: an earlier token file at `out` stays whole, with its metadata
            raise DataError(
                f"no text found in {len(units)} input part(s) ("
                + (f"{counts['documents']} empty document(s), " if counts["documents"] else "")
                + f"{counts['skipped']} file(s) skipped, {counts['bad']} bad record(s)); pass UTF-8 text, "
                "JSONL, JSON, Parquet or HF dataset inputs"
            )
        if tools_key is not None and not counts["tools_field"]:
            _no_tools_field(tools_key, fields, strict)  # raised inside the write too, with --strict

    if mask_file is None:
        _atomic_write(out, chunks())
    else:
        with mask_file:  # the mask is replaced only once the token file it describes is written
            _atomic_write(out, chunks())
    meta = {
        "format": FORMAT,
        "dtype": dtype.name,
        "n_tokens": counts["tokens"],
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.spec,
        "eot": eot,
        "sha256": sha.hexdigest(),
        "max_token_id": counts["max_id"],
        "n_sources": len(sources),
        "n_documents": counts["documents"],
        "n_skipped": counts["skipped"],
        "n_bad_records": counts["bad"],
        **(extra_meta or {}),
    }
    if isinstance(key, tuple):
        meta["loss_mask"] = {
            "file": mask_path(out).name,
            "sha256": mask_sha.hexdigest(),
            "n_targets": counts["targets"],
            "prompt_key": key[0],
            "completion_key": key[1],
        }
    if chat is not None:
        meta["loss_mask"] = {
            "file": mask_path(out).name,
            "sha256": mask_sha.hexdigest(),
            "n_targets": counts["targets"],
            "messages_key": key.key,
            "tools_key": key.tools_key,
            "chat_template_sha256": chat.sha256,
            "assistant_tokens": "generation markers" if chat.marked else "prefix difference",
        }
    _atomic_write(out.with_suffix(".json"), iter([json.dumps(meta, indent=2).encode()]))
    if mask_file is None:
        mask_path(out).unlink(missing_ok=True)  # an earlier preparation's mask no longer describes `out`
    return meta


def _record_key(
    text_key: str,
    prompt_key: str | None,
    completion_key: str | None,
    messages_key: str | None,
    tools_key: str | None,
    out: Path,
) -> Key:
    """What a record's document is: ``text_key``, the (prompt, completion) pair when both are named, or the
    conversation in ``messages_key`` (with the tools in ``tools_key``)."""
    if tools_key is not None and messages_key is None:
        raise DataError(
            f"--tools-key {tools_key!r} names the tools field of chat records; add --messages-key (e.g. messages)"
        )
    if prompt_key is None and completion_key is None and messages_key is None:
        return text_key
    if messages_key is not None and (prompt_key is not None or completion_key is not None):
        raise DataError(
            "--messages-key and --prompt-key/--completion-key are two kinds of fine-tuning record; name one"
        )
    if messages_key is None and (prompt_key is None or completion_key is None):
        given, missing = ("--prompt-key", "--completion-key")[:: 1 if prompt_key is not None else -1]
        raise DataError(
            f"{given} needs {missing} too: a fine-tuning record is a prompt and a completion (e.g. "
            "--prompt-key prompt --completion-key completion)"
        )
    if prompt_key is not None and prompt_key == completion_key:
        raise DataError(f"--prompt-key and --completion-key both name {prompt_key!r}; name two fields")
    if mask_path(out) == out or out.suffix == ".json":
        raise DataError(
            f"--out {str(out)!r} would be overwritten by its mask or metadata; name it e.g. train.bin"
        )
    if messages_key is not None:
        return Messages(messages_key, tools_key or "tools")
    return prompt_key, completion_key


def _chat_template(spec: str, eot: int, eot_token: str | None) -> tuple[ChatTemplate, int]:
    """The tokenizer folder's chat template, loaded here so that a folder without one is refused before any
    worker starts, and the end-of-text token that separates its conversations: ``eot`` unless the template writes
    it. Many chat tokenizers declare their end-of-turn token as EOS (Qwen2.5's <|im_end|>, Llama 3's <|eot_id|>),
    which would split every conversation at every turn; without an explicit ``eot_token`` the separator is then a
    special token named as a document's end that the template never writes (`ChatTemplate.separator`: Qwen2.5's
    <|endoftext|>, Llama 3's <|end_of_text|>), named in a `PrepareNote`. An ``eot_token`` the template writes, or
    no such token, is refused with the fix."""
    chat = ChatTemplate(spec)
    written = chat.probe()
    if eot not in written:
        return chat, eot
    separator = chat.separator(written) if eot_token is None else None
    if separator is not None:
        warnings.warn(
            f"the tokenizer's end-of-text token {chat.special_name(eot)!r} ends the chat template's turns, so "
            f"conversations are separated by {chat.special_name(separator)!r} (id {separator}), a special token "
            "the template never writes; pass --eot-token to choose another",
            PrepareNote,
            stacklevel=3,
        )
        return chat, separator
    unwritten = [t for t in chat.special_tokens() if chat.never_writes(t, written)]
    named = (
        ("--eot-token " + repr(eot_token)) if eot_token is not None else "the tokenizer's end-of-text token"
    )
    hint = f", e.g. --eot-token {chat.special_name(unwritten[0])!r}" if unwritten else ""
    raise DataError(
        f"{named}, {chat.special_name(eot)!r} (id {eot}), which `prepare` puts between documents, is also "
        "written by the chat template in every conversation (it ends turns), so every conversation would be "
        f"split at it, and the tokenizer has no special token named as a document's end ({', '.join(SEPARATORS)}) "
        f"that the template never writes; pass --eot-token with a special token the template does not write{hint}"
    )


def _no_tools_field(tools_key: str, fields: set[str], strict: bool) -> None:
    """--tools-key names a field no record has: the conversations were prepared without tools (their calls
    trained with no schema), which a misspelt or wrong field name does silently. A warning; strict: an error."""
    have = f" (their fields: {', '.join(sorted(fields)[:12])})" if fields else ""
    problem = (
        f"--tools-key {tools_key!r}: no record has a field {tools_key!r}{have}, so every conversation was "
        "prepared without tools (tool calls trained with no schema); name the records' tools field with "
        "--tools-key, or leave --tools-key out for records without tools"
    )
    if strict:
        raise DataError(f"{problem} (an error with --strict; without it, a warning)")
    warnings.warn(problem, stacklevel=5)


class _TempBeside:
    """A file written to a temp file next to ``path`` and renamed over it when the ``with`` block succeeds
    (removed when it fails), so a reader sees the old file or the whole new one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        _make_folder(path)
        try:
            fd, self.tmp = temp_beside(path)
        except OSError as e:
            raise _unwritable(path, e) from None
        self.f = os.fdopen(fd, "wb")

    def write(self, data: bytes) -> None:
        try:
            self.f.write(data)
        except OSError as e:  # disk full, quota, I/O error
            raise _unwritable(self.path, e) from None

    def __enter__(self) -> _TempBeside:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.f.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            Path(self.tmp).unlink(missing_ok=True)


_SHOWN_PER_FILE = 5


def _report(unit: Unit, result: UnitResult, strict: bool) -> None:
    """Warn about a skipped file or a unit's bad records (the first few by location); strict: raise instead."""
    if strict and (result.skipped or result.problems):
        problem = f"{unit.path}: {result.skipped}" if result.skipped else result.problems[0]
        raise DataError(f"bad input (--strict stops at the first): {problem}; fix it or drop --strict")
    if result.skipped:
        warnings.warn(f"skipping {unit.path}: {result.skipped}", stacklevel=4)
    if result.problems:
        shown = "; ".join(result.problems[:_SHOWN_PER_FILE])
        more = len(result.problems) - _SHOWN_PER_FILE
        warnings.warn(
            f"{len(result.problems)} bad record(s) skipped: {shown}"
            + (f"; and {more} more" if more > 0 else ""),
            stacklevel=4,
        )


# --- reading and sampling ----------------------------------------------------------------------------------


def read_token_meta(path: str | Path) -> dict[str, Any]:
    """The metadata of token file ``path`` (``path.json``), checked to be tessera's; DataError otherwise."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a token file" if path.is_dir() else "does not exist"
        raise DataError(
            f"token file {str(path)!r} {what}; run `tessera prepare INPUT --out FILE` first and name "
            "FILE, or unset data.path to use the default corpus"
        )
    meta_path = path.with_suffix(".json")
    if not meta_path.is_file():
        raise DataError(
            f"metadata {str(meta_path)!r} for token file {str(path)!r} is missing; "
            "re-run `tessera prepare` to write both files"
        )
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT or meta["dtype"] not in ("uint16", "uint32"):
            raise ValueError(f"format {meta.get('format')!r}, dtype {meta.get('dtype')!r}")
        _check_fields(meta)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # UnicodeDecodeError is a ValueError
        raise DataError(
            f"metadata {str(meta_path)!r} is not tessera token metadata ({e}); re-run `tessera prepare`"
        ) from None
    return meta


def _check_fields(meta: dict[str, Any]) -> None:
    """The numbers the data pipeline computes with are integers in range (`prepare` writes them so); a
    ValueError naming the first that is not, as a hand-edited or damaged file may hold anything."""

    def whole(key: str, low: int) -> int:
        value = meta[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{key} = {value!r} is not an integer >= {low}")
        return value

    whole("n_tokens", 0)
    vocab = whole("vocab_size", 1)
    if meta.get("max_token_id") is not None:  # optional: files of older versions lack it (and eot)
        whole("max_token_id", 0)  # compared with the model's vocabulary by check_vocab, which names the fix
    if meta.get("eot") is not None and whole("eot", 0) >= vocab:
        raise ValueError(f"eot = {meta['eot']} is not below vocab_size = {vocab}")
    mask = meta.get("loss_mask")
    if mask is not None:  # prompt/completion data (`prepare` with prompt_key and completion_key)
        if not isinstance(mask, dict) or not isinstance(mask.get("sha256"), str):
            raise ValueError(f"loss_mask = {mask!r} is not an object with a sha256")
        targets = mask.get("n_targets")
        if not isinstance(targets, int) or isinstance(targets, bool) or not 0 <= targets <= meta["n_tokens"]:
            raise ValueError(f"loss_mask.n_targets = {targets!r} is not an integer in [0, n_tokens]")


class TokenDataset:
    """A prepared token file opened as a read-only memmap, validated against its metadata.

    ``window_start`` (data.window_start): where sampled windows start, "any" token or a "document" start
    (`start`); "document" needs the end-of-text token the metadata records (DataError naming the fix).
    ``write_index``: whether this process may write the cache of the file's document starts
    (`index_path`); every process reads it. A multi-rank run lets rank 0 alone write it (`index_documents`)."""

    def __init__(self, path: str | Path, window_start: str = "any", write_index: bool = True) -> None:
        if window_start not in WINDOW_STARTS:
            raise ValueError(f"window_start must be one of {WINDOW_STARTS}, got {window_start!r}")
        self.path = Path(path)
        self.meta = read_token_meta(self.path)
        self.window_start = window_start
        self.write_index = write_index
        self._document_starts: np.ndarray | None = None  # built on first use (`document_starts`)
        self._root: TokenDataset = self  # the whole file, whose index a part (`view`) takes its starts from
        self._span = (0, int(self.meta["n_tokens"]))  # this part's tokens [lo, hi) in the whole file
        dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        expected = self.meta["n_tokens"] * dtype.itemsize
        actual = self.path.stat().st_size
        if self.meta["n_tokens"] <= 0:
            raise DataError(
                f"token file {str(self.path)!r} holds no tokens; re-run `tessera prepare` on text files"
            )
        if actual != expected:
            raise DataError(
                f"token file {str(self.path)!r} has {actual} bytes but its metadata says "
                f"{self.meta['n_tokens']} {dtype.name} tokens ({expected} bytes): the file is truncated or "
                "belongs to another preparation; re-run `tessera prepare` to rebuild it"
            )
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r", shape=(self.meta["n_tokens"],))
        self.mask = self._open_mask() if "loss_mask" in self.meta else None
        """uint8 [n_tokens], 1 where the token is a target (prompt/completion data); None without a mask."""
        if window_start == "document":  # refused now, before any step
            self._eot_for("document starts", 'or set data.window_start = "any"')

    def _open_mask(self) -> np.ndarray:
        """The loss mask the metadata records, checked to hold one byte per token; DataError otherwise."""
        path, n = mask_path(self.path), int(self.meta["n_tokens"])
        if not path.is_file():
            raise DataError(
                f"token file {str(self.path)!r} records a loss mask, but {str(path)!r} is missing; copy it "
                "with the token file, or re-run `tessera prepare` to rebuild both"
            )
        size = path.stat().st_size
        if size != n:
            raise DataError(
                f"loss mask {str(path)!r} has {size} bytes but token file {str(self.path)!r} holds {n} tokens "
                "(one mask byte each): it belongs to another preparation; re-run `tessera prepare` to rebuild both"
            )
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(n,))

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def has_mask(self) -> bool:
        return self.mask is not None

    @property
    def n_targets(self) -> int:
        """How many tokens the loss mask marks in this file (part): the count `prepare` recorded for the whole
        file, less those outside a part (counted on whichever side is smaller)."""
        assert self.mask is not None and self._root.mask is not None
        total = int(self.meta["loss_mask"]["n_targets"])
        lo, hi = self._span
        n = len(self._root.mask)
        if (lo, hi) == (0, n):
            return total
        if hi - lo <= n // 2:
            return _count_marked(self.mask)
        return total - _count_marked(self._root.mask[:lo]) - _count_marked(self._root.mask[hi:])

    def view(self, start: int, end: int) -> TokenDataset:
        """The same file restricted to tokens [start, end): a held-out split samples only inside its part."""
        part = copy.copy(self)
        part.meta = dict(self.meta)  # a part's own facts (max_token_id found by a pass) stay its own
        part.tokens = self.tokens[start:end]
        part.mask = self.mask[start:end] if self.mask is not None else None
        # the part takes its document starts from the whole file's index, from its first token on (a held-out
        # cut is a document start)
        part._document_starts = None
        part._span = (self._span[0] + start, self._span[0] + end)
        return part

    def holdout_cut(self, fraction: float) -> int | None:
        """Where `split_documents` cuts: just after the first document boundary at or after `holdout_target`;
        None when there is none before the file's end (no whole document to hold out). `tessera validate` asks
        this too. DataError when the file records no end-of-text token."""
        eot = self.meta.get("eot")
        if eot is None:
            raise DataError(
                f"token file {str(self.path)!r} records no end-of-text token, so its documents cannot be "
                "held out whole; prepare it again with `tessera prepare` (or use data.valid_path)"
            )
        cut = _next_boundary(self.tokens, holdout_target(self.n_tokens, fraction), int(eot))
        return cut if cut is not None and cut < self.n_tokens else None

    def split_documents(self, fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """(train, validation): the last ``fraction`` of the tokens, moved forward to the next document
        boundary so that no document is on both sides."""
        cut = self.holdout_cut(fraction)
        if cut is None:
            raise DataError(
                f"token file {str(self.path)!r} has no document boundary after token "
                f"{holdout_target(self.n_tokens, fraction)}, so data.valid_fraction = {fraction} leaves no whole "
                "document to hold out; use a larger fraction, more documents, or data.valid_path"
            )
        return self.view(0, cut), self.view(cut, self.n_tokens)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eot(self) -> int:
        """The end-of-text token that ends every document (recorded by `prepare`); DataError if none is."""
        return self._eot_for("document boundaries", "or set data.document_mask = false")

    def _eot_for(self, what: str, other_fix: str) -> int:
        """The recorded end-of-text token; DataError naming ``what`` needs it and the fixes when none is."""
        eot = self.meta.get("eot")
        if eot is None:
            raise DataError(
                f"token file {str(self.path)!r} records no end-of-text token, so its {what} are unknown; "
                "prepare it again with `tessera prepare` (--eot-token TOKEN for a tokenizer without one), "
                f"{other_fix}"
            )
        return int(eot)

    @property
    def document_starts(self) -> np.ndarray:
        """int64 offsets of this file's (or part's) document starts, ascending: its first token and every token
        after an end-of-text token. On first use read from the file's cache (`index_path`), or found by one
        chunked scan and cached; then kept (8 bytes per document). A part takes its share of the file's."""
        if self._document_starts is None:
            eot = self._eot_for("document starts", 'or set data.window_start = "any"')
            if self._root is not self:
                self._document_starts = _starts_within(self._root.document_starts, *self._span)
            else:
                self._document_starts = self._cached_starts(eot)
        return self._document_starts

    @property
    def index_path(self) -> Path:
        """Where the cache of the file's document starts lives: beside the token file, its name plus
        ``.doc-starts`` (never the name of the token file, its metadata or its mask)."""
        return self._root.path.with_name(self._root.path.name + INDEX_SUFFIX)

    def _index_key(self, eot: int) -> dict[str, Any]:
        """What the cached index must have been built from: the token file as it is now (size and modification
        time, and the sha256 of its tokens that `prepare` recorded) and the end-of-text token that ends its
        documents. No seq_len: the index holds every document start, whatever the window."""
        stat = self.path.stat()
        return {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "sha256": self.meta.get("sha256"),
            "n_tokens": int(self.meta["n_tokens"]),
            "eot": eot,
        }

    def _cached_starts(self, eot: int) -> np.ndarray:
        """The whole file's document starts from its cache when that was built from this file as it is now
        (and is whole), else from a scan, written to the cache when this process may write it."""
        key = self._index_key(eot)
        starts = _read_index(self.index_path, key)
        if starts is None:
            starts = _document_starts(self.tokens, eot)
            if self.write_index:
                _write_index(self.index_path, key, starts)
        return starts

    def window(self, start: int, seq_len: int) -> np.ndarray:
        """The ``seq_len`` + 1 tokens from ``start`` (int64): inputs are all but the last, targets all but the
        first. A window that reaches the file's (part's) end continues at its first token: the stream is read as
        a ring, so that a document near the end opens a whole window too ("any" starts never reach the end)."""
        return np.asarray(_ring(self.tokens, start, seq_len + 1), dtype=np.int64)

    def start(self, index: int, seq_len: int, seed: int) -> int:
        """Where global sample ``index``'s window of ``seq_len`` + 1 tokens starts under ``seed``: the one place
        `sample` and `target_mask` ask, so a window's targets and their mask bytes always agree.

        "any": hash(seed, index) mod (n_tokens - seq_len), every start that leaves a whole window. "document":
        the same hash mod the number of document starts picks one of them, so each document is equally likely to
        open a window, whatever its length (as fine-tuning samples examples), the last ones too: their window
        holds them whole (up to seq_len + 1 tokens) and then the file's first tokens (`window`)."""
        if self.n_tokens < min_tokens(seq_len):
            raise DataError(
                f"token file {str(self.path)!r} has {self.n_tokens} tokens, too few for sequences of "
                f"model.seq_len = {seq_len} (needs at least {seq_len + 1}); use more data or a shorter "
                "model.seq_len"
            )
        n_starts = self.n_tokens - seq_len  # starts [0, n_starts) leave seq_len + 1 tokens
        if self.window_start == "any":
            return window_start(index, seed, n_starts)
        starts = self.document_starts
        return int(starts[window_start(index, seed, len(starts))])

    @property
    def max_token_id(self) -> int:
        """The largest token id in the file: recorded by `prepare`, else found by one pass over the file."""
        if "max_token_id" not in self.meta:  # files prepared before it was recorded
            step = 1 << 24
            self.meta["max_token_id"] = max(
                int(self.tokens[i : i + step].max()) for i in range(0, self.n_tokens, step)
            )
        return int(self.meta["max_token_id"])

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse ids the embedding cannot index (an IndexError on CPU, a device-side assert on a GPU)."""
        if self.vocab_size > vocab_size:
            raise DataError(
                f"the data's tokenizer has {self.vocab_size} tokens but model.vocab_size = "
                f"{vocab_size}; set model.vocab_size >= {self.vocab_size}"
            )
        if self.max_token_id >= vocab_size:
            raise DataError(
                f"token file {str(self.path)!r} holds token id {self.max_token_id}, but model.vocab_size = "
                f"{vocab_size} allows ids up to {vocab_size - 1}; set model.vocab_size >= "
                f"{self.max_token_id + 1} or re-run `tessera prepare` with the model's tokenizer"
            )

    def verify(self) -> None:
        """Check the tokens' sha256 against the metadata (reads the whole file); DataError if they differ."""
        sha = hashlib.sha256()
        step = 1 << 22
        tokens = np.memmap(self.path, dtype=self.tokens.dtype, mode="r", shape=(int(self.meta["n_tokens"]),))
        for i in range(0, len(tokens), step):
            sha.update(np.ascontiguousarray(tokens[i : i + step]).tobytes())
        if sha.hexdigest() != self.meta["sha256"]:
            raise DataError(
                f"token file {str(self.path)!r} does not match the checksum in its metadata: it was "
                "modified or corrupted after preparation; re-run `tessera prepare` to rebuild it"
            )
        if self.mask is not None:
            path = mask_path(self.path)
            mask = np.memmap(path, dtype=np.uint8, mode="r", shape=(int(self.meta["n_tokens"]),))
            sha = hashlib.sha256()
            for i in range(0, len(mask), step):
                sha.update(np.ascontiguousarray(mask[i : i + step]).tobytes())
            if sha.hexdigest() != self.meta["loss_mask"]["sha256"]:
                raise DataError(
                    f"loss mask {str(path)!r} does not match the checksum in the metadata of "
                    f"{str(self.path)!r}: it was modified, or belongs to another preparation; re-run "
                    "`tessera prepare` to rebuild both"
                )

    def target_mask(self, index: int, seq_len: int, seed: int) -> np.ndarray:
        """Which of global sample ``index``'s next-token targets (`sample`'s y) are trained on: bool [seq_len],
        the loss mask's bytes of the target tokens. DataError when the file has no loss mask."""
        if self.mask is None:
            raise DataError(
                f"token file {str(self.path)!r} has no loss mask, but data.loss_mask = true trains only on "
                "targets a mask marks; prepare it with `tessera prepare --prompt-key KEY --completion-key KEY` "
                "(or `--messages-key KEY`), or set data.loss_mask = false"
            )
        start = self.start(index, seq_len, seed)  # as `sample`
        return self.window_mask(start, seq_len)

    def window_mask(self, start: int, seq_len: int) -> np.ndarray:
        """The loss mask's bytes of the targets of `window` (``start``, ``seq_len``): bool [seq_len]."""
        assert self.mask is not None
        return np.asarray(_ring(self.mask, start + 1, seq_len)) != 0  # [s]: the targets' bytes, as `window`

    def sample(self, index: int, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs x and next-token targets y (int64, [seq_len]) of global sample `index` under `seed`."""
        start = self.start(index, seq_len, seed)
        window = self.window(start, seq_len)  # window: [s + 1]
        if int(window.max()) > self.max_token_id:  # check_vocab compared the recorded maximum to the model
            raise DataError(
                f"token file {str(self.path)!r} holds id {int(window.max())} near token {start}, above the "
                f"largest id {self.max_token_id} its metadata records: the file was changed or damaged after "
                "preparation (`tessera validate --data` checks its checksum); re-run `tessera prepare`"
            )
        return window[:-1], window[1:]


def _document_starts(tokens: np.ndarray, eot: int, block: int = 1 << 24) -> np.ndarray:
    """Offset 0 and every offset just after an end-of-text token, below len(tokens): int64, ascending. Read in
    blocks, so a file larger than memory is scanned without loading it."""
    parts = [np.zeros(1, dtype=np.int64)]
    for lo in range(0, len(tokens), block):
        hits = np.flatnonzero(np.asarray(tokens[lo : lo + block]) == eot)
        parts.append(hits.astype(np.int64) + (lo + 1))
    starts = np.concatenate(parts)
    return starts[starts < len(tokens)]  # the last document's end-of-text token starts nothing


def _ring(values: np.ndarray, start: int, length: int) -> np.ndarray:
    """``length`` consecutive entries of ``values`` from ``start``, continuing at entry 0 past the end (a view
    when they do not reach it). ``length`` is at most len(values): `TokenDataset.start` refuses shorter files."""
    n = len(values)
    assert 0 < length <= n, (length, n)
    start %= n
    if start + length <= n:
        return values[start : start + length]
    return np.concatenate([values[start:], values[: length - (n - start)]])


def _starts_within(starts: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The document starts of tokens [lo, hi) of a file whose starts are ``starts``, counted from lo: the
    file's starts inside, and the part's first token (as a scan of the part alone would find them)."""
    inside = starts[np.searchsorted(starts, lo) : np.searchsorted(starts, hi)] - lo
    if len(inside) and inside[0] == 0:
        return inside
    return np.concatenate([np.zeros(1, dtype=np.int64), inside])


def _read_index(path: Path, key: dict[str, Any]) -> np.ndarray | None:
    """The document starts cached in ``path`` when it was written for ``key`` and is whole (its checksum and
    shape hold); None otherwise (missing, stale, torn or damaged: the caller scans the file again)."""
    try:
        with path.open("rb") as f:
            header = json.loads(f.readline(1 << 16))
            offset = f.tell()
        if header.get("format") != INDEX_FORMAT or header.get("key") != key:
            return None
        count = header["count"]
        # one more than recorded: a longer file is not the one written
        starts = np.fromfile(path, dtype="<i8", count=count + 1, offset=offset)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # UnicodeDecodeError is a ValueError
        return None
    if len(starts) != count or hashlib.sha256(starts.tobytes()).hexdigest() != header.get("sha256"):
        return None
    if not count or starts[0] != 0 or starts[-1] >= key["n_tokens"] or np.any(np.diff(starts) <= 0):
        return None
    return starts.astype(np.int64)


def _write_index(path: Path, key: dict[str, Any], starts: np.ndarray) -> None:
    """Cache ``starts`` in ``path`` for ``key``: a JSON header line, then the starts as little-endian int64,
    written beside it and renamed over it (readers see the old cache or the whole new one). A folder that cannot
    be written (read-only data) is a warning: the run goes on with the scanned index."""
    payload = np.ascontiguousarray(starts, dtype="<i8").tobytes()
    header = {
        "format": INDEX_FORMAT,
        "key": key,
        "count": len(starts),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    try:
        fd, tmp = temp_beside(path)
    except OSError as e:  # a read-only data folder
        _not_cached(path, e)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            f.write(payload)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if not isinstance(e, OSError):
            raise
        _not_cached(path, e)  # disk full, or a folder of that name in the way


def _not_cached(path: Path, e: OSError) -> None:
    """The warning that the index could not be cached: the run goes on, but scans the file at every start."""
    token_file = path.with_name(path.name.removesuffix(INDEX_SUFFIX))
    warnings.warn(
        f"the document starts of {str(token_file)!r} cannot be cached in {str(path)!r} "
        f"({why_unwritable(path, e)}), so every run scans the file for them again; make its folder writable "
        "to cache them",
        stacklevel=5,
    )


def index_documents(*datas: TokenDataset | Blend | None) -> None:
    """Read or build (and cache, where allowed) the document-start index of every file of ``datas``: a
    multi-rank run calls this on rank 0 before a barrier, so the other ranks read rank 0's cache."""
    for data in datas:
        if data is None:
            continue
        for f in data.sources if isinstance(data, Blend) else [data]:
            f.document_starts  # noqa: B018 (built and cached on first use)


def long_documents(data: TokenDataset | Blend, seq_len: int, loss_mask: bool = False) -> str | None:
    """With data.window_start = "document": a warning, naming the fix, when documents of ``data`` are longer than
    a window (seq_len + 1 tokens): every window that holds one of their tokens starts at or before their start,
    so their tokens past the first seq_len + 1 are in no window and never trained. None when every document fits.
    With ``loss_mask`` (data.loss_mask) what is lost is counted in targets, the tokens the loss mask trains."""
    files = data.sources if isinstance(data, Blend) else [data]
    loss_mask = loss_mask and all(f.has_mask for f in files)  # else refused before training, naming the file
    window = min_tokens(seq_len)
    long = lost = documents = trained = longest = 0
    for f in files:
        starts = f.document_starts
        lengths = np.diff(np.append(starts, f.n_tokens))  # [documents]: the last one to the end
        over = lengths > window
        long += int(over.sum())
        if loss_mask:
            lost += _targets_in(f.mask, starts[over] + window, starts[over] + lengths[over])
            trained += f.n_targets
        else:
            lost, trained = lost + int((lengths[over] - window).sum()), trained + f.n_tokens
        documents += len(lengths)
        longest = max(longest, int(lengths.max()))
    if not long:
        return None
    names = ", ".join(str(f.path) for f in files)
    what = "targets" if loss_mask else "tokens"
    share = 100 * lost / trained if trained else 0.0
    return (
        f'data.window_start = "document": {long:,} of the {documents:,} documents of {names} are longer than a '
        f"window (model.seq_len + 1 = {window} tokens, the longest {longest:,}); windows start at document "
        f"starts, so their {lost:,} {what} past the first {window} tokens ({share:.3g}% of the training "
        f"{what}) are never trained; set model.seq_len >= {longest - 1} to train every document whole, or "
        'data.window_start = "any" to cut windows anywhere'
    )


def _count_marked(mask: np.ndarray, block: int = 1 << 24) -> int:
    """Nonzero bytes of a (memory-mapped) mask, read in blocks."""
    return sum(int(np.count_nonzero(mask[lo : lo + block])) for lo in range(0, len(mask), block))


def _targets_in(mask: np.ndarray | None, lo: np.ndarray, hi: np.ndarray) -> int:
    """How many tokens the loss mask marks in the ranges [lo[i], hi[i]) (the long documents' untrained tails:
    few, so each is read on its own rather than the whole mask)."""
    assert mask is not None
    return sum(int(np.count_nonzero(mask[a:b])) for a, b in zip(lo.tolist(), hi.tolist(), strict=True))


def _next_boundary(tokens: np.ndarray, start: int, eot: int, block: int = 1 << 20) -> int | None:
    """Index just after the first end-of-text token at or after ``start`` (read in blocks), or None."""
    for lo in range(start, len(tokens), block):
        hits = np.flatnonzero(np.asarray(tokens[lo : lo + block]) == eot)
        if len(hits):
            return lo + int(hits[0]) + 1
    return None


class Blend:
    """Several token files sampled by weight: sample ``i`` comes from the file that a hash of (seed, i) picks
    (each file with probability weight / sum of weights), at that file's window for (seed, i)."""

    def __init__(self, sources: list[TokenDataset], weights: list[float]) -> None:
        if len(sources) != len(weights) or not sources or min(weights) <= 0:
            raise ValueError(f"need one positive weight per source, got {weights} for {len(sources)} sources")
        self.sources = sources
        total = float(sum(weights))
        self.cumulative = np.cumsum([w / total for w in weights])
        self.vocab_size = max(s.vocab_size for s in sources)

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.sources)

    def check_vocab(self, vocab_size: int) -> None:
        """`TokenDataset.check_vocab` of every source."""
        for source in self.sources:
            source.check_vocab(vocab_size)

    @property
    def eot(self) -> int:
        """The sources' common end-of-text token; DataError if one has none or they differ."""
        eots = {str(s.path): s.eot for s in self.sources}
        if len(set(eots.values())) > 1:
            raise DataError(
                f"the blended token files end documents with different tokens {eots}; prepare every file "
                "with the same tokenizer and --eot-token"
            )
        return next(iter(eots.values()))

    @property
    def has_mask(self) -> bool:
        return all(s.has_mask for s in self.sources)

    def target_mask(self, index: int, seq_len: int, seed: int) -> np.ndarray:
        """`TokenDataset.target_mask` of the source sample ``index`` is drawn from."""
        return self.sources[self.source_of(index, seed)].target_mask(index, seq_len, seed)

    def source_of(self, index: int, seed: int) -> int:
        """Which source global sample ``index`` is drawn from: a pure function of (seed, index)."""
        u = window_start(index, seed ^ _BLEND_SALT, 1 << 53) / float(1 << 53)  # uniform in [0, 1)
        return min(int(np.searchsorted(self.cumulative, u, side="right")), len(self.sources) - 1)

    def sample(self, index: int, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        return self.sources[self.source_of(index, seed)].sample(index, seq_len, seed)


_BLEND_SALT = 0x6A09E667F3BCC909  # any constant: makes the source choice independent of the window start


def open_data(
    sources: list[tuple[str, float]],
    valid_path: str | None = None,
    valid_fraction: float = 0.0,
    window_start: str = "any",
    write_index: bool = True,
) -> tuple[TokenDataset | Blend, TokenDataset | Blend | None]:
    """(training data, validation data or None) from ``(path, weight)`` pairs: one file, or a `Blend`.

    ``valid_fraction`` holds out the last whole documents of every file (the validation data is then the blend
    of those tails with the same weights); ``valid_path`` names a separate token file. Every file and part
    starts its windows by ``window_start`` (`TokenDataset.start`), each from its own document starts, whose
    cache only a ``write_index`` process writes.
    """
    files = [TokenDataset(p, window_start, write_index) for p, _ in sources]
    weights = [w for _, w in sources]
    valid: TokenDataset | Blend | None = (
        TokenDataset(valid_path, window_start, write_index) if valid_path is not None else None
    )
    if valid_fraction > 0:
        splits = [f.split_documents(valid_fraction) for f in files]
        files = [train for train, _ in splits]
        valid = _one_or_blend([held for _, held in splits], weights)
    return _one_or_blend(files, weights), valid


def _one_or_blend(files: list[TokenDataset], weights: list[float]) -> TokenDataset | Blend:
    return files[0] if len(files) == 1 else Blend(files, weights)


def _splitmix64(z: int) -> int:
    """The splitmix64 finaliser: a bijective, well-mixing hash of 64-bit integers."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def window_start(index: int, seed: int, n_starts: int) -> int:
    """Start offset in [0, n_starts) of global sample `index`: output `index` (from 0) of a splitmix64 generator
    whose state starts at splitmix64(seed), i.e. mix(mix(seed) + (index + 1)·golden) mod n_starts.

    A pure function of (seed, index): no RNG state to checkpoint, identical on every rank and layout.
    """
    if index < 0:
        raise ValueError(f"sample index must be non-negative, got {index}")
    state = _splitmix64(seed & _MASK64)
    return _splitmix64((state + (index + 1) * _GOLDEN) & _MASK64) % n_starts


def batch_indices(
    step: int, global_batch: int, dp_rank: int, dp_size: int, micro: int, micro_batch: int, offset: int = 0
) -> list[int]:
    """Global sample indices of one micro-batch of one data-parallel rank.

    Step k owns samples [o + k·B, o + (k+1)·B) for offset o. Micro-batch m of rank r takes the consecutive slice
    starting at o + k·B + (m·dp_size + r)·micro_batch, so over all m < B / (dp_size·micro_batch) and r < dp_size
    the slices tile the step's range exactly: every layout sees the same set of samples per step. The offset is
    0 unless a resume changed the global batch: the run then continues at the sample the checkpoint reached,
    o = samples - step·B (the trainer's ``sample_offset``), so no sample is trained twice or left out.
    """
    n_micro, rem = divmod(global_batch, dp_size * micro_batch)
    if rem or n_micro < 1:
        raise ValueError(
            f"global_batch = {global_batch} is not a positive multiple of dp_size {dp_size} × micro_batch "
            f"{micro_batch}; choose global_batch = {max(1, n_micro) * dp_size * micro_batch}"
        )
    if not (0 <= dp_rank < dp_size and 0 <= micro < n_micro and step >= 0):
        raise ValueError(
            f"need 0 <= dp_rank < {dp_size}, 0 <= micro < {n_micro}, step >= 0; got dp_rank={dp_rank}, "
            f"micro={micro}, step={step}"
        )
    first = offset + step * global_batch + (micro * dp_size + dp_rank) * micro_batch
    if first < 0:
        raise ValueError(f"step {step} with offset {offset} precedes sample 0")
    return list(range(first, first + micro_batch))


def get_batch(
    dataset: TokenDataset | Blend,
    step: int,
    micro: int,
    dp_rank: int,
    dp_size: int,
    micro_batch: int,
    global_batch: int,
    seq_len: int,
    seed: int,
    offset: int = 0,
    loss_mask: bool = False,
) -> tuple[Any, Any]:
    """Inputs and targets, LongTensors [micro_batch, seq_len], of one micro-batch (see `batch_indices`). With
    ``loss_mask`` every target the data's loss mask leaves out is `IGNORE_INDEX` (`tessera.model.targets`)."""
    import torch

    idx = batch_indices(step, global_batch, dp_rank, dp_size, micro, micro_batch, offset)
    xs, ys = zip(*(dataset.sample(i, seq_len, seed) for i in idx), strict=True)
    x, y = torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))  # x, y: [mb, s]
    if loss_mask:
        from tessera.model.targets import IGNORE_INDEX

        keep = torch.from_numpy(
            np.stack([dataset.target_mask(i, seq_len, seed) for i in idx])
        )  # keep: [mb, s]
        y = y.masked_fill(~keep, IGNORE_INDEX)
    return x, y


def target_count(
    dataset: TokenDataset | Blend, step: int, global_batch: int, seq_len: int, seed: int, offset: int = 0
) -> int:
    """How many targets the loss mask keeps in the whole global batch of ``step`` (samples [o + k·B, o + (k+1)·B),
    every micro-batch of every data-parallel rank): the one denominator of a masked step's loss. A pure function
    of the data, so every rank of every layout computes the same number with no communication."""
    first = offset + step * global_batch
    return sum(int(dataset.target_mask(i, seq_len, seed).sum()) for i in range(first, first + global_batch))
