"""What each model family is, declared once: its parallel plan, its features and its parameter/FLOP terms.

A `FamilyPlan` says which Linears of a block read the block's input (column-parallel in Megatron 1D; their
outputs are the MLP activation's arguments) and which one writes back to the residual stream (row-parallel),
which vectors stay replicated, whether the family has learned positions, RoPE, biases, a gated MLP, and what
norm it uses. The model code builds its modules from it (tessera/model/gpt.py, llama.py, ...), and everything
that must know the family reads it instead of inspecting modules or comparing family names: tensor
parallelism (tessera/parallel/model_1d.py, model_2d.py, layers_2d.py), the config's defaults and checks, the
cost model's parameter counts (tessera/planner/cost.py ModelShape), the memory and start-up estimates.

Pure data, no torch import, so the config, planner and estimator can read it (the family modules themselves
need torch, which is why the declarations live here and each family module refers to its entry).

How each parameter is laid out follows from its role (docs/tensor-1d.md, docs/tensor-2d.md):

============================  ======================================  ===========================================
parameter                     Megatron 1D (t ranks)                    Optimus 2D (q×q grid, rank (i, j))
============================  ======================================  ===========================================
token embedding, head.out     ``vocab``: rows split (V padded to t)   ``vocab``: V by i (padded to q), h by j
``attention_in``/``mlp_in``   ``column``: weight rows (and bias) split ``linear``: weightᵀ block (i, j); bias by j
``attention_out``/``mlp_out`` ``row``: weight columns split, bias      ``linear``: weightᵀ block (i, j); bias by j
                              replicated
norm weights (and biases)     ``replicated``                          ``vector``: slice j, replicated over i
``attn.q_norm``/``k_norm``    ``replicated`` (gradient all-reduced:   ``grid``: whole on every rank (gradient
                              each rank normalises its own heads)     summed over the grid's rows and columns)
position table [S, h]         ``replicated``                          ``vector``: h by j, replicated over i
============================  ======================================  ===========================================
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from tessera.errors import ConfigError

__all__ = [
    "FAMILIES",
    "FAMILY_PLANS",
    "FamilyPlan",
    "LinearShape",
    "family_plan",
    "head_dim_of",
    "is_global_layer",
]

_NORMS = ("layer", "rms")
_FFN_RULES = ("4h", "swiglu")


def head_dim_of(d_model: int, n_heads: int, head_dim: int | None) -> int:
    """The per-head width a model uses: ``model.head_dim`` when given, else d_model / n_heads (the one place
    that decides it, for the config, the model and the estimators alike). Qwen3 and Mistral-Nemo give it
    explicitly (hidden 1024, 16 heads, head_dim 128 in Qwen3-0.6B's config.json), so the attention's inner width
    n_heads · head_dim may differ from d_model (transformers' LlamaAttention: q_proj hidden → heads·head_dim,
    o_proj heads·head_dim → hidden)."""
    return head_dim if head_dim is not None else d_model // n_heads


@dataclass(frozen=True, slots=True)
class LinearShape:
    """One Linear of a block: global in/out features, whether it has a bias, its 1D role."""

    name: str
    """Name inside the block, e.g. "attn.wq" or "mlp.w_down"."""
    d_in: int
    d_out: int
    bias: bool
    role: str
    """"column" (reads the block input: output features split) or "row" (writes the residual: input split)."""


@dataclass(frozen=True, slots=True)
class FamilyPlan:
    """One model family's declaration (see the module docstring for the layouts its roles imply)."""

    name: str
    """`ModelConfig.family`, e.g. "llama"."""
    token_embedding: str
    """Attribute of ``model.embed`` holding the token ``nn.Embedding`` (vocabulary-parallel; tied to the head)."""
    position_embedding: str | None
    """Attribute of ``model.embed`` holding the learned absolute position table [S, h] (replicated), or None."""
    rope: bool
    """Rotary positions inside attention (one shared ``model.rope``)."""
    norm: str
    """"layer" (LayerNorm: weight and bias) or "rms" (RMSNorm: weight only)."""
    mlp_in: tuple[str, ...]
    """MLP Linears reading the block input, in the order the MLP's ``activate`` takes their outputs."""
    mlp_out: str
    """MLP Linear writing back to the residual stream."""
    qkv_bias: bool
    """Biases on wq, wk, wv."""
    out_bias: bool
    """Bias on the attention output projection wo."""
    mlp_bias: bool
    """Biases on every MLP Linear."""
    ffn_rule: str
    """Default MLP width when ``model.ffn_hidden`` is unset: "4h", or "swiglu" (8h/3 rounded up to 64)."""
    qk_norm: bool = False
    """An RMSNorm over each head's features on the queries and on the keys (``attn.q_norm``, ``attn.k_norm``,
    weights [head_dim]) after the projections, before RoPE (Qwen3)."""
    attention_in: tuple[str, ...] = ("wq", "wk", "wv")
    """Attention Linears reading the block input (one region entry for all three)."""
    attention_out: str = "wo"
    """Attention Linear writing back to the residual stream."""
    free_head_dim: bool = True
    """Whether ``model.head_dim`` may differ from d_model / n_heads. GPT-2's config has no head_dim key (its head
    width is always n_embd / n_head), so the GPT family refuses it."""
    heads_divide_hidden: bool = False
    """Whether d_model must be a multiple of n_heads even when ``model.head_dim`` is given: transformers 5's
    ``LlamaConfig.validate_architecture`` refuses a Llama whose hidden size is not, so such a model could neither
    be imported from nor exported to a Llama folder (Gemma2Config has the same rule; Qwen2, Qwen3 and Mistral have
    none)."""
    post_norms: bool = False
    """Two more norms per block on the sublayers' outputs before each residual add (``attn_post_norm``,
    ``mlp_post_norm``; Gemma 2's post_attention_layernorm and post_feedforward_layernorm)."""
    norm_offset: float = 0.0
    """RMSNorm computes x̂·(offset + w) in fp32 and its weights start at 0 when this is 1 (Gemma's
    ``x * (1 + weight)``); 0: x̂·w with weights starting at 1 (Llama)."""
    embed_scale: bool = False
    """Token embeddings multiplied by sqrt(d_model) (Gemma), the factor cast to the hidden dtype first."""
    softcaps: bool = False
    """Whether ``model.attn_softcap``, ``model.final_softcap`` and ``model.query_pre_attn_scalar`` apply (Gemma 2);
    other families refuse them (their Hugging Face configs have no place for them)."""

    local_attention: bool = False
    """Gemma 3's local layers: ``model.sliding_window``, ``model.sliding_window_pattern`` and
    ``model.rope_local_theta`` apply (tessera/model/gemma3.py decides each layer's window and RoPE base)."""

    def __post_init__(self) -> None:
        if self.norm not in _NORMS or self.ffn_rule not in _FFN_RULES:
            raise ValueError(f"family {self.name}: norm in {_NORMS}, ffn_rule in {_FFN_RULES}")
        if self.norm_offset and self.norm != "rms":
            raise ValueError(f"family {self.name}: norm_offset needs norm = 'rms'")

    @property
    def block_norms(self) -> tuple[str, ...]:
        """Names of one block's hidden-size norms: the two pre-norms, plus the post-norms if declared."""
        return ("attn_norm", "mlp_norm") + (("attn_post_norm", "mlp_post_norm") if self.post_norms else ())

    # --- features ----------------------------------------------------------------------------------------------

    @property
    def has_position_embedding(self) -> bool:
        return self.position_embedding is not None

    @property
    def gated_mlp(self) -> bool:
        """Two Linears read the MLP input (SwiGLU's gate and up)."""
        return len(self.mlp_in) > 1

    @property
    def norm_bias(self) -> bool:
        return self.norm == "layer"

    def default_ffn(self, d_model: int) -> int:
        """The MLP width when none is given."""
        if self.ffn_rule == "swiglu":
            return 64 * -(-(8 * d_model // 3) // 64)
        return 4 * d_model

    # --- the tensor-parallel plan ------------------------------------------------------------------------------

    @lru_cache(maxsize=256)  # noqa: B019 - frozen plans, a handful per run; the planner's search asks ~1e5 times
    def block_linears(self, d_model: int, q_dim: int, kv_dim: int, ffn: int) -> tuple[LinearShape, ...]:
        """Every Linear of one block with its global shape, bias and 1D role (column before row); ``q_dim`` is
        the attention's inner width n_heads · head_dim (d_model unless ``model.head_dim`` says otherwise)."""
        h = d_model
        qkv_out = {"wq": q_dim, "wk": kv_dim, "wv": kv_dim}
        out = [LinearShape(f"attn.{n}", h, qkv_out[n], self.qkv_bias, "column") for n in self.attention_in]
        out.append(LinearShape(f"attn.{self.attention_out}", q_dim, h, self.out_bias, "row"))
        out += [LinearShape(f"mlp.{n}", h, ffn, self.mlp_bias, "column") for n in self.mlp_in]
        out.append(LinearShape(f"mlp.{self.mlp_out}", ffn, h, self.mlp_bias, "row"))
        return tuple(out)

    def placement_1d(self, name: str) -> str:
        """How plain parameter ``name`` lies on the Megatron 1D group: "vocab", "column", "row" (weight only:
        its bias is "replicated") or "replicated"."""
        if name == "head.out.weight" or name == f"embed.{self.token_embedding}.weight":
            return "vocab"
        module, _, kind = name.rpartition(".")
        suffix = ".".join(module.split(".")[2:]) if name.startswith("blocks.") else ""
        if suffix in {f"attn.{n}" for n in self.attention_in} | {f"mlp.{n}" for n in self.mlp_in}:
            return "column"
        if suffix in (f"attn.{self.attention_out}", f"mlp.{self.mlp_out}"):
            return "row" if kind == "weight" else "replicated"
        return "replicated"

    def placement_2d(self, name: str) -> str:
        """How plain parameter ``name`` lies on the Optimus 2D grid: "vocab" (V by i, h by j), "linear" (the
        transposed weight's block (i, j)), "vector" (last dim by j, replicated over the grid rows i) or "grid"
        (whole on every rank: the per-head q/k norms, as each rank holds whole heads)."""
        if name.endswith(self.head_norms):
            return "grid"
        where = self.placement_1d(name)
        if where == "vocab":
            return "vocab"
        return "linear" if where in ("column", "row") and name.endswith(".weight") else "vector"

    @property
    def head_norms(self) -> tuple[str, ...]:
        """Block-relative names of the per-head q/k norm weights (none without ``qk_norm``)."""
        return ("attn.q_norm.weight", "attn.k_norm.weight") if self.qk_norm else ()

    @property
    def residual_outputs(self) -> tuple[str, ...]:
        """Block-relative names of the Linears writing into the residual stream (GPT-2's scaled init)."""
        return (f"attn.{self.attention_out}", f"mlp.{self.mlp_out}")

    def replicated_block_vectors(self) -> int:
        """h-sized parameters of one block replicated across the 1D tensor group (norm weights and biases,
        row-parallel biases): their gradients are all-reduced under sequence parallelism."""
        return len(self.block_norms) * self.norm_params(1) + self.out_bias + self.mlp_bias

    # --- parameter counts (the cost model's and the estimator's terms) -----------------------------------------

    def norm_params(self, d_model: int) -> int:
        """Parameters of one norm."""
        return (2 if self.norm_bias else 1) * d_model

    @lru_cache(maxsize=256)  # noqa: B019 - as block_linears
    def block_params(self, d_model: int, q_dim: int, kv_dim: int, ffn: int, head_dim: int) -> int:
        """Weights, biases, the block's norms (two, or four with post-norms) and the per-head q/k norms (if any)."""
        linears = self.block_linears(d_model, q_dim, kv_dim, ffn)
        linear = sum(lin.d_in * lin.d_out + lin.bias * lin.d_out for lin in linears)
        norms = len(self.block_norms) * self.norm_params(d_model)
        return linear + norms + self.head_norm_params(head_dim)

    def head_norm_params(self, head_dim: int) -> int:
        """Parameters of one block's per-head q/k norms (whole on every tensor rank, in 1D and 2D alike)."""
        return 2 * head_dim if self.qk_norm else 0

    def block_matmul_params(self, d_model: int, q_dim: int, kv_dim: int, ffn: int) -> int:
        """Weights of one block's matrix multiplies (forward FLOPs per token = 2 × this)."""
        return sum(lin.d_in * lin.d_out for lin in self.block_linears(d_model, q_dim, kv_dim, ffn))

    def position_params(self, seq_len: int, d_model: int) -> int:
        """The learned position table's parameters (0 without one)."""
        return seq_len * d_model if self.has_position_embedding else 0


FAMILY_PLANS: dict[str, FamilyPlan] = {}
"""Every family, by `ModelConfig.family`."""


def _register(plan: FamilyPlan) -> FamilyPlan:
    FAMILY_PLANS[plan.name] = plan
    return plan


# GPT-2 (Radford et al. 2019): learned positions, LayerNorm, GELU MLP, every Linear biased (tessera/model/gpt.py).
GPT = _register(
    FamilyPlan(
        name="gpt",
        token_embedding="wte",
        position_embedding="wpe",
        rope=False,
        norm="layer",
        mlp_in=("fc",),
        mlp_out="proj",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        ffn_rule="4h",
        free_head_dim=False,
    )
)

# Llama (Touvron et al. 2023): RoPE, RMSNorm, SwiGLU, no biases (tessera/model/llama.py).
LLAMA = _register(
    FamilyPlan(
        name="llama",
        token_embedding="tok",
        position_embedding=None,
        rope=True,
        norm="rms",
        mlp_in=("w_gate", "w_up"),
        mlp_out="w_down",
        qkv_bias=False,
        out_bias=False,
        mlp_bias=False,
        ffn_rule="swiglu",
        heads_divide_hidden=True,
    )
)

# Qwen2 (Yang et al. 2024): Llama with biases on wq, wk, wv only (tessera/model/qwen2.py).
QWEN2 = _register(replace(LLAMA, name="qwen2", qkv_bias=True, heads_divide_hidden=False))

# Qwen3 (Yang et al. 2025, "Qwen3 Technical Report"; dense sizes): Llama with an RMSNorm on each query and key head
# before RoPE, no biases (tessera/model/qwen3.py).
QWEN3 = _register(replace(LLAMA, name="qwen3", qk_norm=True, heads_divide_hidden=False))

# Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size"): Llama's block with
# RMSNorm x̂·(1 + w), norms before and after each sublayer, embeddings scaled by sqrt(d_model), a GeGLU MLP (GELU,
# tanh approximation), attention logits and final logits soft-capped (tessera/model/gemma2.py).
GEMMA2 = _register(
    replace(
        LLAMA,
        name="gemma2",
        post_norms=True,
        norm_offset=1.0,
        embed_scale=True,
        softcaps=True,
    )
)

# Gemma 3 (Gemma Team 2025, "Gemma 3 Technical Report"): Gemma 2's block with per-head q/k RMSNorms (the (1 + w)
# form), no soft-caps by default, local sliding-window layers with their own RoPE base between global layers
# (tessera/model/gemma3.py).
GEMMA3 = _register(replace(GEMMA2, name="gemma3", qk_norm=True, local_attention=True))

FAMILIES: tuple[str, ...] = tuple(FAMILY_PLANS)
"""The family names a config may give."""


def is_global_layer(cfg: Any, layer: int) -> bool:
    """Whether layer ``layer`` (0-based, the model's global index) of ``cfg`` (a `ModelConfig`) attends to every
    earlier position: every layer without ``sliding_window``, else the layers with (layer + 1) a multiple of
    ``sliding_window_pattern`` (transformers' Gemma3TextConfig layer_types). The one place that decides it, for
    the model (tessera/model/gemma3.py) and the Hugging Face export alike."""
    window = getattr(cfg, "sliding_window", None)
    return window is None or (layer + 1) % cfg.sliding_window_pattern == 0


def family_plan(family: str | Any) -> FamilyPlan:
    """The declaration of ``family``: a name, or anything with a ``.family`` (a `ModelConfig`, a model's cfg)."""
    name = family if isinstance(family, str) else family.family
    try:
        return FAMILY_PLANS[name]
    except KeyError:
        raise ConfigError(
            f"model.family = {name!r} is unknown; use one of {', '.join(FAMILY_PLANS)}"
        ) from None
