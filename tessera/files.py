"""A file written whole or not at all: its bytes go to a new file beside it, which is then renamed over it."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["temp_beside"]


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
