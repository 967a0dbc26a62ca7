"""Uneven pipeline stages in the planner: the simulator against a hand-computed timeline, no silent rounding of
the layer count, the closed form close to the simulator, and the search's balanced splits."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.planner.cost import (
    ModelShape,
    Plan,
    embedding_time,
    layer_time,
    layers_per_stage,
    logits_time,
)
from tessera.planner.hardware import Hardware, load_hardware
from tessera.planner.search import SearchSpace, model_config, search
from tessera.planner.steptime import balanced_stage_layers, fast_step, simulate_step

REL = 1e-9
UNEVEN_FAST_VS_SIM = 0.05
"""The closed form prices uneven stages from per-rank work (m·max W + the rest/v); measured within ≈ 4 %."""

# Transfers free (infinite bandwidth, no latency) so the timeline is compute only.
FREE_LINKS = Hardware(
    name="free-links",
    peak_flops={"bf16": 100e12},
    memory_bytes=80e9,
    hbm_bandwidth=1e12,
    gpus_per_node=8,
    intra_node_bandwidth=1e30,
    intra_node_latency=0.0,
    inter_node_bandwidth=1e30,
    inter_node_latency=0.0,
)
GPT = ModelShape(
    n_layers=4, d_model=1024, n_heads=16, n_kv_heads=16, ffn_hidden=4096, vocab_size=32000, seq_len=1024
)


def test_uneven_1f1b_matches_the_hand_computed_timeline() -> None:
    plan = Plan(pp=2, n_microbatches=2, stage_layers=(1, 3), flash_attention=True)
    lt, emb = layer_time(GPT, FREE_LINKS, plan), embedding_time(GPT, FREE_LINKS, plan)[0]
    head = logits_time(GPT, FREE_LINKS, plan)
    f, b = lt.forward, lt.backward
    F0, B0 = f + emb.forward, b + emb.backward  # stage 0: one block + the embedding
    F1, B1 = 3 * f + head.forward, 3 * b + head.backward  # stage 1: three blocks + the output layer
    # rank 0: F(0) F(1) B(0) B(1); rank 1: F(0) B(0) F(1) B(1). Rank 1 is the bottleneck:
    # F(1) on rank 1 starts after its B(0) at F0 + F1 + B1; rank 0's B(1) waits for rank 1's B(1).
    b00_start = F0 + F1 + B1
    step = F0 + 2 * F1 + 2 * B1 + B0
    bd, sim = simulate_step(GPT, FREE_LINKS, plan, "1f1b")
    assert sim.step_time == pytest.approx(step, rel=REL)
    b00 = next(
        e for e in sim.timeline if e.rank == 0 and e.action.kind.value == "B" and e.action.microbatch == 0
    )
    assert (b00.start, b00.end) == pytest.approx((b00_start, b00_start + B0), rel=REL)
    assert bd.compute == pytest.approx(2 * (F1 + B1), rel=REL)  # the critical rank is the heavier one
    assert bd.step_time == pytest.approx(step + bd.optimizer, rel=REL)


def test_layers_that_do_not_divide_are_an_error_never_rounded() -> None:
    shape = dataclasses.replace(GPT, n_layers=70)
    plan = Plan(pp=12, n_microbatches=12)
    with pytest.raises(ValueError, match=r"70 layers do not split evenly .* stage_layers"):
        fast_step(shape, FREE_LINKS, plan, "1f1b")
    with pytest.raises(ValueError, match="do not split evenly"):
        simulate_step(shape, FREE_LINKS, plan, "1f1b")
    with pytest.raises(ValueError, match="must have p·v = 12"):
        layers_per_stage(shape, dataclasses.replace(plan, stage_layers=(6,) * 11))
    uneven = dataclasses.replace(plan, stage_layers=(5, *[6] * 10, 5))
    assert layers_per_stage(shape, uneven) == uneven.stage_layers
    assert simulate_step(shape, FREE_LINKS, uneven, "1f1b")[0].step_time > 0


@pytest.mark.parametrize(
    ("schedule", "v", "counts"),
    [
        ("1f1b", 1, (8, 11, 11, 11, 11, 10, 10, 8)),
        ("gpipe", 1, (18, 22, 22, 18)),
        ("interleaved", 2, (8, 11, 11, 10, 10, 11, 11, 8)),
        ("breadth_first", 2, (8, 11, 11, 10, 10, 11, 11, 8)),
    ],
)
def test_uneven_closed_form_is_close_to_the_simulator(schedule: str, v: int, counts: tuple[int, ...]) -> None:
    shape = ModelShape.from_config(model_config("llama-70b")[1])
    assert sum(counts) == shape.n_layers == 80
    p = len(counts) // v
    plan = Plan(
        dp=2,
        pp=p,
        tp=8,
        virtual_stages=v,
        n_microbatches=8,
        recompute="selective",
        flash_attention=True,
        stage_layers=counts,
        accumulation="layered" if schedule == "breadth_first" else "depth_first",
    )
    hw = load_hardware("a100-80gb")
    fast, (simulated, _) = fast_step(shape, hw, plan, schedule), simulate_step(shape, hw, plan, schedule)
    assert fast.step_time == pytest.approx(simulated.step_time, rel=UNEVEN_FAST_VS_SIM)


def test_balanced_split_lightens_the_end_stages() -> None:
    assert balanced_stage_layers(70, 1, 0.5, 2.0) == (70,)
    # no extras: target 70/12 ≈ 5.83 → ends round to 6, the middle ten share 58
    assert balanced_stage_layers(70, 12, 0.0, 0.0) == (6, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5, 6)
    # target (70 + 0.4 + 2.6)/12 ≈ 6.08: first round(5.68) = 6, last round(3.48) = 3, the middle ten share 61
    assert balanced_stage_layers(70, 12, 0.4, 2.6) == (6, 7, 6, 6, 6, 6, 6, 6, 6, 6, 6, 3)
    assert balanced_stage_layers(10, 2, 0.0, 2.0) == (6, 4)


def test_search_offers_uneven_stages_when_the_layers_do_not_divide() -> None:
    # one checkpointing mode and micro-batches up to 2: a search of ~1,400 layouts instead of ~12,000, the same
    # question (uneven splits are offered for every mode and micro-batch alike)
    space = SearchSpace(uneven_pipelines=True, checkpointing=("full",), max_micro_batch=2)
    res = search("llama-8b", 24, load_hardware("a100-80gb"), 48, space=space, keep=10**9)  # 32 layers: p = 3
    uneven = [c for c in res.candidates if c.plan.pp == 3]
    assert uneven and all(c.plan.stage_layers is not None and sum(c.plan.stage_layers) == 32 for c in uneven)
    assert all(c.schedule in ("1f1b", "gpipe") for c in uneven)
    plain_space = dataclasses.replace(space, uneven_pipelines=False)
    plain = search("llama-8b", 24, load_hardware("a100-80gb"), 48, space=plain_space, keep=10**9)
    assert not [c for c in plain.candidates if c.plan.pp == 3]  # opt-in only


def test_search_falls_back_to_uneven_stages_only_when_no_even_layout_fits() -> None:
    hw = load_hardware("a100-80gb")
    space = SearchSpace(checkpointing=("full",), max_micro_batch=2)
    # 7 GPUs, 64 sequences, 32 layers: no data size (7 ∤ 64), tensor size or even pipeline takes the 7
    res = search("llama-8b", 7, hw, 64, space=space, keep=10**9)
    assert res.uneven_fallback and res.candidates
    assert all(c.plan.pp == 7 and sum(c.plan.stage_layers) == 32 for c in res.candidates)
    never = search("llama-8b", 7, hw, 64, space=dataclasses.replace(space, uneven_pipelines=False))
    assert not never.uneven_fallback and never.enumerated == 0 and "no valid layout" in never.no_fit_message()
    # where a layout with p | L fits, the default tries no other pipeline size (its balanced splits of a p | L
    # pipeline stay: they shift blocks off the embedding's and the head's stages)
    even = search("llama-8b", 8, hw, 64, space=space, keep=10**9)
    assert not even.uneven_fallback and even.candidates and all(32 % c.plan.pp == 0 for c in even.candidates)


def test_no_fit_message_names_the_savings_it_searched() -> None:
    res = search("llama-405b", 8, load_hardware("a100-40gb"), 8)  # 405B does not fit in 8 × 40 GB
    assert not res.candidates
    assert "even with ZeRO-3, full checkpointing and uneven pipelines (searched)" in res.no_fit_message()
    one = search("llama-405b", 1, load_hardware("a100-40gb"), 1)
    assert "even with full checkpointing (searched)" in one.no_fit_message()  # no ZeRO-3 on one GPU


def test_an_uneven_plan_is_written_as_a_valid_config(tmp_path) -> None:
    from tessera.config import load_config
    from tessera.planner.report import write_config

    space = SearchSpace(pipeline=(3,), uneven_pipelines=True)
    res = search("llama-8b", 24, load_hardware("a100-80gb"), 48, space=space)
    best = res.best
    assert best.plan.stage_layers is not None
    cfg = load_config(write_config(res, best, tmp_path / "uneven.toml"))  # write_config validates it too
    assert list(cfg.parallel.stage_layers) == list(best.plan.stage_layers)


def test_trainer_prediction_honours_stage_layers() -> None:
    from tessera.config import from_dict
    from tessera.planner.calibrate import predict_trainer_step, trainer_plan

    cfg = from_dict(
        {
            "model": {"size": "gpt2-mini"},
            "parallel": {"pipeline": 2, "stage_layers": [1, 3]},
            "train": {"global_batch": 4, "micro_batch": 1},
        }
    )
    plan, schedule = trainer_plan(cfg, 2)
    assert plan.stage_layers == (1, 3) and schedule == "1f1b"
    hw = load_hardware("a100-80gb")
    even = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, stage_layers=None))
    # the heavier second stage makes the uneven split slower than the even one
    assert predict_trainer_step(cfg, 2, hw).step_time > predict_trainer_step(even, 2, hw).step_time


def test_memory_and_parameters_follow_the_actual_stage_split() -> None:
    """Uneven stages (1, 3) on p = 2: rank 1 holds 3 blocks, not L/p = 2 — its parameters, stored activations
    and (through `most_params`) the data-parallel and optimizer pricing use the split."""
    from tessera.planner.cost import activation_bytes_per_layer, memory_per_rank, params_per_rank, rank_layers
    from tessera.planner.steptime import most_params

    plan = Plan(pp=2, dp=4, n_microbatches=2, stage_layers=(1, 3), flash_attention=True)
    assert [rank_layers(GPT, plan, r) for r in (0, 1)] == [1.0, 3.0]
    h, V = GPT.d_model, GPT.vocab_size
    assert params_per_rank(GPT, plan, 1) == 3 * GPT.layer_params() + 2 * h + V * h  # final norm + head copy
    assert params_per_rank(GPT, plan, 0) == GPT.layer_params() + V * h + GPT.seq_len * h
    mem = memory_per_rank(GPT, plan, inflight_microbatches=1, stage=1)
    assert mem.activations == pytest.approx(3 * activation_bytes_per_layer(GPT, plan), rel=REL)
    assert most_params(GPT, plan) == params_per_rank(GPT, plan, 1)
    even = dataclasses.replace(plan, stage_layers=None)
    assert rank_layers(GPT, even, 1) == 2.0
