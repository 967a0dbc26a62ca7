"""Starting local ranks (``tessera train --nproc N``) so that none outlives the launcher.

- Each worker runs in its own process group (so a terminal's Ctrl-C reaches the launcher only, which forwards
  it once) and asks the kernel for SIGKILL when the launcher dies (``PR_SET_PDEATHSIG`` on Linux): a launcher
  killed by SIGKILL, the OOM killer or a crash takes its workers with it.
- SIGTERM, SIGINT, SIGHUP and the run's pre-emption signal (``train.stop_signal``) are forwarded to every
  worker, which stop together at a step boundary after a checkpoint and exit 75 (`tessera.errors`). Workers
  still alive ``grace_s`` after that, or after a second signal, are killed.
- A worker that fails ends the others at once; the user sees one line naming it (and the last step it reported,
  from its heartbeat file RUN_DIR/heartbeat/rank{r}) after that rank's own message.
- Ranks do not print their user errors, nor the watchdog's hang message: they report them in a folder of this
  launcher's (`tessera.rank_errors`), which prints each different message once with the ranks that reported
  it. After an error every rank decides alike (a config or resume refusal), or a hang, the others get
  `SAME_ERROR_WAIT_S` to reach and report it too (a hang's other ranks time out in the same collective, and
  write their stacks) before they are stopped; ranks a hang report names as not responding are not waited for.
- The rendezvous port listens before any rank starts: the launcher opens it and hands it to rank 0, whose
  TCPStore serves on it (`rendezvous_socket`), so no rank's connection is refused while rank 0 is still
  importing (docs/launching.md, "Rendezvous").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.errors import EXIT_DIVERGED, EXIT_PEER_LOST, EXIT_RESUMABLE, EXIT_USER_ERROR
from tessera.rank_errors import ERROR_DIR, SAME_ERROR_WAIT_S, format_reports, name_ranks, read_reports

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = [
    "STORE_FD",
    "die_with_torchrun_agent",
    "free_port",
    "launch_local",
    "rendezvous_socket",
    "set_parent_death_signal",
    "torchrun_attempt_store",
]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_POLL_S = 0.05


def free_port() -> int:
    """A free TCP port on localhost for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STORE_FD = "TESSERA_STORE_FD"
"""Set in rank 0's environment only: the inherited file descriptor of the listening rendezvous socket."""


def rendezvous_socket() -> socket.socket:
    """A socket listening on a free localhost port, for rank 0's TCPStore to serve on (``STORE_FD``).

    torch's env:// rendezvous starts the store's server in rank 0's ``init_process_group``, after rank 0's
    imports; a rank that gets there first has its connection refused and retries with a growing back-off, so it
    may join seconds after the server is up (docs/launching.md, "Rendezvous"). A socket that already listens
    makes the kernel complete every early connection and queue it until rank 0's server accepts it. Binding
    the port here, instead of picking one for rank 0 to bind later (`free_port`), also leaves no moment for
    another program to take it."""
    return socket.create_server(("127.0.0.1", 0))


def torchrun_attempt_store(timeout: timedelta, environ: Mapping[str, str] | None = None) -> Store | None:
    """Under torchrun with its agent's store (the default): that store, with this attempt's keys apart.

    torchrun's agent keeps one TCPStore for the whole job, and workers of a restart (``--max-restarts``) join it
    again. Without a prefix the new ranks find the dead attempt's keys there: gloo's full-mesh connect reads a
    peer's listening address as soon as its key exists, so a rank that starts before its peer has re-published
    connects to the dead process's address and waits until the timeout (30 minutes by default). Prefixing by
    ``TORCHELASTIC_RESTART_COUNT`` gives every attempt fresh keys (docs/launching.md, "Restarts"). The agent
    outlives its workers, so a rank may also use it to meet its peers on the way out (`tessera.rank_errors`)."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    import torch.distributed as dist  # here: the launcher itself never imports torch

    agent = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"tessera/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent exits; False where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_torchrun_agent() -> bool:
    """Under torchrun, ask for SIGKILL when torchrun's agent (this worker's parent) dies, as tessera's own
    launcher does for its workers; exit at once if the agent is already gone. True when armed.

    torchrun sets no parent-death signal, so a SIGKILLed agent (OOM killer, a scheduler's hard kill) used to
    leave its workers training as orphans. The parent's pid is read before ``prctl`` and compared after it: a
    parent that died in between (the worker was re-parented) is caught by the comparison, one that died before
    is caught by a parent pid of 1 (re-parenting to a subreaper other than init is not detected then)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "TESSERA_LAUNCHER" in os.environ:
        return False  # not under torchrun, or under tessera's launcher, whose preexec_fn already did this
    parent = os.getppid()
    armed = set_parent_death_signal(signal.SIGKILL)
    if parent == 1 or os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)  # as if the signal had come: nobody is left to report to
    return armed


