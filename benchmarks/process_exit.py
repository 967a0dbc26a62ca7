"""What ending a `tessera` command without the interpreter's final collections saves, side by side in one run.

    python benchmarks/process_exit.py [PAIRS]   # writes results/process_exit.md and .png (default 4 pairs)

Three commands, on the demo's model (gpt2-mini, byte-level, the embedded corpus at 1 MB): a process that imports
the trainer (torch, dynamo, tessera's modules) and then runs `tessera --help`, which isolates the exit of every
torch-importing command; `tessera train --nproc 2` for 2 steps (the launcher and two ranks); and `tessera
generate` of 20 tokens from a one-process run's checkpoint, written once before the pairs. Each runs alternately
as now and as before, in fresh processes; "before" is the same code with
`tessera.process_exit.finish_quickly_at_exit` replaced by a no-op, done by a `sitecustomize` module on
PYTHONPATH that every process of the command imports at start (the ranks too). "Now" gets a `sitecustomize`
that imports the same module and changes nothing, so both pay the same start. Reported: the CPU seconds of all
the command's processes (RUSAGE_CHILDREN; the figure that load on a shared machine disturbs least) and its wall
time, medians and ranges, and the ratios now / before (docs/launching.md, "How a command ends").
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

SITECUSTOMIZE = {
    "before": "import tessera.process_exit as p\np.finish_quickly_at_exit = lambda: None\n",
    "now": "import tessera.process_exit as p\n",
}


def _commands(run_dir: Path) -> dict[str, list[str]]:
    train = [
        "train",
        "configs/demo.toml",
        "--train.steps=2",
        "--train.eval_every=0",
        "--data.default_corpus_mb=1",
        "--log.progress=false",
        "--checkpoint.resume=false",
    ]
    return {
        "write the checkpoint": [*train, "--parallel.data=1", f"--log.run_dir={run_dir / 'one'}"],
        "trainer imported, --help": ["-c", _IMPORTED_THEN_HELP],
        "train --nproc 2": [*train, "--nproc", "2", f"--log.run_dir={run_dir / 'two'}"],
        "generate 20 tokens": ["generate", str(run_dir / "one"), "--prompt", "def ", "--tokens", "20"],
    }


_IMPORTED_THEN_HELP = (
    "import sys, torch._dynamo, tessera.train.trainer\n"
    "from tessera.cli import main\n"
    "sys.argv = ['tessera', '--help']\n"
    "main()"
)


def _timed(argv: list[str], site: Path) -> tuple[float, float]:
    """Wall seconds of ``python -m tessera argv`` (``python -c CODE`` for ``["-c", CODE]``) and the CPU seconds
    of all its processes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    command = [sys.executable, *argv] if argv[0] == "-c" else [sys.executable, "-m", "tessera", *argv]
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def compare(pairs: int) -> None:
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sites = {}
        for kind, text in SITECUSTOMIZE.items():
            sites[kind] = root / kind
            sites[kind].mkdir()
            (sites[kind] / "sitecustomize.py").write_text(text)
        commands = _commands(root)
        _timed(commands.pop("write the checkpoint"), sites["now"])
        for _ in range(pairs):
            for name, argv in commands.items():
                for kind in ("before", "now"):
                    runs.setdefault(name, {}).setdefault(kind, []).append(_timed(argv, sites[kind]))
    _report(runs, pairs)


def _span(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _report(runs: dict[str, dict[str, list[tuple[float, float]]]], pairs: int) -> None:
    lines = [
        "# Ending a command without the final collections: before vs now",
        "",
        f"`python benchmarks/process_exit.py {pairs}`: {pairs} alternating pairs per command, fresh processes,",
        "medians (ranges), seconds. CPU is the sum over the command's processes; wall follows the shared 2-core",
        "machine's load.",
        "",
        "| command | CPU before | CPU now | now / before | wall before | wall now | now / before |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, kinds in runs.items():
        walls = {k: [w for w, _ in v] for k, v in kinds.items()}
        cpus = {k: [c for _, c in v] for k, v in kinds.items()}
        ratio_wall = statistics.median(walls["now"]) / statistics.median(walls["before"])
        ratio_cpu = statistics.median(cpus["now"]) / statistics.median(cpus["before"])
        lines.append(
            f"| {name} | {_span(cpus['before'])} | {_span(cpus['now'])} | {ratio_cpu:.2f} | "
            f"{_span(walls['before'])} | {_span(walls['now'])} | {ratio_wall:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "process_exit.md").write_text(text)
    _plot(runs, RESULTS / "process_exit.png")


def _plot(runs: dict[str, dict[str, list[tuple[float, float]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(runs)
    for offset, kind, color in ((-0.2, "before", "tab:gray"), (0.2, "now", "tab:blue")):
        cpu = [statistics.median(c for _, c in runs[n][kind]) for n in names]
        ax.barh([i + offset for i in range(len(names))], cpu, height=0.38, color=color, label=kind)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("CPU seconds of the command's processes (median)")
    ax.set_title("Ending a command without the final collections")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    if sys.argv[2:] or (sys.argv[1:] and not sys.argv[1].isdigit()):
        raise SystemExit(__doc__)
    compare(int(sys.argv[1]) if sys.argv[1:] else 4)
