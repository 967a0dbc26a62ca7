"""Shortest training time per model size and method family, and the GPU count that reaches it.

    python benchmarks/training_time.py [--hardware a100-80gb]
    # writes benchmarks/results/planner_training_time.md and planner_training_time.png

Method: tessera/planner/analysis.py (Lamy-Poirier 2021, arXiv 2106.02679; docs/planner.md §4): critical batch at Kaplan's compute-efficient
target loss, steps from the steps/data trade-off, a full layout search per GPU count (8 … 65,536), each method
family a filter on the searched layouts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.planner.analysis import (  # noqa: E402
    ANALYSIS_MODELS,
    METHOD_FAMILIES,
    ModelAnalysis,
    analyse_model,
    analysis_table,
    format_duration,
    layouts_table,
)
from tessera.planner.hardware import load_hardware  # noqa: E402


def plot(analyses: list[ModelAnalysis], path: Path) -> None:
    """Left: shortest time vs model size per family. Right: time vs GPUs for the largest model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for family in METHOD_FAMILIES:
        xs = [a.shape.n_params() / 1e9 for a in analyses if a.best[family].candidate is not None]
        ys = [a.best[family].days for a in analyses if a.best[family].candidate is not None]
        style = "k--" if family == "all methods" else "-o"
        left.plot(xs, ys, style, label=family, markersize=4)
        big = analyses[-1].curve.get(family, [])
        if big:
            right.plot([g for g, _ in big], [d for _, d in big], style, label=family, markersize=4)
    left.set(xscale="log", yscale="log", xlabel="parameters (B)", ylabel="shortest training time (days)")
    left.set_title("Shortest training time at the critical batch", fontsize=10)
    right.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="training time (days)")
    right.set_title(f"{analyses[-1].model}: training time vs GPU count", fontsize=10)
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CHANGES = (
    "## What moved in this re-run\n"
    "\n"
    "Latest (2026-12-03, after 86cd2e2 and 39c5cc9): the pipeline runtime keeps a stage's output only "
    "until it is sent or read (86cd2e2), and the memory estimate the search prunes with no longer counts "
    "the outputs a rank sent for its micro-batches in flight; it also counts a stage's first backward's "
    "weight gradient under no and selective recomputation, the sequence-parallel and 2D output layers' "
    "backward and the 2D grid's received inputs (39c5cc9). The 1T row moves: 12.2 -> 11.5 d @ 65,536 (all"
    " methods and breadth-first + ZeRO-3), the same d512 p16 t8+SP breadth-first v8 b1 m25 layout now "
    "with plain ZeRO-3 and no recomputation (17.7 s, MFU 44 %, 74 GB; was ZeRO-3 hybrid 64x8 with op "
    "checkpointing, 19 s, 56 GB): its rank sent 200 outputs a step (8 stages x 25 micro-batches, 26 MB "
    "each), 5.2 GB the estimate no longer holds, which leaves room to recompute nothing. Breadth-first + "
    "ZeRO-3 at 8,192 GPUs 87.7 -> 81.5 d; 1D tensor + (interleaved) 1F1B at 512 GPUs 1394.3 -> 1389.5 d; "
    "2D tensor + 1F1B at 512 / 1,024 / 2,048 GPUs 1999.3 / 959.2 / 497.0 -> 1752.2 / 905.6 / 482.4 d; the"
    " 145.6B and 310.1B winners' memory -1 GB. The method ranking is unchanged; every other cell and "
    "winning layout is unchanged. The run does not separate the two commits' shares.\n"
)
"""What the last re-run changed and why (against the commit just before it, same searches), written at the top
of the report."""