def _worker_setup(launcher_pid: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
            os._exit(1)

    return setup


def launch_local(
    nproc: int,
    argv: list[str],
    *,
    stop_signals: tuple[int, ...] = (),
    grace_s: float = 120.0,
    heartbeat_dir: Path | None = None,
    max_restarts: int = 0,
) -> int:
    """Run ``python -m tessera *argv`` in ``nproc`` local ranks (torchrun's environment); their exit status.

    0 when every rank finished, 75 when they stopped cleanly on a signal, else the first failing rank's status.
    ``stop_signals`` are forwarded to the workers besides SIGTERM, SIGINT and SIGHUP (sent on as SIGTERM).
    After a failure that a restart can cure (a rank killed, hung or lost; not a user error or a diverged run)
    all ranks are started again, up to ``max_restarts`` times; they resume from the newest checkpoint. Each
    attempt rendezvous on a fresh port, so no state of the dead process group is reused.
    """
    for attempt in range(max_restarts + 1):
        code, signalled = _launch_once(nproc, argv, stop_signals, grace_s, heartbeat_dir)
        if (
            code in (0, EXIT_RESUMABLE, EXIT_USER_ERROR, EXIT_DIVERGED)
            or signalled
            or attempt == max_restarts
        ):
            return code
        print(
            f"restarting all {nproc} ranks from the newest checkpoint ({attempt + 1} of {max_restarts})",
            file=sys.stderr,
        )
    return code


def _launch_once(
    nproc: int, argv: list[str], stop_signals: tuple[int, ...], grace_s: float, heartbeat_dir: Path | None
) -> tuple[int, bool]:
    """One attempt: (exit status, whether the launcher was signalled meanwhile)."""
    started = time.time()  # heartbeats from before it are an earlier run's (the run directory is reused)
    # Kept open until every worker is gone: if rank 0 dies before serving on it, the ranks waiting on it are
    # not reset but stopped by this launcher, which names rank 0, as when they used to retry a refused port.
    with rendezvous_socket() as listener, tempfile.TemporaryDirectory(prefix="tessera-errors-") as errors:
        base = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(listener.getsockname()[1]),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "TESSERA_LAUNCHER": "1",  # ranks leave naming a failed peer to this launcher
            ERROR_DIR: errors,  # and printing their errors, which it prints once for all ranks alike
        }
        store = {STORE_FD: str(listener.fileno())}  # rank 0 only: the one that hosts the store
        procs: list[subprocess.Popen] = []
        with _forwarding(procs, stop_signals) as state:
            for r in range(nproc):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tessera", *argv],
                        env={**base, "RANK": str(r), "LOCAL_RANK": str(r), **(store if r == 0 else {})},
                        pass_fds=(listener.fileno(),) if r == 0 else (),
                        process_group=0,
                        preexec_fn=_worker_setup(os.getpid()),
                    )
                )
            try:
                code, failure = _supervise(procs, state, grace_s, Path(errors))
            finally:
                _kill_all(procs)  # whatever happened above, no worker outlives this function
            # printed once every rank has ended: the reports of all ranks that wrote one, each message once
            sys.stderr.write(format_reports(read_reports(Path(errors), nproc)))
            line = None if failure is None else _describe_failure(*failure, heartbeat_dir, started)
            if line:
                print(line, file=sys.stderr)
            return code, state["signal"] is not None


