"""A user error on many ranks (tessera/rank_errors.py): each different message once, with the ranks that said
it; under torchrun an every-rank decision is printed by rank 0 alone, any other error by each rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.errors import CheckpointError, ConfigError, DataError, TesseraError
from tessera.rank_errors import (
    ERROR_DIR,
    decided_on_every_rank,
    format_reports,
    rank_ranges,
    read_reports,
    report_error,
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
