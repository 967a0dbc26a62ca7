"""Writing pictures (`tessera plot`, `tessera schedule show --out`): whole or not at all, errors as messages."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tessera.errors import TesseraError, why_unwritable
from tessera.files import temp_beside

__all__ = ["save_figure"]


def save_figure(fig: Any, out: Path, fmt: str, **savefig: Any) -> Path:
    """Write matplotlib figure ``fig`` to ``out`` in format ``fmt`` through a temp file in out's folder renamed
    over it, so a failed write leaves no partial picture (and an earlier one whole). A folder that cannot be
    made or written (a path component that is a file, no permission, disk full) is a TesseraError naming it.
    ``savefig``: more arguments of ``fig.savefig`` (dpi)."""
    out = Path(out)
    if out.is_dir():
        raise TesseraError(f"--out {out} is a directory; pass a file name such as {out / ('picture.' + fmt)}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_beside(out)
    except OSError as e:
        raise TesseraError(
            f"cannot write --out {out}: {why_unwritable(out, e)}; pass a path in a writable folder"
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=fmt, **savefig)
        os.replace(tmp, out)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise TesseraError(
            f"cannot write --out {out}: {why_unwritable(out, e)}; free some space or pass another path"
        ) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
