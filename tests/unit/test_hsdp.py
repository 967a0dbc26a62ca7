"""Hybrid sharding (`parallel.zero_shard_size`) without ranks: validate's refusals, the groups' members, and the
memory and traffic figures, hand-computed. The runs themselves: tests/distributed/test_hsdp.py; the dry run against
the formulas: tests/unit/test_dryrun_formulas.py and test_peak_vs_dryrun.py."""

from __future__ import annotations

from dataclasses import replace

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
from tests.unit.test_search import FAST_VS_SIM_TOLERANCE  # the closed form within 1 % of the simulated step

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
    fp32 elements, so the replica all-reduce hands 4·(5 + 4) = 36 bytes (18 with a bf16 gradient reduction);
    ZeRO's own bytes move unchanged."""
    data = {("reduce_scatter", "data"): 400.0, ("all_gather", "data"): 800.0}
    assert _hybrid_traffic(data, 2, {0: 10, 1: 7}, 4) == {
        ("reduce_scatter", "data_shard"): 400.0,
        ("all_gather", "data_shard"): 800.0,
        ("all_reduce", "data_replicate"): 36,
    }
    assert _hybrid_traffic(data, 2, {0: 10, 1: 7}, 2)[("all_reduce", "data_replicate")] == 18


# --- the planner: hybrid sharding priced on the levelled network (tessera.planner) ------------------------------


def _a100():
    from tessera.planner.hardware import load_hardware

    return load_hardware("a100-80gb")


def test_the_replica_all_reduce_is_priced_by_hand() -> None:
    """dp 16 = 2 nodes × shard groups of 8: each rank all-reduces its 1/8 gradient shard with the one rank at its
    position on the other node. Ψ = 1e9 bf16 gradients (the published accounting): 2.5e8 bytes; a ring of 2
    members moves 2·(2−1)/2 = 1 × the buffer over the one NIC share per node, with 2 node-crossing hops of
    latency (the tree, 2 × the buffer at 90 %, is slower). tessera's autocast reduces the fp32 shard: twice the
    bytes, unless the gradient reduction is bf16."""
    from tessera.planner.cost import replica_reduce_time
    from tessera.planner.cost.collectives import group_placement

    hw = _a100()
    plan = Plan(dp=16, zero_stage=3, zero_shard=8, dtype="bf16")
    assert group_placement(hw, plan, "data_shard").intra_node  # ZeRO's collectives stay in the node
    replica = group_placement(hw, plan, "data_replicate")
    assert (replica.ranks, replica.nodes, replica.per_node) == (2, 2, 1)
    nic = min(hw.intra_node_bandwidth, hw.inter_node_bandwidth)
    by_hand = 2.5e8 / nic + 2 * hw.inter_node_latency
    assert replica_reduce_time(1e9, hw, plan) == pytest.approx(by_hand, rel=1e-12)
    fp32 = Plan(dp=16, zero_stage=3, zero_shard=8, dtype="bf16", autocast=True)
    assert replica_reduce_time(1e9, hw, fp32) == pytest.approx(2 * 2.5e8 / nic + 2 * hw.inter_node_latency)
    bf16 = replace(fp32, grad_reduce_bytes=2)  # train.grad_reduce_dtype = "bf16": a bf16 copy on the wire
    assert replica_reduce_time(1e9, hw, bf16) == pytest.approx(by_hand, rel=1e-12)
    assert replica_reduce_time(1e9, hw, Plan(dp=16, zero_stage=3)) == 0.0  # plain ZeRO: no replicas


