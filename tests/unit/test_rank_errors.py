"""A user error on many ranks (tessera/rank_errors.py): each different message once, with the ranks that said
it; under torchrun an every-rank decision is printed once per different text (by rank 0 alone where there is no
agent store to meet in), any other error by each rank. The watchdog's hang message likewise, its numbers merged.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tessera import rank_errors
from tessera.errors import CheckpointError, ConfigError, DataError, TesseraError
from tessera.rank_errors import (
    ERROR_DIR,
    decided_on_every_rank,
    format_reports,
    rank_ranges,
    read_reports,
    report_error,
    report_hang,
)


def _every_rank(message: str) -> TesseraError:
    with pytest.raises(TesseraError) as caught, decided_on_every_rank():
        raise CheckpointError(message)
    return caught.value


def test_rank_ranges() -> None:
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert rank_ranges([3]) == "3" and rank_ranges(range(1024)) == "0-1023" and rank_ranges([]) == ""
    assert rank_ranges([4, 0, 1, 4]) == "0-1, 4"


def test_only_errors_raised_inside_are_marked_as_every_ranks() -> None:
    assert _every_rank("x").same_on_every_rank
    assert not DataError("x").same_on_every_rank and not ConfigError("x").same_on_every_rank


def test_under_torchrun_rank_0_alone_prints_an_every_rank_decision(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each rank printed it: 1,024 copies at 1,024 ranks. Rank 0 says which ranks stop with it silently."""
    e = _every_rank("checkpoint c was trained with other settings")
    report_error(e, {"WORLD_SIZE": "1024", "RANK": "0"})
    err = capsys.readouterr().err
    assert err.startswith("[rank 0] error: checkpoint c was trained with other settings\n")
    assert "ranks 1-1023 exit with status 2 too, without repeating it" in err
    for rank in ("1", "1023"):
        report_error(e, {"WORLD_SIZE": "1024", "RANK": rank})
        assert capsys.readouterr().err == ""


def test_under_torchrun_any_other_error_is_printed_by_its_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """A file missing on one node must never be hidden, whichever rank meets it."""
    for rank in ("0", "5"):
        report_error(DataError("data/x.bin is missing"), {"WORLD_SIZE": "8", "RANK": rank})
        assert capsys.readouterr().err == f"[rank {rank}] error: data/x.bin is missing\n"
    report_error(_every_rank("bad config"), {"WORLD_SIZE": "1"})  # one process: as it always was
    assert capsys.readouterr().err == "error: bad config\n"


def test_under_tessera_launcher_a_rank_reports_instead_of_printing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {"WORLD_SIZE": "4", ERROR_DIR: str(tmp_path)}
    for rank in range(3):
        report_error(_every_rank("refused"), {**env, "RANK": str(rank)})
    report_error(DataError("rank 3's shard is unreadable"), {**env, "RANK": "3"})
    assert capsys.readouterr().err == ""
    reports = read_reports(tmp_path, 4)
    assert reports[3] == {"message": "rank 3's shard is unreadable", "same_on_every_rank": False}
    assert format_reports(reports) == (
        "[ranks 0-2] error: refused\n[rank 3] error: rank 3's shard is unreadable\n"
    )
    # a folder it cannot write to: the rank prints its error itself, nothing is lost
    report_error(DataError("lost?"), {**env, ERROR_DIR: str(tmp_path / "missing" / "folder"), "RANK": "2"})
    assert capsys.readouterr().err == "[rank 2] error: lost?\n"


def test_reports_group_identical_messages_only() -> None:
    same = {"message": "m", "same_on_every_rank": True}
    reports = {r: same for r in (0, 1, 2, 3, 5)} | {4: {"message": "m2", "same_on_every_rank": True}}
    assert format_reports(reports) == "[ranks 0-3, 5] error: m\n[rank 4] error: m2\n"
    assert format_reports({}) == ""


def test_a_damaged_report_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text("{not json")
    (tmp_path / "rank1.json").write_text(json.dumps({"message": "ok", "same_on_every_rank": False}))
    assert list(read_reports(tmp_path, 2)) == [1]


@pytest.fixture
def agent_store() -> Iterator[dict[str, str]]:
    """A TCPStore standing in for torchrun's agent's (its keys are this test's alone), and the environment
    torchrun gives its workers to find it, less the rank and world size."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
    del store


def _ranks_at_once(calls: list) -> None:
    """Run each call in its own thread, as ranks run at the same time (they wait in the store for each other)."""
    threads = [threading.Thread(target=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


def test_under_torchrun_a_different_every_rank_decision_of_another_rank_is_printed(
    agent_store: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 read another config file (another seed): it used to exit 2 in silence, assuming rank 0 had said
    what it would. Now each different text is printed once, by whichever rank claimed it first."""
    env = {**agent_store, "WORLD_SIZE": "3"}
    said = {0: "seed 9 now", 1: "seed 8 now", 2: "seed 9 now"}
    _ranks_at_once(
        [lambda r=r: report_error(_every_rank(said[r]), {**env, "RANK": str(r)}) for r in range(3)]
    )
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if " error: " in line]
    assert sorted(line.split("] error: ")[1] for line in lines) == ["seed 8 now", "seed 9 now"], err
    assert "[rank 1] error: seed 8 now" in lines, err
    assert err.count("a rank that decides otherwise prints its own") == 2, err


