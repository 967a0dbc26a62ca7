"""tessera.traffic, the one source of tensor-parallel traffic: the planner prices exactly the bytes the runtime
moves (the planner's priced bytes against a dry run's byte counters, in-process), and the published per-layer
volumes the cost model keeps for the papers relate to it as their docstrings say."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessera.config import from_dict
from tessera.dryrun import _scalar_traffic, dry_run, measured_by_axis
from tessera.execution import resolve
from tessera.memory import cost_plan
from tessera.planner.cost import (
    ModelShape,
    Plan,
    embedding_time,
    logits_time,
    pp_p2p_volume,
    tp1d_layer_volume,
    tp2d_layer_volume,
    tp_comm_time_per_layer,
)
from tessera.planner.cost import collectives as cost_collectives
from tessera.planner.cost.volume import volume_of
from tessera.planner.hardware import load_hardware
from tessera.traffic import FORWARD, tensor_calls

LAYOUTS = {
    # 1D with sequence parallelism: re-gathers, replicated vectors' gradients, the loss's all-reduces
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}),
    # 1D with full checkpointing: the replayed forward without the block's last exit (traffic.replayed_1d)
    "tp2_full": (2, {"tensor": 2, "checkpointing": "full"}),
    # 2D with full checkpointing: SUMMA blocks, norm statistics, the vocabulary SUMMA, the replayed forward
    "tp2x2_full": (4, {"tensor": "2x2", "checkpointing": "full"}),
    # Gemma 2 with full checkpointing: its post-norm saves the MLP exit's output, so the replay issues that exit
    # too (traffic.replays_mlp_exit), without and with SP
    "gemma2_tp2_full": (2, {"tensor": 2, "checkpointing": "full"}),
    "gemma2_tp2_sp_full": (2, {"tensor": 2, "sequence_parallel": True, "checkpointing": "full"}),
    # ... and on the grid: the replay runs the MLP output Linear's SUMMA there, not for Llama (tp2x2_full)
    "gemma2_tp2x2_full": (4, {"tensor": "2x2", "checkpointing": "full"}),
}
MODELS = {
    name: "gemma2-tiny" for name in ("gemma2_tp2_full", "gemma2_tp2_sp_full", "gemma2_tp2x2_full")
}  # others: llama-tiny


def _planner_bytes(cfg, world: int, kind: str, monkeypatch: pytest.MonkeyPatch) -> float:
    """Bytes of ``kind`` the planner prices for one step of rank 0 (one stage holding every block): every
    collective's seconds replaced by its bytes if it is of ``kind``, else 0."""
    plan, shape, hw = cost_plan(resolve(cfg, world)), ModelShape.from_config(cfg.model), load_hardware("h100")
    prices: dict[str, str | None] = {"kind": None}
    monkeypatch.setattr(
        cost_collectives,
        "collective_time",
        lambda hw, k, nbytes, where: nbytes if k == prices["kind"] else 0.0,
    )
    head_compute = logits_time(shape, hw, plan)  # compute only
    prices["kind"] = kind
    tp, emb, head = (
        tp_comm_time_per_layer(shape, hw, plan),
        embedding_time(shape, hw, plan)[1],
        logits_time(shape, hw, plan),
    )
    block = tp.forward + tp.backward + tp.recompute
    ends = (
        emb.forward
        + emb.backward
        + head.forward
        + head.backward
        - head_compute.forward
        - head_compute.backward
    )
    return plan.n_microbatches * (shape.n_layers * block + ends)


