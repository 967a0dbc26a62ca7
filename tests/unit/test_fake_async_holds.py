"""The dry run's asynchronous collectives hold their tensors until waited for, as NCCL's requests do.

A GPU rank's ``async_op=True`` collective keeps its buffers alive until its request is waited for (NCCL's work
stashes them for the allocator's safety), so a buffer the caller drops right after issuing it (2D SUMMA's
partial products, `tensor_2d._summa_atb`) still counts on the rank until then. The fake backend's requests hold
nothing; `tessera.fake.fake_process_group` wraps the collectives tessera issues asynchronously so that they do.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tessera import comm
from tessera.fake import FakeRank, fake_process_group

N = 1024  # fp32 elements: 4 KiB a buffer


def _reduce(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    return comm.reduce(t, 0, group, async_op=async_op)


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    return comm.all_reduce(t, group, async_op=async_op)


def _broadcast(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    return comm.broadcast(t, 0, group, async_op=async_op)


def _reduce_scatter(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    return comm.reduce_scatter_into(torch.empty(N // 2), t, group=group, async_op=async_op)


COLLECTIVES = {"reduce": _reduce, "all_reduce": _all_reduce, "broadcast": _broadcast}
COLLECTIVES["reduce_scatter"] = _reduce_scatter


@pytest.mark.parametrize("kind", list(COLLECTIVES))
def test_a_dropped_buffer_lives_until_its_request_is_waited_for(kind: str) -> None:
    issue = COLLECTIVES[kind]
    with fake_process_group(0, 2), FakeRank() as tracker:
        group = dist.new_group([0, 1])
        base = tracker.live
        work = issue(torch.ones(N), group, True)  # the caller keeps no reference to its buffer
        held = tracker.live - base
        work.wait()
        after = tracker.live - base
        issue(torch.ones(N), group, False)  # a blocking call holds nothing afterwards
        blocking = tracker.live - base
    assert held >= 4 * N, held  # the request holds the buffer its caller dropped
    assert held - after >= 4 * N, (held, after)  # the wait released it
    assert blocking == after, (blocking, after)
