"""How long a resumed GPT-2 124M run takes to start on one process: the build (`TrainingRun`, which chooses and
verifies the checkpoint first) and the load (`TrainingRun.resume`), wall and CPU seconds, as one JSON line.

    python benchmarks/resume_start.py RUN_DIR write    # once: one training step, a checkpoint with Adam moments
    python benchmarks/resume_start.py RUN_DIR compare  # 3 pairs, side by side: writes results/resume_start.md + .png
    python benchmarks/resume_start.py RUN_DIR time [--drawing]   # one timed resume, one JSON line

The model is gpt2-124m with seq_len 64 (the parameters are the 124M model's but for the position table); the data
is `tests.distributed.conftest.synthetic_corpus` as bytes, written to RUN_DIR/tokens.bin by ``write``. ``time``
writes nothing: the run is built and loaded, never stepped or saved. ``--drawing`` builds it as every resume
did before it stopped drawing initial values (``TrainingRun._value_source`` called with values, the oracle of
tests/distributed/test_resume_undrawn.py). ``compare`` runs ``time`` and ``time --drawing`` alternately in fresh
processes and reports the medians and their ratio (docs/checkpoints.md, "Resuming builds without initial
values").
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
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


def timed(run_dir: Path, drawing: bool) -> dict[str, float]:
    """Seconds to build the run and to load its checkpoint (wall and this process's CPU), and the peak RSS;
    ``drawing``: built with initial values drawn, as before."""
    from tessera.train.trainer import TrainingRun

    if drawing:
        value_source = TrainingRun._value_source
        TrainingRun._value_source = lambda run, overwritten=False, values=True: value_source(
            run, overwritten, True
        )
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


KEYS = ("build_wall_s", "load_wall_s", "total_wall_s", "total_cpu_s", "max_rss_mib")
RESULTS = Path(__file__).resolve().parent / "results"


def compare(run_dir: Path, pairs: int = 3) -> None:
    """``pairs`` resumes of each kind, alternating, each in a fresh process; the medians, ranges and ratio."""
    runs: dict[str, list[dict[str, float]]] = {"drawing": [], "not drawing": []}
    for _ in range(pairs):
        for kind, flag in (("drawing", ["--drawing"]), ("not drawing", [])):
            out = subprocess.run(
                [sys.executable, __file__, str(run_dir), "time", *flag],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {kind: {k: statistics.median(r[k] for r in rs) for k in KEYS} for kind, rs in runs.items()}
    command = f"python benchmarks/resume_start.py RUN_DIR compare  ({pairs} pairs, alternating)"
    lines = [
        "# Resume start: drawing initial values vs not (GPT-2 124M, seq_len 64, one process, CPU)",
        "",
        f"`{command}`; medians (ranges) of fresh processes. The build includes choosing and verifying the",
        "checkpoint (1.9 GB with its Adam moments); the load reads it into the built run. Wall-clock on a shared",
        "2-core machine.",
        "",
        "| | drawing (before) | not drawing (now) | now / before |",
        "|---|---|---|---|",
    ]
    for k in KEYS:
        spans = {
            kind: f"{med[kind][k]:.2f} ({min(r[k] for r in rs):.2f}-{max(r[k] for r in rs):.2f})"
            for kind, rs in runs.items()
        }
        lines.append(
            f"| {k} | {spans['drawing']} | {spans['not drawing']} | "
            f"{med['not drawing'][k] / med['drawing'][k]:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "resume_start.md").write_text(text)
    _plot(runs, RESULTS / "resume_start.png")


def _plot(runs: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, rs in enumerate(runs.values()):
        build = statistics.median(r["build_wall_s"] for r in rs)
        load = statistics.median(r["load_wall_s"] for r in rs)
        ax.barh(i, build, color="tab:blue", label="build" if i == 0 else None)
        ax.barh(i, load, left=build, color="tab:orange", label="load" if i == 0 else None)
    ax.set_yticks(range(len(runs)), list(runs))
    ax.set_xlabel("seconds (median wall)")
    ax.set_title("Resume start, GPT-2 124M on CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2 or args[1] not in ("write", "time", "compare") or args[2:] not in ([], ["--drawing"]):
        raise SystemExit(__doc__)
    if args[1] == "write":
        write(Path(args[0]))
    elif args[1] == "compare":
        compare(Path(args[0]))
    else:
        print(json.dumps(timed(Path(args[0]), drawing=args[2:] == ["--drawing"])))
