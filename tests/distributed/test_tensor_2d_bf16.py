"""Optimus 2D (2×2, 4 gloo ranks) under bf16 autocast against the single-device bf16 reference.

Both runs are what ``train.dtype = "bf16"`` builds (`make_stepper` from the config: fp32 master weights,
`precision.autocast` over the step): the default layered accumulation (the schedule runtime, one autocast region per
step whose bf16 weight copies the micro-batches share) and depth_first (the direct loop, a region per micro-batch).
The 2D run's loss on every rank and every gradient, reassembled to full shape (``full_parameters``), are compared
with the plain model's on the same micro-batches (GPT: tied, biases, LayerNorm; Llama: GQA, RoPE, SwiGLU).

The bound. bf16 keeps 8 significant bits: rounding to nearest has relative error ≤ u = 2^-8. Both runs cast the
same fp32 weights and (as long as they agree) the same activations to bf16, and round every product's output to
bf16; they differ in how a product C = Σ_t P_t is formed. One device rounds the whole k-deep product once
(≤ u·|C|). SUMMA sums q partial products P_t of k/q-deep blocks, rounded to bf16 on the way: the forward (AB)
accumulates the running sum in bf16 (q roundings), ABᵀ and AᵀB (backward, logits, weight gradients) round each
P_t and reduce them in bf16 across the grid (q + 1 roundings). With q = 2 the two runs' products of equal inputs
thus differ by at most (q + 1)·u·Σ_t|P_t| = 3u relative to the product (Σ_t|P_t| = |C| unless the partials
cancel; 2D adds a bias in fp32 after the product, one device inside its bf16 linear: one rounding fewer). A
weight gradient is such a product (AᵀB of the input activation and the output gradient) whose inputs carry the
differences of every product before them, forward and backward; but it sums over the b·s tokens, whose
independent rounding differences mostly cancel, so the upstream products add about u in all, not 3u each (the
first block's gradients differ no more than the last block's). Prediction: ≤ 3u + ~1u = 4u of the tensor's
largest reference entry; the bound takes a factor 2 over it: GRAD_BOUND = 8u. A bias's gradient is the token sum of
the output gradient whose product with the O(1) normalised input is its weight's gradient, so its rounding noise
scales with that weight's gradient: its scale is the larger of the two maxima. That matters for GPT's key bias,
analytically zero (softmax ignores a per-query constant), whose bf16 gradient is pure rounding noise in both runs.
The loss: the mean cross-entropy moves by at most 2·max|Δz| (its gradient in the logits z has 1-norm ≤ 2), and the
logits are one more product, so |Δloss| ≤ 2·GRAD_BOUND·max|z|: a worst case, loose because the mean over tokens
averages the differences out; the gradients carry the sharp check.

Measured on this machine (one step of 2 micro-batches of 4 × 16 tokens): gradients differ by at most 2.2u of
their scale for GPT and 2.6u for Llama (every tensor 0.3-2.6u; the key bias 0.9u), 3× under the bound, and by
at most 2.6u over 4 more seeds; the loss by ≤ 4e-5 (≤ 7e-5 over the seeds), against a bound of ~5e-2. Both
accumulations give identical numbers. A bf16-only bug breaks it: caching weight casts by shape (same-shaped
blocks sharing one bf16 copy; fp32 never caches) moves the gradients by 100-800u, though the loss only by 1.5e-3.

What this comparison cannot see: a single-device fp32 run is within 2-3.3u of the bf16 reference too (bf16's own
rounding moves results as far as SUMMA's re-rounding does), so a 2D run that ignored autocast would pass it. The
SUMMA byte counts show that the blocks did travel (and were multiplied) in bf16; a transposed weight block, SUMMA's
typical wrong-orientation bug, must break the bound.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from tessera import comm
from tessera.config import Config, from_dict
from tessera.groups import Groups, build_groups
from tessera.layout import Layout
from tessera.model.build import build_model
from tessera.parallel.apply import parallelize
from tessera.parallel.model_2d import comm_bytes_2d
from tessera.train.steppers import make_stepper
from tests.harness import run_distributed

U = 2.0**-8
"""bf16's unit roundoff (8 significant bits, round to nearest)."""
GRAD_BOUND = 8 * U
"""Elementwise gradient bound, relative to the tensor's scale (module docstring: 2 × the predicted 4u)."""
SUMMA_KINDS = ("broadcast", "reduce")
"""The SUMMA products' collectives: their blocks are the bf16 operands (the embedding's and norms' stay fp32)."""
CORRUPT = "blocks.0.attn.wv.weight"
"""The weight whose block the negative control transposes (both families have it)."""
Q, MICRO_BATCH, M, SEQ = 2, 4, 2, 16
SEED, DATA_SEED = 0, 1
# d_model 32, 4 heads, 2 blocks; GPT tied with biases, Llama untied with 2 KV heads
FAMILIES = {"gpt": "gpt2-tiny", "llama": "llama-tiny"}
ACCUMULATIONS = ("layered", "depth_first")
CASES = [(family, acc) for family in FAMILIES for acc in ACCUMULATIONS]

