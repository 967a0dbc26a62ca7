"""Tokenizers: a dependency-free byte tokenizer, and a wrapper for local Hugging Face `tokenizers` JSON files.

Documents are separated by one end-of-text token (`eot`) when several files are tokenized into one stream. For
the byte tokenizer that is byte 0 (NUL): it never occurs in text files (`tessera.train.data.prepare` treats a
file containing NUL as binary and skips it), so the separator is unambiguous and costs one token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tessera.errors import DataError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]

_EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    spec: str
    vocab_size: int
    eot: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


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


class HFTokenizer:
    """A local Hugging Face `tokenizers` JSON file (tokenizer.json); needs `pip install 'tessera[hf]'`."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF  # optional dependency, imported only when used
        except ImportError:
            raise DataError(
                f"tokenizer {str(path)!r} needs the `tokenizers` package, which is not installed; "
                "run `pip install 'tessera[hf]'`, or use data.tokenizer = \"byte\""
            ) from None
        p = Path(path)
        if not p.is_file():
            raise DataError(f'tokenizer file {str(p)!r} does not exist; pass a tokenizer.json path or "byte"')
        try:
            self._tok = _HF.from_file(str(p))
        except Exception as e:  # the Rust library raises its own exception type
            raise DataError(f"tokenizer file {str(p)!r} could not be loaded: {e}") from None
        self.spec = str(p.resolve())
        self.vocab_size = self._tok.get_vocab_size()
        vocab = self._tok.get_vocab()
        self.eot = next((vocab[n] for n in _EOT_NAMES if n in vocab), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by spec: "byte", or otherwise the path of a tokenizers JSON file."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
