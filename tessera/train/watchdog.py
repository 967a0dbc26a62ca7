"""A hang watchdog: a rank that makes no progress for ``train.hang_timeout_s`` dumps its stack and exits 4.

Each rank runs a daemon thread that, every few seconds, writes ``RUN_DIR/heartbeat/rank{r}`` (its last finished
step and the wall-clock time; the local launcher reads it to say where a dead rank was) and checks that the
training loop has finished a step within the timeout. When it has not, the thread writes every thread's Python
stack (faulthandler) to ``RUN_DIR/stacks/rank{r}.txt``, reads the other ranks' heartbeats, and exits the
process with a message naming the ranks that stopped responding (a heartbeat older than a few intervals: a
stopped or frozen process, whose own thread cannot write) or, when all respond, the ranks behind the others
(stuck elsewhere, e.g. a mismatched collective). The healthy ranks are all blocked in a collective with the
stuck one, so they all time out alike; the message is shown once for all of them (`tessera.rank_errors.
report_hang`: under tessera's launcher one line naming the ranks that timed out, under torchrun the first rank
to time out's), each with its stack on disk as long as its launcher has not stopped it first.

The clock starts after the first step (start-up, compilation and data preparation do not count) and pauses
while a checkpoint is written or loaded.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tessera.errors import EXIT_HANG
from tessera.rank_errors import name_ranks, report_hang

__all__ = ["Watchdog"]


class Watchdog:
    """Start with ``with Watchdog(...) as dog:``; call ``dog.progress(step)`` after each step."""

    def __init__(self, run_dir: Path, rank: int, world: int, timeout_s: float) -> None:
        self.run_dir, self.rank, self.world, self.timeout_s = Path(run_dir), rank, world, timeout_s
        self.interval = max(0.2, min(5.0, timeout_s / 10)) if timeout_s > 0 else 5.0
        self.step = -1  # not armed until the first step has finished
        self._last = time.monotonic()
        self._paused = 0
        self._beat_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        (self.run_dir / "heartbeat").mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, name="tessera-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)

    def progress(self, step: int) -> None:
        """Step ``step`` has finished (the first call arms the timeout); the heartbeat follows within a second."""
        due = time.monotonic() - self._beat_at > 1.0  # at most once a second from the loop: cheap
        self.step, self._last = step, time.monotonic()
        if due:
            self._beat()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No timeout inside (a checkpoint save or load may legitimately take long)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()
            idle = time.monotonic() - self._last
            if self.timeout_s > 0 and self.step >= 0 and not self._paused and idle > self.timeout_s:
                self._fire(idle)

    def _beat(self) -> None:
        self._beat_at = time.monotonic()
        path = self.run_dir / "heartbeat" / f"rank{self.rank}"
        part = path.with_name(f"{path.name}.{threading.get_ident()}.part")  # readers never see half a line
        with contextlib.suppress(OSError):
            part.write_text(f"{self.step} {time.time():.3f}\n")
            os.replace(part, path)

    def _fire(self, idle: float) -> None:
        stacks = self.run_dir / "stacks"
        with contextlib.suppress(OSError):
            stacks.mkdir(parents=True, exist_ok=True)
            with open(stacks / f"rank{self.rank}.txt", "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        diagnosis, silent = self._culprits()
        # {idle} and {step} differ between the ranks that time out; the rest is what they all read
        message = (
            f"no progress for {{idle}}s (train.hang_timeout_s = {self.timeout_s:g}) after step {{step}}; "
            f"{diagnosis}; stacks in {stacks}/"
        )
        report_hang(self.rank, self.world, message, {"idle": idle, "step": self.step}, silent)
        sys.stderr.flush()
        os._exit(EXIT_HANG)  # the main thread is blocked in a collective: nothing else would end the process

    def _culprits(self) -> tuple[str, list[int]]:
        """What the heartbeats say (the same text on every rank that reads them: no clock readings in it, so the
        launcher prints it once), and the ranks not responding."""
        now, beats = time.time(), {}
        for r in range(self.world):
            try:
                step, when = (self.run_dir / "heartbeat" / f"rank{r}").read_text().split()
                beats[r] = (int(step), float(when))
            except (OSError, ValueError):
                beats[r] = (-1, 0.0)
        silent = [r for r, (_, when) in beats.items() if now - when > 3 * self.interval + 1]
        if silent:
            return f"not responding: {_by_step(silent, beats)}", silent
        newest = max(step for step, _ in beats.values())
        behind = [r for r, (step, _) in beats.items() if step < newest]
        if behind:
            return f"behind the others (step {newest}): {_by_step(behind, beats)}", []
        return "every rank responds at the same step (a collective that never completes)", []


def _by_step(ranks: list[int], beats: dict[int, tuple[int, float]]) -> str:
    """``ranks 8-15 (step 41), rank 3 (step 40)``: the ranks grouped by their last heartbeat's step, so that a
    node of silent ranks is one entry."""
    steps: dict[int, list[int]] = {}
    for r in ranks:
        steps.setdefault(beats[r][0], []).append(r)
    where = {step: f"step {step}" if step >= 0 else "no step yet" for step in steps}  # -1: none read or armed
    return ", ".join(f"{name_ranks(steps[step])} ({where[step]})" for step in sorted(steps, reverse=True))
