"""Run a function in N gloo processes on CPU and surface the failing rank's traceback.

Each test gets a fresh free port, a per-test timeout and a clean teardown: a hung rank is killed rather than
hanging CI, and the first failing rank's full traceback is re-raised in the parent.
"""

from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tessera.train.launch import free_port

__all__ = ["DistributedTestError", "run_distributed"]


class DistributedTestError(AssertionError):
    """A rank failed or timed out; the message holds that rank's traceback."""


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
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
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
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