Grads = dict[str, torch.Tensor]


def _config(family: str, accumulation: str, tensor: str, dtype: str) -> Config:
    return from_dict(
        {
            "model": {"size": FAMILIES[family], "seq_len": SEQ},
            "parallel": {"tensor": tensor, "accumulation": accumulation},
            "train": {"global_batch": M * MICRO_BATCH, "micro_batch": MICRO_BATCH, "dtype": dtype},
        }
    )


def _batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """M micro-batches (tokens, targets), each [MICRO_BATCH, SEQ]: the same on every rank and the reference."""
    g = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, vocab, (M * MICRO_BATCH, SEQ + 1), generator=g)
    return list(zip(tokens[:, :-1].split(MICRO_BATCH), tokens[:, 1:].split(MICRO_BATCH), strict=True))


def _step(
    cfg: Config, layout: Layout, groups: Groups | None, corrupt: str | None = None
) -> tuple[float, Grads, dict[tuple[str, str], int]]:
    """One step's loss, full gradients and collective bytes by (kind, group name), the model built and run as the
    trainer does; ``corrupt`` names a weight whose top-left block (1/q of each side) is transposed first."""
    torch.manual_seed(SEED)
    model = parallelize(build_model(cfg.model), layout, groups, cfg)
    if corrupt is not None:
        with torch.no_grad():
            w = model.get_parameter(corrupt)
            n = min(w.shape) // Q
            w[:n, :n] = w[:n, :n].t().clone()
    stepper = make_stepper(model, cfg, layout, groups)
    comm.STATS.reset()
    loss = stepper.run(_batches(cfg.model.vocab_size))
    sent = dict(comm.STATS.bytes)
    stepper.close()
    if hasattr(model, "full_parameters"):  # the 2D model: collective over the grid
        return loss, model.full_parameters(grad=True), sent
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}, sent


def _run_2d(rank: int, world: int) -> dict[tuple[str, str], dict]:
    """Every case on this rank: its loss, its SUMMA bytes by (kind, "row" | "col") and (last rank, a grid corner
    other than P_00) the full gradients."""
    layout = Layout(q=Q)
    groups = build_groups(layout)
    names = {comm.group_name(groups.same_row): "row", comm.group_name(groups.same_col): "col"}
    out = {}
    for family, acc in CASES:
        loss, grads, sent = _step(_config(family, acc, f"{Q}x{Q}", "bf16"), layout, groups)
        summa = {(k, names[g]): b for (k, g), b in sent.items() if k in SUMMA_KINDS and g in names}
        out[(family, acc)] = {"loss": loss, "summa": summa, "grads": grads if rank == world - 1 else None}
    return out


@cache
def _reference(family: str, accumulation: str, dtype: str, corrupt: str | None = None) -> tuple[float, Grads]:
    loss, grads, _ = _step(_config(family, accumulation, "1", dtype), Layout(), None, corrupt)
    return loss, grads