def _supervise(
    procs: list[subprocess.Popen], state: dict, grace_s: float, errors: Path
) -> tuple[int, tuple[int, int, dict[int, dict], list[int]] | None]:
    """Wait for the workers: (exit status, None or the failure to describe: (first failed rank, its status, the
    reports written so far, the ranks still running, which the caller stops))."""
    waiting_since: float | None = None  # when a rank reported an error every rank decides alike
    while True:
        codes = [p.poll() for p in procs]
        # a rank that only lost contact with a failed one is not the news: name the one that failed first
        failed = sorted(
            ((r, c) for r, c in enumerate(codes) if c not in (None, 0, EXIT_RESUMABLE)),
            key=lambda rc: (rc[1] == EXIT_PEER_LOST, rc[0]),
        )
        running = [r for r, c in enumerate(codes) if c is None]
        if failed and not state["signal"]:
            rank, code = failed[0]
            reports = read_reports(errors, len(procs))
            first = reports.get(rank, {})
            # ranks the report says will not report (frozen ones, named in a hang's message) are not waited for
            awaited = [r for r in running if r not in first.get("silent", ())]
            if awaited and (first.get("same_on_every_rank") or first.get("others_follow")):
                # the others decide the same at the same point, or time out in the same collective: let them say
                # so (and write their stacks) rather than be stopped
                waiting_since = waiting_since or time.monotonic()
                if time.monotonic() < waiting_since + SAME_ERROR_WAIT_S:
                    time.sleep(_POLL_S)
                    continue
            return _status(code), (rank, code, reports, running)
        if all(c is not None for c in codes):
            if failed:
                return _status(failed[0][1]), None
            return (EXIT_RESUMABLE if EXIT_RESUMABLE in codes else 0), None
        if state["signal"] and time.monotonic() > state["since"] + grace_s:
            print(
                f"error: ranks still running {grace_s:.0f}s after {state['signal']}; killed", file=sys.stderr
            )
            return 128 + signal.SIGKILL, None
        time.sleep(_POLL_S)


def _describe_failure(
    rank: int,
    code: int,
    reports: dict[int, dict],
    stopped: list[int],
    heartbeat_dir: Path | None,
    started: float,
) -> str:
    """The launcher's line after a failure. A rank that reported its error was named with it already: the line
    then only names the ranks that were stopped (none: no line); else it names the rank and how it ended."""
    if rank in reports:
        return f"stopped {name_ranks(stopped)} after rank {rank}'s error" if stopped else ""
    return f"error: {_describe_exit(rank, code, heartbeat_dir, started)}; the other ranks were stopped"


def _status(code: int) -> int:
    """A worker's exit status as a shell reports it: 128 + N for "killed by signal N"."""
    return 128 - code if code < 0 else code


def _describe_exit(rank: int, code: int, heartbeat_dir: Path | None, started: float) -> str:
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    step = read_heartbeat(heartbeat_dir, rank, since=started) if heartbeat_dir is not None else None
    at = f" after step {step}" if step is not None and step >= 0 else ""
    return f"rank {rank} {how}{at}"


def read_heartbeat(heartbeat_dir: Path, rank: int, since: float = 0.0) -> int | None:
    """The step a rank last reported in ``heartbeat_dir/rank{r}`` (the trainer's watchdog) at or after ``since``
    (wall-clock seconds), or None: a rank that failed before its first step of this attempt was named with the
    step an earlier run in the same run directory had reached."""
    try:
        step, when = (Path(heartbeat_dir) / f"rank{rank}").read_text().split()
        return int(step) if float(when) >= since else None
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _forwarding(procs: list[subprocess.Popen], stop_signals: tuple[int, ...]) -> Iterator[dict]:
    """Forward stop signals to the workers while inside; a second one kills them."""
    state: dict = {"signal": None, "since": 0.0}
    forwarded = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT, signal.SIGHUP: signal.SIGTERM}
    forwarded |= {s: s for s in stop_signals}

    def handler(signum: int, frame: object) -> None:
        if state["signal"] is not None and signum in (signal.SIGINT, signal.SIGTERM):
            _kill_all(procs)  # asked twice: stop waiting for a clean stop
            return
        state["signal"] = state["signal"] or signal.Signals(signum).name
        state["since"] = time.monotonic()
        _signal_all(procs, forwarded[signum])

    old = {s: signal.signal(s, handler) for s in forwarded}
    try:
        yield state
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _signal_all(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    _signal_all(procs, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=10)
