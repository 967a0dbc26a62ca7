"""When context parallelism wins, by the planner: Llama 3.1 8B at 8K–128K tokens on 8, 16 and 64 H100s.

    python benchmarks/planner_context.py     # writes benchmarks/results/planner_context.{md,png}

For every sequence length s ∈ {8K, 16K, 32K, 64K, 128K} and GPU count, two `tessera plan` searches of the same
space but for one option: with context parallelism (the default space at s ≥ 8192: c ∈ {2, 4, 8, 16}, one
pipeline stage, 1D tensor parallelism) and without (`SearchSpace(context=())`). Global batch: one sequence per
GPU (8 to 64 sequences: 64K to 8M tokens a step). Reported: the best layout of each search, its predicted step
time and memory per GPU (the estimator `tessera memory` uses), and which wins. The micro-batch is capped at 4
(`max_micro_batch`) to keep the 30 searches to about a minute; the best layouts use b ≤ 2 at these lengths.
Predictions, not measurements: the cost model of docs/cost-model.md on the shipped `h100` description.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.config import ModelConfig  # noqa: E402
from tessera.planner.hardware import load_hardware  # noqa: E402
from tessera.planner.search import PLANNER_SIZES, Candidate, SearchSpace, search  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "planner_context.md"
PNG = OUT.with_suffix(".png")
MODEL = "llama3.1-8b"
SEQS = (8192, 16384, 32768, 65536, 131072)
GPUS = (8, 16, 64)
HARDWARE = "h100"


def best(seq_len: int, gpus: int, context: bool) -> Candidate | None:
    """The best layout of the search with (default space) or without context parallelism; None if none fits."""
    cfg = ModelConfig(**{**PLANNER_SIZES[MODEL], "seq_len": seq_len})
    space = SearchSpace(max_micro_batch=4, context=None if context else ())
    result = search(cfg, gpus, load_hardware(HARDWARE), gpus, space=space, keep=1)
    return result.candidates[0] if result.candidates else None


def cell(c: Candidate | None) -> str:
    if c is None:
        return "does not fit | – | –"
    return f"{c.table_label} | {c.step_time:.3g} s | {c.memory.total / 1e9:.1f} GB"


def main() -> None:
    rows: list[tuple[int, int, Candidate | None, Candidate | None]] = []
    start = time.perf_counter()
    for gpus in GPUS:
        for s in SEQS:
            rows.append((gpus, s, best(s, gpus, False), best(s, gpus, True)))
    seconds = time.perf_counter() - start
    lines = [
        "# Context parallelism in the planner: Llama 3.1 8B, 8K–128K tokens, H100",
        "",
        "Command: `python benchmarks/planner_context.py`. " + " ".join(__doc__.split("\n\n")[2].split()),
        "",
        f"{len(rows) * 2} searches in {seconds:.0f} s.",
        "",
        "| GPUs | s | best without context | step | memory/GPU | best with context | step | memory/GPU | "
        "winner |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for gpus, s, without, with_cp in rows:
        if with_cp is None and without is None:
            winner = "neither fits"
        elif without is None or (with_cp is not None and with_cp.step_time < without.step_time):
            gain = "" if without is None else f" ({without.step_time / with_cp.step_time - 1:+.1%} faster)"
            winner = f"context {with_cp.plan.cp}{gain}" if with_cp.plan.cp > 1 else "no context"
        else:
            winner = "no context"
        lines.append(f"| {gpus} | {s // 1024}K | {cell(without)} | {cell(with_cp)} | {winner} |")
    lines += [
        "",
        "Without context parallelism a sequence's activations must fit one tensor group (tensor ≤ 8 ranks: one "
        "node), with full checkpointing at the longest lengths; with it, the s/c tokens of a context rank leave "
        "room for less recomputation or a smaller tensor split (whose GEMMs run more efficiently), at the price "
        "of each layer's K/V all-gather and dK/dV reduce-scatter (the `cp_comm` part of `tessera plan`'s "
        "breakdown). The memory column is the estimator's peak per GPU (`tessera memory`), under 95 % of 80 GB.",
    ]
    OUT.write_text("\n".join(lines) + "\n")
    picture(rows)
    print("\n".join(lines))


def picture(rows: list[tuple[int, int, Candidate | None, Candidate | None]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_g, ax_m) = plt.subplots(1, 3, figsize=(15, 4))
    for color, gpus in zip(("#4c72b0", "#dd8452", "#55a868"), GPUS, strict=True):
        for style, index, name in (("--", 2, "without context"), ("-", 3, "with context")):
            pts = [(s, r[index]) for r in rows if r[0] == gpus for s in [r[1]] if r[index] is not None]
            xs = [s // 1024 for s, _ in pts]
            # step time per sequence of the global batch (one per GPU), so the GPU counts share an axis
            ax_t.plot(
                xs,
                [c.step_time / gpus for _, c in pts],
                style,
                color=color,
                marker="o",
                label=f"{gpus} GPUs, {name}",
            )
            ax_m.plot(xs, [c.memory.total / 1e9 for _, c in pts], style, color=color, marker="o")
        both = [(r[1], r[2], r[3]) for r in rows if r[0] == gpus and r[2] is not None and r[3] is not None]
        ax_g.plot(
            [s // 1024 for s, _, _ in both],
            [without.step_time / with_cp.step_time for _, without, with_cp in both],
            "-",
            color=color,
            marker="o",
            label=f"{gpus} GPUs",
        )
    ax_g.axhline(1.0, color="#999999", linewidth=0.8)
    ax_g.set_ylabel("step time without / with context parallelism")
    ax_g.legend(fontsize=7)
    for ax in (ax_t, ax_g, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xticks([s // 1024 for s in SEQS], [f"{s // 1024}K" for s in SEQS])
        ax.set_xlabel("sequence length (tokens)")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("predicted step time / sequences per step (s)")
    ax_m.set_ylabel("predicted memory per GPU (GB)")
    ax_t.legend(fontsize=7)
    fig.suptitle(
        f"{MODEL} on H100: best layout with and without context parallelism (tessera plan)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(PNG, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
