"""How the pipeline runtime's own Python work grows with the micro-batches per step (the list length).

A large global batch on few data ranks means thousands of micro-batches per pipeline rank (the demo model at
global batch 320,000 on pipeline 4 × data 2: 20,000 each, 400,000 lowered actions). Everything the runtime
derives from its list must then be linear in it; three parts were quadratic until they were fixed (where each
receive is posted, the NCCL order check, the per-action sweep of pending sends: docs/pipeline-runtime.md).

Measured here, for 1F1B on 4 pipeline ranks with m micro-batches per step (one step = one list per rank):

(a) in one process, no communication: building the lowered lists (`lowered_schedule`, memo cleared), the
    receive positions of rank 1 (`recv_post_positions`) and constructing rank 1's `PipelineEngine`
    (`build_pipeline`, given the lists as the trainer is);
(b) on 4 gloo ranks: one training step of a 4-layer gpt2-tiny (sequence 8, micro-batch 1), slowest rank.

Each m doubles the last, so against the first row a linear part takes 2×, 4×, 8× and a quadratic one 4×, 16×,
64×: the tables give that ratio (the growth; ratios of one run, since the machine's speed drifts between runs) and
the time per action, which stays flat when the cost is linear.

    python benchmarks/pipeline_scale.py            # writes benchmarks/results/pipeline_scale.md and .png
    python benchmarks/pipeline_scale.py --quick    # smaller m, nothing written
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: import the repository's tessera
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tessera.config import Config, from_dict  # noqa: E402
from tessera.execution import resolve  # noqa: E402
from tessera.layout import Layout  # noqa: E402
from tessera.model.build import build_model  # noqa: E402
from tessera.pipeline import build as schedule_build  # noqa: E402
from tessera.pipeline.run_order import recv_post_positions  # noqa: E402
from tessera.pipeline.runtime import build_pipeline  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PP = 4
SEQ = 8
BUILD_M = [2_500, 5_000, 10_000, 20_000]
STEP_M = [250, 500, 1_000, 2_000]
_RANK_1 = SimpleNamespace(
    coord=lambda axis: 1, pp=None, dp=None
)  # pipeline rank 1's groups, without processes


def _config(m: int) -> Config:
    """4-layer gpt2-tiny on PP pipeline ranks, 1F1B, m micro-batches of one sequence per step."""
    return from_dict(
        {
            "model": {"size": "gpt2-tiny", "n_layers": PP, "seq_len": SEQ},
            "parallel": {"pipeline": PP, "schedule": "1f1b"},
            "train": {"global_batch": m, "micro_batch": 1},
        }
    )


def _timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def build_row(m: int, repeats: int = 3) -> dict[str, float]:
    """(a): seconds to lower and validate, to find rank 1's receive positions and to construct its engine; the
    best of ``repeats`` (a single pass can meet one of the cycle collector's full sweeps, ~0.4 s at 120,000
    actions)."""
    cfg = _config(m)
    best: dict[str, float] = {}
    for _ in range(repeats):
        schedule_build._build.cache_clear()  # time the build itself, not the memo
        plan, t_lower = _timed(lambda: resolve(cfg, PP))
        lowered = plan.lowered()
        _, t_recv = _timed(lambda lists=lowered: recv_post_positions(lists[1], 2))
        torch.manual_seed(0)
        model = build_model(cfg.model)
        engine, t_engine = _timed(
            lambda model=model, plan=plan: build_pipeline(model, Layout(dp=1, pp=PP), _RANK_1, cfg, plan=plan)
        )
        times = {"lower": t_lower, "recv": t_recv, "engine": t_engine}
        best = {k: min(v, best.get(k, v)) for k, v in times.items()}
    return {"m": m, "actions": len(engine.actions), **best}


def _step_rank(rank: int, world: int, m: int) -> tuple[float, int, float]:
    """(b) on one gloo rank: (seconds of one step, this rank's actions, its loss)."""
    from tessera.groups import build_groups

    cfg = _config(m)
    layout = Layout(dp=1, pp=world)
    torch.manual_seed(0)
    engine = build_pipeline(
        build_model(cfg.model), layout, build_groups(layout), cfg, plan=resolve(cfg, world)
    )
    g = torch.Generator().manual_seed(1)
    vocab = cfg.model.vocab_size
    batches = [
        (torch.randint(0, vocab, (1, SEQ), generator=g), torch.randint(0, vocab, (1, SEQ), generator=g))
        for _ in range(m)
    ]
    torch.distributed.barrier()
    loss, seconds = _timed(lambda: engine.step(batches))
    return seconds, len(engine.actions), float(loss)


def step_row(m: int) -> dict[str, float]:
    from tests.harness import run_distributed

    ranks = run_distributed(_step_rank, PP, m, timeout=3600)
    seconds, _, loss = max(ranks)
    return {"m": m, "actions": max(n for _, n, _ in ranks), "step": seconds, "loss": loss}


def _growth(rows: list[dict[str, float]], key: str) -> list[str]:
    """Each row's time over the first row's: 2×, 4×, 8× for a linear cost, 4×, 16×, 64× for a quadratic one."""
    return ["1×"] + [f"{r[key] / rows[0][key]:.1f}×" for r in rows[1:]]


def report(build: list[dict[str, float]], step: list[dict[str, float]], command: str) -> str:
    lines = [
        "# Pipeline runtime: its own work against the micro-batches per step",
        "",
        f"`{command}` (written by `benchmarks/pipeline_scale.py`; what it measures is in its docstring).",
        "1F1B on 4 pipeline ranks, m micro-batches per step. Each row doubles m; growth is the time over the first",
        "row's: 2×, 4×, 8× for a linear cost, 4×, 16×, 64× for a quadratic one. Wall-clock on a shared 2-core CPU",
        "machine; times of a few ms are noisy, so read the growth over the whole range.",
        "",
        "## (a) One process: lower + validate, receive positions, engine construction (rank 1); best of 3",
        "",
        "| m | rank 1 actions | lower + validate s | growth | receive positions s | growth | engine s | growth "
        "| engine µs/action |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    growth = {k: _growth(build, k) for k in ("lower", "recv", "engine")}
    for i, r in enumerate(build):
        lines.append(
            f"| {r['m']:,} | {r['actions']:,} | {r['lower']:.2f} | {growth['lower'][i]} | {r['recv']:.3f} "
            f"| {growth['recv'][i]} | {r['engine']:.3f} | {growth['engine'][i]} "
            f"| {r['engine'] / r['actions'] * 1e6:.1f} |"
        )
    lines += [
        "",
        "## (b) Four gloo ranks: one training step of a 4-layer gpt2-tiny (slowest rank)",
        "",
        "| m | actions (largest rank) | step s | growth | µs/action | loss |",
        "|---|---|---|---|---|---|",
    ]
    step_growth = _growth(step, "step")
    for i, r in enumerate(step):
        lines.append(
            f"| {r['m']:,} | {r['actions']:,} | {r['step']:.2f} | {step_growth[i]} "
            f"| {r['step'] / r['actions'] * 1e6:.0f} | {r['loss']:.6f} |"
        )
    return "\n".join(lines) + "\n"


def plot(build: list[dict[str, float]], step: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (
        ("lower", "lower + validate"),
        ("recv", "receive positions"),
        ("engine", "engine build"),
    ):
        ax.loglog([r["m"] for r in build], [r[key] for r in build], "o-", label=f"(a) {label}")
    ax.loglog([r["m"] for r in step], [r["step"] for r in step], "s-", label="(b) one step, 4 gloo ranks")
    m0, t0 = step[0]["m"], step[0]["step"]
    ms = [m0, build[-1]["m"]]
    ax.loglog(ms, [t0 * m / m0 for m in ms], "k:", lw=1, label="slope 1 (linear)")
    ax.loglog(ms, [t0 * (m / m0) ** 2 for m in ms], "k--", lw=1, label="slope 2 (quadratic)")
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("seconds")
    ax.set_ylim(top=max(r["step"] for r in step) * 30)
    ax.set_title("Pipeline runtime work vs micro-batches (1F1B, 4 ranks)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="m up to 4× smaller, nothing written")
    args = parser.parse_args()
    build_ms = BUILD_M[:2] if args.quick else BUILD_M
    step_ms = STEP_M[:2] if args.quick else STEP_M
    build = [build_row(m) for m in build_ms]
    step = [step_row(m) for m in step_ms]
    command = "python benchmarks/pipeline_scale.py" + (" --quick" if args.quick else "")
    text = report(build, step, command)
    print(text)
    if not args.quick:
        (RESULTS / "pipeline_scale.md").write_text(text)
        plot(build, step, RESULTS / "pipeline_scale.png")


if __name__ == "__main__":
    main()
