"""Tokenizers: a dependency-free byte tokenizer, and a wrapper for local Hugging Face `tokenizers` JSON files.

Documents are separated by one end-of-text token (`eot`) when several files are tokenized into one stream. For
the byte tokenizer that is byte 0 (NUL): it never occurs in text files (`tessera.train.data.prepare` treats a
file containing NUL as binary and skips it), so the separator is unambiguous and costs one token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tessera.errors import DataError
from tessera.files import read_json_object

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer", "resolve_eot"]

_EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    spec: str
    vocab_size: int
    eot: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no files needed; `eot` = 0 (NUL) separates documents."""

    spec = "byte"
    vocab_size = 256
    eot: int | None = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; invalid UTF-8 (e.g. a sequence cut mid-character) becomes U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        """The id of a one-byte token (e.g. "\\n"); None for anything longer."""
        raw = token.encode("utf-8")
        return raw[0] if len(raw) == 1 else None


class HFTokenizer:
    """A local Hugging Face `tokenizers` JSON file (tokenizer.json), or a `save_pretrained` folder holding one;
    needs `pip install 'tessera[hf]'`. A folder's EOS token (tokenizer_config.json, else config.json's
    eos_token_id) is the document separator; otherwise the first of `_EOT_NAMES` in the vocabulary."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF  # optional dependency, imported only when used
        except ImportError:
            raise DataError(
                f"tokenizer {str(path)!r} needs the `tokenizers` package, which is not installed; "
                "run `pip install 'tessera[hf]'`, or use data.tokenizer = \"byte\""
            ) from None
        folder = Path(path) if Path(path).is_dir() else None
        p = folder / "tokenizer.json" if folder is not None else Path(path)
        if not p.is_file():
            raise DataError(
                f"tokenizer {str(p)!r} does not exist; pass a tokenizer.json file, a folder holding one "
                '(as `save_pretrained` writes it), or "byte"'
            )
        try:
            self._tok = _HF.from_file(str(p))
        except Exception as e:  # the Rust library raises its own exception type
            raise DataError(f"tokenizer file {str(p)!r} could not be loaded: {e}") from None
        self.spec = str((folder or p).resolve())
        self.vocab_size = self._tok.get_vocab_size()
        vocab = self._tok.get_vocab()
        eos = _folder_eos(folder, vocab) if folder is not None else None
        self.eot = eos if eos is not None else next((vocab[n] for n in _EOT_NAMES if n in vocab), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _folder_eos(folder: Path, vocab: dict[str, int]) -> int | None:
    """The EOS id a `save_pretrained` folder declares: tokenizer_config.json's eos_token, else the model's
    config.json eos_token_id (the first, when it lists several); None when neither says. `resolve_eot` checks
    that an id from config.json is in the vocabulary."""
    config = _read_json(folder / "tokenizer_config.json")
    token = config.get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str) and token in vocab:
        return vocab[token]
    eos_id = _read_json(folder / "config.json").get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
    return eos_id if isinstance(eos_id, int) and not isinstance(eos_id, bool) else None


def _read_json(path: Path) -> dict:
    """A JSON object file of a tokenizer folder ({} when absent); DataError naming it when it is not one."""
    if not path.is_file():
        return {}
    return read_json_object(path, DataError, "restore it, or save the tokenizer again")


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by spec: "byte", or the path of a tokenizers JSON file or of a folder holding one."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def resolve_eot(tok: Tokenizer, eot_token: str | None = None) -> int:
    """The id that ends every document: ``eot_token`` (an id when it is a decimal number, else a token of the
    vocabulary) when given, else the tokenizer's own end-of-text token. A tokenizer without one is an error:
    documents concatenated with no separator would silently run into each other."""
    if eot_token is None:
        if tok.eot is None:
            raise DataError(
                f"tokenizer {tok.spec!r} has no end-of-text token (looked for {', '.join(_EOT_NAMES)}), so "
                "documents would run into each other; name one of its tokens with --eot-token TOKEN "
                "(e.g. --eot-token '</s>') or give its id (--eot-token 2)"
            )
        if not 0 <= tok.eot < tok.vocab_size:  # a folder's config.json may name any number
            raise DataError(
                f"tokenizer {tok.spec!r} declares end-of-text id {tok.eot}, outside its vocabulary of "
                f"{tok.vocab_size}, so every document would end in an id the model cannot embed; name the "
                f"end-of-text token with --eot-token TOKEN (or an id below {tok.vocab_size})"
            )
        return tok.eot
    # A number is an id, even where the vocabulary also holds it as a token ("2" is one in every byte-level BPE):
    # the documented `--eot-token 2` must mean id 2, and any token can still be named by its id. ASCII digits
    # only, since str.isdigit also accepts "²", which int() refuses.
    number = eot_token.isascii() and eot_token.isdigit()
    if number:
        found = int(eot_token) if int(eot_token) < tok.vocab_size else None
    else:
        found = tok.token_to_id(eot_token)
    if found is None:
        raise DataError(
            f"--eot-token {eot_token!r} is not {'an id' if number else 'a token'} of tokenizer "
            f"{tok.spec!r} (vocabulary of "
            f"{tok.vocab_size}); pass one of its special tokens, such as '</s>', or a token id below "
            f"{tok.vocab_size}"
        )
    return found
