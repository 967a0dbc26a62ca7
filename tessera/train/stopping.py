"""Clean stops on request: SIGTERM, SIGINT or the pre-emption signal make every rank stop at the same step.

A handler only records the signal. At each step boundary the ranks all-reduce (max) the signal number they
saw, so they agree on the stop step even when the signal reached them at different moments; the trainer then
writes a checkpoint there and returns, and `tessera train` exits 75 ("stopped cleanly, resumable"). A second
SIGINT while a stop is pending interrupts at once (KeyboardInterrupt, exit 130).
"""

from __future__ import annotations

import signal
import threading
from types import TracebackType

import torch
import torch.distributed as dist

__all__ = ["StopRequests"]


class StopRequests:
    """Install the stop handlers for the duration of a ``with`` block (main thread only; elsewhere a no-op)."""

    def __init__(self, stop_signal: str = "") -> None:
        names = ["SIGTERM", "SIGINT"] + ([stop_signal] if stop_signal else [])
        self.signals = [getattr(signal, n) for n in names]
        self.seen = 0  # the signal number received, 0 for none
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: object) -> None:
        if self.seen and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: do not wait for the step to finish
        self.seen = self.seen or signum

    def agreed(self, device: torch.device) -> str | None:
        """The signal some rank saw (collective: every rank must call it at the same step), or None."""
        flag = torch.tensor([float(self.seen)], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        seen = int(flag.item())
        return signal.Signals(seen).name if seen else None