EARLIER = (
    "## Earlier re-runs\n"
    "\n"
    "After the bubble fix c53a772 (2026-12-03): the closed form the search ranks by now counts "
    "breadth-first's wrap-around stall when a layout has fewer micro-batches than pipeline ranks ((v - "
    "1)(p - m) chunk units a direction, which the simulator always had). Every layout with m < p was "
    "timed too fast before: the breadth-first column grows (1.7B 16 -> 24 min, 7.5B 1.1 -> 1.8 h, 39.1B "
    "5.0 -> 6.7 h, 145.6B 21.6 h -> 1.1 d, 1T 12.0 -> 12.2 d @ 65,536: `d512 p16 t8+SP | breadth_first v8"
    " | b1 m25 | ZeRO-3 hybrid 64x8 | ckpt op`, 19 s, 56 GB, where the b2 m6 layout's 18.1 s simulates at"
    " 22.7 s). The method ranking is unchanged; breadth-first + ZeRO-3 leads every model by less (7.5B: "
    "1.8 h against 1D tensor's 2.0 h).\n"
    "\n"
    "Before the bubble fix c53a772 (2026-12-03), against af8ffa5 (the last re-run, same searches), one "
    "change to the search and three to the memory estimate it prunes with (2026-12-03, docs/planner.md "
    '"The rings priced as written", docs/memory.md): where the search turns `parallel.tp_comm_overlap` on'
    " it prices the layout's memory again with the rings' backward (per-lane fp32 weight-gradient sums) "
    "and keeps the layout without them where they do not fit (4744dba); the estimate counts the "
    "sequence-parallel entry's weight gradients, ZeRO-3's cached weight copies (1b39745) and a stage's "
    "first backward's weight gradients (a83ed5b). Only the 1T row moves: its winner keeps its layout, "
    "d256 p32 t8+SP breadth-first v4 b1 m50 ZeRO-3 at 65,536 GPUs (75 GB), but now without the rings, "
    "which no longer fit beside it: step 18.0 → 18.9 s, MFU 44 → 42 %, 11.6 → 12.2 days (all methods and "
    "breadth-first + ZeRO-3; the time the rings' 3-lane pricing had gained, now given back). 1D tensor + "
    "(interleaved) 1F1B at 1T: 16.5 → 16.6 d @ 65,536, 26.3 → 26.9 d @ 32,768, 1315.8 → 1389.5 d @ 512. "
    "Every other cell and winning layout is unchanged; the winners' memory per GPU grows 1-3 GB (39.1B 5 "
    "→ 6 GB, 145.6B 26 → 27, 310.1B 53 → 55; the breadth-first + ZeRO-3 family 17 → 18 and 34 → 37 GB). "
    "This run does not separate the search's change from the estimate's. Re-run once more after the "
    "attention's entry backward moment (9038028) and the rings' replay without a copy of the MLP exit's "
    "weight (b5ef8e1): the 1T winner of the first re-run (75 GB) no longer fits; all methods and "
    "breadth-first + ZeRO-3 at 1T now take d1024 p8 t8+SP breadth-first v16 b2 m6 ZeRO-3 hybrid 128×8 "
    "with full recomputation and the rings (step 19.2 s, MFU 39 %, 59 GB), 12.2 → 12.6 days @ 65,536; "
    "data parallel + ZeRO at 310.1B 21.1 → 21.8 d @ 16,384; 1D tensor + 1F1B at 1T 1389.5 → 1416.3 d @ "
    "512. Every other cell is unchanged. Re-run a third time after selective recomputation's replay "
    "counted once (3a09cd2), a stage's first backward holding its later blocks' weight gradients "
    "(d6b842d), the 2D grid's stage boundaries (b9a84b8) and the reduce-scatter's output shard (80352c1):"
    " one cell moves, 1T at 512 GPUs for 1D tensor + (interleaved) 1F1B and all methods, 1416.3 → 1430.6 "
    "d; every other cell and winning layout is unchanged. Re-run a fourth time after op checkpointing "
    "entered the search (0d8f8f7; never with the rings, not on the 2D grid), one micro-batch without a "
    "pipeline priced once (9f375fc) and the memory estimator's fixes of 1bf2c93 (later ZeRO reductions "
    "walked as the runtime runs them, the floor's output shard, ZeRO-3's cast copies in a window, 2D's "
    "exit SUMMA, the MLP backward without recomputation). The 1T winner keeps its layout but takes op "
    "checkpointing where it had full recomputation and the rings (0d8f8f7's mode, which does not run with"
    " the rings): d1024 p8 t8+SP breadth-first v16 b2 m6 ZeRO-3 hybrid 128×8 with `ckpt op`, step 19.2 → "
    "18.1 s, MFU 39 → 42 %, 59 → 70 GB, 12.6 → 12.0 days @ 65,536 (all methods and breadth-first + "
    "ZeRO-3; that family's curve 23.2 → 21.9 d @ 32,768). The method ranking at 1T is unchanged "
    "(breadth-first + ZeRO-3 = all methods 12.0 d, 1D tensor (+ interleaved) 1F1B 16.6 d, 2D tensor + "
    "1F1B 49.3 d, data parallel + ZeRO no fit), and the shortest time is still reached at the 65,536-GPU "
    "cap. Two more cells move: 1T at 512 GPUs for 1D tensor + (interleaved) 1F1B and all methods, 1430.6 "
    "→ 1394.3 d, and data parallel + ZeRO at 39.1B, 1.4 → 1.2 d @ 8,192; every other cell and winning "
    "layout is unchanged. This run does not separate the three commits' shares in these two cells (no run"
    " at their parents: 20 min each on this machine at a load of 3-5).\n"
    "\n"
    "After the estimator's replay moments: No change to the search, against 0785e3e: the memory estimate "
    "changed (2026-12-03: full recomputation's replay priced as the larger of its two backward moments "
    "instead of their sum, its remaining moments counted; docs/memory.md), and 2D's replay no longer runs"
    " the MLP exit's SUMMA product (4223138). The shortest time per size does not move (1T: 11.6 d @ "
    "65,536, breadth-first + ZeRO-3), nor does any family but 2D tensor + 1F1B, whose 1T cells are 2-3 % "
    "shorter (50.4 → 49.3 d @ 65,536, 2042 → 1999 d @ 512): smaller estimated replays let it keep more "
    "micro-batches or lighter recomputation. The previous re-run's change (the estimate of 2026-12-02: "
    "ZeRO-3 with full recomputation no longer over-estimated, so data parallel + ZeRO fits 39.1B-310.1B "
    "and breadth-first + ZeRO-3 reaches 1T from 8,192 GPUs) and the one before it (hybrid shard groups "
    "spanning nodes, against 4cfbbec) are in the repository's history.\n"
    "\n"
    "After hybrid sharding entered the search: Against 995b71d (same searches), three changes to the "
    "search and the step time: hybrid sharding (`parallel.zero_shard_size`, docs/zero.md) is searched "
    "beside every ZeRO-3 layout with a shard group of one node's data ranks, its gradient shards "
    "all-reduced across the nodes under the backward as the runtime does; pipeline-free depth-first "
    "accumulation is priced one micro-batch at a time, as the runtime runs it (docs/cost-model.md §4); "
    "ZeRO-1 depth-first reduce-scatters each stage at its last REDUCE, which the step time already "
    "assumed. One cell moves: the data-parallel + ZeRO family at 7.5B, 9.8 h @ 2048 GPUs (d2048 "
    "breadth-first v36 b2 ZeRO-2 with the deferred gather, step 1.35 s) → 5.0 h @ 8192 (d8192 v36 b1 "
    "ZeRO-3 hybrid 1024×8, step 0.84 s): whole-group ZeRO's gathers and reduce-scatters over 2,048+ ranks"
    " across nodes stopped it scaling, while hybrid sharding keeps them in the node and sends 1/8 of the "
    "gradients across, so the family's curve keeps falling to 8,192 GPUs (0.41 → 0.25 → 0.21 days at "
    "2,048 / 4,096 / 8,192). Every other cell and every winner is unchanged (hybrid variants are searched"
    " for the other families' ZeRO-3 layouts too but do not win there).\n"
    "\n"
    "After the rings' chunk GEMMs on 3 lanes: One change to the step time, against the commit just before"
    " it (same searches): a tensor-parallel ring's chunk GEMMs are priced on the runtime's 3 CUDA lanes "
    "(docs/cost-model.md §6; Transformer Engine's default pool), where they were priced one after the "
    "other, each chunk with its own partly empty last wave. The rings now price faster on every layout of"
    " these tables they apply to, so every 1D + SP winner takes them, and the families with 1D tensor "
    "parallelism gain up to 11 %: all methods at 1T 12.2 → 11.6 days on the same layout (d256 p32 t8+SP "
    "breadth-first v4 ZeRO-3, step 18.9 → 18.0 s, MFU 42 → 44 %), 39.1B 5.4 → 5.0 h, 145.6B 22.9 → 21.6 h"
    " (now ZeRO-1 with the deferred gather, step 1.76 → 1.66 s), 310.1B 2.4 → 2.3 days (step 4.17 → 3.91 "
    "s); 1D tensor + 1F1B at 1T 17.3 → 16.5 days. The data-parallel + ZeRO and 2D families do not move "
    "(no 1D tensor parallelism).\n"
    "\n"
    "After the overlap slowdown: One change to the step time, against the commit just before it (same "
    "searches): a data-parallel collective hidden under compute now slows that compute by the hardware "
    "file's `overlap_slowdown` (18.9 % on the GPU files, the average measured in arXiv 2507.03114; "
    "`steptime.dp_cost`, docs/cost-model.md §6), where overlap used to be free. Layouts that hide much "
    "data-parallel traffic pay most: the data-parallel + ZeRO family (1.7B 55 → 60 min, 7.5B 11.8 → 12.9 "
    "h, now at 2048 GPUs), breadth-first + ZeRO-3 (1.7B 33 → 36 min, 7.5B 2.3 → 2.6 h, 145.6B 22.5 h → "
    "1.1 d on a new layout, d512 p16 v5 instead of d1024 p8 v10) and the 2D family (1.7B 45 → 49 min, "
    "7.5B 3.3 → 3.6 h); the 1D tensor families, whose DP traffic is small beside their tensor-parallel "
    "time, move ≤ 3 %. The all-methods winners keep their layouts: 1T 12.0 → 12.2 days (d256 p32 t8+SP "
    "breadth-first v4 m50, ZeRO-3; step 18.6 → 18.9 s, MFU 42 %), 310.1B 2.2 → 2.5 days (step 3.84 → 4.33"
    " s). The same commit prices FSDP's per-block gather unit for the published FSDP rows (tessera's "
    "pipeline-free ZeRO already ran one stage per block) and fixes `fast_step` for a tied embedding "
    "across a pipeline under plain depth-first data parallelism (it priced rank 0's single reduction, not"
    " the middle ranks' every-micro-batch ones); this table does not separate their effect from the "
    "slowdown's.\n"
    "\n"
    "After the per-dtype step time: the previous table predated the estimator's per-dtype bf16 memory "
    "count and walked peak: at main just before the per-dtype step time, the 1T winner was already d256 "
    "p32 t8+SP breadth-first v4 m50 (10.3 days, MFU 49 %), since d2048 p4 v32 (8.5 days) needs full "
    "checkpointing under that count (11.4 days), and the data-parallel family had no fitting layout from "
    "39.1B up. The step time then priced tessera's own bytes under autocast (`Plan.autocast`, "
    "docs/cost-model.md §3-4): the fp32 residual stream and each Linear's input cast, backward's "
    "weight-gradient cast back to fp32 and accumulation into the fp32 gradient (18 bytes per local weight"
    " per micro-batch), fp32 gradients and ZeRO gathers on the data-parallel group, and the fp32 Adam "
    "step. Every time grew and no family's ranking changed: 1T 10.3 → 12.0 days on the same layout "
    "(compute per step 12.7 → 14.9 s, mostly the weight-gradient accumulation; exposed data-parallel "
    "traffic 0.17 → 0.33 s), MFU 49 → 42 %; 1D tensor + 1F1B 14.6 → 17.2 days, 2D tensor + 1F1B 50.8 → "
    "53.3 days (with 2D's weights then cast once per step, which landed meanwhile and also moved which 2D"
    " layouts fit). The small models moved most, their fp32 gradient all-reduce over 2,048 nodes being "
    "exposed (1.7B: step 0.031 → 0.044 s, data-parallel 5 → 16 ms, MFU 7 → 5 %). Modular breadth-first + "
    "ZeRO-3 stayed the fastest family for 310B and 1T (tied with all methods); at 145.6B all methods "
    "found a breadth-first ZeRO-0 layout 6 % faster than the ZeRO-3 family (21.2 against 22.6 hours; tied"
    " before).\n"
    "\n"
    "After the tied embedding's gradient exchange entered the lowered IR (one reduction of the first and "
    "last stage, after an EXCHANGE at the step's end, priced by `fast_step` and the simulator as the "
    "runtime runs it): every GPT time grew by at most a few percent (1T 12.0 → 12.1 days, same layouts), "
    "except 1D tensor + 1F1B at the small sizes (1.7B 25 → 30 min, 7.5B 2.0 → 2.3 h at 65,536 GPUs): "
    "their depth-first reductions of the tied stages no longer overlap the backward but wait for the "
    "exchange. No winner changed.\n"
    "\n"
    "After the two communication overlaps entered the search: one change to the step time, against the "
    "commit just before it (same searches): the search considers the two communication overlaps tessera "
    "now runs (docs/cost-model.md §6, docs/planner.md §1): `parallel.overlap_param_gather` on every "
    "ZeRO-1/2 layout with d > 1 that still fits with its shard copies (ZeRO-1/2's gather deferred to the "
    "next step, the rank's first stage's share exposed) and `parallel.tp_comm_overlap` (1D + SP "
    "collectives as rings under the GEMM chunks) where it prices faster. The deferred gather moves most: "
    "the data-parallel + ZeRO family (7.5B 12.9 → 9.8 h), 1D tensor + interleaved 1F1B (7.5B 2.3 h now at"
    " 16,384 GPUs, 39.1B 9.0 → 8.1 h, 310.1B 2.7 → 2.4 days), and two all-methods winners move to ZeRO-1 "
    "with the deferred gather: 39.1B 5.5 → 5.4 h (d1024 p8 t8+SP breadth-first v6; ZeRO-0 before), 310.1B"
    " 2.5 → 2.4 days (d1024 p8 t8+SP interleaved v12, step 4.33 → 4.17 s; breadth-first ZeRO-3 before). "
    "The rings win only where a rank's GEMMs are large enough that their b·s/t-row chunks still fill the "
    "A100's waves: 145.6B's winner keeps its layout with them (ZeRO-0, step 1.79 → 1.76 s, 23.2 → 22.9 "
    "h), as does breadth-first + ZeRO-3 at 145.6B (1.1 → 1.0 days, step 2.04 → 2.00 s). The 1T winner "
    "keeps its layout and time (12.2 days, d256 p32 t8+SP breadth-first v4 ZeRO-3: neither overlap "
    "applies or pays); its family curve gains at 16,384 and 32,768 GPUs (46.9 → 45.7, 24.5 → 24.2 days). "
    "1D tensor + 1F1B and 2D are unchanged.\n"
)
"""What the re-runs before the last one changed, oldest first, written at the end of the report."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hardware", default="a100-80gb")
    args = ap.parse_args()
    hw = load_hardware(args.hardware)
    start = time.perf_counter()
    analyses = []
    for model in ANALYSIS_MODELS:
        analyses.append(analyse_model(model, hw))
        print(f"{model}: searched in {analyses[-1].search_seconds:.1f} s", flush=True)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    plot(analyses, results / "planner_training_time.png")
    big = analyses[-1]
    curve = "\n".join(
        f"| {family} | "
        + " | ".join(f"{g}: {format_duration(d)}" for g, d in big.curve.get(family, []))
        + " |"
        for family in METHOD_FAMILIES
    )
    text = (
        "# Shortest training time per model size and method family\n\n"
        f"Command: `python benchmarks/training_time.py --hardware {args.hardware}` "
        f"({time.perf_counter() - start:.0f} s wall on a shared 2-core machine; the searches themselves "
        f"{sum(a.search_seconds for a in analyses):.0f} s).\n\n"
        "Target loss (1 + α_N/α_S)·L(N) (Kaplan's compute-efficient stopping point), batch = the critical batch "
        "rounded per layout, steps from S = S_min(1 + B_crit/B), GPU counts 8 … 65,536 (powers of two), "
        f"{hw.name} ({hw.memory_bytes / 1e9:.0f} GB, layouts must fit in 95 %). "
        "Cell: shortest training time @ the GPU count reaching it; @ 65536 means the cap was binding (the time "
        "was still falling). Method: tessera/planner/analysis.py, docs/planner.md.\n\n"
        + CHANGES
        + "\n## Shortest training time\n\n"
        + analysis_table(analyses)
        + "\n## Winning layouts (all methods)\n\n"
        + layouts_table(analyses)
        + "\n## Winning layouts (modular breadth-first + ZeRO-3)\n\n"
        + layouts_table(analyses, "modular breadth-first + ZeRO-3")
        + f"\n## {big.model}: shortest time per family at each GPU count\n\n"
        + "| family | GPUs: time |\n|---|---|\n"
        + curve
        + "\n\n![training time](planner_training_time.png)\n\n"
        + EARLIER
    )
    (results / "planner_training_time.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
