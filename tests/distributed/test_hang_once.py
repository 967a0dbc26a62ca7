"""A hang that every rank meets is one message, not one per rank (tessera/rank_errors.py, `report_hang`): through
`tessera train --nproc 3` one line naming the ranks that timed out, under torchrun the first one's alone; the
exit status is 4 and each rank that timed out leaves its stack.

Every rank is made to stop making progress after step 3 by a `sitecustomize` module (Python imports it at
start-up) that sleeps in the training loop's progress call: no rank is in a collective, so none errors out when
the first one exits, and all of them time out. Nothing asserts on timing; each run has a generous bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tessera.errors import EXIT_HANG

TIMEOUT_S = 300  # a 3-rank tiny run on a loaded 2-core machine, then the 6 s hang timeout
STALL = """
import time
import tessera.train.watchdog as watchdog

progress = watchdog.Watchdog.progress

def stall_after_step_3(self, step):
    progress(self, step)
    if step == 3:
        time.sleep(10**6)

watchdog.Watchdog.progress = stall_after_step_3
"""


LAUNCHER = [sys.executable, "-m", "tessera", "train", "--nproc", "3"]
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "3",
    "-m",
    "tessera",
    "train",
]


def _run(launcher: list[str], token_file: Path, run_dir: Path) -> subprocess.CompletedProcess:
    argv = [
        *launcher, f'--data.path="{token_file}"', f'--log.run_dir="{run_dir}"',
        "--log.progress=false", "--log.tensorboard=false", "--model.n_layers=2", "--model.d_model=32",
        "--model.n_heads=2", "--model.seq_len=16", "--train.steps=1000000", "--train.global_batch=6",
        "--train.micro_batch=2", "--checkpoint.every=1000000", "--train.warmup_steps=1",
        "--train.hang_timeout_s=6", "--train.collective_timeout_s=600",
    ]  # fmt: skip
    site = run_dir.parent / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STALL)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_a_hang_every_rank_meets_is_one_line_naming_the_ranks(token_file: Path, tmp_path: Path) -> None:
    """Each rank printed `[rank r] error: no progress for Ns ...` (1,024 lines at 1,024 ranks; here three, then
    the launcher's `error: rank 1 exited with status 4`), and the launcher stopped the others as soon as the first
    exited: one that had not timed out by then left no stack."""
    run_dir = tmp_path / "run"
    out = _run(LAUNCHER, token_file, run_dir)
    assert out.returncode == EXIT_HANG, out.stderr
    lines = [line for line in out.stderr.splitlines() if "no progress" in line]
    assert len(lines) == 1 and lines[0].startswith("[ranks 0-2] error: no progress for "), out.stderr
    assert "after step 3; every rank responds at the same step" in lines[0], out.stderr
    assert lines[0].endswith(f"stacks in {run_dir / 'stacks'}/"), out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    for rank in range(3):
        assert 'File "' in (run_dir / "stacks" / f"rank{rank}.txt").read_text()


def test_under_torchrun_the_first_rank_to_time_out_prints_the_hang_alone(
    token_file: Path, tmp_path: Path
) -> None:
    """torchrun shows no rank's output to another: the ranks meet in its agent's store, and only the first to time
    out prints (each printed its own line; how many depended on how soon torchrun stopped the others)."""
    run_dir = tmp_path / "run"
    out = _run(TORCHRUN, token_file, run_dir)
    assert out.returncode != 0, out.stderr
    assert "exitcode  : 4" in out.stderr or "exitcode: 4" in out.stderr.replace(" ", ""), out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "no progress" in line]
    assert len(lines) == 1 and "the others that do exit 4 without repeating this" in lines[0], out.stderr
    assert "after step 3; every rank responds at the same step" in lines[0], out.stderr
    assert (
        'File "'
        in (run_dir / "stacks" / f"{lines[0].split(']')[0].replace('[rank ', 'rank')}.txt").read_text()
    )
