"""Optimus 2D tensor parallelism against the single-device reference: loss, every gradient, comm bytes, memory.

Layout matrix: tp2x2 (4 ranks), tp3x3 (9 ranks, slow), dp2_tp2x2 (8 ranks); GPT (tied, learned positions, GELU,
biases) and Llama (GQA with n_kv_heads < n_heads, RoPE, SwiGLU, untied head); a vocabulary (257) that q does not
divide. The reference is the plain model on one process with the same seed and the full global batch.
"""

from __future__ import annotations

import pytest
import torch

from tessera import comm
from tessera.config import ModelConfig
from tessera.groups import build_groups
from tessera.layout import Axis, Layout
from tessera.model.build import build_model
from tessera.parallel.data import GradSync
from tessera.parallel.layers_2d import shard_block
from tessera.parallel.model_2d import apply_tensor_2d, comm_bytes_2d
from tessera.parallel.precision import autocast
from tessera.parallel.tensor_2d import Grid2D, matmul_ab_2d, matmul_abt_2d, matmul_atb_2d
from tests.harness import run_distributed

# fp32 on CPU: SUMMA sums the same products in a different order (q partial GEMMs, reductions), so results agree
# to rounding. Gradients are compared per tensor relative to that tensor's largest reference entry.
LOSS_RTOL = 1e-5
GRAD_TOL_REL_MAX = 1e-5
GRAD_ATOL = 1e-9  # floor for gradients that are exactly 0 in theory (key biases: softmax ignores them)
GRAD_NORM_RTOL = 1e-5
OPS_TOL = 1e-12  # SUMMA ops alone in float64 on O(1) entries: sums of ≤ 15 products, rounding ~1e-15
SEED = 1234
SEQ = 8

# Qwen3: Llama with per-head q/k norms (whole on every grid rank); untied, vocabulary 257 padded to 258
QWEN3_V257 = dict(
    family="qwen3",
    d_model=16,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=32,
    vocab_size=257,
    seq_len=SEQ,
    n_layers=2,
    tie_embeddings=False,
)

MODELS = {
    "gpt": dict(family="gpt", d_model=24, n_heads=4, vocab_size=64, seq_len=SEQ, n_layers=2),
    "llama": dict(
        family="llama",
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=48,
        vocab_size=64,
        seq_len=SEQ,
        n_layers=2,
        tie_embeddings=False,
    ),
    "gpt_v257": dict(family="gpt", d_model=24, n_heads=4, vocab_size=257, seq_len=SEQ, n_layers=1),
    "llama_v257": dict(
        family="llama",
        d_model=16,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=32,
        vocab_size=257,
        seq_len=SEQ,
        n_layers=1,
    ),
    # Qwen2: Llama with q/k/v biases; vocabulary 257 padded to 258, tied
    "qwen2_v257": dict(
        family="qwen2",
        d_model=16,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=32,
        vocab_size=257,
        seq_len=SEQ,
        n_layers=2,
    ),
    "qwen3_v257": QWEN3_V257,
    # head_dim 8 ≠ 16 / 4 (Qwen3-0.6B's kind of shape): the attention 32 wide, wq/wk/wv/wo SUMMA blocks of it
    "qwen3_hd8_v257": dict(QWEN3_V257, head_dim=8),
    # Gemma 2: four (1 + w) norms per block, scaled embedding, GeGLU, soft-caps that bite (weights at std 0.3:
    # scores and logits of order one), query_pre_attn_scalar ≠ head_dim 8 ≠ 16 / 4; tied, vocabulary 257
    "gemma2_v257": dict(
        QWEN3_V257,
        family="gemma2",
        head_dim=8,
        tie_embeddings=True,
        query_pre_attn_scalar=12,
        attn_softcap=1.5,
        final_softcap=2.0,
        init_std=0.3,
    ),
    # Gemma 3: Gemma 2's block plus per-head (1 + w) q/k norms, layer 0 local (window 3 < SEQ, RoPE base 10), layer
    # 1 global; scalar ≠ head_dim 8 ≠ 16 / 4, no caps (Gemma 3's default); untied, vocabulary 257
    "gemma3_v257": dict(
        QWEN3_V257,
        family="gemma3",
        head_dim=8,
        tie_embeddings=False,
        query_pre_attn_scalar=12,
        sliding_window=3,
        sliding_window_pattern=2,
        rope_local_theta=10.0,
        init_std=0.3,
    ),
    # q = 3: heads, KV heads, hidden and MLP width divisible by 3; vocabulary 64 is padded to 66
    "gpt_q3": dict(family="gpt", d_model=36, n_heads=6, vocab_size=64, seq_len=SEQ, n_layers=1),
    "llama_q3": dict(
        family="llama",
        d_model=36,
        n_heads=6,
        n_kv_heads=3,
        ffn_hidden=36,
        vocab_size=64,
        seq_len=SEQ,
        n_layers=1,
    ),
}

