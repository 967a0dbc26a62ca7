"""One run per run directory: an exclusive lock held by rank 0 for the whole run.

``RUN_DIR/tessera.lock`` holds the holder's host, pid, start time and command line, and rank 0 keeps an
exclusive ``flock`` on it while it trains. The kernel drops that lock when the process ends however it ends
(SIGKILL, OOM, a node reboot on a local disk), so a lock left by a dead run is stale by construction: the next
run takes it over and says whose it was. A live holder makes a second run stop with a message naming it.
On network filesystems ``flock`` is forwarded to the server by NFSv4 and Lustre (with ``-o flock``); where it is
not, the lock only guards against runs on the same machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tessera.errors import TesseraError

__all__ = ["LOCK_FILE", "RunDirLocked", "run_dir_lock"]

LOCK_FILE = "tessera.lock"


class RunDirLocked(TesseraError):
    """Another live run holds this run directory."""


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, enabled: bool = True) -> Iterator[None]:
    """Hold ``run_dir``'s lock inside the block (a no-op when not ``enabled``: ranks other than 0)."""
    if not enabled:
        yield
        return
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirLocked(_held_by(path, run_dir)) from None
        _announce_stale(path)  # a holder that ended cleanly left the file empty
        _write_holder(fd)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _held_by(path: Path, run_dir: Path) -> str:
    h = _holder(path)
    who = f"pid {h.get('pid', '?')} on {h.get('host', '?')}, started {h.get('started', '?')}"
    return (
        f"run directory {run_dir} is in use by another run ({who}: {h.get('command', '?')})\n    fix: wait for "
        "it to finish or stop it, or give this run its own --log.run_dir"
    )


def _announce_stale(path: Path) -> None:
    h = _holder(path)
    if h:
        sys.stderr.write(
            f"note: taking over {path} from a run that is no longer running (pid {h.get('pid')} on "
            f"{h.get('host')}, started {h.get('started')})\n"
        )


def _write_holder(fd: int) -> None:
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv)[:500],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