@pytest.mark.parametrize(
    "dtype", ["fp32", "bf16"]
)  # bf16: fp32 entries and norm statistics, bf16 exits and SUMMA
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_prices_the_runtime_bytes(name: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    world, parallel = LAYOUTS[name]
    raw = {
        "model": {"size": MODELS.get(name, "llama-tiny")},
        "parallel": parallel,
        "train": {"global_batch": 4, "micro_batch": 2, "dtype": dtype},
    }
    cfg = from_dict(raw)
    measured = {k: b for (k, axis), b in measured_by_axis(dry_run(cfg, world, 0)).items() if axis == "tensor"}
    # the step's gradient-norm scalars are not a micro-batch's traffic
    measured["all_reduce"] -= _scalar_traffic(cost_plan(resolve(cfg, world)))[("all_reduce", "tensor")]
    priced = {kind: _planner_bytes(cfg, world, kind, monkeypatch) for kind in measured}
    assert priced == pytest.approx(measured, rel=1e-12)


def _gpt(h: int = 16) -> ModelShape:
    return ModelShape(
        n_layers=1, d_model=h, n_heads=4, n_kv_heads=4, ffn_hidden=4 * h, vocab_size=50, seq_len=8
    )


def test_published_1d_volume_and_the_runtime_traffic() -> None:
    shape, plan = _gpt(), Plan(tp=4, micro_batch=2, dtype="bf16")
    x = 2 * 8 * 16 * 2  # one hidden state b·s·h in bf16
    assert volume_of(tensor_calls(shape, plan, "block")) == tp1d_layer_volume(shape, plan)
    sp = replace(plan, sequence_parallel=True)
    exact, published = volume_of(tensor_calls(shape, sp, "block")), tp1d_layer_volume(shape, sp)
    assert (
        exact.all_gather == published.all_gather + 2 * x
    )  # backward re-gathers the attention and MLP inputs
    assert exact.reduce_scatter == published.reduce_scatter
    assert (
        exact.all_reduce == 6 * 16 * 4
    )  # GPT's two LayerNorms (weight, bias) and two row-parallel biases, fp32
    full = replace(plan, recompute="full")
    replay = volume_of(tensor_calls(shape, full, "replay"))
    published_replay = tp1d_layer_volume(shape, full).all_reduce - tp1d_layer_volume(shape, plan).all_reduce
    assert replay.all_reduce == published_replay - x  # the runtime never replays the block's last exit


def test_published_2d_volume_and_the_runtime_traffic() -> None:
    shape = replace(_gpt(h=32), family="llama", swiglu=True, ffn_hidden=96)  # no biases
    q, b = 2, 4
    plan = Plan(tp=q * q, tp_kind="2d", micro_batch=b, dtype="bf16")
    exact, published = volume_of(tensor_calls(shape, plan, "block")), tp2d_layer_volume(shape, plan)
    act = b * 8 / q * (32 // q) * 2  # one activation block m × h/q
    # the published form fuses QKV and gate+up; the runtime's q, k, v and gate, up are separate Linears reading the
    # same input: three more activation-side SUMMA terms (weights are the same blocks either way)
    assert exact.broadcast == published.broadcast + 3 * (2 * q * act)
    assert exact.reduce == published.reduce + 3 * (q * act)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_2d_replay_drops_the_mlp_exits_summa_unless_a_post_norm_saves_it(family: str) -> None:
    """Full recomputation on the grid replays the block's forward collectives but the MLP output Linear's two
    SUMMA broadcasts (checkpointing.save_early saves its operands before them); Gemma 2's post-norm saves that Linear's
    output, so its replay keeps them. Hand-computed: q = 2, b = 4, s = 8 (m = 16 local tokens), h 32, f 96, bf16."""
    shape = replace(_gpt(h=32), family=family, swiglu=True, ffn_hidden=96)
    plan = Plan(tp=4, tp_kind="2d", micro_batch=4, dtype="bf16", recompute="full")
    forward = volume_of([c for c in tensor_calls(shape, plan, "block") if c.phase == FORWARD])
    replay = volume_of(tensor_calls(shape, plan, "replay"))
    activations, weights = (
        2 * 16 * (96 // 2) * 2,
        2 * (96 // 2) * (32 // 2) * 2,
    )  # q blocks each, row / column
    dropped = 0 if family == "gemma2" else activations + weights
    assert forward.broadcast - replay.broadcast == dropped
    assert (replay.all_reduce, replay.reduce) == (forward.all_reduce, forward.reduce)


def test_parts_are_named() -> None:
    with pytest.raises(ValueError, match="part must be one of"):
        tensor_calls(_gpt(), Plan(tp=2), "loss")


def test_autocast_moves_fp32_boundaries_and_entries_and_bf16_exits() -> None:
    """Under tessera's autocast the residual stream is fp32: the pipeline sends it in fp32 and a 1D entry's
    backward all-reduces its fp32 gradient, while an exit all-reduces a bf16 Linear output; the published
    accounting (Megatron: bf16 everywhere) keeps 2 bytes for all of them."""
    shape, published = _gpt(), Plan(tp=4, pp=2, micro_batch=2, dtype="bf16")
    tessera = replace(published, autocast=True)
    x = 2 * 8 * 16  # one hidden state b·s·h, elements
    assert pp_p2p_volume(shape, published, 0).send == 2 * x
    assert pp_p2p_volume(shape, tessera, 0).send == 4 * x
    by_phase = {(c.phase, c.nbytes) for c in tensor_calls(shape, tessera, "block")}
    assert by_phase == {("forward", 2 * x), ("backward", 4 * x)}
    assert {c.nbytes for c in tensor_calls(shape, published, "block")} == {2 * x}