def test_the_step_overlaps_the_replica_all_reduce_with_the_backward_in_both_step_models() -> None:
    """The fast closed form and the simulator agree on a hybrid plan of 8 one-block stages, and its data-parallel
    cost exceeds that of ZeRO-3 over the shard group alone by what the runtime leaves of the replica all-reduce
    (`ZeroStageComm`): each stage's launched at the next stage's reduction, so only the last two stages' (2/8 of
    it) run past the last compute and the other 6/8 only slow the compute under them (`hw.overlap_slowdown`);
    layered or depth-first alike, depth-first with several micro-batches too: the runtime runs them one at a
    time (each a sweep of the 8 stages), so a stage's last reduction is in the last sweep, the next stage's one
    backward before the end (priced in breadth-first order, stage j's all-reduce started 4j − 1 backwards
    before the end and 1/8 of it was exposed: 26 % less). ZeRO-1 with depth-first accumulation alike: its one
    reduce-scatter per stage runs at the stage's REDUCE, in the last sweep (it was held to ``finish``, with
    nearly all of the replica all-reduce exposed there)."""
    from tessera.planner.cost import replica_reduce_time
    from tessera.planner.cost.shape import ModelShape as Shape
    from tessera.planner.network import TESSERA_ORDER
    from tessera.planner.steptime import fast_step, params_per_rank, simulated_breakdown

    hw = _a100()
    shape = Shape(
        n_layers=8, d_model=2048, n_heads=16, n_kv_heads=16, ffn_hidden=8192, vocab_size=32000, seq_len=2048
    )
    common = {
        "micro_batch": 1,
        "virtual_stages": 8,
        "dtype": "bf16",
        "autocast": True,
        "rank_order": TESSERA_ORDER,
    }
    cases = (
        (3, 4, "layered"),
        (3, 1, "depth_first"),
        (3, 4, "depth_first"),
        (2, 4, "depth_first"),
        (1, 4, "depth_first"),
    )
    for zero, m, accumulation in cases:
        run = {**common, "zero_stage": zero, "n_microbatches": m, "accumulation": accumulation}
        hybrid, in_node = Plan(dp=16, zero_shard=8, **run), Plan(dp=8, **run)
        fast, sim = (
            fast_step(shape, hw, hybrid, "breadth_first"),
            simulated_breakdown(shape, hw, hybrid, "breadth_first"),
        )
        assert fast.dp_comm == pytest.approx(sim.dp_comm, rel=FAST_VS_SIM_TOLERANCE)
        replica = replica_reduce_time(params_per_rank(shape, hybrid, 0), hw, hybrid)
        extra = fast.dp_comm - fast_step(shape, hw, in_node, "breadth_first").dp_comm
        exposed, hidden = replica * 2 / 8, replica * 6 / 8
        assert extra == pytest.approx(exposed + hw.overlap_slowdown * hidden, rel=0.01), (zero, accumulation)


def test_the_search_tries_whole_node_shard_groups_beside_zero3() -> None:
    """On 32 A100s (4 nodes of 8) without tensor or pipeline parallelism the search prices ZeRO-3 over all 32
    ranks and, beside it, hybrid sharding over one node (s = 8, 4 replicas) and over two (s = 16, 2 replicas;
    s = 32 is plain ZeRO-3), as configs `tessera validate` accepts; no hybrid variant for ZeRO-1/2."""
    from tessera.planner.search import SearchSpace, search

    space = SearchSpace(
        tensor_1d=(1,), tensor_2d=(), pipeline=(1,), zero_stages=(2, 3), checkpointing=("full",)
    )
    found = search("gpt2-350m", 32, _a100(), global_batch=64, space=space).candidates
    hybrid = [c for c in found if c.plan.zero_replicas > 1]
    assert {(c.plan.zero_stage, c.plan.zero_dp, c.plan.zero_replicas) for c in hybrid} == {
        (3, 8, 4),
        (3, 16, 2),
    }
    assert any(c.plan.zero_stage == 3 and c.plan.zero_replicas == 1 for c in found)
    for c in hybrid[:3]:
        s = c.config.parallel.zero_shard_size
        assert f"hybrid {32 // s}×{s}" in c.label
        assert resolve(c.config, 32, training=False).zero_replicas == 32 // s


@pytest.mark.parametrize(
    ("tensor", "pipeline", "gpus", "shards"),
    [
        (1, 1, 512, [8, 16, 32, 64]),  # one node's 8 data ranks × 1, 2, 4, 8 nodes
        (2, 2, 512, [2, 4, 8, 16]),  # 2 data ranks per node
        (8, 1, 64, [2, 4]),  # a data rank fills a node: shard groups of 2, 4 nodes (s = 8 is d)
        (8, 2, 256, [2, 4, 8]),  # a data rank fills 2 nodes: s = 1 (no sharding) skipped, then 2, 4, 8
        (3, 1, 48, []),  # 3 ranks per data rank neither fill nor divide a node: no size tiles it
    ],
)
def test_the_search_tries_node_multiples_that_tile_whole_nodes(
    tensor: int, pipeline: int, gpus: int, shards: list[int]
) -> None:
    """`_hybrid_shards`: one node's data ranks × 1, 2, 4, 8 (`HYBRID_NODE_MULTIPLES`), each below and dividing
    d; every one of them tiles the layout's nodes (`Layout.shard_groups_straddling`)."""
    from tessera.planner.search import HYBRID_NODE_MULTIPLES, SearchSpace, _Ctx, _hybrid_shards

    assert HYBRID_NODE_MULTIPLES == 8
    hw = _a100()
    ctx = _Ctx(
        shape=None, hw=hw, space=SearchSpace(), limit=0, flops_token=0, peak_total=0, gpus=gpus, run=None
    )  # type: ignore[arg-type]
    dp = gpus // (tensor * pipeline)
    assert _hybrid_shards(ctx, tensor, pipeline, dp) == shards
    layout = Layout(dp=dp, pp=pipeline, tp=tensor)
    for s in shards:
        assert layout.shard_groups_straddling(s, hw.gpus_per_node) is None, s
    assert _hybrid_shards(replace(ctx, space=SearchSpace(hybrid_sharding=False)), tensor, pipeline, dp) == []


