"""How long a resumed GPT-2 124M run takes to start on one process: the build (`TrainingRun`, which chooses and
verifies the checkpoint first) and the load (`TrainingRun.resume`), wall and CPU seconds, as one JSON line.

    python benchmarks/resume_start.py RUN_DIR write   # once: one training step, a checkpoint with Adam moments
    python benchmarks/resume_start.py RUN_DIR time    # one timed resume (run it interleaved with another commit)

The model is gpt2-124m with seq_len 64 (the parameters are the 124M model's but for the position table); the data
is `tests.distributed.conftest.synthetic_corpus` as bytes, written to RUN_DIR/tokens.bin by ``write``. ``time``
writes nothing: the run is built and loaded, never stepped or saved. Compare commits by running ``time`` in
fresh processes alternately with each commit on PYTHONPATH (docs/checkpoints.md, "Resuming builds without
initial values").
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

from tessera.config import Config, from_dict


def _config(run_dir: Path) -> Config:
    return from_dict(
        {
            "model": {"size": "gpt2-124m", "seq_len": 64},
            "train": {"steps": 10, "global_batch": 1, "micro_batch": 1, "warmup_steps": 1, "device": "cpu"},
            "data": {"path": str(run_dir / "tokens.bin")},
            "checkpoint": {"every": 0, "resume": True},
            "log": {"run_dir": str(run_dir), "progress": False, "tensorboard": False},
        }
    )


def write(run_dir: Path) -> None:
    """The byte-level token file and a checkpoint of step 1 (so it holds the Adam moments)."""
    from tessera.train.data import prepare
    from tessera.train.trainer import TrainingRun
    from tests.distributed.conftest import synthetic_corpus

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "corpus.txt").write_text(synthetic_corpus())
    prepare([run_dir / "corpus.txt"], run_dir / "tokens.bin", "byte")
    run = TrainingRun(_config(run_dir), 0, 1)
    if run.resume() != 0:
        raise SystemExit(f"{run_dir} already holds a checkpoint")
    run.step(0, None)
    run.save(1)


def timed(run_dir: Path) -> dict[str, float]:
    """Seconds to build the run and to load its checkpoint (wall and this process's CPU), and the peak RSS."""
    from tessera.train.trainer import TrainingRun

    cpu0, wall0 = time.process_time(), time.perf_counter()
    run = TrainingRun(_config(run_dir), 0, 1)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    if run.resume() != 1:
        raise SystemExit(f"{run_dir} holds no checkpoint of step 1: run `write` first")
    cpu2, wall2 = time.process_time(), time.perf_counter()
    return {
        "build_wall_s": wall1 - wall0,
        "build_cpu_s": cpu1 - cpu0,
        "load_wall_s": wall2 - wall1,
        "total_wall_s": wall2 - wall0,
        "total_cpu_s": cpu2 - cpu0,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in ("write", "time"):
        raise SystemExit(__doc__)
    if sys.argv[2] == "write":
        write(Path(sys.argv[1]))
    else:
        print(json.dumps(timed(Path(sys.argv[1]))))
