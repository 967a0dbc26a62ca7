"""Hybrid sharding (`parallel.zero_shard_size`) without ranks: validate's refusals, the groups' members, and the
memory and traffic figures, hand-computed. The runs themselves: tests/distributed/test_hsdp.py; the dry run against
the formulas: tests/unit/test_dryrun_formulas.py and test_peak_vs_dryrun.py."""

from __future__ import annotations

import pytest

from tessera.cli import main
from tessera.config import load_config
from tessera.dryrun import _hybrid_traffic
from tessera.execution import resolve, violations
from tessera.layout import Layout
from tessera.memory import cost_plan, estimate, stage_params
from tessera.planner.cost import ModelShape
from tessera.planner.cost.plan import Plan
from tessera.planner.cost.rank_memory import model_state_bytes

DEMO = "configs/demo.toml"


def _demo(overrides: list[str], world: int = 4):
    """The demo config (a data size of 2) on ``world`` data-parallel ranks."""
    return load_config(DEMO, [f"parallel.data={world}", *overrides])


def _rules(overrides: list[str], world: int) -> list:
    return [
        v for v in violations(_demo(overrides, world), world, training=False) if v.rule.startswith("zero")
    ]


@pytest.mark.parametrize(
    ("overrides", "world", "words"),
    [
        (["parallel.zero_shard_size=2"], 4, ["parallel.zero = 0", "set parallel.zero = 1, 2 or 3"]),
        (["parallel.zero=3", "parallel.zero_shard_size=3"], 4, ["does not divide", "one of [2, 4]"]),
        (["parallel.zero=3", "parallel.zero_shard_size=8"], 4, ["does not divide", "one of [2, 4]"]),
        (["parallel.zero=1", "parallel.zero_shard_size=1"], 4, ["shards nothing", "parallel.zero = 0"]),
        (["parallel.zero=2", "parallel.zero_shard_size=2"], 1, ["does not divide", "remove"]),
    ],
)
def test_validate_refuses_a_bad_shard_size_naming_the_key_and_the_fix(
    overrides: list[str], world: int, words: list[str]
) -> None:
    found = _rules(overrides, world)
    assert len(found) == 1, found
    text = f"{found[0].problem} {found[0].fix}"
    assert "parallel.zero_shard_size" in text
    for word in words:
        assert word in text, text


def test_a_shard_size_below_one_is_out_of_range() -> None:
    found = violations(_demo(["parallel.zero=3", "parallel.zero_shard_size=0"]), 4, training=False)
    assert [v.rule for v in found] == ["parallel.zero_shard_size"]


@pytest.mark.parametrize(("shard", "replicas"), [(None, 1), (4, 1), (2, 2)])
def test_the_plan_resolves_the_shard_group_and_says_so(shard: int | None, replicas: int) -> None:
    overrides = ["parallel.zero=3"] + ([f"parallel.zero_shard_size={shard}"] if shard else [])
    plan = resolve(_demo(overrides), 4, training=False)
    assert (plan.zero_shard, plan.zero_replicas) == (shard or 4, replicas)
    assert ("replicated 2×" in plan.describe()) == (replicas == 2)
    assert cost_plan(plan).zero_dp == (shard or 4)
    assert cost_plan(plan).zero_shard == (2 if replicas == 2 else 0)  # plain ZeRO: the cost model's old Plan


def test_validate_prints_the_hybrid_plan(capsys: pytest.CaptureFixture) -> None:
    args = ["--parallel.data=4", "--parallel.zero=2", "--parallel.zero_shard_size=2", "--world-size", "4"]
    assert main(["validate", DEMO, *args]) == 0
    assert "ZeRO: 2 sharded over 2 data-parallel ranks, replicated 2×" in capsys.readouterr().out


def test_shard_groups_are_consecutive_data_ranks_and_replicas_the_rest() -> None:
    """dp 4 × pp 2 (rank = data·2 + pipe): data ranks 0,1 and 2,3 shard together; 0,2 and 1,3 replicate."""
    layout = Layout(dp=4, pp=2)
    assert layout.data_shard_groups(2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_replica_groups(2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.data_shard_groups(4) == layout.all_groups(*layout.axes[:1])  # one group: plain ZeRO
    with pytest.raises(ValueError, match="does not divide"):
        layout.data_shard_groups(3)


def test_model_state_is_sharded_over_the_shard_group_only() -> None:
    """Ψ = 1e9 fp32 parameters, ZeRO-3 over shard groups of 8 of 64 data ranks: 4Ψ/8 each of parameters and
    gradients, 8Ψ/8 of Adam moments (the formulas of dp = 8, not 64)."""
    shape = ModelShape(
        n_layers=2, d_model=64, n_heads=2, n_kv_heads=2, ffn_hidden=256, vocab_size=128, seq_len=32
    )
    hybrid = Plan(dp=64, zero_shard=8, zero_stage=3)
    assert (hybrid.zero_dp, hybrid.zero_replicas) == (8, 8)
    assert model_state_bytes(1e9, hybrid.zero_dp, 3, "fp32") == (0.5e9, 0.5e9, 1e9)
    from tessera.planner.cost.rank_memory import memory_per_rank

    got = memory_per_rank(shape, hybrid, inflight_microbatches=1, precision="fp32")
    same = memory_per_rank(shape, Plan(dp=8, zero_stage=3), inflight_microbatches=1, precision="fp32")
    assert (got.params, got.grads, got.optimizer) == (same.params, same.grads, same.optimizer)


def test_tessera_memory_divides_by_the_shard_size() -> None:
    """The demo config's model state at dp 4 with shard groups of 2 is that of its Ψ over 2 ranks, by hand:
    ZeRO-3 keeps 4Ψ/2 parameters, 4Ψ/2 gradient shards and 8Ψ/2 moments per rank."""
    cfg = _demo(["parallel.zero=3", "parallel.zero_shard_size=2"])
    plan = resolve(cfg, 4, training=False)
    psi = sum(stage_params(ModelShape.from_config(cfg.model), cost_plan(plan), plan.stage_layers))
    bd = estimate(cfg, 4).breakdown
    assert (bd.params, bd.grads, bd.optimizer) == (4 * psi / 2, 4 * psi / 2, 8 * psi / 2)


def test_hybrid_traffic_moves_zero_to_the_shard_group_and_adds_the_replica_all_reduce() -> None:
    """Stages of 10 and 7 parameters in shard groups of 2: flat buffers padded to 10 and 8, shards of 5 and 4
    fp32 elements, so the replica all-reduce hands 4·(5 + 4) = 36 bytes; ZeRO's own bytes move unchanged."""
    data = {("reduce_scatter", "data"): 400.0, ("all_gather", "data"): 800.0}
    assert _hybrid_traffic(data, 2, {0: 10, 1: 7}) == {
        ("reduce_scatter", "data_shard"): 400.0,
        ("all_gather", "data_shard"): 800.0,
        ("all_reduce", "data_replicate"): 36,
    }