def test_skipping_smaller_shards_where_a_larger_did_not_fit_changes_no_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The search skips a hybrid shard size where plain ZeRO-3 or a larger shard of the same schedule, split
    and checkpointing did not fit (more model state per rank, the same activations). Priced one by one instead,
    llama-8b on 128 A100-40GB (shards 2 to 16 beside 1D t ≤ 2, p ≤ 2) gives the same counts and candidates, and
    the skip is taken (fewer layouts priced)."""
    from tessera.planner import search as search_module
    from tessera.planner.hardware import load_hardware

    hw = load_hardware("a100-40gb")
    space = search_module.SearchSpace(
        tensor_1d=(1, 2), tensor_2d=(), pipeline=(1, 2), zero_stages=(3,), sequence_parallel=(False,)
    )
    priced = 0
    evaluate = search_module._evaluate

    def counted(*args: object, **kwargs: object) -> object:
        nonlocal priced
        priced += 1
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(search_module, "_evaluate", counted)
    answers = {}
    for prune in (True, False):
        monkeypatch.setattr(search_module, "_PRUNE_SMALLER_SHARDS", prune)
        priced = 0
        r = search_module.search("llama-8b", 128, hw, 256, space=space)
        answers[prune] = (
            r.enumerated,
            r.rejected_memory,
            [(c.label, c.step_time) for c in r.candidates],
            priced,
        )
    assert answers[True][:3] == answers[False][:3]
    assert answers[False][1] > 0 and {c for c in answers[True][2] if "hybrid" in c[0]}  # rejections, hybrids
    assert answers[True][3] < answers[False][3] == answers[False][0]


def test_a_shard_group_of_two_nodes_is_priced_on_both_nodes_by_hand() -> None:
    """dp 64 with shard groups of 16 (MiCS's partition group of two 8-GPU nodes): ZeRO-3's all-gather ring holds
    16 ranks, 8 per node, so each node's 8 NICs carry its node-crossing traffic, min(NVLink, 8 × 25 GB/s); of its
    15 steps one crosses a node boundary (2 nodes: 15 · 1 // 15). Per step of Ψ = 1e9 bf16 parameters on one
    micro-batch: two all-gathers (forward, backward) and one reduce-scatter of 2e9 bytes, each (15/16)·2e9 / bw +
    14 NVLink hops + 1 network hop. The replica groups, 4 ranks 16 apart, one per node: one NIC each."""
    from tessera.planner.cost.collectives import group_placement
    from tessera.planner.cost.comm_time import dp_collective_times
    from tessera.planner.network import TESSERA_ORDER

    hw = _a100()
    plan = Plan(dp=64, zero_stage=3, zero_shard=16, dtype="bf16", rank_order=TESSERA_ORDER)
    shard = group_placement(hw, plan, "data_shard")
    assert (shard.ranks, shard.nodes, shard.per_node) == (16, 2, 8)
    replica = group_placement(hw, plan, "data_replicate")
    assert (replica.ranks, replica.nodes, replica.per_node) == (4, 4, 1)
    bw = min(hw.intra_node_bandwidth, 8 * hw.inter_node_bandwidth)
    one = 15 / 16 * 2e9 / bw + 14 * hw.intra_node_latency + 1 * hw.inter_node_latency
    reduce, gather = dp_collective_times(1e9, hw, plan)
    assert reduce == pytest.approx(one, rel=1e-12)
    assert gather == pytest.approx(2 * one, rel=1e-12)


# --- node placement: a shard group that straddles a node boundary --------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "shard", "straddles"),
    [
        (Layout(dp=24), 12, [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]),  # node 0 + half of 1, half + 2
        (Layout(dp=32), 16, None),  # two whole nodes each: MiCS's partition group, legitimate
        (Layout(dp=32), 4, None),  # half a node each
        (Layout(dp=16, tp=8), 2, None),  # one rank on each of two nodes, which every group of them shares
        (Layout(dp=12, tp=2), 6, [12, 14, 16, 18, 20, 22]),  # 6 data ranks × 2 tensor: 12 ranks, not a node
        (Layout(dp=12, pp=2), 4, None),  # 4 data ranks × 2 pipeline ranks = one node
    ],
)
def test_a_shard_group_straddles_when_it_shares_a_node_with_another(
    layout: Layout, shard: int, straddles: list[int] | None
) -> None:
    assert layout.shard_groups_straddling(shard, 8) == straddles


def test_the_straddling_warning_names_the_problem_and_the_sizes_that_tile_nodes() -> None:
    text = Layout(dp=24).shard_placement_warning(12, 8)
    assert text is not None
    for words in ("parallel.zero_shard_size = 12", "straddles nodes of 8 GPUs", "4 on node 1, 8 on node 2"):
        assert words in text, text
    assert text.endswith("one of [2, 4, 8, 24]")
    assert Layout(dp=32).shard_placement_warning(16, 8) is None


@pytest.mark.parametrize(("world", "shard", "warns"), [(24, 12, True), (24, 8, False), (32, 16, False)])
def test_build_groups_warns_once_on_rank_0_when_shard_groups_straddle_nodes(
    world: int, shard: int, warns: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At start-up the ranks per node are LOCAL_WORLD_SIZE (torchrun's, `tessera train --nproc`'s): 12 on 8-GPU
    nodes warns (a warning: the run is right, only slower), 8 and 16 (two whole nodes) do not; only rank 0
    says it. Built in a fake process group of the real world size (`tessera.fake`)."""
    import warnings

    from tessera.fake import fake_process_group
    from tessera.groups import build_groups

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for rank in (0, 1):
        with warnings.catch_warnings(record=True) as caught, fake_process_group(rank, world):
            warnings.simplefilter("always")
            groups = build_groups(Layout(dp=world), "cpu", zero_shard=shard)
            assert groups.shard is not None
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        said = [m for m in said if "zero_shard_size" in m]
        assert len(said) == (1 if warns and rank == 0 else 0), said


def test_tessera_memory_with_hardware_warns_of_a_straddling_shard_size(capsys: pytest.CaptureFixture) -> None:
    common = ["parallel.zero=3", "train.global_batch=192", "--hardware", "a100-80gb", "--world-size", "24"]
    assert main(["memory", DEMO, "parallel.data=24", "parallel.zero_shard_size=12", *common]) == 0
    assert "warning: parallel.zero_shard_size = 12 straddles nodes of 8 GPUs" in capsys.readouterr().out
    assert main(["memory", DEMO, "parallel.data=24", "parallel.zero_shard_size=8", *common]) == 0
    assert "straddles" not in capsys.readouterr().out


def test_the_simulator_runs_pipeline_free_depth_first_micro_batch_by_micro_batch_as_the_runtime() -> None:
    """A pipeline-free ZeRO run with depth-first accumulation and several micro-batches: the runtime runs one
    stage per block, micro-batch by micro-batch (`compute_options`: breadth-first with ``consecutive = 1``); the
    planner's simulator of the plan `trainer_plan` prices (the search's) runs the same actions in the same
    order, not breadth-first's (every micro-batch through a block before the next block)."""
    from tessera.config import from_dict
    from tessera.execution import resolve
    from tessera.planner.calibrate import trainer_plan
    from tessera.planner.cost.shape import ModelShape as Shape
    from tessera.planner.steptime import simulate_step

    model = {"family": "llama", "n_heads": 4, "d_model": 128, "vocab_size": 256, "seq_len": 64, "n_layers": 3}
    for parallel in ({"zero": 2}, {"zero": 3, "zero_shard_size": 2}):
        raw = {"model": model, "parallel": {**parallel, "accumulation": "depth_first"}}
        cfg = from_dict({**raw, "train": {"global_batch": 12, "micro_batch": 1}})
        world = 4
        execution = resolve(cfg, world, training=False)
        assert (execution.pp, execution.micro_batches) == (1, 3)
        runs = [(a.kind, a.stage, a.microbatch) for a in execution.lowered()[0] if a.kind.is_compute]
        plan, schedule = trainer_plan(cfg, world)
        _, sim = simulate_step(Shape.from_config(cfg.model), _a100(), plan, schedule)
        simulated = [(e.action.kind, e.action.stage, e.action.microbatch) for e in sim.timeline]
        simulated = [step for step in simulated if step[0].is_compute]
        assert simulated == runs, parallel
