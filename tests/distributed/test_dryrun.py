"""The dry run (tessera/dryrun.py) against the real thing: the same layout on 8 gloo ranks.

Every rank of a real run of dp2 × pp2 × tp2 (sequence parallel, ZeRO-1, llama-tiny) measures its own step with
`measure_step`; the dry run repeats ranks 0 and 7 in this process under fake tensors and a fake process group.
What the dry run reports from the runtime's objects must equal the real run's exactly: every collective's bytes
per (kind, group), parameter, gradient and optimizer-state bytes, and the activation bytes saved for backward.

The traffic formulas must then equal the dry run's bytes exactly on the tensor and pipeline axes and for the
step's scalars. The data axis's gradient and parameter volumes are left out: the cost model counts the replicated
norm weights as if they were sharded by the tensor degree (docs/dryrun.md).
"""

from __future__ import annotations

import dataclasses

from tessera.config import from_dict
from tessera.dryrun import dry_run, formula_traffic, measure_step, measured_by_axis
from tests.harness import run_distributed

WORLD = 8
RAW = {
    "model": {"size": "llama-tiny"},
    "parallel": {"pipeline": 2, "tensor": 2, "sequence_parallel": True, "zero": 1, "schedule": "1f1b"},
    "train": {"global_batch": 8, "micro_batch": 2},
}
EXACT = ("params", "grads", "optimizer", "activations", "comm")


def _real_step(rank: int, world: int) -> dict:
    result = measure_step(from_dict(RAW), world, rank)
    return {name: getattr(result, name) for name in EXACT}


def test_dry_run_reports_what_the_real_run_does():
    real = run_distributed(_real_step, WORLD, timeout=300)
    for rank in (0, WORLD - 1):
        result = dry_run(from_dict(RAW), WORLD, rank)
        fake = dataclasses.asdict(result)
        assert {name: fake[name] for name in EXACT} == real[rank], f"rank {rank}"
        # at the peak the state is live and so are either the saved activations or the gradients (not both:
        # backward frees the one as it makes the other)
        state = fake["params"] + fake["optimizer"]
        assert fake["peak"] >= state + max(fake["activations"], fake["grads"]), f"rank {rank}"
        measured = measured_by_axis(result)
        formula = formula_traffic(from_dict(RAW), WORLD, rank)
        exact = [key for key in measured if key[1] != "data" or key[0] == "all_reduce"]
        assert {k: formula.get(k) for k in exact} == {k: measured[k] for k in exact}, f"rank {rank}"
