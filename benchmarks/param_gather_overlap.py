"""ZeRO-1/2's post-step parameter all-gather under the next forward: `parallel.overlap_param_gather` off vs on.

    python benchmarks/param_gather_overlap.py            # ZeRO-1 and ZeRO-2 on d = 2 (~1 min on 2 CPU cores)
    python benchmarks/param_gather_overlap.py --quick    # smoke run (tiny model, 2 timed blocks), no files written

One gloo job of d = 2 data-parallel ranks (spawned here) builds, per ZeRO stage, the same Llama twice as `tessera
train` does (`TrainingRun`: the execution plan, the ScheduledStepper, ShardedAdamW), once with the flag off and
once on, and trains both on the same batches, step for step, in interleaved blocks so outside load hits both
alike. A block is ``--block`` consecutive optimizer steps of one variant, timed barrier to barrier on rank 0's
clock and closed by `finish_param_gathers`, so the gathers the "on" variant leaves in flight after its last step
are counted in its own block (as the end of training counts them), never hidden under the other variant's steps.
The step time reported is a block's time over its steps. The losses of the two variants must be bit-identical
(the overlap changes only when the same collectives are waited for; docs/zero.md).

CPU gloo numbers say little about GPUs: here gloo's transfer threads and the next forward share the same two
cores, while on a GPU the all-gather runs on NVLink / the NIC beside the SMs. Read the ratio as what deferring
the wait costs or saves on this machine, not as a GPU prediction.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: import the repository's tessera
    sys.path.insert(0, str(ROOT))

from off_on import VARIANTS, bar_chart, machine_line, median_range_ms, on_off_ratio, publish  # noqa: E402

from tessera.config import Config, load_config  # noqa: E402
from tessera.model.build import meta_model  # noqa: E402
from tessera.train.data import prepare  # noqa: E402
from tessera.train.trainer import TrainingRun  # noqa: E402
from tests.distributed.conftest import synthetic_corpus  # noqa: E402  (fixed, learnable text; no download)
from tests.harness import run_distributed  # noqa: E402  (one rank per process, gloo, tracebacks surfaced)

WORLD = 2
MODEL = dict(family="llama", d_model=384, n_heads=6, n_kv_heads=2, n_layers=6, vocab_size=256, seq_len=64)
QUICK = dict(MODEL, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2)


def _overrides(model: dict, zero: int, overlap: bool, token_file: str, run_dir: str, steps: int) -> list[str]:
    return [
        *(f"model.{k}={v}" for k, v in model.items()),
        f"parallel.data={WORLD}",
        f"parallel.zero={zero}",
        f"parallel.overlap_param_gather={str(overlap).lower()}",
        "train.global_batch=4",
        "train.micro_batch=1",  # two micro-batches per rank: ZeRO's accumulation path, not a single pass
        f"train.steps={steps}",
        "train.warmup_steps=1",
        "train.eval_every=0",
        f"data.path={token_file}",
        f"log.run_dir={run_dir}",
        "log.progress=false",
        "log.tensorboard=false",
        "checkpoint.every=0",
        "checkpoint.resume=false",
    ]


def _config(*args: Any) -> Config:
    return load_config(None, _overrides(*args))


def _timed_block(run: TrainingRun, first: int, n: int, losses: list[float]) -> float:
    """``n`` optimizer steps from ``first`` and the gathers they leave in flight; seconds per step."""
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(first, first + n):
        losses.append(run.step(step, None)[0])
    run.stepper.zero.finish_param_gathers()  # the "on" variant's last gathers belong to its own block
    dist.barrier()
    return (time.perf_counter() - t0) / n


def _timed_gather(run: TrainingRun) -> float:
    """The post-step all-gather of every stage alone, waited for (it re-gathers the unchanged shards)."""
    dist.barrier()
    t0 = time.perf_counter()
    run.stepper.zero.gather_updated_params()
    dist.barrier()
    return time.perf_counter() - t0


def _rank(
    rank: int, world: int, model: dict, zeros: list[int], token_file: str, args: dict
) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    total = (args["warmup"] + args["blocks"]) * args["block"]
    for zero in zeros:
        with tempfile.TemporaryDirectory() as run_dir:
            runs = {
                v: TrainingRun(_config(model, zero, v == "on", token_file, run_dir, total), rank, world)
                for v in VARIANTS
            }
            assert runs["on"].plan.overlap_param_gather and not runs["off"].plan.overlap_param_gather
            losses: dict[str, list[float]] = {v: [] for v in VARIANTS}
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for k in range(args["warmup"] + args["blocks"]):
                for v, run in runs.items():  # interleaved: off, on, off, on, ...
                    t = _timed_block(run, k * args["block"], args["block"], losses[v])
                    if k >= args["warmup"]:
                        times[v].append(t)
            gather = [_timed_gather(runs["off"]) for _ in range(args["blocks"])]
            for run in runs.values():
                run.stepper.close()
        out[f"zero{zero}"] = {"times": times, "losses": losses, "gather": gather}
    return out


def _token_file(root: Path) -> str:
    text = root / "corpus.txt"
    text.write_text(synthetic_corpus())
    prepare([text], root / "tokens.bin", "byte")
    return str(root / "tokens.bin")


def _n_params(model: dict) -> int:
    cfg = load_config(None, [f"model.{k}={v}" for k, v in model.items()])
    return sum(p.numel() for p in meta_model(cfg.model).parameters())


def report(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    m = args.model
    lines = [
        "# ZeRO-1/2 parameter all-gather under the next forward on CPU gloo: `overlap_param_gather` off vs on",
        "",
        f"Command: `{command}` (generated by benchmarks/param_gather_overlap.py).",
        "",
        machine_line(args.load, f", d = {WORLD} data-parallel ranks"),
        "",
        f"Model: Llama, d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads ({m['n_kv_heads']} "
        f"KV), vocabulary {m['vocab_size']}, sequence {m['seq_len']}: {args.params / 1e6:.2f} M parameters "
        f"(fp32 all-gather output {args.params * 4 / 2**20:.1f} MiB per step). Global batch 4 in micro-batches "
        "of 1 (2 per rank), AdamW, built and stepped by `TrainingRun` as `tessera train` does (ScheduledStepper, "
        f"one stage per block, ShardedAdamW). {args.warmup} warm-up and {args.blocks} timed blocks of "
        f"{args.block} steps per variant, the variants interleaved block by block; a block ends with "
        "`finish_param_gathers` (the 'on' variant's last gathers are counted in its own block). Step time = "
        "block time / steps: median (min–max) over blocks. 'All-gather alone': every stage's post-step "
        "all-gather of the 'off' run, launched and waited for by itself after the timed blocks (barrier to "
        "barrier), median (min–max) of as many repeats as blocks.",
        "",
        "| ZeRO | off: step (min–max) | on: step (min–max) | on / off | all-gather alone (share of off step) | "
        "losses off vs on |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = r["losses"]["off"] == r["losses"]["on"]
        cells = [
            str(r["zero"]),
            median_range_ms(r["times"]["off"], 0),
            median_range_ms(r["times"]["on"], 0),
            f"{r['ratio']:.2f}",
            f"{median_range_ms(r['gather'], 0)} ({statistics.median(r['gather']) / statistics.median(r['times']['off']):.0%})",
            f"{'bit-identical' if same else 'DIFFERENT'} over {len(r['losses']['on'])} steps "
            f"(last {r['losses']['on'][-1]:.4f})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Reading: " + READING,
        "",
        *(f"- {_verdict(r)}" for r in rows),
        "",
        "![step time off vs on](param_gather_overlap.png)",
    ]
    return "\n".join(lines)


READING = (
    "the flag moves no byte and changes no number (the losses above are compared with `==`); it only lets the "
    "next step's forward start before the post-step all-gathers of the later stages are waited for. What it can "
    "hide is bounded by the gather's share of a step: everything but the first stage's (here one block plus the "
    "embedding), under the forwards of the stages before each. On this CPU gloo's transfer threads and the "
    "forward compete for the same two cores (with another job's load on them), so a deferred gather mostly "
    "runs at the same time as compute rather than beside it, and the ratio measured here is no evidence about "
    "GPUs, where the all-gather runs on NVLink / the NIC beside the SMs (docs/zero.md, 'Overlapping the "
    "parameter all-gather with the next forward'). Do not price the overlap on GPUs from these numbers."
)


def _verdict(r: dict[str, Any]) -> str:
    """What one ZeRO stage's figures allow: the flag can save at most the gather's share of a step."""
    share = statistics.median(r["gather"]) / statistics.median(r["times"]["off"])
    minima = min(r["times"]["on"]) / min(r["times"]["off"])
    if r["ratio"] < 1 - share:
        what = "more than the flag can save, so most of the difference is the other jobs' load, not the flag"
    elif r["ratio"] <= 1:
        what = "within what the flag can save"
    else:
        what = (
            "a slowdown: the deferred gather's gloo threads compete with the forward for the two cores, or "
            "noise (compare the min–max ranges)"
        )
    return (
        f"ZeRO-{r['zero']}: the all-gather alone is {share:.0%} of an 'off' step, the most deferring it could "
        f"save (less, as the first stage's gather stays exposed); on / off of the medians {r['ratio']:.2f} is "
        f"{what}; of the fastest blocks {minima:.2f}."
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    bar_chart(
        rows,
        path,
        flag="overlap_param_gather",
        labels=[f"ZeRO-{r['zero']} (on/off {r['ratio']:.2f})" for r in rows],
        ylabel="optimizer step, median over blocks (ms)",
        title=f"d = {WORLD} ZeRO on CPU gloo (2 shared cores; says little about GPUs)",
        ranges=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--zero", type=int, nargs="+", default=[1, 2], choices=[1, 2], help="ZeRO stages")
    parser.add_argument("--blocks", type=int, default=16, help="timed blocks per variant")
    parser.add_argument("--block", type=int, default=2, help="optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=1, help="untimed blocks per variant")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 timed blocks, no files written")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    args.model = QUICK if args.quick else MODEL
    if args.quick:
        args.blocks, args.warmup = 2, 1
    args.params = _n_params(args.model)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        token_file = _token_file(Path(tmp))
        steps = {"warmup": args.warmup, "blocks": args.blocks, "block": args.block}
        result = run_distributed(_rank, WORLD, args.model, args.zero, token_file, steps, timeout=900)[0]
    args.load = (load_before, os.getloadavg()[0])
    rows = []
    for zero in args.zero:
        r = result[f"zero{zero}"] | {"zero": zero}
        r["ratio"] = on_off_ratio(r["times"])
        print(f"ZeRO-{zero}: on / off {r['ratio']:.2f}", flush=True)
        rows.append(r)
    publish("param_gather_overlap", rows, args, argv, report, plot)


if __name__ == "__main__":
    main()
