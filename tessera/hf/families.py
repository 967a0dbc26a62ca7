"""Supported Hugging Face architectures, one `HFFamily` table entry each; pure data, no torch.

An entry says which HF ``config.json`` key holds each tessera `ModelConfig` field, which HF settings must have
one exact value (anything else is refused by name: tessera would compute something else), and how every
weight is named and laid out. Adding an architecture whose blocks tessera already computes is one entry here.

Weight layout: an `HFTensor` is the concatenation, along its output dimension, of one or more tessera
parameters (GPT-2's fused ``c_attn`` = wq, wk, wv). ``conv1d`` marks GPT-2's Conv1D, which stores a Linear's
weight transposed ([in, out]). Names carry ``{i}`` for the block index. An entry whose tessera parameter the
model does not have (the output projection when it is tied to the embedding) is left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "FAMILIES",
    "TIED_HEAD",
    "HFFamily",
    "HFTensor",
    "family_for_model_type",
    "family_for_tessera",
    "weight_names",
]

TIED_HEAD = "lm_head.weight"
"""The output projection's HF name; saved by some versions next to the embedding it is tied to."""


@dataclass(frozen=True, slots=True)
class HFTensor:
    """One tensor of an HF checkpoint and the tessera parameters it holds."""

    hf: str
    """HF name, e.g. "model.layers.{i}.self_attn.q_proj.weight"."""
    parts: tuple[str, ...]
    """tessera parameter names concatenated along the HF tensor's output dimension (usually one)."""
    conv1d: bool = False
    """Stored [in, out] (GPT-2 Conv1D) rather than nn.Linear's [out, in]; only matters for 2-D weights."""


@dataclass(frozen=True, slots=True)
class HFFamily:
    """An HF architecture tessera represents exactly."""

    model_type: str
    """HF ``config.json`` "model_type", e.g. "llama"."""
    architecture: str
    """The ``AutoModelForCausalLM`` class name written to "architectures"."""
    family: str
    """tessera's `ModelConfig.family`."""
    keys: dict[str, str]
    """tessera ModelConfig field -> HF config key. A null or absent HF value falls back (see config.py)."""
    tie_default: bool
    """HF's default of "tie_word_embeddings" for this architecture."""
    required: dict[str, tuple[Any, ...]]
    """HF config key -> the values tessera computes exactly; absent keys take HF's default (the first value)."""
    tensors: tuple[HFTensor, ...]
    """Every weight, block weights with "{i}"."""
    embedding: str
    """HF name of the token embedding: a tied output projection is this tensor (checked against a saved
    ``lm_head.weight``)."""
    kv_heads_absent: int | None = None
    """transformers' KV head count when config.json lacks the key (None: the head count, as Llama's; a null
    value means the head count in every architecture)."""
    head_dim_absent: int | None = None
    """transformers' head dim when config.json lacks "head_dim" (None: hidden / heads, as Llama's)."""
    rope: bool = False
    """Whether the architecture uses rotary embeddings (rope_theta / rope_parameters apply)."""
    ignored: tuple[str, ...] = field(default=())
    """HF tensor names that are buffers, not weights (present in some old saves); skipped on import."""
    window_everywhere: bool = False
    """A non-null ``sliding_window`` applies to every layer whatever ``layer_types`` says (Mistral)."""
    window_without_layer_types: bool = False
    """Without ``layer_types`` a non-null ``sliding_window`` still applies to some layers (Gemma 2: transformers'
    Gemma2Config slides every other layer); with it, ``layer_types`` says which."""
    local_layers: bool = False
    """Gemma 3's local and global layers: ``layer_types`` becomes ``model.sliding_window_pattern``, the per-layer-type
    ``rope_parameters`` become ``model.rope_theta`` and ``model.rope_local_theta`` (tessera/hf/config.py), and the
    sliding window is computed rather than refused."""
    extra_keys: dict[str, tuple[str, Any]] = field(default_factory=dict)
    """Further tessera ModelConfig fields the architecture sets: field -> (HF config key, transformers' value when
    the key is absent). A null value means None (Gemma 2's soft-caps: no cap)."""
    unapplied: dict[str, str] = field(default_factory=dict)
    """tessera ModelConfig field -> the HF config key transformers' model of this architecture stores but never
    computes with (Gemma 3's attn_logit_softcapping: Gemma3Attention passes no softcap to its attention). The
    field imports as None whatever config.json says, as transformers computes, and a model with it set cannot be
    exported as this architecture."""
    text_config: str | None = None
    """A multimodal architecture's config.json key holding its language model's config (Gemma3ForConditionalGeneration:
    "text_config"). Its language model is imported: that config (`text_defaults` filling the keys it leaves out,
    the top-level "tie_word_embeddings" tying the head), its weights under one of `text_layouts`; the weights under
    `not_imported` are left unread. An export writes the text-only architecture of the same tessera family. None: a
    text-only architecture."""
    text_model_type: str = ""
    """The model_type the ``text_config`` must have (absent: taken as this one, the config class's sub-config)."""
    text_defaults: dict[str, Any] = field(default_factory=dict)
    """transformers' values of the text config's keys that a config.json may leave out: the released Gemma 3 4B/12B/
    27B folders list only the keys that differ from Gemma3TextConfig's defaults."""
    text_layouts: tuple[tuple[tuple[str, str], ...], ...] = ()
    """Each way a checkpoint names its language model's weights, as (text-only prefix, stored prefix) pairs: the
    text-only name "model.layers.0..." is stored as "language_model.model.layers.0..." in one layout."""
    not_imported: tuple[str, ...] = ()
    """Prefixes of the stored weights that are not imported (a vision tower, a multimodal projector)."""


