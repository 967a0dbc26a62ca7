"""The model as the cost model sees it (`ModelShape`), its FLOPs, and the published closed forms.

Symbols as in `tessera.planner.cost`. Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.model.family import FamilyPlan, LinearShape, family_plan, head_dim_of, is_global_layer
from tessera.modes import CHECKPOINTING

__all__ = [
    "RECOMPUTE",
    "ROW_PARALLEL",
    "ModelShape",
    "hardware_flops_per_token",
    "layer_forward_flops",
    "linears",
    "logits_forward_flops",
    "model_flops_per_token",
    "narayanan_flops_per_iteration",
    "narayanan_params",
]

RECOMPUTE = CHECKPOINTING
"""Activation recomputation modes: the checkpointing modes of `tessera.modes`."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelShape:
    """The parts of a model configuration that the cost model needs.

    The family's declaration (`features`, tessera/model/family.py) says which biases, norms, position table and
    MLP matrices a block has. Without a `family`, `swiglu` picks one: False is GPT style (LayerNorm with bias,
    biased linears, GELU MLP, learned positions), True Llama style (RMSNorm, no biases, SwiGLU, rotary).
    """

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int
    swiglu: bool = False
    tied: bool = True
    dropout: bool = False
    """Dropout layers present (adds 1-byte masks to activation memory and HBM traffic, Korthikanti's accounting)."""
    family: str | None = None
    """`ModelConfig.family`; None: GPT or Llama style by `swiglu`."""
    head_dim: int | None = None
    """Features per head; None means d_model / n_heads (`ModelConfig.head_dim`). Resolved at construction by
    `tessera.model.family.head_dim_of`: an int on every constructed shape."""
    attn_softcap: float | None = None
    """Attention logit soft-cap (`ModelConfig.attn_softcap`, Gemma 2): attention is then computed explicitly and
    keeps its a·s² scores for backward (`tessera.planner.cost.rank_memory.capped_score_bytes`)."""
    final_softcap: float | None = None
    """Final logit soft-cap (`ModelConfig.final_softcap`): the head keeps one more logits-sized tensor (tanh's)."""
    local_layers: int = 0
    """Layers attending within a sliding window (Gemma 3's local layers, `tessera.model.family.is_global_layer`):
    they share one [s, s] band mask per micro-batch, which their SDPA keeps for backward
    (`tessera.planner.cost.rank_memory.attention_bias_bytes`)."""

    def __post_init__(self) -> None:
        if (self.head_dim is None and self.d_model % self.n_heads) or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) unless head_dim is given, "
                f"and n_heads by n_kv_heads ({self.n_kv_heads})"
            )
        object.__setattr__(self, "head_dim", head_dim_of(self.d_model, self.n_heads, self.head_dim))

    @property
    def q_dim(self) -> int:
        """The attention's inner width n_heads · head_dim (wq's outputs, wo's inputs; d_model by default)."""
        return self.n_heads * self.head_dim

    @property
    def features(self) -> FamilyPlan:
        """The family's declaration: its biases, norms, position table and MLP matrices."""
        return family_plan(self.family or ("llama" if self.swiglu else "gpt"))

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def block_linears(self) -> tuple[LinearShape, ...]:
        """Every Linear of one block with its global shape (`FamilyPlan.block_linears`)."""
        return self.features.block_linears(self.d_model, self.q_dim, self.kv_dim, self.ffn_hidden)

    def block_matmul_params(self) -> int:
        """Weights of one block's matrix multiplies (`FamilyPlan.block_matmul_params`)."""
        return self.features.block_matmul_params(self.d_model, self.q_dim, self.kv_dim, self.ffn_hidden)

    def layer_params(self) -> int:
        """Weights + biases + norm parameters of one block: h(q + 2·kv) + q·h + c·h·f (q = n_heads·head_dim, = h
        by default; c = 3 for a gated MLP, else 2) plus the family's biases, norms (two; four with Gemma 2's
        post-norms) and per-head q/k norms (Qwen3: 2·head_dim). GPT with f = 4h, g = a: 12h² + 13h (Narayanan
        eq. 2)."""
        return self.features.block_params(
            self.d_model, self.q_dim, self.kv_dim, self.ffn_hidden, self.head_dim
        )

    def embedding_params(self) -> int:
        """Token embedding (+ learned positions, GPT) (+ untied output head) + final norm."""
        h, fam = self.d_model, self.features
        n = self.vocab_size * h + fam.position_params(self.seq_len, h)
        n += 0 if self.tied else self.vocab_size * h
        return n + fam.norm_params(h)

    def n_params(self) -> int:
        """Total parameter count."""
        return self.n_layers * self.layer_params() + self.embedding_params()

    def n_params_non_embedding(self) -> int:
        """Parameters outside embeddings/head (Kaplan's N): L × layer_params."""
        return self.n_layers * self.layer_params()

    @classmethod
    def from_config(cls, obj: Any) -> ModelShape:
        """Duck-typed from an object with n_layers, d_model, n_heads, vocab_size, seq_len and optionally
        n_kv_heads (None ⇒ n_heads), ffn_hidden (None ⇒ the family's rule), family (its declaration gives
        swiglu), swiglu, tie_embeddings/tied, dropout (a rate > 0 ⇒ True), head_dim (None ⇒ d_model / n_heads)."""
        h = int(obj.d_model)
        family = getattr(obj, "family", None)
        fam = family_plan(family or ("llama" if getattr(obj, "swiglu", False) else "gpt"))
        swiglu = fam.gated_mlp
        ffn = getattr(obj, "ffn_hidden", None) or fam.default_ffn(h)
        tied = getattr(obj, "tie_embeddings", getattr(obj, "tied", True))
        return cls(
            n_layers=int(obj.n_layers),
            d_model=h,
            n_heads=int(obj.n_heads),
            n_kv_heads=int(getattr(obj, "n_kv_heads", None) or obj.n_heads),
            ffn_hidden=int(ffn),
            vocab_size=int(obj.vocab_size),
            seq_len=int(obj.seq_len),
            swiglu=swiglu,
            tied=bool(tied),
            dropout=bool(getattr(obj, "dropout", 0) or 0),
            family=family,
            head_dim=getattr(obj, "head_dim", None),
            attn_softcap=getattr(obj, "attn_softcap", None),
            final_softcap=getattr(obj, "final_softcap", None),
            local_layers=sum(not is_global_layer(obj, i) for i in range(int(obj.n_layers))),
        )


