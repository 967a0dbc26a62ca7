"""Synchronous stand-ins for CUDA streams, so that CPU tests run the ring's lanes (`tessera.parallel.ring_1d`'s
`_Lanes`) with several lanes: every operation runs at once on the CPU, and each stream logs what a CUDA stream
would have been asked (wait for another stream, keep a tensor's memory, run the work issued in a context)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

from tessera import traffic
from tessera.parallel import ring_1d

Log = list[tuple[str, str, object]]
"""(operation, this stream's name, the other stream's name / id of the tensor / None), in call order."""


class SyncStream:
    """A `ring_1d._Stream` whose operations only log themselves."""

    def __init__(self, name: str, log: Log) -> None:
        self.name, self.log = name, log

    def wait(self, other: SyncStream) -> None:
        self.log.append(("wait", self.name, other.name))

    def keep(self, t: torch.Tensor) -> None:
        self.log.append(("keep", self.name, id(t)))

    @contextmanager
    def active(self) -> Iterator[None]:
        self.log.append(("enter", self.name, None))
        yield
        self.log.append(("exit", self.name, None))


@contextmanager
def forced_lanes(count: int | None = None) -> Iterator[Log]:
    """Inside: ring_1d's rings run on ``count`` lanes (``RING_GEMM_LANES``, kept when None; min(count, t) for a
    ring of t) of `SyncStream`s, CPU tensors included. Yields the streams' log: the current stream is "current",
    lane j "lane{j}"."""
    log: Log = []

    def streams(like: torch.Tensor, n: int) -> tuple[SyncStream, list[SyncStream]]:
        return SyncStream("current", log), [SyncStream(f"lane{j}", log) for j in range(n)]

    lanes = traffic.RING_GEMM_LANES if count is None else count
    with (
        mock.patch.object(traffic, "RING_GEMM_LANES", lanes),
        mock.patch.object(ring_1d, "_streams", streams),
    ):
        yield log


def lanes_entered(log: Log) -> set[int]:
    """The lanes some work ran on."""
    return {int(name.removeprefix("lane")) for op, name, _ in log if op == "enter"}
