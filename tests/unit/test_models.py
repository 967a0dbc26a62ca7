"""Plain GPT, Llama and Qwen2 models: shapes, parameter counts, causality, GQA, RoPE, tying, init and sampling."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.config import ModelConfig
from tessera.errors import ConfigError
from tessera.model.build import build_model, generate
from tessera.model.layers import apply_rope, rope_tables
from tessera.model.sizes import SIZES

EXACT_TOL = 1e-6  # float32 recomputation of the same maths (different but equivalent kernels)
INIT_STD_REL_TOL = 0.05  # sample std of >=16k N(0, σ²) draws is within ~1% of σ; 5% is a loose bound
LOSS_AT_INIT_TOL = 0.1  # near-zero logits at init give a loss within this of ln(V)

torch.set_num_threads(1)


def cfg_for(name: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**SIZES[name], **overrides})


def on_meta(cfg: ModelConfig):
    with torch.device("meta"):
        return build_model(cfg)


def expected_params(c: ModelConfig) -> int:
    """Hand formula of the parameter count, independent of the module code."""
    h, hd, L, V, f = c.d_model, c.head_size, c.n_layers, c.vocab_size, c.ffn
    q_out, kv_out = c.n_heads * hd, c.kv_heads * hd
    attn = h * q_out + 2 * h * kv_out + q_out * h  # wq, wk, wv, wo
    if c.family == "gpt":
        attn += q_out + 2 * kv_out + h  # biases of wq, wk, wv, wo
        mlp = 2 * h * f + f + h
        norms = 2 * (2 * h)
        extra = c.seq_len * h + 2 * h  # wpe, final LayerNorm
    else:
        attn += q_out + 2 * kv_out if c.family == "qwen2" else 0  # Qwen2: biases of wq, wk, wv only
        attn += 2 * hd if c.family in ("qwen3", "gemma3") else 0  # Qwen3, Gemma 3: per-head q/k norms
        mlp = 3 * h * f
        norms = (4 if c.family in ("gemma2", "gemma3") else 2) * h  # Gemma: norms before and after
        extra = h  # final RMSNorm
    embeddings = V * h * (1 if c.tie_embeddings else 2)
    return L * (attn + mlp + norms) + embeddings + extra


@pytest.mark.parametrize("name", list(SIZES))
def test_every_size_builds_with_formula_param_count(name):
    cfg = cfg_for(name)
    model = on_meta(cfg)
    assert model.num_params() == expected_params(cfg)
    assert list(model.blocks) == [str(i) for i in range(cfg.n_layers)]


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("gpt2-124m", 124_439_808),  # GPT-2 small with wpe, tied (nanoGPT: 123.65M + 0.79M positions)
        ("llama-1b", 1_235_814_400),  # Llama 3.2 1B, tied
        ("llama-8b", 8_030_261_248),  # Llama 3 8B, untied
        (
            "llama3.1-8b",
            8_030_261_248,
        ),  # Llama 3.1 8B: Llama 3 8B's shape, llama3 RoPE scaling has no parameters
        ("llama3.2-3b", 3_212_749_824),  # Llama 3.2 3B, tied (transformers' LlamaForCausalLM at its config)
        ("gpt3-175b", 174_615_846_912),  # GPT-3 175B shape with V padded to 51200, tied, learned positions
        ("megatron-1t", 1_008_038_758_400),  # Narayanan 2021 Table 1: 1008.0 billion
        # Qwen2 0.5B (tied), 7B, 72B: the counts transformers' Qwen2ForCausalLM has at the released configs
        ("qwen2-0.5b", 494_032_768),
        ("qwen2-7b", 7_615_616_512),
        ("qwen2-72b", 72_706_203_648),
        # Qwen3 1.7B (tied), 8B, 14B: the counts transformers' Qwen3ForCausalLM has at the released configs
        ("qwen3-1.7b", 1_720_574_976),
        ("qwen3-8b", 8_190_735_360),
        ("qwen3-14b", 14_768_307_200),
        # Qwen3 0.6B (tied), 4B (tied), 32B: head_dim 128 ≠ hidden / heads; transformers' Qwen3ForCausalLM built
        # on the meta device at the released configs has these counts (tests/unit/test_hf.py builds it)
        ("qwen3-0.6b", 596_049_920),
        ("qwen3-4b", 4_022_468_096),
        ("qwen3-32b", 32_762_123_264),
        # Mistral NeMo 12B: head_dim 128 with 32 heads at hidden 5120 (transformers' MistralForCausalLM: the same)
        ("mistral-nemo-12b", 12_247_782_400),
        # Gemma 2 2B, 9B, 27B (tied, four norms per block): transformers' Gemma2ForCausalLM on the meta device at
        # the released configs has these counts (tests/unit/test_hf.py builds it)
        ("gemma2-2b", 2_614_341_888),
        ("gemma2-9b", 9_241_705_984),
        ("gemma2-27b", 27_227_128_320),
        # Gemma 3 1B (tied, four norms and per-head q/k norms per block): transformers' Gemma3ForCausalLM on the
        # meta device (tests/unit/test_gemma3.py builds it)
        ("gemma3-1b", 999_885_952),
        # Gemma 3 4B, 12B, 27B (the language models of the released multimodal folders): transformers'
        # Gemma3ForCausalLM on the meta device at their text configs (tests/unit/test_gemma3_multimodal.py builds it)
        ("gemma3-4b", 3_880_263_168),
        ("gemma3-12b", 11_766_034_176),
        ("gemma3-27b", 27_009_346_304),
    ],
)
def test_known_parameter_counts(name, count):
    assert on_meta(cfg_for(name)).num_params() == count


def test_flops_per_token_palm_convention():
    cfg = cfg_for("gpt2-124m")
    model = on_meta(cfg)
    n_matmul = 124_439_808 - cfg.seq_len * cfg.d_model  # the wpe lookup does no matmul; wte is the tied head
    assert model.flops_per_token() == 6 * n_matmul + 12 * 12 * 768 * 1024
    untied = on_meta(cfg_for("llama-8b"))
    n_matmul = 8_030_261_248 - 128256 * 4096  # untied token embedding is a lookup only
    assert untied.flops_per_token(seq_len=2048) == 6 * n_matmul + 12 * 32 * 4096 * 2048


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "gemma2-tiny", "gemma3-tiny"])
def test_forward_backward(name):
    torch.manual_seed(0)
    cfg = cfg_for(name)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    logits = model(tokens)
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)
    loss = model(tokens, targets=tokens.roll(-1, dims=1))
    assert abs(loss.item() - math.log(cfg.vocab_size)) < LOSS_AT_INIT_TOL
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, f"{pname} got a zero gradient"


def test_loss_helper_matches_manual_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.bfloat16)
    targets = torch.randint(0, 7, (2, 5))
    logp = torch.log_softmax(logits.float(), dim=-1)
    manual = -logp.gather(-1, targets[..., None]).mean()
    assert torch.allclose(build_model(cfg_for("gpt2-tiny")).loss(logits, targets), manual, atol=EXACT_TOL)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "gemma2-tiny", "gemma3-tiny"])
def test_causal(name):
    torch.manual_seed(0)
    cfg = cfg_for(name)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    changed = tokens.clone()
    t = cfg.seq_len // 2
    changed[0, t] = (tokens[0, t] + 1) % cfg.vocab_size
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :t], b[:, :t], atol=EXACT_TOL, rtol=0)
    assert not torch.allclose(a[:, t:], b[:, t:], atol=EXACT_TOL, rtol=0)


def test_gqa_equals_mha_with_repeated_kv_weights():
    torch.manual_seed(0)
    gqa_cfg = cfg_for("llama-tiny")  # 4 query heads, 2 KV heads
    mha_cfg = cfg_for("llama-tiny", n_kv_heads=gqa_cfg.n_heads)
    gqa, mha = build_model(gqa_cfg), build_model(mha_cfg)
    rep, hd = gqa_cfg.n_heads // gqa_cfg.kv_heads, gqa_cfg.head_size
    state = {}
    for name, w in gqa.state_dict().items():
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):
            # [nkv·hd, h] -> [nh·hd, h]: query head j uses KV head j // rep
            w = w.view(gqa_cfg.kv_heads, hd, -1).repeat_interleave(rep, dim=0).reshape(-1, w.shape[-1])
        state[name] = w
    mha.load_state_dict(state)
    tokens = torch.randint(0, gqa_cfg.vocab_size, (2, gqa_cfg.seq_len))
    assert torch.allclose(gqa(tokens), mha(tokens), atol=EXACT_TOL, rtol=0)


def test_rope_depends_only_on_relative_position():
    torch.manual_seed(0)
    hd, seq = 16, 32
    cos, sin = rope_tables(hd, seq, theta=10000.0)
    q, k = torch.randn(1, 1, 1, hd), torch.randn(1, 1, 1, hd)

    def score(m: int, n: int) -> float:
        qm = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum().item()

    assert score(3, 1) == pytest.approx(score(20, 18), abs=1e-5)
    assert score(7, 7) == pytest.approx((q * k).sum().item(), abs=1e-5)  # offset 0: plain dot product
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)
    x = torch.randn(2, 3, seq, hd)
    assert torch.allclose(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation


def test_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head dim"):
        rope_tables(7, 4, theta=10000.0)


@pytest.mark.parametrize(("name", "tok"), [("gpt2-tiny", "wte"), ("llama-tiny", "tok")])
def test_tied_weights_are_one_parameter(name, tok):
    torch.manual_seed(0)
    model = build_model(cfg_for(name, tie_embeddings=True))
    assert model.tied_parameters() == [("head.out.weight", f"embed.{tok}.weight")]
    a, b = (model.get_parameter(n) for n in model.tied_parameters()[0])
    assert a is b
    model(torch.randint(0, 256, (1, 8)), torch.randint(0, 256, (1, 8))).backward()
    assert a.grad is b.grad
    untied = build_model(cfg_for(name, tie_embeddings=False))
    assert untied.tied_parameters() == []
    assert untied.head.out.weight is not getattr(untied.embed, tok).weight
    assert untied.num_params() == model.num_params() + 256 * model.cfg.d_model


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "gemma2-tiny", "gemma3-tiny"])
def test_init_is_deterministic_given_seed(name):
    states = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        states.append(build_model(cfg_for(name)).state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not all(torch.equal(states[0][k], states[2][k]) for k in states[0])


def test_init_distribution():
    torch.manual_seed(0)
    cfg = cfg_for("gpt2-mini")
    model = build_model(cfg)
    std = cfg.init_std
    scaled = std / math.sqrt(2 * cfg.n_layers)
    blk = model.blocks["1"]
    assert blk.attn.wq.weight.std().item() == pytest.approx(std, rel=INIT_STD_REL_TOL)
    assert blk.attn.wo.weight.std().item() == pytest.approx(scaled, rel=INIT_STD_REL_TOL)
    assert blk.mlp.proj.weight.std().item() == pytest.approx(scaled, rel=INIT_STD_REL_TOL)
    assert model.embed.wte.weight.std().item() == pytest.approx(std, rel=INIT_STD_REL_TOL)
    assert torch.all(blk.mlp.fc.bias == 0) and torch.all(blk.attn_norm.bias == 0)
    assert torch.all(blk.attn_norm.weight == 1) and torch.all(model.head.norm.weight == 1)
    llama = build_model(cfg_for("llama-mini"))
    assert llama.blocks["0"].mlp.w_down.weight.std().item() == pytest.approx(scaled, rel=INIT_STD_REL_TOL)
    assert all(m.bias is None for m in llama.modules() if isinstance(m, torch.nn.Linear))


def test_meta_model_materialises():
    torch.manual_seed(0)
    reference = build_model(cfg_for("llama-tiny"))
    model = on_meta(cfg_for("llama-tiny"))
    model.to_empty(device="cpu")
    assert model.head.out.weight is not model.embed.tok.weight  # to_empty made new Parameters ...
    torch.manual_seed(0)
    model.init_weights()
    assert model.head.out.weight is model.embed.tok.weight  # ... and init_weights re-tied them
    ours, theirs = model.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(model.rope.cos, reference.rope.cos)
    tokens = torch.randint(0, 256, (1, 16))
    assert torch.allclose(model(tokens), reference(tokens), atol=EXACT_TOL, rtol=0)


def test_invalid_config_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"model.d_model = 30 is not divisible"):
        build_model(ModelConfig(d_model=30, n_heads=4))


def test_too_long_sequence_is_a_clear_error():
    cfg = cfg_for("gpt2-tiny")
    with pytest.raises(ValueError, match=r"exceeds model\.seq_len"):
        build_model(cfg)(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "gemma2-tiny", "gemma3-tiny"])
def test_generate(name):
    torch.manual_seed(0)
    cfg = cfg_for(name)
    model = build_model(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 3))  # longer than the context: truncated
    out = generate(model, prompt, 5, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, cfg.seq_len + 8)
    assert torch.equal(out[:, : prompt.shape[1]], prompt)
    assert out.min() >= 0 and out.max() < cfg.vocab_size
    again = generate(model, prompt, 5, top_k=10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    greedy = generate(model, prompt, 1, temperature=0)
    assert torch.equal(greedy[:, -1], model(prompt[:, -cfg.seq_len :])[:, -1].argmax(-1))
    assert model.training
