"""Single-process parts of Optimus 2D: the communication formulas, the layer maths at q = 1, the config checks.

The multi-process tests (tests/distributed/test_tensor_2d.py) assert that comm.STATS equals `comm_bytes_2d`
exactly; here the formula itself is checked against hand-written closed forms, so a wrong formula cannot pass by
agreeing with a wrong implementation.
"""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig
from tessera.errors import ConfigError
from tessera.model.build import build_model
from tessera.parallel.model_2d import Model2D, check_2d, comm_bytes_2d
from tessera.parallel.tensor_2d import Grid2D, matmul_ab_2d, matmul_abt_2d, matmul_atb_2d, summa_bytes

LOSS_RTOL = 1e-6  # q = 1: the same maths through differently composed kernels (LayerNorm, cross-entropy)
GRAD_TOL_REL_MAX = 1e-5  # per tensor, relative to its largest reference entry
GRAD_ATOL = 1e-9  # floor for gradients that are exactly 0 in theory (key biases)

torch.set_num_threads(1)

GPT = ModelConfig(family="gpt", d_model=24, n_heads=4, vocab_size=50, seq_len=8, n_layers=2)
LLAMA = ModelConfig(
    family="llama", d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=50, seq_len=8, n_layers=2
)
LLAMA_HD = ModelConfig(  # head_dim 16 ≠ 32 / 4: wq's outputs and wo's inputs 64 wide
    family="llama",
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_hidden=48,
    vocab_size=50,
    seq_len=8,
    n_layers=2,
)


def test_summa_bytes_hand_computed() -> None:
    # m = 6 tokens per rank, K = 4, N = 8, q = 2, fp32: activation block 6·2·4 = 48 B, weight block 2·4·4 = 32 B
    assert summa_bytes("ab", 6, 4, 8, 2) == {("broadcast", "row"): 96, ("broadcast", "col"): 64}
    assert summa_bytes("abt", 6, 4, 8, 2) == {("broadcast", "col"): 64, ("reduce", "row"): 96}
    assert summa_bytes("atb", 6, 4, 8, 2) == {("broadcast", "row"): 96, ("reduce", "col"): 64}
    assert summa_bytes("ab", 6, 4, 8, 1) == {}
    with pytest.raises(ValueError, match="unknown SUMMA op"):
        summa_bytes("ba", 6, 4, 8, 2)


def _closed_form(cfg: ModelConfig, b: int, s: int, q: int, e: int = 4) -> dict[tuple[str, str], int]:
    """docs/tensor-2d.md's totals written out directly (independent of comm_bytes_2d's bookkeeping)."""
    h, f, kv, L, m = cfg.d_model, cfg.ffn, cfg.kv_heads * cfg.head_size, cfg.n_layers, b // q * s
    a = (
        cfg.n_heads * cfg.head_size
    )  # the attention's width: wq's outputs, wo's inputs (h unless head_dim is set)
    vp = -(-cfg.vocab_size // q) * q
    gpt = cfg.family == "gpt"
    ins = [h, h, h, a] + ([h, f] if gpt else [h, h, f])  # input widths of the block's linears
    weights = 2 * h * a + 2 * h * kv + (2 if gpt else 3) * h * f  # weight elements per block
    outs = a + 2 * kv + 2 * h + f if gpt else 0  # bias elements per block (GPT only)
    norms = 2 * L + 1
    return {
        ("broadcast", "row"): e * (2 * m * L * sum(ins) + 2 * m * vp),
        ("reduce", "row"): e * (m * L * sum(ins) + m * vp),
        ("broadcast", "col"): e * (2 * L * weights // q + 2 * vp * h // q),
        ("reduce", "col"): e * (L * weights // q + vp * h // q),
        ("all_reduce", "row"): e * norms * (4 if gpt else 2) * m,
        ("all_reduce", "col"): e
        * (L * outs // q + norms * (2 if gpt else 1) * h // q + (s * h // q if gpt else 0) + 1),
        ("reduce_scatter", "col"): e * m * h,
        ("all_gather", "col"): e * m * h,
        ("all_gather", "row"): e * 2 * q * m,
    }


@pytest.mark.parametrize("cfg", [GPT, LLAMA, LLAMA_HD], ids=["gpt", "llama", "llama_head_dim_16"])
@pytest.mark.parametrize("q", [2, 4])
def test_comm_bytes_2d_matches_closed_form(cfg: ModelConfig, q: int) -> None:
    assert comm_bytes_2d(cfg, 8, 8, q) == _closed_form(cfg, 8, 8, q)


def test_comm_bytes_2d_is_empty_without_a_grid() -> None:
    assert comm_bytes_2d(GPT, 4, 8, 1) == {}


def test_check_2d_names_every_violation() -> None:
    cfg = ModelConfig(family="llama", d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=50)
    problems = check_2d(cfg, 3)
    assert len(problems) == 3  # d_model, n_heads, n_kv_heads (ffn 48 is divisible by 3)
    assert any("n_kv_heads = 2" in p for p in problems)
    assert check_2d(cfg, 2) == []
    with pytest.raises(ConfigError, match="n_kv_heads"):
        Model2D(build_model(cfg), Grid2D(q=3, i=0, j=0))


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_model_2d_on_a_1x1_grid_is_the_plain_model(cfg: ModelConfig) -> None:
    """The 2D layers' maths (norms, vocabulary-parallel loss, embeddings, tying) without communication."""
    torch.manual_seed(0)
    plain = build_model(cfg)
    pmodel = Model2D(plain, Grid2D(q=1, i=0, j=0))
    tokens = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    ref = plain(tokens[:, :-1], tokens[:, 1:])
    ref.backward()
    loss = pmodel(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=LOSS_RTOL)
    grads = pmodel.full_parameters(grad=True)
    assert set(grads) == {n for n, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        tol = max(GRAD_TOL_REL_MAX * p.grad.abs().max().item(), GRAD_ATOL)
        assert (grads[name] - p.grad).abs().max().item() <= tol, name
    want = sum(p.grad.pow(2).sum() for p in plain.parameters())
    assert pmodel.grad_norm_sq().item() == pytest.approx(want.item(), rel=GRAD_TOL_REL_MAX)


def test_summa_ops_on_a_1x1_grid_are_matmuls_with_their_gradients() -> None:
    grid = Grid2D(q=1, i=0, j=0)
    a = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, y: matmul_ab_2d(x, y, grid), (a, w))
    torch.autograd.gradcheck(lambda x, y: matmul_abt_2d(x, y, grid), (c, w))
    torch.autograd.gradcheck(lambda x, y: matmul_atb_2d(x, y, grid), (a, c))
