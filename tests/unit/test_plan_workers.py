"""`tessera plan`'s search workers (`search._price_layouts`, forked processes) end with the command: a signal to it
alone or to its whole process group (a terminal's Ctrl-C, a scheduler's SIGTERM) stops it as it stops a search in
one process (SIGINT: "interrupted", exit 130; SIGTERM: killed by the signal), with no worker's traceback and no
worker left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAN = (
    "import sys; sys.argv = ['tessera', 'plan', '--model', 'megatron-1t', '--gpus', '3072', '--global-batch', "
    "'1536', '--jobs', '2']; from tessera.cli import main; sys.exit(main())"
)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    """Running (a zombie, not yet reaped by whoever adopted it, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
    reason="reads a process's children from Linux's /proc (CONFIG_PROC_CHILDREN)",
)
@pytest.mark.parametrize(
    ("sig", "group", "code", "stderr"),
    [
        (signal.SIGINT, True, 130, "interrupted\n"),
        (signal.SIGINT, False, 130, "interrupted\n"),
        (signal.SIGTERM, True, -signal.SIGTERM, ""),
        (signal.SIGTERM, False, -signal.SIGTERM, ""),
    ],
    ids=["sigint-group", "sigint-parent", "sigterm-group", "sigterm-parent"],
)
def test_a_signal_stops_the_plan_and_its_workers(sig: int, group: bool, code: int, stderr: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", PLAN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    deadline = time.monotonic() + 60
    workers: list[int] = []
    while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
        workers = _children(proc.pid)
        time.sleep(0.02)
    assert len(workers) == 2, "the search's two workers never started"
    (os.killpg if group else os.kill)(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code
    assert err.decode() == stderr
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers)
