"""Validate accepts ⇔ train runs: a property test over generated configs (tessera.execution is the one judge).

Configs are drawn across families (GPT, Llama), tied/untied embeddings, world sizes 1-4, data × pipeline ×
tensor (1D, 1D + sequence parallelism with or without its communication overlap, 2D), the four schedules, stages
per rank, explicit stage splits, ZeRO 0-3 (1/2 with or without the overlapped parameter all-gather; hybrid sharding's
shard size), accumulation
orders and checkpointing modes; most are drawn consistent with their world size so that many are accepted. Two
properties:

- every config the plan rejects, `tessera train` rejects before starting a rank, with the same violations;
- a bounded, feature-spread sample of the accepted ones trains one step on gloo (every config of one world size
  in one process group), with a finite loss.

Deterministic: hypothesis runs derandomized (a fixed seed) with bounded examples and no example database.
"""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tessera.cli import main
from tessera.config import Config, as_overrides, from_dict
from tessera.execution import resolve, violations
from tessera.memory import estimate
from tests.config_space import HypothesisPick, draw_run_config
from tests.distributed.conftest import trainer_config
from tests.harness import run_distributed

EXAMPLES = 400
"""Generated configs per property (no processes for the rejected ones: milliseconds each)."""
SAMPLE_PER_WORLD = {1: 3, 2: 6, 3: 2, 4: 4}
"""Accepted configs trained one step, per world size: bounded so the test stays well under a minute and a half."""
FOUND = [  # (world size, raw sections): accepted configs a search of the config space found failing to train
    # pipeline rank 1 holds one stage of no blocks, neither embedding nor head, so no parameters: ZeRO's sharded
    # optimizer had no shards and torch refused it as the run was built ("optimizer got an empty parameter list")
    (
        3,
        {
            "model": {
                "family": "llama",
                "n_layers": 2,
                "d_model": 32,
                "n_heads": 2,
                "n_kv_heads": 1,
                "vocab_size": 256,
                "seq_len": 8,
                "tie_embeddings": tied,
            },
            "parallel": {
                "pipeline": 3,
                "schedule": schedule,
                "stage_layers": [1, 0, 1],
                "zero": zero,
                "overlap_param_gather": zero == 2,
            },
            "train": {"micro_batch": 2, "global_batch": 6, "dtype": "fp32"},
        },
    )
    for zero, schedule, tied in ((2, "gpipe", True), (3, "1f1b", False))
]
HYBRID = [  # (world size, raw sections): hybrid sharding (dp 4 = 2 × 2), which the drawn sample rarely holds
    (
        4,
        {
            "model": {
                "family": "llama",
                "n_layers": layers,
                "d_model": 32,
                "n_heads": 2,
                "vocab_size": 256,
                "seq_len": 8,
            },
            "parallel": {"zero": zero, "zero_shard_size": 2, "accumulation": accumulation, **extra},
            "train": {"micro_batch": 1, "global_batch": 8, "dtype": "fp32"},
        },
    )
    for zero, accumulation, layers, extra in (
        (3, "depth_first", 2, {}),
        # one block: one stage per rank, reduced once per micro-batch; crashed at its last REDUCE until 35e0889
        (2, "depth_first", 1, {}),
        (1, "layered", 2, {"overlap_param_gather": True}),
    )
]
SETTINGS = settings(
    derandomize=True,
    max_examples=EXAMPLES,
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@st.composite
def run_configs(draw: st.DrawFn) -> tuple[int, dict]:
    """(world size, raw config sections) of a tiny model (tests/config_space.py)."""
    return draw_run_config(HypothesisPick(draw))


def _config(raw: dict) -> Config:
    return from_dict({k: {n: x for n, x in v.items() if x is not None} for k, v in raw.items()})


@SETTINGS
@given(case=run_configs())
def test_rejected_configs_are_rejected_by_train_with_the_same_message(case: tuple[int, dict]) -> None:
    world, raw = case
    cfg = _config(raw)
    problems = violations(cfg, world)
    if not problems:
        plan = resolve(cfg, world)  # accepted: the plan resolves and prices
        assert plan.micro_batches >= 1 and sum(plan.stage_layers) == cfg.model.n_layers
        # accepted: a split the run can take, not one ignored
        split, par = cfg.parallel.stage_layers, cfg.parallel
        stages = par.pipeline * par.stages_per_rank
        assert split is None or (sum(split), len(split)) == (cfg.model.n_layers, stages)
        assert estimate(cfg, world).total > 0
        return
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", *as_overrides(raw), "--nproc", str(world)])
    assert code == 2
    for problem in problems:
        assert str(problem) in err.getvalue(), (str(problem), err.getvalue())


def _accepted_sample() -> dict[int, list[dict]]:
    """Accepted configs of each world size, spread over the features (first of each kind, then the rest)."""
    accepted: list[tuple[int, dict]] = []

    @settings(SETTINGS, max_examples=3 * EXAMPLES)  # a wider pool to spread the sample over
    @given(case=run_configs())
    def collect(case: tuple[int, dict]) -> None:
        if not violations(_config(case[1]), case[0]):
            accepted.append(case)

    collect()
    plans = [(world, raw, resolve(_config(raw), world)) for world, raw in accepted]
    plans.sort(key=lambda wrp: -_richness(wrp[2], wrp[1]))  # stable: generation order among equals
    by_world: dict[int, list[dict]] = {}
    keys = (
        lambda p: (p.world_size, p.pp > 1, p.q > 1, p.tp > 1, p.runner),  # every layout kind first
        lambda p: (p.world_size, p.schedule, p.zero, p.accumulation),  # then schedules and ZeRO stages
        lambda p: id(p),  # then anything
    )
    for key in keys:
        seen: set = set()
        for world, raw, plan in plans:
            chosen = by_world.setdefault(world, [])
            if len(chosen) >= SAMPLE_PER_WORLD[world] or raw in chosen or key(plan) in seen:
                continue
            seen.add(key(plan))
            chosen.append(raw)
    return by_world


def _richness(plan, raw: dict) -> int:
    """How many parallel features a config combines (the sample takes the richest of each kind first)."""
    features = (
        plan.pp > 1,
        plan.q > 1,
        plan.tp > 1,
        plan.sequence_parallel,
        plan.tp_comm_overlap,
        plan.overlap_param_gather,
        plan.zero > 0,
        plan.zero_replicas > 1,
        plan.dp > 1,
        plan.stages_per_rank > 1 and plan.pp > 1,
        "stage_layers" in raw["parallel"],
        not raw["model"]["tie_embeddings"],
        raw["model"]["family"] != "gpt",
    )
    return sum(features)


def _train_one_step(rank: int, world: int, configs: list[dict]) -> list[float]:
    from tessera.train.trainer import train

    return [train(from_dict(raw)).losses[0] for raw in configs]


def test_accepted_configs_train_one_step(token_file: Path, tmp_path: Path) -> None:
    sample = _accepted_sample()
    assert sum(map(len, sample.values())) >= sum(SAMPLE_PER_WORLD.values()) - 2, sample
    for world, raw in FOUND + HYBRID:
        assert violations(_config(raw), world) == [], raw
        sample.setdefault(world, []).append(raw)
    for world, raws in sorted(sample.items()):
        configs = []
        for i, raw in enumerate(raws):
            full = trainer_config(token_file, tmp_path / f"w{world}_{i}", {}, {}, steps=1)
            configs.append({**full, **{k: {**full.get(k, {}), **v} for k, v in raw.items()}})
            configs[-1]["model"] = {n: x for n, x in raw["model"].items() if x is not None}
            configs[-1]["train"]["warmup_steps"] = 1
        losses = run_distributed(_train_one_step, world, configs, timeout=300)[0]
        for raw, loss in zip(raws, losses, strict=True):
            assert math.isfinite(loss), (world, raw, loss)
