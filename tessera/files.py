"""Files tessera reads and writes: a JSON object file read with its damage named, and a file written whole or not
at all (its bytes go to a new file beside it, which is then renamed over it)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from tessera.errors import TesseraError

__all__ = ["read_json_object", "temp_beside"]


def temp_beside(out: Path) -> tuple[int, Path]:
    """Create a new, empty temp file in ``out``'s folder to write ``out`` into before `os.replace`; its
    descriptor (open for writing) and path. It gets the permissions of any new file (0o666 less the umask),
    so ``out`` ends readable as the user's other files are: `tempfile.mkstemp` makes 0o600 files, which left
    token files and pictures unreadable to the rest of a team. OSError as `os.open` raises it (a folder that
    is a file, no permission)."""
    while True:
        tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:  # another writer's temp file of the same name: draw another
            continue


def read_json_object(path: Path, error: type[TesseraError], fix: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``error`` naming the file and ``fix`` when it is not UTF-8 JSON or not an
    object (a torn or hand-edited file), where json would raise a bare ValueError or the caller an
    AttributeError."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise error(f"{path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise error(f"{path} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value
