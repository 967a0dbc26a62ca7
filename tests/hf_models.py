"""Tiny random-weight `transformers` models saved as `save_pretrained` folders (no downloads), for the HF tests."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = [
    "GEMMA3_LINEAR",
    "GEMMA3_LOCAL",
    "HEAD_DIMS",
    "KINDS",
    "LLAMA3_ROPE",
    "VOCAB",
    "hf_config",
    "make_gemma3_multimodal",
    "make_hf",
    "rel_err",
    "train_bpe",
]

VOCAB = 259
"""Not divisible by 2 or 4, so tensor-parallel vocabulary padding is exercised; covers the byte data (256)."""

KINDS = (
    "gpt2",
    "gpt2_untied",
    "llama",
    "llama_tied",
    "llama3",
    "mistral",
    "qwen2",
    "qwen2_tied",
    "qwen3",
    "qwen3_tied",
    "llama_hd",
    "mistral_hd",
    "qwen3_hd",
    "gemma2_tied",
    "gemma2_qpas",
    "gemma2_nocap_tied",
    "gemma3_tied",
    "gemma3_qpas",
)
"""gpt2 (tied), gpt2_untied, llama (grouped-query attention, untied), llama_tied, llama3 (Llama with Llama 3.1's
RoPE scaling, `LLAMA3_ROPE`), mistral (MistralForCausalLM without a sliding window), qwen2 (Llama with q/k/v
biases, GQA, untied), qwen2_tied, qwen3 (Llama with per-head q/k norms, GQA, untied), qwen3_tied; and with a
head_dim other than hidden / heads = 8 (as Qwen3-0.6B/4B/32B and Mistral-Nemo): llama_hd (head_dim 12: q_proj
32 → 48), mistral_hd and qwen3_hd (head_dim 16: q_proj 32 → 64, o_proj 64 → 32); Gemma 2 (head_dim 16, GQA,
`GEMMA2_CAPS` soft-caps, a sliding window as wide as the context): gemma2_tied (query_pre_attn_scalar = head_dim),
gemma2_qpas (scalar 24 ≠ head_dim, untied), gemma2_nocap_tied (both caps null); Gemma 3 text (head_dim 16, GQA,
`GEMMA3_LOCAL`: windows far narrower than the context, local and global layers with different RoPE bases):
gemma3_tied (3 layers, pattern 2: local, global, local; window 4), gemma3_qpas (4 layers, pattern 3: local, local,
global, local; window 5; scalar 24, untied)."""

HEAD_DIMS = {
    "llama_hd": 12,
    "mistral_hd": 16,
    "qwen3_hd": 16,
    "gemma2_tied": 16,
    "gemma2_qpas": 16,
    "gemma2_nocap_tied": 16,
    "gemma3_tied": 16,
    "gemma3_qpas": 16,
}
"""The head_dim of each kind that gives one (the others: hidden / heads = 8)."""

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 128,
}
"""llama3 scaling for the tiny shapes (head dim 8): the wavelengths 2π/f are 6.3, 94, 1405 and 21000 positions,
so with 128/8 = 16 and 128/1 = 128 as the band's ends one frequency is kept, one interpolated and two divided
by the factor (the released models' 8192 would divide all but the first). transformers warns that
original_max_position_embeddings is not below max_position_embeddings (32); it computes the same formula."""


GEMMA2_CAPS = {"attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.0}
"""Soft-caps that bite at the tiny shapes (scores and logits of order one; the released 50 and 30 would leave them
nearly linear), so a cap left out or misplaced moves the logits by far more than the tolerance."""


GEMMA3_LOCAL = {
    "gemma3_tied": dict(num_hidden_layers=3, sliding_window=4, pattern=2),
    "gemma3_qpas": dict(num_hidden_layers=4, sliding_window=5, pattern=3),
}
"""Each Gemma 3 kind's layers, window and pattern (every pattern-th layer global): windows of 4 and 5 positions, so
at the tests' 16-32 positions a band left out, off by one or put on the wrong layers moves the logits. RoPE bases
1e6 (global) and 10 (local): swapped tables would show at every position past the first."""


def hf_config(kind: str, **over: object):
    """A tiny transformers config of ``kind``; weights drawn with std 0.2 so that logits are of order one."""
    import transformers

    common = dict(vocab_size=VOCAB, initializer_range=0.2, bos_token_id=0, eos_token_id=1)
    if kind.startswith("gpt2"):
        return transformers.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
            tie_word_embeddings=kind == "gpt2",
            **common,
            **over,
        )
    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    if kind in HEAD_DIMS:
        over = {"head_dim": HEAD_DIMS[kind], **over}
        kind = kind.removesuffix("_hd")
    if kind.startswith("gemma2"):
        caps = dict.fromkeys(GEMMA2_CAPS) if "nocap" in kind else GEMMA2_CAPS
        gemma = dict(
            query_pre_attn_scalar=24 if kind == "gemma2_qpas" else over["head_dim"],
            sliding_window=shape["max_position_embeddings"],  # as wide as the context: masks nothing
            tie_word_embeddings=kind.endswith("_tied"),
            # Gemma2Config's pad_token_id 0 makes transformers' embedding zero that row's lookup gradient
            # (padding_idx); tessera trains every row (docs/huggingface.md), so the fixture has no pad token
            pad_token_id=None,
            **caps,
        )
        return transformers.Gemma2Config(
            **shape, rope_theta=1e4, rms_norm_eps=1e-6, **common, **(gemma | over)
        )
    if kind.startswith("gemma3"):
        local = dict(GEMMA3_LOCAL[kind])
        layers, p = local.pop("num_hidden_layers"), local.pop("pattern")
        gemma = dict(
            layer_types=["sliding_attention" if (i + 1) % p else "full_attention" for i in range(layers)],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            },
            query_pre_attn_scalar=24 if kind == "gemma3_qpas" else over["head_dim"],
            tie_word_embeddings=kind.endswith("_tied"),
            pad_token_id=None,  # as Gemma 2's fixture: tessera trains every embedding row
            **local,
        )
        return transformers.Gemma3TextConfig(
            **(shape | {"num_hidden_layers": layers}), rms_norm_eps=1e-6, **common, **(gemma | over)
        )
    if kind.startswith("qwen2"):
        tie = kind == "qwen2_tied"
        return transformers.Qwen2Config(
            **shape, tie_word_embeddings=tie, rope_theta=1e6, rms_norm_eps=1e-6, **common, **over
        )
    if kind == "mistral":
        over = {"sliding_window": None, **over}  # v0.2/v0.3: full attention (MistralConfig's default is 4096)
        return transformers.MistralConfig(**shape, rope_theta=1e6, rms_norm_eps=1e-6, **common, **over)
    if kind == "llama3":
        return transformers.LlamaConfig(**shape, rope_parameters=dict(LLAMA3_ROPE), **common, **over)
    if kind.startswith("qwen3"):  # head_dim given: Qwen3Config's default is 128, not hidden / heads
        tie = kind == "qwen3_tied"
        return transformers.Qwen3Config(
            **{**shape, "head_dim": 8, **common, **over},
            tie_word_embeddings=tie,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
        )
    return transformers.LlamaConfig(
        **shape, tie_word_embeddings=kind == "llama_tied", rope_theta=50000.0, **common, **over
    )


def make_hf(folder: Path, kind: str, seed: int = 0):
    """A random-weight transformers model of ``kind`` saved to ``folder``; returned in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind)).eval()
    if kind.startswith("qwen2"):  # transformers starts biases at 0; draw them so a mis-mapped one would show
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.2)
    # ... and the q/k norm weights at 1: draw them too (q_norm and k_norm swapped would show)
    if kind.startswith("qwen3"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(1.0, 0.5)
    # ... and Gemma's (1 + w) norm weights at 0: draw them (two of the four norms swapped would show)
    if kind.startswith(("gemma2", "gemma3")):  # Gemma 3's q/k norms too
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("layernorm.weight", "_norm.weight")) or name == "model.norm.weight":
                    p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model


