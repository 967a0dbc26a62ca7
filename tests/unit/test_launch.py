"""The local launcher (tessera/train/launch.py), without torch: its rendezvous socket listens before any rank
exists, only rank 0 inherits it, and each attempt has its own; a failed rank is named with the step it reached
in this attempt."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tessera.train.launch as launch

_POPEN = subprocess.Popen  # the launcher's, replaced in the tests (launch.subprocess is this same module)


class _Spawns:
    """Stands in for subprocess.Popen in the launcher: at the moment each rank would start, note whether its
    MASTER_PORT accepts a connection, then start `python -c pass` (exit 0) or `exit(1)` in its place."""

    def __init__(self, exit_code: int = 0, beats: Path | None = None) -> None:
        self.exit_code = exit_code
        self.beats = beats  # where each rank reports step 7 before it exits, as the trainer's watchdog would
        self.ranks: list[dict] = []

    def __call__(self, args: list[str], *, env: dict[str, str], pass_fds: tuple[int, ...], **kw: object):
        port = int(env["MASTER_PORT"])
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            listening = True
        except ConnectionRefusedError:
            listening = False
        fd = env.get(launch.STORE_FD)
        self.ranks.append(
            {
                "rank": int(env["RANK"]),
                "port": port,
                "listening": listening,
                "fd": fd,
                "pass_fds": pass_fds,
                "fd_port": socket.socket(fileno=os.dup(int(fd))).getsockname()[1] if fd else None,
            }
        )
        code = f"raise SystemExit({self.exit_code})"
        if self.beats is not None:
            beat = self.beats / f"rank{env['RANK']}"
            code = (
                f"import pathlib, time; pathlib.Path({str(beat)!r}).write_text(f'7 {{time.time()}}'); {code}"
            )
        return _POPEN([sys.executable, "-c", code], env=env, pass_fds=pass_fds, **kw)


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_rendezvous_port_listens_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, nproc: int
) -> None:
    """Rank 0's store must not be the first to listen (it did, after rank 0's imports: peers that got there
    first were refused and backed off). Fails if the launcher hands out a port nobody listens on yet."""
    spawns = _Spawns()
    monkeypatch.setattr(launch.subprocess, "Popen", spawns)
    assert launch.launch_local(nproc, ["train"]) == 0
    assert [r["rank"] for r in spawns.ranks] == list(range(nproc))
    assert all(r["listening"] for r in spawns.ranks), spawns.ranks
    port = spawns.ranks[0]["port"]
    assert {r["port"] for r in spawns.ranks} == {port}
    # rank 0 alone inherits the listening socket, and it is the one on MASTER_PORT
    rank0, *others = spawns.ranks
    assert rank0["pass_fds"] == (int(rank0["fd"]),) and rank0["fd_port"] == port
    assert all(r["fd"] is None and r["pass_fds"] == () for r in others)
    assert _refused(port), "the rendezvous socket outlived the attempt"


def test_each_attempt_listens_on_a_fresh_port(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--max-restarts: a new attempt meets nothing of the dead one's store, as before."""
    spawns = _Spawns(exit_code=1)
    monkeypatch.setattr(launch.subprocess, "Popen", spawns)
    assert launch.launch_local(2, ["train"], max_restarts=2, heartbeat_dir=tmp_path) == 1
    ports = [r["port"] for r in spawns.ranks if r["rank"] == 0]
    assert len(ports) == 3 and len(set(ports)) == 3, ports
    assert all(r["listening"] for r in spawns.ranks)


