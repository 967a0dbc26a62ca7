"""The local launcher's rendezvous socket (tessera/train/launch.py), without torch: the port listens before any
rank exists, only rank 0 inherits it, and each attempt has its own."""

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

    def __init__(self, exit_code: int = 0) -> None:
        self.exit_code = exit_code
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