GEMMA3_LINEAR = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
}
"""Gemma 3 4B/12B/27B's RoPE tables at the tiny shapes: the global layers' linearly scaled by 8 (every frequency
divided by it: at the tests' 16-32 positions the fastest turns 4 rad instead of 31), the local ones unscaled."""

TINY_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)
"""A SigLIP vision tower of 2 × 2 patches, with mm_tokens_per_image = 4: the projector pools nothing."""


def make_gemma3_multimodal(
    folder: Path, layout: str = "language_model", tied: bool = True, seed: int = 0, **text: object
):
    """A random-weight `Gemma3ForConditionalGeneration` (gemma3_tied's text config with `GEMMA3_LINEAR`, ``text``
    over it, and `TINY_VISION`) saved to ``folder``; returned in eval mode. ``layout`` names its weights:
    "language_model" as transformers 5.24's save_pretrained (and the released folders) write them
    ("language_model.model.*", "vision_tower.*"), "model.language_model" as its module names are
    ("model.language_model.*", "model.vision_tower.*", "lm_head.weight"), rewritten here from the saved file."""
    import transformers
    from safetensors.torch import load_file, save_file

    config = hf_config("gemma3_tied").to_dict() | {"rope_parameters": GEMMA3_LINEAR} | text
    for key in ("architectures", "dtype", "torch_dtype", "transformers_version", "tie_word_embeddings"):
        config.pop(key, None)
    mm = transformers.Gemma3Config(
        text_config=config, vision_config=TINY_VISION, mm_tokens_per_image=4, tie_word_embeddings=tied
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(mm).eval()
    with torch.no_grad():  # Gemma's (1 + w) norm weights start at 0: draw them, as make_hf does
        for name, p in model.model.language_model.named_parameters():
            if name.endswith(("layernorm.weight", "_norm.weight")) or name == "norm.weight":
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    if layout == "model.language_model":
        renames = {
            "language_model.model.": "model.language_model.",
            "language_model.lm_head.": "lm_head.",
            "vision_tower.": "model.vision_tower.",
            "multi_modal_projector.": "model.multi_modal_projector.",
        }
        tensors = load_file(folder / "model.safetensors")
        renamed = {}
        for name, t in tensors.items():
            old = next(o for o in renames if name.startswith(o))
            renamed[renames[old] + name[len(old) :]] = t
        save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of b."""
    return float((a - b).abs().max() / b.abs().max())


def train_bpe(path: Path, text: str, vocab_size: int = 300) -> None:
    """Train a byte-level BPE tokenizer on ``text`` (specials [UNK] = 0, <|endoftext|> = 1) and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator([text], trainer)
    tok.save(str(path))