LAYOUTS = {"tp2x2": Layout(q=2), "tp3x3": Layout(q=3), "dp2_tp2x2": Layout(dp=2, q=2)}
MICRO_BATCH = {"tp2x2": 4, "tp3x3": 3, "dp2_tp2x2": 2}  # per data-parallel rank; divisible by q


def _data(cfg: ModelConfig, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]  # [B, s] each


def _model(cfg: ModelConfig):
    torch.manual_seed(SEED)
    return build_model(cfg)


def _reference(cfg: ModelConfig, batch: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = _model(cfg)
    tokens, targets = _data(cfg, batch)
    loss = model(tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker_2d(
    rank: int, world: int, model_names: list[str], layout_name: str, saved_families: list[str]
) -> dict[str, list]:
    """One launch per layout: every model's run, plus (tp2x2) the saved-activation measurement."""
    groups = build_groups(LAYOUTS[layout_name])
    runs = [_run_one(rank, world, groups, name, layout_name) for name in model_names]
    saved = [_saved_bytes_2d(groups, family) for family in saved_families]
    casts = _weight_casts_2d(groups) if layout_name == "tp2x2" else None
    return {
        "runs": runs,
        "saved": saved,
        "ops": _summa_ops_errors(Grid2D.from_groups(groups)),
        "casts": casts,
    }


def _summa_ops_errors(grid: Grid2D) -> dict[str, float]:
    """Each SUMMA op and its gradients against the full float64 product, on non-square blocks."""
    g = torch.Generator().manual_seed(SEED)
    M, K, N = 4 * grid.q, 3 * grid.q, 5 * grid.q
    shapes = {"ab": ((M, K), (K, N)), "abt": ((M, N), (K, N)), "atb": ((M, K), (M, N))}
    maths = {"ab": lambda a, b: a @ b, "abt": lambda a, b: a @ b.t(), "atb": lambda a, b: a.t() @ b}
    ops = {"ab": matmul_ab_2d, "abt": matmul_abt_2d, "atb": matmul_atb_2d}
    errors = {}
    for name, (sa, sb) in shapes.items():
        a = torch.randn(*sa, generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(*sb, generator=g, dtype=torch.float64, requires_grad=True)
        c = maths[name](a, b)
        dc = torch.randn(c.shape, generator=g, dtype=torch.float64)
        c.backward(dc)
        la, lb = (shard_block(t, grid, 1, 0).requires_grad_() for t in (a, b))
        lc = ops[name](la, lb, grid)
        lc.backward(shard_block(dc, grid, 1, 0))
        errors[name] = max(
            (lc - shard_block(c, grid, 1, 0)).abs().max().item(),
            (la.grad - shard_block(a.grad, grid, 1, 0)).abs().max().item(),
            (lb.grad - shard_block(b.grad, grid, 1, 0)).abs().max().item(),
        )
    return errors


def _run_one(rank: int, world: int, groups, model_name: str, layout_name: str) -> dict:
    layout = LAYOUTS[layout_name]
    cfg = ModelConfig(**MODELS[model_name])
    pmodel = apply_tensor_2d(_model(cfg), groups, None)
    b = MICRO_BATCH[layout_name]
    tokens, targets = _data(cfg, b * layout.dp)
    d = groups.coord(Axis.DATA)
    tokens, targets = tokens[d * b : (d + 1) * b], targets[d * b : (d + 1) * b]
    sync = GradSync(pmodel.parameters(), groups.dp)
    comm.STATS.reset()
    loss = pmodel(tokens, targets)
    sync.arm()
    loss.backward()
    sync.finish()
    names = {"row": comm.group_name(groups.same_row), "col": comm.group_name(groups.same_col)}
    measured = {k: v for k, v in comm.STATS.bytes.items() if k[1] in names.values()}
    expected = {(kind, names[g]): n for (kind, g), n in comm_bytes_2d(cfg, b, cfg.seq_len, layout.q).items()}
    full = pmodel.full_parameters()
    grads = pmodel.full_parameters(grad=True)
    norm_sq = pmodel.grad_norm_sq().item()
    out = {"loss": loss.item(), "dp": d, "measured": dict(measured), "expected": expected, "norm_sq": norm_sq}
    if rank == world - 1:  # the last rank (a grid corner other than P_00) returns the reassembled tensors
        out |= {"params": full, "grads": grads}
    return out


def _launch(model_names: list[str], layout_name: str, saved_families: tuple[str, ...] = ()) -> list[dict]:
    layout = LAYOUTS[layout_name]
    args = (model_names, layout_name, list(saved_families))
    return run_distributed(_worker_2d, layout.world_size, *args, timeout=300)


def _check(model_names: list[str], layout_name: str, per_rank: list[dict] | None = None) -> None:
    per_rank = per_rank or _launch(model_names, layout_name)
    for r in per_rank:
        assert max(r["ops"].values()) <= OPS_TOL, f"SUMMA op differs from the full product: {r['ops']}"
    for k, name in enumerate(model_names):
        _check_one(name, layout_name, [r["runs"][k] for r in per_rank])


def _check_one(model_name: str, layout_name: str, results: list[dict]) -> None:
    layout = LAYOUTS[layout_name]
    cfg = ModelConfig(**MODELS[model_name])
    ref_loss, ref_grads = _reference(cfg, MICRO_BATCH[layout_name] * layout.dp)
    for r in results:
        assert r["measured"] == r["expected"], f"comm bytes differ from comm_bytes_2d: {r}"
    losses = [sum(r["loss"] for r in results if r["dp"] == d) / layout.tensor_size for d in range(layout.dp)]
    assert sum(losses) / layout.dp == pytest.approx(ref_loss, rel=LOSS_RTOL)
    for r in results:  # every rank of a tensor group reports its data shard's loss
        assert r["loss"] == pytest.approx(losses[r["dp"]], rel=LOSS_RTOL)
    last = results[-1]
    plain = _model(cfg)
    assert set(last["params"]) == {n for n, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        assert torch.equal(last["params"][name], p.detach()), f"{name}: reassembled weights differ"
        got, want = last["grads"][name], ref_grads[name]
        assert got.shape == want.shape, name
        tol = max(GRAD_TOL_REL_MAX * want.abs().max().item(), GRAD_ATOL)
        err = (got - want).abs().max().item()
        assert err <= tol, f"{model_name}/{layout_name} {name}: max |Δgrad| {err:.3g} > {tol:.3g}"
    want_sq = sum(g.pow(2).sum().item() for g in ref_grads.values())
    for r in results:
        assert r["norm_sq"] == pytest.approx(want_sq, rel=GRAD_NORM_RTOL)


TP2X2_MODELS = ["gpt", "llama", "gpt_v257", "llama_v257"]
SAVED_FAMILIES = ["gpt", "llama"]


@pytest.fixture(scope="module")
def tp2x2_results() -> list[dict]:
    """One 4-rank launch shared by the tp2x2 tests (spawning ranks costs more than the models on 2 cores)."""
    models = [*TP2X2_MODELS, "qwen2_v257", "qwen3_v257", "qwen3_hd8_v257", "gemma2_v257", "gemma3_v257"]
    return _launch(models, "tp2x2", SAVED_FAMILIES)


def test_tp2x2_gpt_llama_and_vocab_257(tp2x2_results: list[dict]) -> None:
    """GPT and Llama (GQA, RoPE), and vocabulary 257 on q = 2 (padded to 258 inside, invisible outside)."""
    _check(TP2X2_MODELS, "tp2x2", tp2x2_results)


def test_tp2x2_qwen2(tp2x2_results: list[dict]) -> None:
    """Qwen2 (q/k/v biases, GQA, RoPE, tied, vocabulary 257): collective bytes (`comm_bytes_2d`, from the family
    declaration: the q/k/v bias gradients' column all-reduces included), loss, every weight and gradient, the norm."""
    k = len(TP2X2_MODELS)
    _check_one("qwen2_v257", "tp2x2", [r["runs"][k] for r in tp2x2_results])


def test_tp2x2_qwen3(tp2x2_results: list[dict]) -> None:
    """Qwen3 (per-head q/k norms, GQA, RoPE, untied, vocabulary 257): the norms' weights whole on every grid rank,
    their gradients summed over the rows and the columns (`comm_bytes_2d` counts both), loss, every weight and
    gradient, the norm (each replicated norm weight counted once)."""
    k = len(TP2X2_MODELS) + 1
    _check_one("qwen3_v257", "tp2x2", [r["runs"][k] for r in tp2x2_results])


def test_tp2x2_head_dim_other_than_d_model_over_heads(tp2x2_results: list[dict]) -> None:
    """Qwen3 with head_dim 8 ≠ d_model / n_heads = 4: wq [32, 16], wk/wv [16, 16], wo [16, 32] in SUMMA blocks,
    collective bytes (`comm_bytes_2d` with the 32-wide attention), loss, every weight and gradient, the norm."""
    k = len(TP2X2_MODELS) + 2
    _check_one("qwen3_hd8_v257", "tp2x2", [r["runs"][k] for r in tp2x2_results])


def test_tp2x2_gemma2(tp2x2_results: list[dict]) -> None:
    """Gemma 2: collective bytes (`comm_bytes_2d` with four norms per block, each a row all-reduce of statistics
    forward and backward and a column all-reduce of its weight's gradient), loss, every weight and gradient (the
    (1 + w) norms' over the grid rows, the final cap on logit blocks), the norm."""
    k = len(TP2X2_MODELS) + 3
    _check_one("gemma2_v257", "tp2x2", [r["runs"][k] for r in tp2x2_results])


def test_tp2x2_gemma3(tp2x2_results: list[dict]) -> None:
    """Gemma 3: collective bytes (`comm_bytes_2d` with Gemma 2's four norms and the per-head q/k norms' traffic),
    loss, every weight and gradient (the local layer's band and RoPE base on the grid), the norm."""
    k = len(TP2X2_MODELS) + 4
    _check_one("gemma3_v257", "tp2x2", [r["runs"][k] for r in tp2x2_results])


def test_dp2_tp2x2_matches_single_device() -> None:
    _check(["gpt", "llama"], "dp2_tp2x2")


@pytest.mark.slow
def test_tp3x3_matches_single_device() -> None:
    _check(["gpt_q3", "llama_q3"], "tp3x3")


# Saved-for-backward bytes per rank, 2D q = 2 against the plain single-device model on the same micro-batch.
# Theory: every activation is split over batch (q) and hidden/heads (q), i.e. 1/q² = 0.25 of the plain model's;
# on top each rank keeps the whole micro-batch's token ids and lookup masks (the vocabulary-parallel embedding
# looks up all b sequences before its reduce-scatter). 0.30 leaves 0.05 for those at these sizes.
SAVED_RATIO_MAX = 0.30
SAVED_MODEL = dict(d_model=64, n_heads=4, n_kv_heads=2, vocab_size=128, seq_len=32, n_layers=2)
SAVED_BATCH = 8


def saved_activation_bytes(model, tokens: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of the unique storages autograd saves for backward in one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    loss.backward()
    return sum(seen.values())


def _saved_bytes_2d(groups, family: str) -> int:
    cfg = ModelConfig(family=family, **SAVED_MODEL)
    return saved_activation_bytes(apply_tensor_2d(_model(cfg), groups), *_data(cfg, SAVED_BATCH))


def test_saved_activation_bytes_per_rank_2x2(tp2x2_results: list[dict]) -> None:
    for k, family in enumerate(SAVED_FAMILIES):
        cfg = ModelConfig(family=family, **SAVED_MODEL)
        plain = saved_activation_bytes(_model(cfg), *_data(cfg, SAVED_BATCH))
        for r in tp2x2_results:
            got = r["saved"][k]
            assert got <= SAVED_RATIO_MAX * plain, f"{family}: 2D saves {got} B/rank, plain {plain} B"


# bf16 autocast with several micro-batches in flight (a layered step): tessera's region casts each weight block
# once (`precision.cast_operand`, autocast's caching rule), torch's region alone casts it on every call
CAST_MICRO_BATCHES = 3


def _weight_copies(model) -> tuple[object, dict[int, set[int]]]:
    """A saved-tensor hook and the distinct storages of each parameter's bf16 copies it sees saved."""
    params = {id(p) for p in model.parameters()}
    copies: dict[int, set[int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        fn = t.grad_fn  # a cast's node (torch's ToCopyBackward or tessera's), whose first input is the weight
        source = getattr(fn.next_functions[0][0], "variable", None) if fn is not None else None
        if t.dtype == torch.bfloat16 and id(source) in params:
            copies.setdefault(id(source), set()).add(t.untyped_storage()._cdata)
        return t

    return pack, copies


def _weight_casts_2d(groups) -> dict[str, dict]:
    """Every micro-batch's forward, then every backward, under each region: the losses, the gradients and the
    most bf16 copies of one weight block saved at once."""
    cfg = ModelConfig(**MODELS["llama"])
    b = MICRO_BATCH["tp2x2"]
    tokens, targets = _data(cfg, b * CAST_MICRO_BATCHES)
    regions = {
        "tessera": lambda: autocast("bf16", torch.device("cpu")),
        "per_call": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }
    out = {}
    for name, region in regions.items():
        model = apply_tensor_2d(_model(cfg), groups, None)
        pack, copies = _weight_copies(model)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), region():
            losses = [model(x, y) for x, y in zip(tokens.split(b), targets.split(b), strict=True)]
        for loss in losses:
            loss.backward()
        out[name] = {
            "losses": [loss.item() for loss in losses],
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "copies": max(len(c) for c in copies.values()),
            "weights": len(copies),
        }
    return out


def test_tp2x2_bf16_weight_blocks_are_cast_once_per_step(tp2x2_results: list[dict]) -> None:
    """Under bf16 autocast every micro-batch in flight saves the same bf16 copy of each weight block (one per step,
    as autocast's cache keeps one per weight for 1D), not its own; losses and every gradient are bit-identical to
    casting on every call (the same casts, the same products)."""
    for r in tp2x2_results:
        cached, per_call = r["casts"]["tessera"], r["casts"]["per_call"]
        assert cached["weights"] == per_call["weights"] > 0
        assert (cached["copies"], per_call["copies"]) == (1, CAST_MICRO_BATCHES)
        assert cached["losses"] == per_call["losses"]
        for n, g in cached["grads"].items():
            assert torch.equal(g, per_call["grads"][n]), n
