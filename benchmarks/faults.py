"""Fault trials of issue #13 on a tiny 2-rank CPU run; writes benchmarks/results/faults.md.

    python benchmarks/faults.py [--kills 30] [--restarts 5] [--out benchmarks/results/faults.md]

Each trial starts `tessera train --nproc 2` (or torchrun, or a library call) on a synthetic byte corpus,
injects one fault, and records what happened: exit status, workers left alive, steps lost on resume, whether
damage was detected, whether redone steps reproduce their losses bit for bit. The pass/fail tests of the same
behaviours are in tests/distributed/test_signals.py, test_health.py, test_checkpoint_integrity.py and
test_checkpoint_async.py (the fast subset that runs in CI: one kill while checkpointing per mode, one restart
per launcher); this script measures counts and times over repeated trials.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.procs import alive, children, environ  # noqa: E402
from tessera.train.checkpoint import latest_checkpoint  # noqa: E402
from tessera.train.data import prepare  # noqa: E402

WAIT_S = 300


def _corpus(root: Path) -> Path:
    rng = random.Random(0)
    words = ["".join(rng.choices("etaoinshrdlu", k=rng.randint(1, 7))) for _ in range(300)]
    (root / "c.txt").write_text("\n".join(" ".join(rng.choices(words, k=10)) for _ in range(3000)))
    prepare([root / "c.txt"], root / "tokens.bin")
    return root / "tokens.bin"


def _argv(tokens: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "tessera", "train", "--nproc", "2", f'--data.path="{tokens}"',
        f'--log.run_dir="{run_dir}"', "--log.progress=false", "--log.tensorboard=false", "--model.n_layers=2",
        "--model.d_model=32", "--model.n_heads=2", "--model.seq_len=16", f"--train.steps={steps}",
        "--train.global_batch=4", "--train.micro_batch=2", "--train.warmup_steps=2", *extra,
    ]  # fmt: skip


def _start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(x)["step"] for x in lines if x.endswith("}")]


def _until(ready: Callable[[], bool], limit: float = WAIT_S) -> bool:
    end = time.monotonic() + limit
    while not ready():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _running(tokens: Path, run_dir: Path, *extra: str) -> tuple[subprocess.Popen, list[int]]:
    p = _start(_argv(tokens, run_dir, 10**6, *extra))
    _until(lambda: len(_steps(run_dir)) >= 3 or p.poll() is not None)
    return p, children(p.pid)


def trial_launcher_kill(tokens: Path, tmp: Path) -> str:
    p, workers = _running(tokens, tmp / "kill")
    p.kill()
    p.communicate()
    time.sleep(5)
    return f"{sum(map(alive, workers))} of {len(workers)} workers alive 5 s after SIGKILL to the launcher"


def trial_sigterm(tokens: Path, tmp: Path) -> str:
    run = tmp / "term"
    p, _ = _running(tokens, run)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=WAIT_S)
    ran = max(_steps(run)) + 1
    r = _start(_argv(tokens, run, ran + 2))
    r.communicate(timeout=WAIT_S)
    steps = _steps(run)
    lost = len(set(range(ran + 2)) - set(steps))
    return f"exit {p.returncode}; resumed run exit {r.returncode}; {lost} step(s) lost, {len(steps) - len(set(steps))} repeated"


def trial_stopped_rank(tokens: Path, tmp: Path) -> str:
    p, workers = _running(tokens, tmp / "stop", "--train.hang_timeout_s=10")
    os.kill(workers[-1], signal.SIGSTOP)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=WAIT_S)
    named = "not responding: rank" in err
    for w in workers:
        if alive(w):
            os.kill(w, signal.SIGKILL)
    return (
        f"exit {p.returncode} after {time.monotonic() - t0:.0f} s (timeout 10 s); stopped rank named: {named}"
    )


def trial_nan(tokens: Path, tmp: Path) -> str:
    run = tmp / "nan"
    p = _start(_argv(tokens, run, 30, "--train.lr=1e30", "--train.grad_clip=0", "--checkpoint.every=1"))
    _, err = p.communicate(timeout=WAIT_S)
    line = next((x for x in err.splitlines() if "error: step" in x), "")[:90]
    return f"exit {p.returncode}: `{line}`"


def trial_dead_worker(tokens: Path, tmp: Path) -> str:
    p, workers = _running(tokens, tmp / "dead")
    os.kill(workers[-1], signal.SIGKILL)
    _, err = p.communicate(timeout=WAIT_S)
    lines = [x for x in err.splitlines() if x.strip()]
    return f"exit {p.returncode}; {len(lines)} line(s) on stderr: `{lines[0] if lines else ''}`"


def _losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {r["step"]: r["loss"] for r in (json.loads(x) for x in lines if x.endswith("}"))}


def _resume_step(run_dir: Path) -> int:
    """The step a resumed run starts from: that of the newest complete checkpoint."""
    newest = latest_checkpoint(run_dir / "checkpoints")
    return int(newest.name.split("_")[1]) if newest else 0


def trial_kill_during_save(tokens: Path, tmp: Path, kills: int, background: bool) -> str:
    """SIGKILL the launcher at random moments of a run that checkpoints every step (``checkpoint.async`` or not);
    each resumed run is the next one killed. Counted: kills that left a partial save (a ``.tmp`` folder), resumes
    that reached 2 steps past the kill, and redone steps (those after the checkpoint resumed from, which the kill
    lost) whose loss differs from the first time, bit for bit."""
    mode = "async" if background else "sync"
    run, rng = tmp / f"saves_{mode}", random.Random(1)
    argv = _argv(
        tokens,
        run,
        10**6,
        "--checkpoint.every=1",
        "--checkpoint.keep=2",
        f"--checkpoint.async={str(background).lower()}",
    )
    partial = resumed = differ = compared = start = 0
    before: dict[int, float] = {}
    for i in range(kills + 1):
        p = _start(argv)
        target = max(before, default=-1) + 3  # two steps past the last one logged before the kill
        ok = _until(lambda p=p, t=target: max(_losses(run), default=-1) >= t or p.poll() is not None)
        now = _losses(run)
        if i:  # the run resumed from what the kill left
            resumed += ok and p.poll() is None
            redone = [s for s in before if s >= start]  # what the kill lost, run again
            compared += len(redone)
            differ += sum(now.get(s) != before[s] for s in redone)
        if i == kills:
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=WAIT_S)
            break
        time.sleep(rng.uniform(0.0, 1.0))
        p.kill()
        p.communicate()
        time.sleep(1)  # the workers die with the launcher (parent-death signal)
        partial += bool(list((run / "checkpoints").glob("*.tmp")))
        before, start = _losses(run), _resume_step(run)
    return (
        f"{mode}: {resumed} of {kills} kills resumed and ran on ({partial} of them hit a save in progress); "
        f"{differ} of {compared} redone steps differ from their first loss"
    )


def trial_torchrun_agent_kill(tokens: Path, tmp: Path) -> str:
    p = _start(_torchrun(_argv(tokens, tmp / "agent", 10**6)))
    _until(lambda: len(_steps(tmp / "agent")) >= 3 or p.poll() is not None)
    workers = children(p.pid)
    p.kill()
    p.communicate()
    time.sleep(5)
    return f"{sum(map(alive, workers))} of {len(workers)} workers alive 5 s after SIGKILL to torchrun's agent"


def trial_restarts(tokens: Path, tmp: Path, trials: int, torchrun: bool) -> str:
    """Kill rank 1 of a 60-step run (checkpoint every 10) under ``--max-restarts 1``; recovered: exit 0, every step
    logged, and the redone steps' losses equal to their first time. Each wait is bounded by WAIT_S (a hang
    counts as not recovered)."""
    recovered, times = 0, []
    for t in range(trials):
        run = tmp / f"restart_{'torchrun' if torchrun else 'tessera'}_{t}"
        argv = _argv(tokens, run, 60, "--checkpoint.every=10")
        p = _start(_torchrun(argv, "--max-restarts", "1") if torchrun else [*argv, "--max-restarts", "1"])
        _until(lambda p=p, run=run: len(_steps(run)) >= 15 or p.poll() is not None)
        ranks = {environ(w).get("RANK"): w for w in children(p.pid)}
        os.kill(ranks["1"], signal.SIGKILL)
        t0 = time.monotonic()
        before = _losses(run)  # rank 0 cannot finish another step without rank 1
        try:
            p.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        times.append(time.monotonic() - t0)
        after = _losses(run)
        same = all(after.get(s) == loss for s, loss in before.items())
        recovered += p.returncode == 0 and sorted(after) == list(range(60)) and same
    return (
        f"{recovered} of {trials} recovered bit-exactly (exit 0, every step logged, redone steps' losses "
        f"unchanged); kill to finish {min(times):.0f}-{max(times):.0f} s"
    )


def _torchrun(argv: list[str], *launcher: str) -> list[str]:
    """``argv`` (a `tessera train --nproc 2` command) under torchrun instead."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *launcher]
    return [*run, "-m", "tessera", "train", *argv[6:]]


