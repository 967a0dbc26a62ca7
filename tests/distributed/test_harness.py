"""The harness itself: results come back per rank, and a failing rank's traceback reaches the parent."""

from __future__ import annotations

import os
from pathlib import Path

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


_MARK = "unchanged"


def _what_a_rank_inherited(rank: int, world_size: int) -> tuple[str | None, str, str]:
    """Print to stdout, report the environment and directory seen, and change a module global."""
    global _MARK
    print(f"rank {rank} says hello", flush=True)
    seen, _MARK = _MARK, f"changed by rank {rank}"
    return os.environ.get("HARNESS_TEST_VARIABLE"), os.getcwd(), seen


def test_ranks_inherit_the_test_environment_directory_and_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """Forked ranks get what spawned ones inherited at their start: the environment and working directory of
    the test then (not of the test that started the forkserver) and its captured stdout."""
    with capfd.disabled():  # a forkserver this test starts does so outside the capture, without the variable
        run_distributed(_allreduce_rank, 2)
    monkeypatch.setenv("HARNESS_TEST_VARIABLE", "set by the test")
    monkeypatch.chdir(tmp_path)
    got = run_distributed(_what_a_rank_inherited, 2)
    assert [g[:2] for g in got] == [("set by the test", str(tmp_path))] * 2
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out
    monkeypatch.delenv("HARNESS_TEST_VARIABLE")
    assert [g[0] for g in run_distributed(_what_a_rank_inherited, 2)] == [None, None]


def test_no_rank_state_reaches_a_later_launch() -> None:
    """Each launch's ranks start from the same preloaded state: a global a rank changed is back."""
    for _ in range(2):
        assert [seen for *_, seen in run_distributed(_what_a_rank_inherited, 2)] == ["unchanged"] * 2
