"""The default corpus's files and the token arithmetic every run's data must satisfy; no numpy, no torch.

`tessera validate` (tessera/execution.py) judges the data with these before any rank starts, and the trainer's
data (tessera/train/data.py) uses the same functions when it samples and holds out, so the two cannot disagree:

- a sequence of ``seq_len`` tokens needs ``seq_len + 1`` of them (its inputs and the next-token targets);
- ``data.valid_fraction`` holds out from the first document boundary at or after `holdout_target`.

The default corpus (``data.path`` unset) is the standard library's .py files, each one document of its UTF-8
bytes followed by the byte tokenizer's end-of-text token, so its documents' lengths are known from the files'
sizes without preparing it (`default_corpus_documents`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import os
import sysconfig
from pathlib import Path

__all__ = [
    "default_corpus_documents",
    "default_corpus_files",
    "document_cut",
    "holdout_target",
    "min_tokens",
]

_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})


def default_corpus_files(max_bytes: int) -> list[Path]:
    """The Python standard library's own .py sources, at most max_bytes in total.

    Files are taken in order of their path relative to the stdlib directory, skipping test suites, IDLE and
    installed packages (see `_SKIP_DIRS`); a file that would overflow the budget is skipped and the next
    considered. The list is deterministic for a given Python installation and needs no download.
    """
    return [path for path, _ in _chosen(max_bytes)]


def default_corpus_documents(max_bytes: int) -> list[int]:
    """Tokens of each document of the default corpus of ``max_bytes``, in order: a file's bytes (the byte
    tokenizer's ids) and its end-of-text token. Empty when no file fits the budget."""
    return [size + 1 for _, size in _chosen(max_bytes)]


@functools.lru_cache(maxsize=8)  # validate asks per config (the tests: thousands); the stdlib does not change
def _chosen(max_bytes: int) -> tuple[tuple[Path, int], ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen: list[tuple[Path, int]] = []
    total = 0
    for rel in _stdlib_sources(root):
        path = root / rel
        size = path.stat().st_size
        if size == 0 or total + size > max_bytes:
            continue
        chosen.append((path, size))
        total += size
    return tuple(chosen)


def _stdlib_sources(root: Path) -> list[str]:
    """Relative posix paths of the .py files under root, sorted, pruning `_SKIP_DIRS` while walking."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def min_tokens(seq_len: int) -> int:
    """Tokens a file (or held-out part) needs for one training window: seq_len inputs and their next-token
    targets, one token further."""
    return seq_len + 1


def holdout_target(n_tokens: int, fraction: float) -> int:
    """The token from which ``fraction`` of ``n_tokens`` is held out; the cut is the first document boundary at
    or after it (the end of the document holding it), so that no document is on both sides."""
    return max(0, min(n_tokens - 1, round(n_tokens * (1 - fraction))))


def document_cut(lengths: list[int], target: int) -> int | None:
    """The cut after the document holding token ``target`` of documents of these lengths (each ending in its
    end-of-text token), or None when that is the last one: nothing would be held out."""
    ends = list(itertools.accumulate(lengths))
    i = bisect.bisect_right(ends, target)  # first document whose last token (end - 1) is at or after target
    return ends[i] if i < len(ends) - 1 else None
