"""Named model sizes, from tiny test shapes up to real ones, shared by training and planning.

Pure data (no torch import) so the config and the planner can use it without PyTorch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SIZES", "size_names"]

_TINY_VOCAB = 256  # the byte tokenizer's vocabulary


def _llama3(layers: int, d_model: int, heads: int, ffn: int, tie: bool, factor: float) -> dict[str, Any]:
    """A released Llama 3.1/3.2 shape: 8 KV heads, vocabulary 128256, RoPE base 5·10⁵ with llama3 scaling."""
    scaling = dict(type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0)
    return dict(
        family="llama",
        n_layers=layers,
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=8,
        ffn_hidden=ffn,
        vocab_size=128256,
        seq_len=2048,
        tie_embeddings=tie,
        rope_theta=500000.0,
        rope_scaling=scaling | {"original_max_position_embeddings": 8192},
    )


def _qwen3(
    layers: int, d_model: int, heads: int, ffn: int, tie: bool, head_dim: int | None = None
) -> dict[str, Any]:
    """A released Qwen3 dense shape: 8 KV heads, vocabulary 151936, RoPE base 10⁶, RMSNorm eps 1e-6; ``head_dim``
    where config.json gives one other than hidden / heads."""
    width = {} if head_dim is None else {"head_dim": head_dim}
    return dict(
        family="qwen3",
        n_layers=layers,
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=8,
        **width,
        ffn_hidden=ffn,
        vocab_size=151936,
        seq_len=2048,
        tie_embeddings=tie,
        rope_theta=1000000.0,
        norm_eps=1e-6,
    )


def _gemma2(
    layers: int, d_model: int, heads: int, kv_heads: int, head_dim: int, ffn: int, scalar: int
) -> dict[str, Any]:
    """A released Gemma 2 shape: vocabulary 256000, tied, RoPE base 10⁴, RMSNorm eps 1e-6, attention soft-cap 50,
    final soft-cap 30, attention scaled by ``scalar``^-0.5. Context 4096, the sliding window of every other layer:
    tessera computes no window, and at a context no wider than it the window masks nothing (8192, the models'
    context, would attend further than Gemma 2 does in those layers)."""
    return dict(
        family="gemma2",
        n_layers=layers,
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=ffn,
        vocab_size=256000,
        seq_len=4096,
        tie_embeddings=True,
        rope_theta=10000.0,
        norm_eps=1e-6,
        query_pre_attn_scalar=scalar,
        attn_softcap=50.0,
        final_softcap=30.0,
    )


def _gemma3(
    layers: int, d_model: int, heads: int, kv_heads: int, head_dim: int, ffn: int, scalar: int
) -> dict[str, Any]:
    """A released Gemma 3 4B/12B/27B language model: vocabulary 262208, tied, RMSNorm eps 1e-6, no soft-caps,
    attention scaled by ``scalar``^-0.5, window 1024 on 5 local layers (RoPE base 10⁴) to 1 global (base 10⁶,
    linear scaling factor 8), context 131072 (set a shorter model.seq_len to train shorter)."""
    return dict(
        family="gemma3",
        n_layers=layers,
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=ffn,
        vocab_size=262208,
        seq_len=131072,
        tie_embeddings=True,
        norm_eps=1e-6,
        query_pre_attn_scalar=scalar,
        sliding_window=1024,
        sliding_window_pattern=6,
        rope_theta=1e6,
        rope_local_theta=10000.0,
        rope_scaling={"type": "linear", "factor": 8.0},
    )


SIZES: dict[str, dict[str, Any]] = {
    # Test and demo shapes (byte-level vocabulary).
    "gpt2-tiny": dict(family="gpt", n_layers=2, d_model=32, n_heads=4, vocab_size=_TINY_VOCAB, seq_len=32),
    "gpt2-mini": dict(family="gpt", n_layers=4, d_model=128, n_heads=4, vocab_size=_TINY_VOCAB, seq_len=128),
    "llama-tiny": dict(
        family="llama",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=96,
        vocab_size=_TINY_VOCAB,
        seq_len=32,
    ),
    "llama-mini": dict(
        family="llama",
        n_layers=4,
        d_model=128,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=352,
        vocab_size=_TINY_VOCAB,
        seq_len=128,
    ),
    # GPT-2 (Radford et al. 2019), BPE vocabulary 50257, context 1024, tied embeddings.
    "gpt2-124m": dict(family="gpt", n_layers=12, d_model=768, n_heads=12, vocab_size=50257, seq_len=1024),
    "gpt2-350m": dict(family="gpt", n_layers=24, d_model=1024, n_heads=16, vocab_size=50257, seq_len=1024),
    "gpt2-774m": dict(family="gpt", n_layers=36, d_model=1280, n_heads=20, vocab_size=50257, seq_len=1024),
    "gpt2-1.5b": dict(family="gpt", n_layers=48, d_model=1600, n_heads=25, vocab_size=50257, seq_len=1024),
    # Llama 3 shapes (Llama 3.2 1B ties embeddings; the others do not).
    "llama-1b": dict(
        family="llama",
        n_layers=16,
        d_model=2048,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        vocab_size=128256,
        seq_len=2048,
        tie_embeddings=True,
        rope_theta=500000.0,
    ),
    "llama-8b": dict(
        family="llama",
        n_layers=32,
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        vocab_size=128256,
        seq_len=2048,
        tie_embeddings=False,
        rope_theta=500000.0,
    ),
    "llama-70b": dict(
        family="llama",
        n_layers=80,
        d_model=8192,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        vocab_size=128256,
        seq_len=2048,
        tie_embeddings=False,
        rope_theta=500000.0,
    ),
    "llama-405b": dict(
        family="llama",
        n_layers=126,
        d_model=16384,
        n_heads=128,
        n_kv_heads=8,
        ffn_hidden=53248,
        vocab_size=128256,
        seq_len=2048,
        tie_embeddings=False,
        rope_theta=500000.0,
    ),
    # Llama 3.1 / 3.2 / 3.3 (the released config.json files): the Llama 3 shapes above plus llama3 RoPE scaling,
    # factor 8 (3.1 8B/70B/405B; 3.3 70B is 3.1 70B's config) or 32 (3.2 1B/3B), low 1, high 4, pre-training context
    # 8192. The names above stay unscaled (Llama 3's function). Context: tessera's 2048-token training default
    # (the models accept 128k).
    "llama3.2-1b": _llama3(16, 2048, 32, 8192, tie=True, factor=32.0),
    "llama3.2-3b": _llama3(28, 3072, 24, 8192, tie=True, factor=32.0),
    "llama3.1-8b": _llama3(32, 4096, 32, 14336, tie=False, factor=8.0),
    "llama3.1-70b": _llama3(80, 8192, 64, 28672, tie=False, factor=8.0),
    "llama3.1-405b": _llama3(126, 16384, 128, 53248, tie=False, factor=8.0),
    # Mistral NeMo 12B (Mistral AI and NVIDIA 2024; the released config.json of mistralai/Mistral-Nemo-Base-2407):
    # Llama's function (Mistral imports as the llama family; its sliding window is null), head_dim 128 with
    # 32 heads at hidden 5120 (attention 4096 wide), 8 KV heads, vocabulary 2¹⁷, RoPE base 10⁶, untied. Context:
    # tessera's 2048-token training default (the model's is 128000).
    "mistral-nemo-12b": dict(
        family="llama",
        n_layers=40,
        d_model=5120,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffn_hidden=14336,
        vocab_size=131072,
        seq_len=2048,
        tie_embeddings=False,
        rope_theta=1000000.0,
    ),
    # Qwen2 (Yang et al. 2024; the released config.json files): q/k/v biases, RoPE base 10⁶; 0.5B ties embeddings.
    # Context: tessera's 2048-token training default (the models accept 32k-128k).
    "qwen2-tiny": dict(
        family="qwen2",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=96,
        vocab_size=_TINY_VOCAB,
        seq_len=32,
        tie_embeddings=False,
        rope_theta=1000000.0,
        norm_eps=1e-6,
    ),
    "qwen2-0.5b": dict(
        family="qwen2",
        n_layers=24,
        d_model=896,
        n_heads=14,
        n_kv_heads=2,
        ffn_hidden=4864,
        vocab_size=151936,
        seq_len=2048,
        tie_embeddings=True,
        rope_theta=1000000.0,
        norm_eps=1e-6,
    ),
    "qwen2-7b": dict(
        family="qwen2",
        n_layers=28,
        d_model=3584,
        n_heads=28,
        n_kv_heads=4,
        ffn_hidden=18944,
        vocab_size=152064,
        seq_len=2048,
        tie_embeddings=False,
        rope_theta=1000000.0,
        norm_eps=1e-6,
    ),
    "qwen2-72b": dict(
        family="qwen2",
        n_layers=80,
        d_model=8192,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=29568,
        vocab_size=152064,
        seq_len=2048,
        tie_embeddings=False,
        rope_theta=1000000.0,
        norm_eps=1e-5,
    ),
    # Qwen3 dense (Yang et al. 2025; the released config.json files of Qwen/Qwen3-0.6B, -1.7B, -4B, -8B, -14B,
    # -32B): Llama with per-head q/k RMSNorms, no biases, head dim 128 (= hidden / heads in 1.7B, 8B and 14B; 0.6B,
    # 4B and 32B give head_dim 128 explicitly, so their attention is n_heads·128 wide, not hidden), vocabulary
    # 151936, RoPE base 10⁶, RMSNorm eps 1e-6; 0.6B, 1.7B and 4B tie embeddings, 8B, 14B and 32B do not.
    # Context: tessera's 2048-token training default (the models' is 40960).
    "qwen3-tiny": dict(
        family="qwen3",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=96,
        vocab_size=_TINY_VOCAB,
        seq_len=32,
        tie_embeddings=False,
        rope_theta=1000000.0,
        norm_eps=1e-6,
    ),
    "qwen3-0.6b": _qwen3(28, 1024, 16, 3072, tie=True, head_dim=128),
    "qwen3-1.7b": _qwen3(28, 2048, 16, 6144, tie=True),
    "qwen3-4b": _qwen3(36, 2560, 32, 9728, tie=True, head_dim=128),
    "qwen3-8b": _qwen3(36, 4096, 32, 12288, tie=False),
    "qwen3-14b": _qwen3(40, 5120, 40, 17408, tie=False),
    "qwen3-32b": _qwen3(64, 5120, 64, 25600, tie=False, head_dim=128),
    # Gemma 2 (Gemma Team 2024, arXiv 2408.00118; the released config.json files of google/gemma-2-2b, -9b, -27b):
    # head_dim 256 (2B, 9B) or 128 (27B) ≠ hidden / heads, the 27B's scores scaled by 144^-0.5 instead of its
    # head_dim's 128^-0.5. gemma2-tiny: a test shape with soft-caps that bite at its logits' size.
    "gemma2-tiny": dict(
        family="gemma2",
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_hidden=64,
        vocab_size=_TINY_VOCAB,
        seq_len=32,
        norm_eps=1e-6,
        query_pre_attn_scalar=16,
        attn_softcap=1.5,
        final_softcap=2.0,
    ),
    "gemma2-2b": _gemma2(26, 2304, 8, 4, 256, 9216, 256),
    "gemma2-9b": _gemma2(42, 3584, 16, 8, 256, 14336, 256),
    "gemma2-27b": _gemma2(46, 4608, 32, 16, 128, 36864, 144),
    # Gemma 3 text (Gemma Team 2025, arXiv 2503.19786; google/gemma-3-1b-pt's released config.json): head_dim 256 ≠
    # 1152 / 4, one KV head, 5 local layers (window 512, RoPE base 10⁴) to 1 global (base 10⁶), no soft-caps,
    # context 32768. gemma3-tiny: a test shape whose 4-position window is narrower than its context.
    "gemma3-tiny": dict(
        family="gemma3",
        n_layers=3,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_hidden=64,
        vocab_size=_TINY_VOCAB,
        seq_len=32,
        norm_eps=1e-6,
        query_pre_attn_scalar=16,
        sliding_window=4,
        sliding_window_pattern=2,
        rope_theta=1e6,
        rope_local_theta=10000.0,
    ),
    "gemma3-1b": dict(
        family="gemma3",
        n_layers=26,
        d_model=1152,
        n_heads=4,
        n_kv_heads=1,
        head_dim=256,
        ffn_hidden=6912,
        vocab_size=262144,
        seq_len=32768,
        tie_embeddings=True,
        norm_eps=1e-6,
        query_pre_attn_scalar=256,
        sliding_window=512,
        sliding_window_pattern=6,
        rope_theta=1e6,
        rope_local_theta=10000.0,
    ),
    # Gemma 3 4B, 12B, 27B: the language models of the released Gemma3ForConditionalGeneration folders
    # (google/gemma-3-4b-pt, -12b-pt, -27b-pt config.json "text_config", the keys it leaves out at Gemma3TextConfig's
    # defaults: vocabulary 262208, 8 heads, 4 KV heads, head_dim 256, query_pre_attn_scalar 256, context 131072).
    # Window 1024 on 5 local layers to 1 global; the global layers' RoPE linearly scaled by 8 (positions
    # interpolated to the 128K context), the local ones unscaled.
    "gemma3-4b": _gemma3(34, 2560, 8, 4, 256, 10240, 256),
    "gemma3-12b": _gemma3(48, 3840, 16, 8, 256, 15360, 256),
    "gemma3-27b": _gemma3(62, 5376, 32, 16, 128, 21504, 168),
    # GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, h 12288, 96 heads of 128, context 2048; GPT-2's BPE
    # vocabulary padded to 51200 (a multiple of 1024, as Megatron-LM pads it), tied embeddings.
    "gpt3-175b": dict(family="gpt", n_layers=96, d_model=12288, n_heads=96, vocab_size=51200, seq_len=2048),
    # Megatron-LM's 1T model (Narayanan et al. 2021, Table 1): 128 layers, h 25600, 160 heads, s 2048, V 51200;
    # the planner's Megatron table validates against it (tessera/planner/megatron_table.py).
    "megatron-1t": dict(
        family="gpt", n_layers=128, d_model=25600, n_heads=160, vocab_size=51200, seq_len=2048
    ),
}


def size_names() -> list[str]:
    """All registered size names, in registry order."""
    return list(SIZES)
