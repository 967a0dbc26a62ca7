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

from tessera.errors import EXIT_USER_ERROR

ROOT = Path(__file__).resolve().parents[2]
# A shell's background job (`cmd &`, how CI may start the suite) inherits SIGINT ignored, and Python keeps an
# ignored SIGINT ignored; the command starts as a terminal would start it, with Ctrl-C raising KeyboardInterrupt.
PLAN = (
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
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


pytestmark = pytest.mark.skipif(
    not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
    reason="reads a process's children from Linux's /proc (CONFIG_PROC_CHILDREN)",
)


def _plan_with_its_two_workers() -> tuple[subprocess.Popen[bytes], list[int]]:
    """`tessera plan --jobs 2` in its own process group, once both its workers run."""
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
    return proc, workers


def _stderr_once_ended(proc: subprocess.Popen[bytes]) -> str:
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # it hung: nothing of it is left for the tests that follow
            os.killpg(proc.pid, signal.SIGKILL)
    return err.decode()


def _all_gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


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
    proc, workers = _plan_with_its_two_workers()
    (os.killpg if group else os.kill)(proc.pid, sig)
    err = _stderr_once_ended(proc)
    assert proc.returncode == code
    assert err == stderr
    assert _all_gone(workers)


def test_a_worker_killed_alone_is_an_error_not_a_hang() -> None:
    """The kernel's out-of-memory killer takes one worker and tells the parent nothing: multiprocessing's pool
    would start another and wait for ever for the task that died with it."""
    proc, workers = _plan_with_its_two_workers()
    os.kill(workers[0], signal.SIGKILL)
    err = _stderr_once_ended(proc)
    assert proc.returncode == EXIT_USER_ERROR
    assert err == (
        f"error: a search worker process (pid {workers[0]}) died with exit code -9 (killed by signal 9: out of "
        "memory?); no plan was made. Rerun with --jobs 1 to search in this process.\n"
    )
    assert _all_gone(workers)