def trial_corruption(tmp: Path) -> str:
    import torch
    from torch import nn

    from tessera.errors import CheckpointError
    from tessera.train.checkpoint import load_checkpoint, save_checkpoint

    detected, kinds = (
        0,
        ["tensor data", ".metadata", "rng file", "truncated tensor file", "deleted tensor file"],
    )
    for i, kind in enumerate(kinds):
        model = nn.Linear(8, 8)
        opt = torch.optim.AdamW(model.parameters())
        path = save_checkpoint(tmp / f"c{i}", 1, model, opt, {})
        target = {
            ".metadata": path / ".metadata",
            "rng file": path / "rng_rank0.pt",
        }.get(kind, sorted(path.glob("*.distcp"))[0])
        data = bytearray(target.read_bytes())
        if kind == "deleted tensor file":
            target.unlink()
        elif kind == "truncated tensor file":
            target.write_bytes(bytes(data[: len(data) // 2]))
        else:
            mid = len(data) // 2
            data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])
            target.write_bytes(bytes(data))
        fresh = nn.Linear(8, 8)
        try:
            load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()))
        except CheckpointError:
            detected += 1
    return (
        f"{detected} of {len(kinds)} kinds detected ({', '.join(kinds)}); 0 silent loads"
        if detected == len(kinds)
        else f"{detected} of {len(kinds)} detected"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kills", type=int, default=30, help="kills while checkpointing, in each mode")
    ap.add_argument("--restarts", type=int, default=5, help="killed-rank restarts, per launcher")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults.md"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tokens = _corpus(tmp)
        rows = [
            ("launcher SIGKILL", trial_launcher_kill(tokens, tmp)),
            ("torchrun's agent SIGKILL", trial_torchrun_agent_kill(tokens, tmp)),
            ("launcher SIGTERM, then resume", trial_sigterm(tokens, tmp)),
            ("one rank SIGSTOPped", trial_stopped_rank(tokens, tmp)),
            ("loss NaN (lr 1e30)", trial_nan(tokens, tmp)),
            ("a worker SIGKILLed", trial_dead_worker(tokens, tmp)),
            ("16 flipped bytes and other damage", trial_corruption(tmp)),
            (f"job killed at random, {args.kills}×, checkpoint every step", trial_kill_during_save(tokens, tmp, args.kills, False)),
            ("the same with checkpoint.async", trial_kill_during_save(tokens, tmp, args.kills, True)),
            (f"rank 1 killed, `tessera train --max-restarts 1`, {args.restarts}×", trial_restarts(tokens, tmp, args.restarts, False)),
            (f"rank 1 killed, `torchrun --max-restarts 1`, {args.restarts}×", trial_restarts(tokens, tmp, args.restarts, True)),
        ]  # fmt: skip
    table = "\n".join(f"| {fault} | {result} |" for fault, result in rows)
    text = (
        "# Fault trials (issue #13)\n\n"
        f"`python benchmarks/faults.py --kills {args.kills} --restarts {args.restarts}` on a 2-rank CPU run (gloo, a 2-layer d=32 GPT), "
        f"{time.strftime('%Y-%m-%d')}.\n\n| fault | result |\n|---|---|\n{table}\n"
    )
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
