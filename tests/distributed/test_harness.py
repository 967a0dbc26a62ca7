"""The harness itself: results come back per rank, and a failing rank's traceback reaches the parent."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import DistributedTestError, run_distributed


def _allreduce_rank(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()


def test_results_per_rank() -> None:
    assert run_distributed(_allreduce_rank, 3) == [3.0, 3.0, 3.0]


def test_failing_rank_traceback_is_shown() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 1 failed(.|\n)*boom on purpose"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)
