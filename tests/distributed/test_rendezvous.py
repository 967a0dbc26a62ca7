"""Rank 0 serves the rendezvous store on the launcher's listening socket (tessera/train/launch.py,
`init_distributed`), so a rank that reaches the rendezvous before rank 0 has even started is queued, not refused.

The order is forced, not timed: rank 1 starts alone, and rank 0 only once rank 1's connection to the port is
established (read from /proc/net/tcp)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.train.launch import STORE_FD, rendezvous_socket

DEADLINE_S = 240  # per rank's run: it imports torch and the trainer first, seconds on a loaded 2-core machine

RANK = """
import os, sys
import torch
import torch.distributed as dist
from tessera.train.trainer import init_distributed
if len(sys.argv) > 1:  # the torch version init_distributed sees (its choice of store backend)
    torch.__version__ = torch.torch_version.TorchVersion(sys.argv[1])
rank, world = init_distributed(timeout_s=60)
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
print(int(x.item()), world, os.environ.get("TESSERA_STORE_FD"))
dist.destroy_process_group()
"""


def _connected_to(port: int) -> bool:
    """Whether a connection to 127.0.0.1:port is established: the server's end of it, in the listening socket's
    queue until accepted, is in the IPv4 table (the client's end is in tcp6 when torch connects over IPv6)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "01":  # local address, state ESTABLISHED
            return True
    return False


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="reads Linux's /proc/net/tcp")
@pytest.mark.parametrize("version", [None, "2.7.0"], ids=["this-torch", "torch-before-2.8"])
def test_a_rank_that_arrives_before_rank_0_exists_joins_when_rank_0_serves(version: str | None) -> None:
    """Fails if rank 0 binds MASTER_PORT itself again (the launcher holds it: EADDRINUSE). The second case runs
    the branch taken under torch before 2.8, whose libuv server did not accept on a given socket."""
    with rendezvous_socket() as listener:
        port = listener.getsockname()[1]
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
        }
        env.pop(STORE_FD, None)
        argv = [sys.executable, "-c", RANK, *([version] if version else [])]
        kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        rank1 = subprocess.Popen(argv, env={**env, "RANK": "1", "LOCAL_RANK": "1"}, **kw)
        rank0 = None
        try:
            while not _connected_to(port):  # ends: rank 1 connects, or gives up (its 60 s timeout) and exits
                assert rank1.poll() is None, rank1.communicate()
                time.sleep(0.05)
            fd = listener.fileno()
            rank0 = subprocess.Popen(
                argv, env={**env, "RANK": "0", "LOCAL_RANK": "0", STORE_FD: str(fd)}, pass_fds=(fd,), **kw
            )
            out0 = rank0.communicate(timeout=DEADLINE_S)
            if rank0.returncode != 0:
                rank1.kill()  # as the launcher would: its connection stays queued on the socket we hold
            outs = [out0, rank1.communicate(timeout=DEADLINE_S)]
        finally:
            for p in (rank0, rank1):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
    assert rank0.returncode == 0 and rank1.returncode == 0, outs
    # both joined one group of 2 (1 + 2 summed); rank 0 took the variable out of its environment
    assert [out.split() for out, _ in outs] == [["3", "2", "None"], ["3", "2", "None"]]