def _t(hf: str, *parts: str, conv1d: bool = False) -> HFTensor:
    return HFTensor(hf=hf, parts=parts, conv1d=conv1d)


_GPT2_TENSORS = (
    _t("transformer.wte.weight", "embed.wte.weight"),
    _t("transformer.wpe.weight", "embed.wpe.weight"),
    _t("transformer.h.{i}.ln_1.weight", "blocks.{i}.attn_norm.weight"),
    _t("transformer.h.{i}.ln_1.bias", "blocks.{i}.attn_norm.bias"),
    _t(
        "transformer.h.{i}.attn.c_attn.weight",
        "blocks.{i}.attn.wq.weight",
        "blocks.{i}.attn.wk.weight",
        "blocks.{i}.attn.wv.weight",
        conv1d=True,
    ),
    _t(
        "transformer.h.{i}.attn.c_attn.bias",
        "blocks.{i}.attn.wq.bias",
        "blocks.{i}.attn.wk.bias",
        "blocks.{i}.attn.wv.bias",
        conv1d=True,
    ),
    _t("transformer.h.{i}.attn.c_proj.weight", "blocks.{i}.attn.wo.weight", conv1d=True),
    _t("transformer.h.{i}.attn.c_proj.bias", "blocks.{i}.attn.wo.bias", conv1d=True),
    _t("transformer.h.{i}.ln_2.weight", "blocks.{i}.mlp_norm.weight"),
    _t("transformer.h.{i}.ln_2.bias", "blocks.{i}.mlp_norm.bias"),
    _t("transformer.h.{i}.mlp.c_fc.weight", "blocks.{i}.mlp.fc.weight", conv1d=True),
    _t("transformer.h.{i}.mlp.c_fc.bias", "blocks.{i}.mlp.fc.bias", conv1d=True),
    _t("transformer.h.{i}.mlp.c_proj.weight", "blocks.{i}.mlp.proj.weight", conv1d=True),
    _t("transformer.h.{i}.mlp.c_proj.bias", "blocks.{i}.mlp.proj.bias", conv1d=True),
    _t("transformer.ln_f.weight", "head.norm.weight"),
    _t("transformer.ln_f.bias", "head.norm.bias"),
    _t("lm_head.weight", "head.out.weight"),
)