def test_under_torchrun_the_same_decision_is_printed_once_and_no_rank_waits_past_the_bound(
    agent_store: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**agent_store, "WORLD_SIZE": "4"}
    _ranks_at_once(
        [lambda r=r: report_error(_every_rank("refused"), {**env, "RANK": str(r)}) for r in range(4)]
    )
    assert capsys.readouterr().err.count("error: refused") == 1
    # a new attempt (a restart) has keys of its own: its refusal is printed again; rank 1 never decides (it
    # accepted, or died): rank 0 waits for it only SAME_ERROR_WAIT_S
    monkeypatch.setattr(rank_errors, "SAME_ERROR_WAIT_S", 0.3)
    report_error(
        _every_rank("refused"), {**env, "WORLD_SIZE": "2", "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "1"}
    )
    assert capsys.readouterr().err.startswith("[rank 0] error: refused\n")


def test_under_torchrun_a_rank_that_decided_stays_until_the_others_have(
    agent_store: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun stops every worker as soon as one exits: rank 0 exiting at once would kill rank 1 before it
    printed a different refusal. So rank 0 returns (and exits) only once rank 1 has decided too."""
    monkeypatch.setattr(rank_errors, "SAME_ERROR_WAIT_S", 60.0)
    env = {**agent_store, "WORLD_SIZE": "2"}
    rank0 = threading.Thread(target=report_error, args=(_every_rank("seed 9 now"), {**env, "RANK": "0"}))
    rank0.start()
    rank0.join(timeout=1.0)
    assert rank0.is_alive()  # still waiting for rank 1, which has not decided
    report_error(_every_rank("seed 8 now"), {**env, "RANK": "1"})
    rank0.join(timeout=30)  # far below the 60 s bound: it ended because rank 1 decided
    assert not rank0.is_alive()
    err = capsys.readouterr().err
    assert "[rank 0] error: seed 9 now" in err and "[rank 1] error: seed 8 now" in err


def test_without_a_reachable_store_a_rank_prints_as_before(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent store that does not answer: the rank gives up after STORE_TIMEOUT_S, and rank 0 speaks for all."""
    monkeypatch.setattr(rank_errors, "STORE_TIMEOUT_S", 0.5)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    report_error(_every_rank("refused"), {**env, "WORLD_SIZE": "2", "RANK": "0"})
    assert capsys.readouterr().err.startswith("[rank 0] error: refused\n(every rank decides this alike")


HANG = (
    "no progress for {idle}s (train.hang_timeout_s = 6) after step {step}; not responding: rank 1 (step 41)"
)


def test_hang_reports_of_many_ranks_are_one_line_with_the_range_of_their_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank blocked with a frozen one timed out and printed its own line, differing in seconds idle:
    1,023 lines at 1,024 ranks. Their reports are one line, naming the ranks that timed out."""
    env = {"WORLD_SIZE": "4", ERROR_DIR: str(tmp_path)}
    for rank, idle in ((0, 6.4), (2, 7.6), (3, 6.2)):
        report_hang(rank, 4, HANG, {"idle": idle, "step": 41}, [1], env)
    assert capsys.readouterr().err == ""
    reports = read_reports(tmp_path, 4)
    assert reports[2]["others_follow"] and reports[2]["silent"] == [1]
    assert format_reports(reports) == (
        "[ranks 0, 2-3] error: no progress for 6-8s (train.hang_timeout_s = 6) after step 41; "
        "not responding: rank 1 (step 41)\n"
    )
    assert format_reports({0: reports[0]}) == (
        "[rank 0] error: no progress for 6s (train.hang_timeout_s = 6) after step 41; not responding: rank 1 "
        "(step 41)\n"
    )


def test_under_torchrun_the_first_rank_to_time_out_prints_the_hang(
    agent_store: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    env = {**agent_store, "WORLD_SIZE": "3"}
    for rank in (2, 0):
        report_hang(rank, 3, HANG, {"idle": 7.0 + rank, "step": 41}, [1], env)
    err = capsys.readouterr().err
    assert err.startswith("[rank 2] error: no progress for 9s (train.hang_timeout_s = 6) after step 41; ")
    assert err.count("\n") == 1 and "the others that do exit 4 without repeating this" in err, err
    # no store (another launcher): each rank prints its own line, as before; one process: no rank
    report_hang(2, 3, HANG, {"idle": 7.0, "step": 41}, [1], {})
    assert capsys.readouterr().err.startswith("[rank 2] error: no progress for 7s ")
    report_hang(0, 1, HANG, {"idle": 7.0, "step": 41}, [], {})
    assert capsys.readouterr().err.startswith("error: no progress for 7s ")