def test_a_failed_rank_is_named_with_the_step_of_this_attempt_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A rank that failed before its first step (e.g. a refused resume) was named "after step 41", the step an
    earlier run in the same run directory had reported in its heartbeat file."""
    for r in range(2):
        (tmp_path / f"rank{r}").write_text("41 1000.000\n")  # an earlier run's, in 1970
    monkeypatch.setattr(launch.subprocess, "Popen", _Spawns(exit_code=1))
    assert launch.launch_local(2, ["train"], heartbeat_dir=tmp_path) == 1
    err = capsys.readouterr().err
    assert "exited with status 1; the other ranks were stopped" in err and "after step" not in err, err
    # a step reported in this attempt is named, as before
    monkeypatch.setattr(launch.subprocess, "Popen", _Spawns(exit_code=1, beats=tmp_path))
    assert launch.launch_local(2, ["train"], heartbeat_dir=tmp_path) == 1
    assert "exited with status 1 after step 7; the other ranks were stopped" in capsys.readouterr().err


class _Reports:
    """Stands in for subprocess.Popen: rank r runs ``scripts[r]`` (Python, with ``report(message, every)``
    writing its error report as `tessera.rank_errors.report_error` does) in place of a tessera rank."""

    def __init__(self, scripts: dict[int, str]) -> None:
        self.scripts = scripts

    def __call__(self, args: list[str], *, env: dict[str, str], **kw: object):
        rank = int(env["RANK"])
        code = (
            "import os, pathlib, time\n"
            "from tessera.rank_errors import ERROR_DIR, write_report\n"
            f"def report(message, every):\n"
            f"    write_report(pathlib.Path(os.environ[ERROR_DIR]), {rank}, message, every)\n"
            f"    raise SystemExit(2)\n"
            f"{self.scripts[rank]}\n"
        )
        return _POPEN([sys.executable, "-c", code], env=env, **kw)


def test_an_error_every_rank_reports_is_printed_once_with_their_ranks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Rank 1 reaches the same refusal after rank 0 has exited: the launcher lets it, rather than stopping it at
    once, and prints the message once for both, with no line of its own (both said why they stopped)."""
    scripts = {
        0: "report('refused\\n    fix: this', True)",
        1: "time.sleep(0.5); report('refused\\n    fix: this', True)",
    }
    monkeypatch.setattr(launch.subprocess, "Popen", _Reports(scripts))
    assert launch.launch_local(2, ["train"]) == 2
    assert capsys.readouterr().err == "[ranks 0-1] error: refused\n    fix: this\n"


def test_the_launcher_does_not_wait_for_a_stuck_rank_nor_hide_a_rank_specific_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A rank that never reaches the every-rank decision is stopped after SAME_ERROR_WAIT_S and named; one
    rank's own error stops the others at once and is printed with its rank, and so is a different one."""
    monkeypatch.setattr(launch, "SAME_ERROR_WAIT_S", 0.5)
    monkeypatch.setattr(
        launch.subprocess, "Popen", _Reports({0: "report('refused', True)", 1: "time.sleep(600)"})
    )
    assert launch.launch_local(2, ["train"]) == 2
    assert capsys.readouterr().err == "[rank 0] error: refused\nstopped rank 1 after rank 0's error\n"

    scripts = {0: "time.sleep(600)", 1: "report('rank 1: no such file', False)", 2: "time.sleep(600)"}
    monkeypatch.setattr(launch, "SAME_ERROR_WAIT_S", 600.0)  # not used: this error is rank 1's own
    monkeypatch.setattr(launch.subprocess, "Popen", _Reports(scripts))
    assert launch.launch_local(3, ["train"]) == 2
    assert (
        capsys.readouterr().err
        == "[rank 1] error: rank 1: no such file\nstopped ranks 0, 2 after rank 1's error\n"
    )

    scripts = {0: "report('seed 9 now', True)", 1: "report('seed 8 now', True)"}
    monkeypatch.setattr(launch.subprocess, "Popen", _Reports(scripts))
    assert launch.launch_local(2, ["train"]) == 2
    assert capsys.readouterr().err == "[rank 0] error: seed 9 now\n[rank 1] error: seed 8 now\n"


def test_a_hang_is_one_line_for_the_ranks_that_timed_out_and_the_frozen_one_is_not_waited_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Ranks 0 and 2 time out (their watchdogs, as `report_hang` reports) waiting on rank 1, which is frozen.
    The launcher stopped rank 2 at once after rank 0's exit, so only rank 0's line (and stack) was left; now it
    waits for rank 2, which times out half a second later, and prints one line for both; frozen rank 1, named as
    not responding, is not waited for (SAME_ERROR_WAIT_S is 600 s here) but stopped and named."""
    hang = (
        "report_hang({rank}, 3, 'no progress for {{idle}}s (train.hang_timeout_s = 6) after step {{step}}; "
        "not responding: rank 1 (step 41)', {{'idle': {idle}, 'step': 41}}, [1]); raise SystemExit(4)"
    )
    prelude = "from tessera.rank_errors import report_hang; "
    scripts = {
        0: prelude + hang.format(rank=0, idle=6.3),
        1: "time.sleep(600)",
        2: prelude + "time.sleep(0.5); " + hang.format(rank=2, idle=6.8),
    }
    monkeypatch.setattr(launch, "SAME_ERROR_WAIT_S", 600.0)
    monkeypatch.setattr(launch.subprocess, "Popen", _Reports(scripts))
    assert launch.launch_local(3, ["train"]) == 4
    assert capsys.readouterr().err == (
        "[ranks 0, 2] error: no progress for 6-7s (train.hang_timeout_s = 6) after step 41; not responding: "
        "rank 1 (step 41)\nstopped rank 1 after rank 0's error\n"
    )
