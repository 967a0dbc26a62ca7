"""Data pipeline costs: `tessera prepare` throughput with 1 worker vs every core, and the blended sampler's
overhead per training step.

(a) Tokenize the Python standard library (the default corpus, ``--corpus-mb`` MiB of .py files) with the byte
    tokenizer (reading-bound) and with a byte-level BPE tokenizer trained here on the first MiB (CPU-bound),
    each with ``workers = 1`` and ``workers = os.cpu_count()``; the token files must be identical.
(b) Time the sampler for one training step of the demo config (global batch 32, seq_len 128), single file vs a
    blend of two files, and a training step of the demo model on this machine; the overhead is the sampler's
    extra time as a fraction of the step.

    python benchmarks/data.py              # writes benchmarks/results/data.md
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tessera.config import load_config  # noqa: E402
from tessera.train.data import Blend, TokenDataset, default_corpus_files, get_batch, prepare  # noqa: E402


def _bpe(path: Path, files: list[Path]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["[UNK]", "<|endoftext|>"])
    text, budget = [], 2**20
    for f in files:
        text.append(f.read_text(errors="replace"))
        budget -= len(text[-1])
        if budget < 0:
            break
    tok.train_from_iterator(text, trainer)
    tok.save(str(path))


def prepare_throughput(tmp: Path, corpus_mb: float) -> list[str]:
    """`tessera prepare` as a user runs it (a fresh process each time, so worker start-up is counted)."""
    files = default_corpus_files(int(corpus_mb * 2**20))
    mib = sum(f.stat().st_size for f in files) / 2**20
    (tmp / "files.txt").write_text("\n".join(map(str, files)))
    _bpe(tmp / "bpe.json", files)
    cores = os.cpu_count() or 1
    rows = ["| tokenizer | workers | seconds | MiB/s | speed-up |", "|---|---|---|---|---|"]
    for name, spec in (("byte", "byte"), ("BPE 4096", str(tmp / "bpe.json"))):
        times, shas = {}, set()
        for workers in (1, cores):
            out = tmp / f"{name[:4]}-{workers}.bin"
            cmd = [sys.executable, "-m", "tessera", "prepare", *map(str, files), "--out", str(out)]
            t0 = time.perf_counter()
            subprocess.run(
                [*cmd, "--tokenizer", spec, "--workers", str(workers)], check=True, capture_output=True
            )
            times[workers] = time.perf_counter() - t0
            shas.add(TokenDataset(out).meta["sha256"])
        assert len(shas) == 1, "the token file depends on the worker count"
        for workers, t in times.items():
            rows.append(f"| {name} | {workers} | {t:.2f} | {mib / t:.2f} | {times[1] / t:.2f}× |")
    return [
        f"{len(files)} files, {mib:.1f} MiB; identical token files for every worker count. Each time is a whole "
        "`python -m tessera prepare FILES --workers N` process (interpreter and worker start-up included).",
        "",
        *rows,
    ]


def sampler_overhead(tmp: Path, steps: int) -> list[str]:
    cfg = load_config(ROOT / "configs" / "demo.toml", ["parallel.data=1"])
    tr, seq = cfg.train, cfg.model.seq_len
    files = default_corpus_files(4 * 2**20)
    half = len(files) // 2
    a, b = prepare(files[:half], tmp / "a.bin"), prepare(files[half:], tmp / "b.bin")
    assert a and b
    single = TokenDataset(tmp / "a.bin")
    blend = Blend([TokenDataset(tmp / "a.bin"), TokenDataset(tmp / "b.bin")], [0.7, 0.3])

    def sample_time(data: TokenDataset | Blend) -> float:
        t0 = time.perf_counter()
        for step in range(steps):
            for m in range(tr.global_batch // tr.micro_batch):
                get_batch(data, step, m, 0, 1, tr.micro_batch, tr.global_batch, seq, tr.seed)
        return (time.perf_counter() - t0) / steps

    t_single, t_blend = sample_time(single), sample_time(blend)
    step = _step_time(cfg, single, steps=3)
    overhead = (t_blend - t_single) / step
    return [
        f"Per training step of configs/demo.toml on one process (global batch {tr.global_batch}, seq_len {seq}):",
        "",
        "| | seconds per step |",
        "|---|---|",
        f"| sampler, one file | {t_single * 1e3:.2f} ms |",
        f"| sampler, blend of two files (0.7 / 0.3) | {t_blend * 1e3:.2f} ms |",
        f"| training step (forward + backward + AdamW) | {step * 1e3:.0f} ms |",
        "",
        f"Blend overhead: {100 * overhead:.3f}% of a training step (target: at most 2%).",
    ]


def _step_time(cfg, data: TokenDataset, steps: int) -> float:
    from tessera.model.build import build_model

    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tr = cfg.train
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        for m in range(tr.global_batch // tr.micro_batch):
            x, y = get_batch(data, step, m, 0, 1, tr.micro_batch, tr.global_batch, cfg.model.seq_len, tr.seed)
            model(x, y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return min(times[1:])  # the first step warms up; the fastest is the least disturbed by other load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-mb", type=float, default=8.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data.md"))
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        throughput = prepare_throughput(tmp, args.corpus_mb)
        overhead = sampler_overhead(tmp, args.steps)
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    )
    text = "\n".join(
        [
            "# Data pipeline benchmarks",
            "",
            f"`python benchmarks/data.py --corpus-mb {args.corpus_mb:g} --steps {args.steps}` on {machine}.",
            f"Load average (1 min) {load} (with more runnable processes than cores a second worker finds no idle",
            "core, so the worker speed-up is then a lower bound). Each worker is a fresh process that loads the",
            "tokenizer, so a pool pays off only when tokenizing outweighs that start-up (BPE here, not bytes).",
            "",
            "## `tessera prepare` throughput, 1 worker vs every core",
            "",
            *throughput,
            "",
            "## Blended sampler overhead",
            "",
            *overhead,
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
