"""Checkpoints written in the background (``checkpoint.async = true``) with the same commit protocol.

`save_checkpoint(..., background=saves)` gathers the state as usual, then hands it here: DCP's ``async_save``
copies every tensor to CPU memory in the calling thread (its stager; the copy is the only part training waits
for), writes the copy into ``step_N.tmp/`` from a worker thread, and on success the same thread finishes the
save exactly as a synchronous one does: RNG files, checksums, ``meta.json``, the rename to ``step_N/``,
``latest``, pruning. So a checkpoint still counts only once it is committed, and a crash at any moment leaves
the previous one intact (the kill trials of benchmarks/faults.py run both modes).

- At most one save is in flight: the next save, and the end of the run (a finished run or a clean stop on a
  signal), first wait for the previous one.
- The background thread talks to the other ranks over its own gloo group (created once, collectively), so its
  collectives never interleave with the training loop's on the default group (torchtitan does the same).
  DCP's async save needs a CPU-capable group in any case, which NCCL alone is not.
- A failure in the background (disk full, a rank lost) is raised by the next ``wait()`` as the same
  `CheckpointWriteError` a synchronous save raises; nothing was committed, so resuming takes the previous one.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlanner

__all__ = ["AsyncSaves"]

# one process without a process group: DCP warns from its worker thread, where a catch_warnings cannot reach
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

Publish = Callable[[dist.ProcessGroup | None], Path]


class AsyncSaves:
    """One rank's background checkpoint saves; every rank of the run must hold one (``new`` is collective)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._pending: Future[Path] | None = None

    @classmethod
    def new(cls, timeout_s: float = 0) -> AsyncSaves:
        """Create the saves' own gloo group if a process group exists (collective: every rank, same order);
        its collectives time out after ``timeout_s`` like the run's (0: torch's default)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls(None)
        timeout = timedelta(seconds=timeout_s) if timeout_s > 0 else None
        return cls(dist.new_group(backend="gloo", timeout=timeout))

    def start(
        self,
        state: dict[str, Any],
        tmp: Path,
        publish: Publish,
        write_errors: Callable[[], AbstractContextManager[None]],
        planner: SavePlanner | None = None,
    ) -> None:
        """Copy ``state`` now and write it into ``tmp`` in the background (with ``planner``, the checkpoint
        format's), then ``publish(group)`` (the commit); DCP failures pass through ``write_errors`` (which turns
        them into the user's message)."""
        self.wait()
        with write_errors():
            written = dcp.async_save(
                state,
                storage_writer=FileSystemWriter(tmp),
                planner=planner,
                process_group=self.group,
                no_dist=self.group is None,
            )
        committed: Future[Path] = Future()

        def then(done: Future) -> None:  # runs in DCP's worker thread once the files are written
            try:
                with write_errors():
                    done.result()
                committed.set_result(publish(self.group))
            except BaseException as e:  # handed to wait(), in the training thread
                committed.set_exception(e)

        written.add_done_callback(then)
        self._pending = committed

    def wait(self) -> Path | None:
        """Block until the save in flight is committed; its folder (None if there was none). Raises the error
        that stopped it, once."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._pending is not None

    def settle(self) -> None:
        """`wait`, for when the run is ending on another error: a save of an earlier, healthy step may still
        commit; its own failure is reported on stderr, not raised over the error that is ending the run."""
        try:
            self.wait()
        except Exception as e:
            sys.stderr.write(
                f"WARNING: the checkpoint being written in the background was not committed: {e}\n"
            )
