"""Run a function in N gloo processes on CPU and surface the failing rank's traceback.

Each test gets a fresh free port, a per-test timeout and a clean teardown: a hung rank is killed rather than
hanging CI, and the first failing rank's full traceback is re-raised in the parent.

Ranks are forked from a forkserver that has imported torch and tessera once per test session (`PRELOAD`):
a spawned rank spent about two seconds of CPU importing them, times 2-8 ranks per launch on CI's two cores,
which was most of the distributed suite's start-up cost. Each rank is a fresh fork of that server, not of an
earlier rank, so no test's rank state reaches another; what a spawned rank would have inherited from the test
at its start (the environment, the working directory, sys.path, stdout and stderr) is handed over explicitly.
Only this harness forks: the CLI and fault tests start `python -m tessera` as users do.

The rendezvous port is a socket the test already listens on, handed to rank 0 as `tessera train --nproc` hands
it (`tessera.train.launch.rendezvous_socket`): a port picked free and bound later by rank 0 could be taken in
between by another test's ranks when tests run in parallel (scripts/test runs two at a time).
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout

from tessera.train.launch import STORE_FD, rendezvous_socket
from tessera.train.trainer import _serve_on_launcher_socket

__all__ = ["PRELOAD", "DistributedTestError", "run_distributed"]

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    # torch's Python meta kernels (torch._refs) import dynamo on their first call, which every rank makes in
    # meta_model (normal_, arange on meta): about 2 s of one core per rank, paid here once instead
    "torch._dynamo",
    "pytest",
    "tessera.train.trainer",
    "tessera.train.export",
    "tessera.cli",
    "tessera.parallel.apply",
    "tessera.parallel.model_1d",  # imported lazily by apply, by every tensor-parallel rank
    "tessera.parallel.model_2d",
    "tessera.pipeline.runtime",
    "tests.distributed.conftest",
]
"""Imported once by the forkserver, before any rank is forked: what nearly every rank imports (not
transformers: only the Hugging Face tests' ranks use it, through lazy imports)."""


class DistributedTestError(AssertionError):
    """A rank failed or timed out; the message holds that rank's traceback."""


class _Fd:
    """A file descriptor of the parent, duplicated into the rank as it starts (the forkserver passes it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(dup: Any) -> int:
    return dup.detach()


@functools.cache
def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _inherit(env: dict[str, str], stdout: int, stderr: int) -> None:
    """Give this rank what a spawned one inherits from the test at its start: the environment then (the
    forkserver's is the one of the test that started it) and the test's captured stdout and stderr."""
    os.environ.clear()
    os.environ.update(env)
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    inherited: tuple[dict[str, str], int, int],
    listener: int | None,
) -> None:
    _inherit(*inherited)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    if listener is not None:
        os.environ[STORE_FD] = str(listener)
    torch.set_num_threads(1)
    try:
        server = _serve_on_launcher_socket(default_pg_timeout)  # rank 0: the store on the test's socket
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        del server  # the process group's store holds it from here on
        # gloo connects its mesh pair by pair and init_process_group returns without a barrier: a rank whose
        # ``fn`` runs no collective could finish and close its side while a slower peer is still connecting
        # ("Connection closed by peer" in that peer's init, seen once in CI under load)
        dist.barrier()
        result = fn(rank, world_size, *args)
        # Plain pickle: torch's queue reducers would pass tensors through shared memory, which dies with the rank.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # every failure must reach the parent with its traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be a module-level (picklable) function and its return value picklable. Raises
    ``DistributedTestError`` with the failing rank's traceback, or naming ranks that did not finish in time.
    """
    ctx = _context()
    queue = ctx.SimpleQueue()
    sys.stdout.flush()
    sys.stderr.flush()
    with rendezvous_socket() as listener:
        port = listener.getsockname()[1]
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    *(r, world_size, port, fn, args, queue, (dict(os.environ), _Fd(1), _Fd(2))),
                    _Fd(listener.fileno()) if r == 0 else None,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()  # rank 0 has its own copy of the listening socket once started
    results: dict[int, Any] = {}
    try:
        _collect(queue, procs, results, world_size, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]


def _collect(queue: Any, procs: list, results: dict, world_size: int, timeout: float) -> None:
    import time

    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        if not queue.empty():
            rank, status, payload = queue.get()
            if status == "error":
                raise DistributedTestError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
            continue
        dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results and p.exitcode != 0]
        if dead and queue.empty():
            raise DistributedTestError(
                f"ranks {dead} died without reporting (exit codes {[procs[i].exitcode for i in dead]})"
            )
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(results))
            raise DistributedTestError(f"timed out after {timeout:.0f}s waiting for ranks {missing}")
        time.sleep(0.01)
