"""`tessera train --nproc 2`, through the real launcher: an error every rank reaches alike is shown once, naming
both ranks; errors that differ between ranks are each shown, with their rank (tessera/rank_errors.py). The same
under torchrun, where the ranks meet in its agent's store instead.

Ranks are made to differ by a `sitecustomize` module on rank 1's import path (Python imports it at start-up),
which changes what that rank alone sees, as a node with another config or a broken disk would. Nothing asserts on
timing: each run is bounded by a generous timeout only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tessera.errors import EXIT_USER_ERROR

TIMEOUT_S = 300  # a 2-rank tiny run on a loaded 2-core machine
REFUSED = "was trained with other settings"


def _train(
    token_file: Path, run_dir: Path, *extra: str, rank1_site: str | None = None, torchrun: bool = False
) -> subprocess.CompletedProcess:
    launcher = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "tessera",
        ]
        if torchrun
        else [sys.executable, "-m", "tessera"]
    )
    argv = [
        *launcher, "train", *([] if torchrun else ["--nproc", "2"]),
        f'--data.path="{token_file}"', f'--log.run_dir="{run_dir}"', "--log.progress=false",
        "--log.tensorboard=false", "--model.n_layers=2", "--model.d_model=32", "--model.n_heads=2",
        "--model.seq_len=16", "--train.global_batch=4", "--train.micro_batch=2", "--checkpoint.every=2",
        "--train.warmup_steps=1", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if rank1_site is not None:  # every process gets the folder; the module acts on rank 1 only
        site = run_dir.parent / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(
            f"import os\nif os.environ.get('RANK') == '1':\n{textwrap.indent(textwrap.dedent(rank1_site), '    ')}"
        )
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def trained(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding a checkpoint of step 2, trained with the default data order's seed."""
    run_dir = tmp_path_factory.mktemp("errors_once") / "run"
    out = _train(token_file, run_dir, "--train.steps=2")
    assert out.returncode == 0, out.stderr + out.stdout
    return run_dir


def test_a_refusal_every_rank_makes_is_shown_once_naming_both_ranks(token_file: Path, trained: Path) -> None:
    """A resume with another data.seed: both ranks refuse it alike. It was printed by `[rank 1]` and `[rank 0]`
    (1,024 copies at 1,024 ranks), followed by the launcher's own "error: rank 0 exited with status 2"."""
    out = _train(token_file, trained, "--train.steps=4", "--data.seed=9")
    assert out.returncode == EXIT_USER_ERROR, out.stderr + out.stdout
    assert out.stderr.count(REFUSED) == 1, out.stderr
    assert (
        "[ranks 0-1] error: checkpoint " in out.stderr and "fix: resume with the saved values" in out.stderr
    )
    assert "[rank 0]" not in out.stderr and "[rank 1]" not in out.stderr, out.stderr
    assert "exited with status" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    # under torchrun: once too, by whichever rank claimed it first in torchrun's store
    out = _train(token_file, trained, "--train.steps=4", "--data.seed=9", torchrun=True)
    assert out.stderr.count(REFUSED) == 1 and "exitcode  : 2" in out.stderr, out.stderr


def test_errors_that_differ_between_ranks_are_each_shown_with_their_rank(
    token_file: Path, trained: Path
) -> None:
    """Rank 1 resumes with data.seed 8 where rank 0 has 9 (nodes that read different config files): both refuse,
    in different words, and neither message may stand for the other. Then a rank-specific error on rank 1 alone
    (its data unreadable) while rank 0 has none: shown with its rank, not lost when rank 0 is stopped."""
    other_seed = """
        import tessera.train.trainer as trainer
        compare = trainer.check_compatible
        def as_node_1_sees_it(path, saved, now, *args, **kwargs):
            return compare(path, saved, {**now, "data.seed": 8}, *args, **kwargs)
        trainer.check_compatible = as_node_1_sees_it
    """
    out = _train(token_file, trained, "--train.steps=4", "--data.seed=9", rank1_site=other_seed)
    assert out.returncode == EXIT_USER_ERROR, out.stderr + out.stdout
    assert out.stderr.count(REFUSED) == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if REFUSED in line]
    assert lines[0].startswith("[rank 0] error: ") and "1234 in the checkpoint, 9 now" in lines[0], out.stderr
    assert lines[1].startswith("[rank 1] error: ") and "1234 in the checkpoint, 8 now" in lines[1], out.stderr

    # under torchrun the ranks see nothing of each other's output: rank 1's different refusal was not printed
    # (rank 0 alone printed its own, as if every rank had decided the same); now they meet in torchrun's store
    out = _train(
        token_file, trained, "--train.steps=4", "--data.seed=9", rank1_site=other_seed, torchrun=True
    )
    assert out.stderr.count(REFUSED) == 2, out.stderr
    lines = sorted(line for line in out.stderr.splitlines() if REFUSED in line)
    assert lines[0].startswith("[rank 0] error: ") and "1234 in the checkpoint, 9 now" in lines[0], out.stderr
    assert lines[1].startswith("[rank 1] error: ") and "1234 in the checkpoint, 8 now" in lines[1], out.stderr

    unreadable = """
        import tessera.train.trainer as trainer
        from tessera.errors import DataError
        def fail(cfg, hook=None):
            raise DataError("rank 1 cannot read its data (the test's stand-in for a broken disk on one node)")
        trainer.train = fail
    """
    out = _train(token_file, trained, "--train.steps=4", rank1_site=unreadable)
    assert out.returncode == EXIT_USER_ERROR, out.stderr + out.stdout
    assert out.stderr.count("cannot read its data") == 1, out.stderr
    assert "[rank 1] error: rank 1 cannot read its data" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
