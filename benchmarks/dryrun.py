"""Dry runs of real-size layouts (70B to 1T parameters, 64 to 3072 ranks) on this machine, against the estimate.

    python benchmarks/dryrun.py                 # every layout, ranks: first and last pipeline rank; writes results
    python benchmarks/dryrun.py --only llama70b_2d   # one layout, no files written
    python benchmarks/dryrun.py --compare-only  # re-compare the committed measurements with today's formulas

Each layout is the `tessera dryrun` command printed in the results: the chosen ranks are built and stepped by the
real runtime under fake tensors and a fake process group (docs/dryrun.md). Per rank the table gives the dry run's
parameter, gradient, optimizer, activation and peak bytes beside `tessera memory`'s estimate for that pipeline
position, and the dry run's communication bytes per axis beside the cost model's formulas. Time is wall-clock on
a shared 2-core machine (process time in brackets).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: import the repository's tessera
    sys.path.insert(0, str(ROOT))

from tessera.config import even_split, load_config  # noqa: E402
from tessera.dryrun import (  # noqa: E402
    default_ranks,
    dry_run,
    estimated_memory,
    format_rank,
    formula_traffic,
    measured_by_axis,
)
from tessera.layout import Layout  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "llama70b_2d": (
        "llama-70b, 2D 4×4 × pp4 breadth-first v2 × dp2, ZeRO-1",
        128,
        [
            "model.size=llama-70b",
            "parallel.tensor=4x4",
            "parallel.pipeline=4",
            "parallel.schedule=breadth_first",
            "parallel.stages_per_rank=2",
            "parallel.zero=1",
            "train.micro_batch=4",
            "train.global_batch=32",
        ],
    ),
    "llama405b_sp": (
        "llama-405b, tp8+SP × pp16 interleaved (v2) × dp8",
        1024,
        [
            "model.size=llama-405b",
            "parallel.tensor=8",
            "parallel.sequence_parallel=true",
            "parallel.pipeline=16",
            "parallel.schedule=interleaved",
            "parallel.stages_per_rank=2",
            f"parallel.stage_layers={even_split(126, 32)}",
            "train.micro_batch=1",
            "train.global_batch=128",
        ],
    ),
    "megatron1t": (
        "megatron-1t, t8 × p64 × d6, 1F1B, full checkpointing",
        3072,
        [
            "model.size=megatron-1t",
            "parallel.tensor=8",
            "parallel.pipeline=64",
            "parallel.schedule=1f1b",
            "parallel.checkpointing=full",
            "train.micro_batch=1",
            "train.global_batch=384",
        ],
    ),
    "gpt3_zero3": (
        "gpt3-175b, ZeRO-3 dp64, layered accumulation, full checkpointing",
        64,
        [
            "model.size=gpt3-175b",
            "parallel.zero=3",
            "parallel.accumulation=layered",
            "parallel.checkpointing=full",
            "train.micro_batch=1",
            "train.global_batch=128",
        ],
    ),
    "llama70b_1d": (
        "llama-70b, 1D tp8 × pp8 1F1B, ZeRO-3 dp4",
        256,
        [
            "model.size=llama-70b",
            "parallel.tensor=8",
            "parallel.pipeline=8",
            "parallel.schedule=1f1b",
            "parallel.zero=3",
            "train.micro_batch=1",
            "train.global_batch=32",
        ],
    ),
}
COMMON: list[str] = []  # fp32, tessera's default; bf16 is autocast over fp32 weights (see the results' notes)


def _command(world: int, overrides: list[str]) -> str:
    args = " ".join(f"--{o}" if " " not in o else f"'--{o}'" for o in overrides)
    return f"tessera dryrun --world-size {world} {args}"


def _config(name: str):
    _, world, overrides = LAYOUTS[name]
    cfg = load_config(None, [*overrides, *COMMON])
    cfg.validate(world)
    return cfg


def compare(run: dict) -> None:
    """(Re)compute the estimate and the formulas of a measured layout in place (cheap: no dry run)."""
    cfg = _config(run["name"])
    for r in run["ranks"]:
        r["estimate"] = estimated_memory(cfg, run["world"], r["rank"])
        r["formula"] = {f"{k}/{a}": v for (k, a), v in formula_traffic(cfg, run["world"], r["rank"]).items()}


def run_layout(name: str) -> dict:
    title, world, overrides = LAYOUTS[name]
    cfg = _config(name)
    out = {"name": name, "title": title, "world": world, "command": _command(world, [*overrides, *COMMON])}
    out["ranks"] = []
    wall, cpu = time.perf_counter(), time.process_time()
    for rank in default_ranks(Layout.from_config(cfg.parallel, world)):
        result = dry_run(cfg, world, rank)
        est, traffic = estimated_memory(cfg, world, rank), formula_traffic(cfg, world, rank)
        print(format_rank(result, est, traffic), flush=True)
        measured = {f"{k}/{a}": v for (k, a), v in measured_by_axis(result).items()}
        out["ranks"].append(
            {
                "rank": result.rank,
                "coords": result.coords,
                "dry": {
                    k: getattr(result, k) for k in ("params", "grads", "optimizer", "activations", "peak")
                },
                "build_peak": result.build_peak,
                "estimate": est,
                "traffic": measured,
                "formula": {f"{k}/{a}": v for (k, a), v in traffic.items()},
            }
        )
    out["wall_s"], out["cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{name}: {out['wall_s']:.0f} s wall ({out['cpu_s']:.0f} s process)", flush=True)
    return out


def _pct(dry: float, est: float) -> str:
    return f"{100 * (est - dry) / dry:+.1f}%" if dry else "—"


def to_markdown(runs: list[dict]) -> str:
    lines = [
        "# Dry runs at real scale: the runtime on fake tensors vs `tessera memory` and the traffic formulas",
        "",
        "Generated by `python benchmarks/dryrun.py` (docs/dryrun.md). GiB per rank; diff = (estimate − dry run) /",
        "dry run. Peak: the dry run's allocator peak of a steady step; estimate: `tessera memory` for the same",
        "pipeline position. Build peak: the allocator's peak while the rank builds its model; its estimate is",
        "`tessera memory`'s start-up build peak, for the fullest pipeline rank.",
        "",
    ]
    for run in runs:
        lines += [f"## {run['title']} — {run['world']} ranks", "", f"    {run['command']}", ""]
        lines += [
            f"Time: {run['wall_s']:.0f} s wall, {run['cpu_s']:.0f} s process, for {len(run['ranks'])} ranks.",
            "",
            "| rank | figure | dry run | estimate | diff |",
            "|---|---|---:|---:|---:|",
        ]
        for r in run["ranks"]:
            for key in ("params", "grads", "optimizer", "activations", "peak"):
                dry, est = r["dry"][key], r["estimate"][key]
                lines.append(
                    f"| {r['rank']} | {key} | {dry / 2**30:.2f} | {est / 2**30:.2f} | {_pct(dry, est)} |"
                )
            dry, est = r["build_peak"], r["estimate"]["build_peak"]
            lines.append(
                f"| {r['rank']} | build peak | {dry / 2**30:.2f} | {est / 2**30:.2f} | {_pct(dry, est)} |"
            )
        lines += [
            "",
            "| rank | traffic (bytes / step) | dry run | formula | diff |",
            "|---|---|---:|---:|---:|",
        ]
        for r in run["ranks"]:
            for key in sorted(set(r["traffic"]) | set(r["formula"])):
                dry, f = r["traffic"].get(key, 0), r["formula"].get(key, 0)
                lines.append(f"| {r['rank']} | {key} | {dry:,} | {round(f):,} | {_pct(dry, f)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=list(LAYOUTS), default=None)
    ap.add_argument(
        "--compare-only",
        action="store_true",
        help="recompute the estimates and formulas for the measured results/dryrun.json; rewrite the markdown",
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.compare_only:
        runs = json.loads((RESULTS / "dryrun.json").read_text())
        for run in runs:
            compare(run)
        (RESULTS / "dryrun.json").write_text(json.dumps(runs, indent=1))
        (RESULTS / "dryrun.md").write_text(to_markdown(runs))
        print(f"wrote {RESULTS / 'dryrun.md'}")
        return
    runs = [run_layout(name) for name in ([args.only] if args.only else LAYOUTS)]
    if args.only is None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "dryrun.json").write_text(json.dumps(runs, indent=1))
        (RESULTS / "dryrun.md").write_text(to_markdown(runs))
        print(f"wrote {RESULTS / 'dryrun.md'}")


if __name__ == "__main__":
    main()