def layer_forward_flops(shape: ModelShape, tokens: float, *, attention: bool = True) -> float:
    """Matmul FLOPs of one block's forward on `tokens` tokens (sequences of length s, full attention).

    2·T·[h(q + 2·kv) + q·h + c·h·f] + 4·T·s·q, q = n_heads·head_dim (= h by default), c = 3 for SwiGLU else 2.
    GPT (q = kv = h, f = 4h): 24Th² + 4Tsh, Narayanan 2021 Appendix (per layer 24Bsh² + 4Bs²h). Attention scores
    and A·V: 2·T·s·q each (`attention`).
    """
    h, q, kv, f, s = shape.d_model, shape.q_dim, shape.kv_dim, shape.ffn_hidden, shape.seq_len
    dense = 2 * tokens * (h * (q + 2 * kv) + q * h + (3 if shape.swiglu else 2) * h * f)
    return dense + (4 * tokens * s * q if attention else 0.0)


def logits_forward_flops(shape: ModelShape, tokens: float) -> float:
    """Output projection forward: 2·T·h·V."""
    return 2 * tokens * shape.d_model * shape.vocab_size


def model_flops_per_token(shape: ModelShape) -> float:
    """Model FLOPs per token for forward + backward (backward = 2× forward), no recomputation (MFU convention).

    = 3·(L·layer_fwd + logits_fwd) per token. GPT: 72Lh²(1 + s/(6h) + V/(12Lh)) (Korthikanti eq. 7); general
    GQA/SwiGLU: 12Lh²[(1 + g/a + s/h) + (f/h)(3/2 if SwiGLU else 1) + V/(2Lh)] (Megatron-Core, §1.5).
    """
    return 3 * (shape.n_layers * layer_forward_flops(shape, 1) + logits_forward_flops(shape, 1))


def hardware_flops_per_token(shape: ModelShape, recompute: str = "full") -> float:
    """FLOPs actually executed per token: model FLOPs plus the recomputed forward.

    full: + L·layer_fwd → GPT 96Lh²(1 + s/(6h) + V/(16Lh)) (Narayanan eq. 3 per token);
    selective: + the recomputed attention forward (QKᵀ and A·V) 4sq per layer (q = n_heads·head_dim, = h by default) → 72Lh²(1 + 2s/(9h) + V/(12Lh)).
    Note Korthikanti eq. 8 writes 72Lh²(1 + s/(3h) + ...), i.e. +12sh per layer (their "2.7 % extra" for GPT-3);
    we count only the replayed forward GEMMs. The difference is ≤ 2 % of total FLOPs for s ≤ h.
    """
    _check_recompute(recompute)
    extra = 0.0
    if recompute == "full":
        extra = shape.n_layers * layer_forward_flops(shape, 1)
    elif recompute == "selective":
        extra = shape.n_layers * 4 * shape.seq_len * shape.q_dim
    return model_flops_per_token(shape) + extra


def palm_flops_per_token(shape: ModelShape) -> float:
    """PaLM's MFU numerator (arXiv 2204.02311 App. B), as Llama 3, torchtitan, fms-fsdp and MosaicML count: 6·N +
    12·L·H·Q·s per token (H heads of width Q: n_heads·head_dim, h by default), N every parameter, attention over
    the whole sequence (no causal halving)."""
    return 6 * shape.n_params() + 12 * shape.n_layers * shape.q_dim * shape.seq_len


def narayanan_flops_per_iteration(batch: int, seq_len: int, n_layers: int, hidden: int, vocab: int) -> float:
    """Narayanan 2021 eq. 3: F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (includes the recompute forward)."""
    b, s, l, h, v = batch, seq_len, n_layers, hidden, vocab
    return 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))


def narayanan_params(seq_len: int, n_layers: int, hidden: int, vocab: int) -> float:
    """Narayanan 2021 eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    l, h = n_layers, hidden
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


ROW_PARALLEL = (False, True, False, True)
"""Which of `linears` Megatron splits by input width (row-parallel: proj, fc2); the others by output width."""


def linears(shape: ModelShape) -> list[tuple[int, int]]:
    """(input width, output width) of the four linears of a block: QKV, proj, fc1 (+gate), fc2."""
    h, q, f = shape.d_model, shape.q_dim, shape.ffn_hidden
    return [(h, q + 2 * shape.kv_dim), (q, h), (h, (2 if shape.swiglu else 1) * f), (f, h)]