_LLAMA_TENSORS = (
    _t("model.embed_tokens.weight", "embed.tok.weight"),
    _t("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_norm.weight"),
    _t("model.layers.{i}.self_attn.q_proj.weight", "blocks.{i}.attn.wq.weight"),
    _t("model.layers.{i}.self_attn.k_proj.weight", "blocks.{i}.attn.wk.weight"),
    _t("model.layers.{i}.self_attn.v_proj.weight", "blocks.{i}.attn.wv.weight"),
    _t("model.layers.{i}.self_attn.o_proj.weight", "blocks.{i}.attn.wo.weight"),
    _t("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.mlp_norm.weight"),
    _t("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.mlp.w_gate.weight"),
    _t("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.mlp.w_up.weight"),
    _t("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.mlp.w_down.weight"),
    _t("model.norm.weight", "head.norm.weight"),
    _t("lm_head.weight", "head.out.weight"),
)

_LLAMA_KEYS = {
    "n_layers": "num_hidden_layers",
    "d_model": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_hidden": "intermediate_size",
    "vocab_size": "vocab_size",
    "seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
}

_GEMMA2_TENSORS = (
    _t("model.embed_tokens.weight", "embed.tok.weight"),
    _t("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_norm.weight"),
    _t("model.layers.{i}.self_attn.q_proj.weight", "blocks.{i}.attn.wq.weight"),
    _t("model.layers.{i}.self_attn.k_proj.weight", "blocks.{i}.attn.wk.weight"),
    _t("model.layers.{i}.self_attn.v_proj.weight", "blocks.{i}.attn.wv.weight"),
    _t("model.layers.{i}.self_attn.o_proj.weight", "blocks.{i}.attn.wo.weight"),
    # Gemma 2's post_attention_layernorm normalises the attention's output (Llama's is the MLP's pre-norm)
    _t("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.attn_post_norm.weight"),
    _t("model.layers.{i}.pre_feedforward_layernorm.weight", "blocks.{i}.mlp_norm.weight"),
    _t("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.mlp.w_gate.weight"),
    _t("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.mlp.w_up.weight"),
    _t("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.mlp.w_down.weight"),
    _t("model.layers.{i}.post_feedforward_layernorm.weight", "blocks.{i}.mlp_post_norm.weight"),
    _t("model.norm.weight", "head.norm.weight"),
    _t("lm_head.weight", "head.out.weight"),
)

# What Gemma 2 and 3 compute alike in tessera: tanh GELU, no attention bias, causal attention.
_GEMMA_REQUIRED = {
    "hidden_activation": ("gelu_pytorch_tanh",),
    "attention_bias": (False,),
    "use_bidirectional_attention": (None, False),
}

_GEMMA3_TENSORS = (
    *_GEMMA2_TENSORS[:6],
    _t("model.layers.{i}.self_attn.q_norm.weight", "blocks.{i}.attn.q_norm.weight"),
    _t("model.layers.{i}.self_attn.k_norm.weight", "blocks.{i}.attn.k_norm.weight"),
    *_GEMMA2_TENSORS[6:],
)

# Gemma 3 text (tessera/model/gemma3.py): Gemma 2 with (1 + w) q/k norms, local sliding-window layers with their
# own RoPE base, no soft-caps; Gemma3TextConfig's defaults (transformers 5.24): 4 KV heads, head_dim 256, scalar
# 256, caps null.
_GEMMA3_TEXT = HFFamily(
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    family="gemma3",
    keys=_LLAMA_KEYS,
    tie_default=True,
    required=_GEMMA_REQUIRED,
    tensors=_GEMMA3_TENSORS,
    embedding="model.embed_tokens.weight",
    kv_heads_absent=4,
    head_dim_absent=256,
    rope=True,
    ignored=(".rotary_emb.inv_freq",),
    local_layers=True,
    extra_keys={
        "query_pre_attn_scalar": ("query_pre_attn_scalar", 256),
        "final_softcap": ("final_logit_softcapping", None),
    },
    # transformers 5.24's Gemma3Attention keeps attn_logit_softcapping but never applies it (Gemma 2's passes
    # softcap=...): a folder with it set computes without the cap (found by benchmarks/hf_search.py)
    unapplied={"attn_softcap": "attn_logit_softcapping"},
)

GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
"""Gemma3TextConfig's defaults (transformers 5.24) for the keys tessera reads, which Gemma3Config fills into a
text_config that leaves them out (tests/unit/test_gemma3_multimodal.py compares them with the class)."""

# Gemma 3 4B/12B/27B (Gemma3ForConditionalGeneration, model_type "gemma3"): Gemma 3 text plus a SigLIP vision tower
# and a projector, which are not imported. Checkpoints name the language model "language_model.model.*" (head
# "language_model.lm_head.weight"), as the released folders and transformers 5.24's save_pretrained do, or
# "model.language_model.*" ("lm_head.weight"), the module names of transformers' class since 4.52, which a state dict
# saved directly holds; transformers 5.24's conversion_mapping.py ("llava") loads both. Gemma3ForConditionalGeneration
# applies neither soft-cap of its text config (its forward returns lm_head's logits as they are).
_GEMMA3_MULTIMODAL = replace(
    _GEMMA3_TEXT,
    model_type="gemma3",
    architecture="Gemma3ForConditionalGeneration",
    unapplied={"attn_softcap": "attn_logit_softcapping", "final_softcap": "final_logit_softcapping"},
    text_config="text_config",
    text_model_type="gemma3_text",
    text_defaults=GEMMA3_TEXT_DEFAULTS,
    text_layouts=(
        (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
        (("model.", "model.language_model."), ("lm_head.", "lm_head.")),
    ),
    not_imported=(
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    ),
)

FAMILIES: tuple[HFFamily, ...] = (
    HFFamily(
        model_type="gpt2",
        architecture="GPT2LMHeadModel",
        family="gpt",
        keys={
            "n_layers": "n_layer",
            "d_model": "n_embd",
            "n_heads": "n_head",
            "ffn_hidden": "n_inner",
            "vocab_size": "vocab_size",
            "seq_len": "n_positions",
            "norm_eps": "layer_norm_epsilon",
        },
        tie_default=True,
        required={
            # tessera's GPT MLP is GELU with the tanh approximation ("gelu_new" = "gelu_pytorch_tanh")
            "activation_function": ("gelu_new", "gelu_pytorch_tanh"),
            "scale_attn_weights": (True,),
            "scale_attn_by_inverse_layer_idx": (False,),
            "reorder_and_upcast_attn": (False,),
            "add_cross_attention": (False,),
        },
        tensors=_GPT2_TENSORS,
        embedding="transformer.wte.weight",
        ignored=(".attn.bias", ".attn.masked_bias"),
    ),
    HFFamily(
        model_type="llama",
        architecture="LlamaForCausalLM",
        family="llama",
        keys=_LLAMA_KEYS,
        tie_default=False,
        required={"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)},
        tensors=_LLAMA_TENSORS,
        embedding="model.embed_tokens.weight",
        rope=True,
        ignored=(".rotary_emb.inv_freq",),
    ),
    # Qwen2 is Llama plus q/k/v biases (the architecture implies them: no attention_bias key); tessera/model/qwen2.py.
    HFFamily(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        family="qwen2",
        keys=_LLAMA_KEYS,
        tie_default=False,
        required={"hidden_act": ("silu",)},
        tensors=(
            *_LLAMA_TENSORS,
            _t("model.layers.{i}.self_attn.q_proj.bias", "blocks.{i}.attn.wq.bias"),
            _t("model.layers.{i}.self_attn.k_proj.bias", "blocks.{i}.attn.wk.bias"),
            _t("model.layers.{i}.self_attn.v_proj.bias", "blocks.{i}.attn.wv.bias"),
        ),
        embedding="model.embed_tokens.weight",
        kv_heads_absent=32,  # Qwen2Config's num_key_value_heads default (measured with transformers 5)
        rope=True,
        ignored=(".rotary_emb.inv_freq",),
    ),
    # Mistral 7B (Jiang et al. 2023) is Llama's block: same keys and weight names, no bias keys (never biased),
    # a sliding_window over every layer (null in v0.2/v0.3) and 8 KV heads when the key is absent
    # (MistralConfig's default). Imports as tessera's llama; an imported Mistral exports as Mistral.
    HFFamily(
        model_type="mistral",
        architecture="MistralForCausalLM",
        family="llama",
        keys=_LLAMA_KEYS,
        tie_default=False,
        required={"hidden_act": ("silu",)},
        tensors=_LLAMA_TENSORS,
        embedding="model.embed_tokens.weight",
        kv_heads_absent=8,
        rope=True,
        ignored=(".rotary_emb.inv_freq",),
        window_everywhere=True,
    ),
    # Qwen3 (dense) is Llama plus an RMSNorm on each query and key head (q_norm, k_norm: [head_dim]), no biases
    # (attention_bias would put them on q/k/v and o); tessera/model/qwen3.py.
    HFFamily(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        family="qwen3",
        keys=_LLAMA_KEYS,
        tie_default=False,
        required={"hidden_act": ("silu",), "attention_bias": (False,)},
        tensors=(
            *_LLAMA_TENSORS,
            _t("model.layers.{i}.self_attn.q_norm.weight", "blocks.{i}.attn.q_norm.weight"),
            _t("model.layers.{i}.self_attn.k_norm.weight", "blocks.{i}.attn.k_norm.weight"),
        ),
        embedding="model.embed_tokens.weight",
        kv_heads_absent=32,  # Qwen3Config's defaults: num_key_value_heads 32, head_dim 128 (transformers 5.24)
        head_dim_absent=128,
        rope=True,
        ignored=(".rotary_emb.inv_freq",),
    ),
    # Gemma 2 (tessera/model/gemma2.py): four (1 + w) RMSNorms per block, scaled embeddings, GeGLU, soft-capped
    # attention and final logits, attention scaled by query_pre_attn_scalar^-0.5; Gemma2Config's defaults
    # (transformers 5.24) for the keys a hand-written config.json may lack: 4 KV heads, head_dim 256, scalar 256,
    # caps 50 and 30.
    HFFamily(
        model_type="gemma2",
        architecture="Gemma2ForCausalLM",
        family="gemma2",
        keys=_LLAMA_KEYS,
        tie_default=True,
        required=_GEMMA_REQUIRED,
        tensors=_GEMMA2_TENSORS,
        embedding="model.embed_tokens.weight",
        kv_heads_absent=4,
        head_dim_absent=256,
        rope=True,
        ignored=(".rotary_emb.inv_freq",),
        window_without_layer_types=True,
        extra_keys={
            "query_pre_attn_scalar": ("query_pre_attn_scalar", 256),
            "attn_softcap": ("attn_logit_softcapping", 50.0),
            "final_softcap": ("final_logit_softcapping", 30.0),
        },
    ),
    _GEMMA3_TEXT,
    _GEMMA3_MULTIMODAL,
)


def weight_names(fam: HFFamily, n_layers: int, tied: bool) -> set[str]:
    """The HF tensor names a folder of this shape holds (without the output projection when tied)."""
    names = {t.hf.format(i=i) for t in fam.tensors for i in (range(n_layers) if "{i}" in t.hf else [0])}
    return names - {TIED_HEAD} if tied else names


def family_for_model_type(model_type: str) -> HFFamily | None:
    """The entry for an HF "model_type", or None."""
    return next((f for f in FAMILIES if f.model_type == model_type), None)


def family_for_tessera(family: str) -> HFFamily | None:
    """The entry an export of a tessera family writes (the first of that family: llama, not mistral), or None."""
    return next((f for f in FAMILIES if f.family == family), None)