@cache
def _max_logit(family: str) -> float:
    """Largest |logit| of the reference model on the step's tokens (the loss bound's scale)."""
    cfg = _config(family, "layered", "1", "fp32")
    torch.manual_seed(SEED)
    model = build_model(cfg.model)
    with torch.no_grad():
        return max(model(x).abs().max().item() for x, _ in _batches(cfg.model.vocab_size))


def _scale(name: str, ref: Grads) -> float:
    """The tensor's largest reference entry; a bias's is at least its weight's (module docstring)."""
    scale = ref[name].abs().max().item()
    weight = name.removesuffix(".bias") + ".weight"
    if name.endswith(".bias") and weight in ref:
        scale = max(scale, ref[weight].abs().max().item())
    return scale


def _errors(got: Grads, ref: Grads) -> dict[str, float]:
    """Each gradient's max |got − ref| in units of its scale."""
    assert got.keys() == ref.keys(), sorted(got.keys() ^ ref.keys())
    for name, g in got.items():
        assert g.shape == ref[name].shape, name
    return {name: (g - ref[name]).abs().max().item() / _scale(name, ref) for name, g in got.items()}


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[str, str], dict]]:
    """One 4-rank launch for every case (starting ranks costs more than these steps)."""
    return run_distributed(_run_2d, Q * Q, timeout=120)


@pytest.mark.parametrize(("family", "acc"), CASES)
def test_tp2x2_bf16_matches_single_device_bf16(results: list[dict], family: str, acc: str) -> None:
    """Loss on every rank and every gradient within the derived bf16 bound of the single-device bf16 run."""
    ref_loss, ref_grads = _reference(family, acc, "bf16")
    errors = _errors(results[-1][(family, acc)]["grads"], ref_grads)
    worst = max(errors, key=errors.get)
    print(
        f"{family}/{acc}: max |Δgrad| {errors[worst] / U:.2f}u of scale ({worst}); bound {GRAD_BOUND / U:.0f}u"
    )
    loss_tol = 2 * GRAD_BOUND * _max_logit(family)
    loss_errors = [abs(r[(family, acc)]["loss"] - ref_loss) for r in results]  # every rank reports the loss
    print(f"  max |Δloss| over ranks {max(loss_errors):.2e} (bound {loss_tol:.2e})")
    assert max(loss_errors) <= loss_tol, (
        f"loss per rank {[r[(family, acc)]['loss'] for r in results]} vs {ref_loss}"
    )
    over = {n: f"{e / U:.2f}u" for n, e in errors.items() if e > GRAD_BOUND}
    assert not over, f"{family}/{acc}: gradients beyond {GRAD_BOUND / U:.0f}u of their scale: {over}"


@pytest.mark.parametrize(("family", "acc"), CASES)
def test_tp2x2_bf16_summa_moves_bf16_blocks(results: list[dict], family: str, acc: str) -> None:
    """The 2D run's products ran in bf16, so the comparison above is bf16 against bf16 (an fp32 run would pass it
    too): every rank's SUMMA broadcasts and reductions carry 2-byte elements, M micro-batches' worth of
    ``comm_bytes_2d`` at elem = 2 — half the fp32 bytes."""
    cfg = _config(family, acc, f"{Q}x{Q}", "bf16").model
    per_micro = comm_bytes_2d(cfg, MICRO_BATCH, SEQ, Q, elem=2)
    want = {key: M * b for key, b in per_micro.items() if key[0] in SUMMA_KINDS}
    for rank, r in enumerate(results):
        assert r[(family, acc)]["summa"] == want, f"rank {rank}"


@pytest.mark.parametrize("family", FAMILIES)
def test_bound_rejects_a_transposed_weight_block(results: list[dict], family: str) -> None:
    """The negative control: against a reference whose one weight has a transposed block (what SUMMA computes when
    it takes a block in the wrong orientation), the same comparison exceeds the bound."""
    errors = _errors(
        results[-1][(family, "layered")]["grads"], _reference(family, "layered", "bf16", CORRUPT)[1]
    )
    print(f"{family}: transposed {CORRUPT} block: max |Δgrad| {max(errors.values()) / U:.0f}u of scale")
    assert max(errors.values()) > GRAD_BOUND
