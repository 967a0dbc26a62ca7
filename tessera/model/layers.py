"""Building blocks shared by the GPT and Llama families, and the `TransformerLM` base class.

The model is deliberately plain: an embedding, a `ModuleDict` of blocks keyed "0".."L-1", and a head.
Parallelism (tensor, pipeline, checkpointing, ZeRO) is applied from outside by replacing or wrapping these
modules, so their attribute names are part of the API:

    model.embed                     tokens [b, s] -> hidden [b, s, h]
    model.blocks["i"]               hidden -> hidden; .attn_norm .attn(.wq .wk .wv [.q_norm .k_norm] .wo .core)
                                    .mlp_norm .mlp
    model.head                      hidden -> logits [b, s, V]; .norm .out

Linear layers inside attention use the local head count implied by their output width (`view(b, s, -1, hd)`),
so a tensor-parallel rank that holds a column shard of `wq`/`wk`/`wv` runs the same forward code on its heads.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.model.documents import AttentionMasks, Documents, additive_mask, band_mask
from tessera.model.targets import check_reduction
from tessera.parallel.precision import cast_weight

if TYPE_CHECKING:
    from tessera.config import ModelConfig
    from tessera.model.family import FamilyPlan

__all__ = [
    "Attention",
    "AttentionCore",
    "Block",
    "Head",
    "KVCache",
    "LayerKV",
    "RMSNorm",
    "Rope",
    "TransformerLM",
    "additive_mask",
    "apply_rope",
    "attend",
    "band_mask",
    "compute_dtype",
    "embed_scale",
    "rope_inv_freq",
    "rope_tables",
    "soft_cap",
]


class Linear(nn.Linear):
    """nn.Linear whose weight and bias reach F.linear through `precision.cast_weight` inside tessera's autocast
    region: the one compute-dtype copy per region, but a cast node per call, so the weight's compute-dtype
    gradient is cast to fp32 and accumulated right after this call's backward instead of waiting for the node
    autocast's cache shares between micro-batches (docs/memory.md, "Mixed precision"). Same parameters and state
    dict as nn.Linear; the same numbers (autocast would make the same copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [.., in] -> [.., out]
        return F.linear(x, cast_weight(self.weight), cast_weight(self.bias))


class RMSNorm(nn.Module):
    """Root-mean-square norm with a weight and no bias (Llama); statistics in fp32 whatever the dtype.

    With ``offset`` (Gemma: 1) the output is x̂·(offset + w), computed in fp32 and then cast, as transformers'
    ``Gemma2RMSNorm``; its weight then starts at 0 (`tessera.model.init`)."""

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # x: [..., h]
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # xf: [..., h]
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)  # [..., h]
        return xf.to(x.dtype) * self.weight  # [..., h]


def embed_scale(d_model: int, dtype: torch.dtype) -> float:
    """Gemma's embedding multiplier sqrt(d_model) as transformers' scaled embedding holds it (an fp32 tensor) cast
    to the embedding's dtype, as a Python number (no device tensor per step); the plain, 1D and 2D embeddings of a
    family declaring ``embed_scale`` multiply their lookups by it."""
    return float(torch.tensor(d_model**0.5, dtype=torch.float32).to(dtype))


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap·tanh(x / cap), elementwise (Gemma 2's attention and final logit soft-capping); x itself without a cap.
    The same operations in the same order as transformers (divide, tanh, multiply), so the same bits."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The inverse frequencies [head_dim/2] of RoPE, fp32: 1 / theta^(2i/hd) as Su et al. (2021), Meta's Llama
    reference and transformers compute them (the same operations in the same order, so the same bits), then
    ``scaling`` (`tessera.model.rope_scaling`: llama3, by the published ``apply_scaling`` formula; linear, every
    frequency divided by the factor, as transformers' ``_compute_linear_scaling_rope_parameters``)."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim  # [hd/2]
    inv_freq = 1.0 / (theta**exponent)  # inv_freq: [hd/2]
    if scaling is None:
        return inv_freq
    if scaling.get("type") == "linear":
        return inv_freq / scaling["factor"]  # [hd/2]
    if scaling.get("type") != "llama3":
        raise ValueError(
            f"RoPE scaling {scaling!r} is not implemented (model.rope_scaling: llama3 or linear)"
        )
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # [hd/2]
    # long wavelengths (> original / low) are divided by factor; short ones (< original / high) are kept
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)  # 0..1 across the band between
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(between, smoothed, scaled)  # [hd/2]


def rope_tables(
    head_dim: int,
    seq_len: int,
    theta: float,
    device: torch.device | None = None,
    scaling: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim/2] for positions 0..seq_len-1, computed in fp32."""
    if head_dim % 2:
        raise ValueError(
            f"RoPE needs an even head dim, got {head_dim}; choose model.head_dim (or d_model / n_heads) even"
        )
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)  # [hd/2]
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)  # angles: [s, hd/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, heads, s, hd] by position; cos/sin are [s, hd/2], already sliced to x's positions (or
    [b, 1, s, hd/2], gathered at each sequence's own positions).

    Uses the "rotate half" pairing (dimension i with i + hd/2), the convention of Hugging Face Llama
    checkpoints.
    Taking sliced tables lets a sequence-sharded caller pass its own positions.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()  # x1, x2: [b, nh, s, hd/2]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # out: [b, nh, s, hd]
    return out.to(x.dtype)


class Rope(nn.Module):
    """Rotary position embedding with precomputed, non-persistent cos/sin buffers [seq_len, hd/2].

    The buffers are not saved in state dicts; after materialising a meta-device model call `reset()`
    (`TransformerLM.init_weights` does).
    """

    def __init__(
        self, head_dim: int, seq_len: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.seq_len, self.theta = head_dim, seq_len, theta
        self.scaling = dict(scaling) if scaling is not None else None  # model.rope_scaling
        cos, sin = rope_tables(head_dim, seq_len, theta, scaling=self.scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset(self) -> None:
        """Recompute the tables in place on the buffers' current device."""
        cos, sin = rope_tables(self.head_dim, self.seq_len, self.theta, self.cos.device, self.scaling)
        with torch.no_grad():
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k, whose first position is ``start`` (> 0 when decoding after cached tokens), or whose
        positions are ``positions`` [b, s] (document masking: they restart at every document)."""
        if positions is not None:
            cos = self.cos[positions].unsqueeze(1)  # cos: [b, 1, s, hd/2]
            sin = self.sin[positions].unsqueeze(1)  # sin: [b, 1, s, hd/2]
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [b, nh, s, hd], [b, nkv, s, hd]
        s = q.shape[2]
        if start + s > self.seq_len:
            raise ValueError(
                f"sequence length {start + s} exceeds the RoPE table length model.seq_len = {self.seq_len}"
            )
        cos, sin = self.cos[start : start + s], self.sin[start : start + s]  # cos, sin: [s, hd/2]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [b, nh, s, hd], [b, nkv, s, hd]


class AttentionCore(nn.Module):
    """Causal softmax attention on already-projected heads; no parameters, so checkpointing can wrap it alone.

    ``scale`` multiplies the scores (None: 1/sqrt(head_dim), SDPA's default); ``softcap`` soft-caps them before
    the mask (`soft_cap`, Gemma 2); ``window`` restricts each query to the keys within it (`band_mask`, Gemma 3's
    local layers), cut here when no mask comes in (cached decoding, selective recomputation without documents).
    SDPA cannot soft-cap, so with a cap the scores [b, nh, L, S] are computed and held explicitly (s² memory per
    head, like transformers' eager attention); on a GPU FlexAttention's ``score_mod`` would apply the cap inside a
    fused kernel, but it needs torch.compile (docs/huggingface.md, "Gemma 2").

    q is [b, n_heads, s, hd] and k, v are [b, n_kv_heads, s, hd]; grouped-query attention repeats each KV head
    n_heads / n_kv_heads times (consecutive query heads share a KV head). Head counts come from the tensors,
    so a tensor-parallel rank holding a subset of heads uses it unchanged. With fewer queries than keys
    (decoding after cached tokens) the queries are the last positions: query j sees keys up to S - L + j.
    With ``mask`` [b, 1, L, S] or [L, S] it replaces the causal mask: either boolean (True where a query may
    attend; the window's band is ANDed in here) or additive in the compute dtype (0 or −inf:
    `AttentionMasks.bias`, the document mask, the band or both), which SDPA and the capped path use as they are.
    `attend` passes the additive form, one tensor per micro-batch and kind shared by every layer: SDPA saves a
    float mask of its own dtype by reference, where it converts a boolean one on every call and saves each copy
    (a band cut per layer cost 2·s² bytes per local layer in bf16). SDPA then runs its masked kernel on CPU, and on
    a GPU the memory-efficient one, which takes the additive mask as its bias (flash attention takes none; flex
    attention would skip the masked blocks but needs torch.compile, slow to build on CPU).
    """

    def __init__(
        self, scale: float | None = None, softcap: float | None = None, window: int | None = None
    ) -> None:
        super().__init__()
        self.scale, self.softcap, self.window = scale, softcap, window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        indices: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``indices``: the queries' [L] and keys' [S] global indices, where the keys are not the last S
        positions in order (context parallelism); the window's band is cut from them. ``mask`` is then given."""
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)  # k: [b, nh, S, hd]
            v = v.repeat_interleave(n_rep, dim=1)  # v: [b, nh, S, hd]
        L, S = q.shape[2], k.shape[2]
        if self.window is not None and (mask is None or mask.dtype == torch.bool):
            band = band_mask(L, S, self.window, q.device, indices)  # band: [L, S]
            mask = band if mask is None else mask & band  # [b, 1, L, S] with documents
        if self.softcap is not None:
            return self._capped(q, k, v, mask)  # [b, nh, L, hd]
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [b, nh, s, hd]
        if L == S:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)  # [b, nh, s, hd]
        # SDPA's is_causal aligns the mask top-left when L != S; cached decoding needs it bottom-right
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)  # mask: [L, S]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [b, nh, L, hd]

    def _capped(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Soft-capped attention written out, in transformers' order (Gemma2's eager_attention_forward): scores
        scaled, capped, masked, softmax in fp32 cast back to q's dtype, times V."""
        L, S = q.shape[2], k.shape[2]
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        scores = soft_cap(torch.matmul(q, k.transpose(2, 3)) * scale, self.softcap)  # scores: [b, nh, L, S]
        if mask is None:  # causal, bottom-right (cached decoding: the queries are the last L positions)
            mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)  # mask: [L, S]
        # adding the additive mask equals masked_fill(~mask, -inf) on the finite capped scores, and the add saves
        # nothing for backward, where masked_fill kept its inverted boolean mask per layer
        scores = scores + additive_mask(mask, scores.dtype)  # scores: [b, nh, L, S]
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # probs: [b, nh, L, S]
        return torch.matmul(probs, v)  # [b, nh, L, hd]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul-like op (SDPA) computes ``x`` in here: autocast's where it is on for x's device, else
    x's own. An additive mask in this dtype reaches SDPA uncast, so every layer can share it."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _core_window(core: nn.Module) -> int | None:
    """The sliding window of an attention core, also when checkpointing wraps it (`Checkpointed.inner`)."""
    return getattr(getattr(core, "inner", core), "window", None)


def _recomputed(core: nn.Module) -> bool:
    """Whether selective recomputation wraps the attention core (`Checkpointed`, whose ``inner`` it is)."""
    return hasattr(core, "inner")


def attend(
    attn: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: AttentionMasks | None = None,
    cache: LayerKV | None = None,
) -> torch.Tensor:
    """Normalise each head of q [b, nh, s, hd] and k [b, nkv, s, hd] with ``attn.q_norm`` / ``attn.k_norm`` (if
    any: Qwen3), position them with ``attn.rope`` (if any) and run ``attn.core``: the part every attention layer
    (plain, 1D, 2D) shares once it has its heads, so the per-head norms are applied here and nowhere else. With
    ``docs``, the micro-batch's `AttentionMasks`, the layer's mask is the one all layers of its kind share (with
    document masking positions restart per document and attention stops at document boundaries); with
    ``cache``, q, k, v are the positions after the cached ones."""
    # over head_dim, each head on its own: a rank holding whole heads needs no other rank's features
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)  # q: [b, nh, s, hd], k: [b, nkv, s, hd]
    positions = None if docs is None else docs.positions
    if attn.rope is not None:
        if positions is not None:
            q, k = attn.rope(q, k, positions=positions)  # q: [b, nh, s, hd]
        else:
            q, k = attn.rope(q, k, cache.length if cache is not None else 0)  # q: [b, nh, s, hd]
    if cache is not None:
        k, v = cache.append(k, v)  # k, v: [b, nkv, cached + s, hd]
    if docs is None:
        return attn.core(q, k, v)  # [b, nh, s, hd]
    k, v = docs.gather(k, v)  # k, v: [b, nkv, S, hd], S = s·c under context parallelism (after RoPE: global)
    if positions is None and _recomputed(attn.core):
        # selective recomputation without documents: the core cuts its band itself, again in backward, and keeps
        # none, where the shared band would be kept as the checkpointed core's input, one per micro-batch
        return attn.core(q, k, v)  # [b, nh, s, hd]
    # the micro-batch's additive mask of this layer's kind (global or its window), one tensor for all such layers;
    # None: causal (no documents, a global layer)
    bias = docs.bias(_core_window(attn.core), compute_dtype(q), q.shape[2], k.shape[2], q.device)
    return attn.core(q, k, v, bias)  # [b, nh, s, hd]; bias: [b, 1, s, S], the band [s, S] or None


class LayerKV:
    """One block's cached keys and values [b, nkv, cached, hd] (post-RoPE), grown by `append`."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Positions cached so far; the next token's position."""
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' k, v [b, nkv, s, hd]; returns all cached k, v [b, nkv, cached + s, hd]."""
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v


class KVCache:
    """Per-block `LayerKV`s for incremental decoding (`tessera.model.build.generate`): a forward with a cache
    processes only the new tokens, at positions continuing from `length`."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerKV() for _ in range(n_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention; separate wq, wk, wv, wo projections (simplest to shard)."""

    def __init__(
        self,
        cfg: ModelConfig,
        bias: bool,
        rope: Rope | None = None,
        out_bias: bool | None = None,
        qk_norm: bool = False,
        norm_offset: float = 0.0,
        window: int | None = None,
    ) -> None:
        """``bias``: biases on wq, wk, wv; ``out_bias``: on wo (None: the same as ``bias``); ``qk_norm``: an
        RMSNorm over each query and key head (``q_norm``, ``k_norm``, weights [head_dim], ``cfg.norm_eps``, its
        ``norm_offset``: Gemma 3's (1 + w)); ``window``: a sliding window (`band_mask`, Gemma 3's local layers)."""
        super().__init__()
        h, hd = cfg.d_model, cfg.head_size
        self.head_dim = hd
        self.wq = Linear(h, cfg.n_heads * hd, bias=bias)
        self.wk = Linear(h, cfg.kv_heads * hd, bias=bias)
        self.wv = Linear(h, cfg.kv_heads * hd, bias=bias)
        self.wo = Linear(cfg.n_heads * hd, h, bias=bias if out_bias is None else out_bias)
        self.q_norm = RMSNorm(hd, cfg.norm_eps, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps, norm_offset) if qk_norm else None
        self.core = AttentionCore(_attention_scale(cfg), cfg.attn_softcap, window)
        self.rope = rope

    def forward(
        self, x: torch.Tensor, cache: LayerKV | None = None, docs: AttentionMasks | None = None
    ) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h]; with ``cache``, x holds the positions after the cached ones; ``docs``: the
        micro-batch's masks (`attend`)."""
        b, s, _ = x.shape  # x: [b, s, h]
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # q: [b, nh, s, hd]
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # k: [b, nkv, s, hd]
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # v: [b, nkv, s, hd]
        y = attend(self, q, k, v, docs, cache)  # y: [b, nh, s, hd]
        y = y.transpose(1, 2).reshape(b, s, -1)  # y: [b, s, nh·hd]
        return self.wo(y)  # [b, s, h]


def _attention_scale(cfg: ModelConfig) -> float | None:
    """The scores' scale: query_pre_attn_scalar^-0.5 where given (Gemma 2), else None (SDPA's 1/sqrt(head_dim))."""
    scalar = getattr(cfg, "query_pre_attn_scalar", None)
    return None if scalar is None else scalar**-0.5


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)).

    With post-norms (Gemma 2: ``attn_post_norm``, ``mlp_post_norm``) each sublayer's output is normalised before
    its residual add: x + attn_post_norm(attn(attn_norm(x))), then x + mlp_post_norm(mlp(mlp_norm(x))). The
    tensor-parallel layouts build the same `Block` from their own layers, so the order is decided here once."""

    def __init__(
        self,
        attn_norm: nn.Module,
        attn: nn.Module,
        mlp_norm: nn.Module,
        mlp: nn.Module,
        attn_post_norm: nn.Module | None = None,
        mlp_post_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp
        if (attn_post_norm is None) != (mlp_post_norm is None):
            raise ValueError("a block has both post-norms or neither")
        # None adds no module or parameter: the other families' names are unchanged
        self.attn_post_norm, self.mlp_post_norm = attn_post_norm, mlp_post_norm

    def forward(
        self, x: torch.Tensor, cache: LayerKV | None = None, docs: AttentionMasks | None = None
    ) -> torch.Tensor:
        h = self.attn_norm(x)  # h: [b, s, h]
        if cache is not None:
            a = self.attn(h, cache)  # a: [b, s, h]
        else:
            a = self.attn(h) if docs is None else self.attn(h, docs=docs)  # a: [b, s, h]
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)  # a: [b, s, h]
        x = x + a  # x: [b, s, h]
        m = self.mlp(self.mlp_norm(x))  # m: [b, s, h]
        if self.mlp_post_norm is not None:
            m = self.mlp_post_norm(m)
        return x + m  # [b, s, h]


class Head(nn.Module):
    """Final norm then the output projection (no bias) to vocabulary logits, soft-capped if ``softcap`` is set
    (Gemma 2's final_logit_softcapping; the tensor-parallel heads cap their vocabulary shard the same way)."""

    def __init__(self, norm: nn.Module, d_model: int, vocab_size: int, softcap: float | None = None) -> None:
        super().__init__()
        self.norm, self.softcap = norm, softcap
        self.out = Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.out(self.norm(x)), self.softcap)  # x: [b, s, h] -> [b, s, V]


class TransformerLM(nn.Module):
    """embed → blocks "0".."L-1" → head, with loss, parameter and FLOP counts.

    Subclasses build `embed` (whose attribute `token_embedding_name` is the token `nn.Embedding`) and blocks.
    With `cfg.tie_embeddings` the head's output projection *is* the token embedding's Parameter
    (`head.out.weight = embed.<token_embedding_name>.weight`); `tied_parameters()` names the pair so that
    pipeline and ZeRO code can keep the two copies in sync when they live on different ranks. A pipeline
    stage may set `embed` or `head` to None: forward then takes hidden states in, or gives hidden states out.
    """

    token_embedding_name = "tok"
    """Attribute of `embed` holding the token `nn.Embedding` (the one tied to the head)."""
    plan: FamilyPlan
    """The family's declaration (tessera.model.family), which the subclass builds from and parallel code reads."""

    def __init__(self, cfg: ModelConfig, embed: nn.Module, blocks: list[nn.Module], head: Head) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Module | None = embed
        self.blocks = nn.ModuleDict({str(i): blk for i, blk in enumerate(blocks)})
        self.head: Head | None = head
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make head.out.weight the token embedding's Parameter again (if tied and both are present).

        Moves that create new Parameters (e.g. `to_empty` from the meta device) break the sharing; call this
        afterwards. `init_weights` calls it first.
        """
        if self.cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.out.weight = getattr(self.embed, self.token_embedding_name).weight

    # --- forward -------------------------------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Logits [b, s, V]; or, given targets [b, s], the cross-entropy (a scalar) reduced by ``reduction``
        (`tessera.model.targets`: the mean over all tokens, or the sum over the targets a loss mask keeps).

        With a ``cache`` (decoding), tokens are the positions after the cached ones, which the cache then holds.
        With ``positions`` [b, s] (`tessera.model.documents`), each document of a packed sequence is attended
        and positioned on its own.
        """
        if positions is not None and cache is not None:
            raise ValueError("document masking is for training on packed sequences; decode without it")
        if cache is None:
            docs = self.masks(positions)  # the micro-batch's masks, one per kind for all the blocks
            if self.embed is None:
                x = tokens  # x: [b, s, h]
            else:
                x = self.embed(tokens) if positions is None else self.embed(tokens, docs=docs)  # x: [b, s, h]
            for block in self.blocks.values():
                x = block(x, docs=docs)  # x: [b, s, h]
            docs.release()  # the masks live on in what the layers saved (full recomputation: rebuilt once)
        else:
            x = self.embed(tokens, cache.length)  # x: [b, s, h]
            for block, kv in zip(self.blocks.values(), cache.layers, strict=True):
                x = block(x, kv)  # x: [b, s, h]
        if self.head is None:
            if targets is not None:
                raise ValueError(
                    "this model part has no head, so it cannot compute a loss; pass targets=None"
                )
            return x  # [b, s, h]
        logits = self.head(x)  # logits: [b, s, V]
        return logits if targets is None else self.loss(logits, targets, reduction)

    @staticmethod
    def documents(positions: torch.Tensor) -> Documents:
        """What the blocks need of a micro-batch's documents: all of its sequences (a 2D model keeps its rows)."""
        return Documents(positions)

    def masks(self, positions: torch.Tensor | None) -> AttentionMasks:
        """The holder of one micro-batch's attention masks for a forward of the blocks, which every block gets
        and the caller releases after the last: the micro-batch's `documents` with document masking (``positions``
        [b, s]; under context parallelism always), else `AttentionMasks` (causal; a sliding window's band). The
        tensor-parallel models and the pipeline stages make theirs here too."""
        return AttentionMasks() if positions is None else self.documents(positions)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Mean cross-entropy over every position, or (``reduction="sum"``) its sum over the targets that are not
        `IGNORE_INDEX` (``F.cross_entropy`` skips those); logits upcast to fp32 so bf16/fp16 runs stay stable."""
        check_reduction(reduction)
        if reduction == "sum":  # a masked micro-batch: the trainer divides by the global batch's target count
            return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())  # logits: [b·s, V]

    # --- initialisation ------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Fill every Parameter in place with its deterministic initial value, a function of (seed, name)
        (tessera.model.init.InitSource: N(0, init_std) for Linear and Embedding weights, N(0, init_std /
        sqrt(2·n_layers)) for the residual-stream output projections as in GPT-2, biases 0, norm weights 1, or 0
        for Gemma's x̂·(1 + w)).
        Without ``seed`` one is drawn from the global torch RNG. Re-ties the embedding first (a tied output
        projection is the embedding, drawn once); also resets RoPE tables.
        """
        from tessera.model.init import InitSource, draw_seed

        self.tie_weights()
        source = InitSource.for_model(self, draw_seed() if seed is None else seed)
        for name, p in self.named_parameters():
            if not p.is_meta:
                p.copy_(source(name, tuple(slice(None) for _ in p.shape)))
        for module in self.modules():
            if isinstance(module, Rope) and not module.cos.is_meta:
                module.reset()

    # --- introspection -------------------------------------------------------------------------------------

    def tied_parameters(self) -> list[tuple[str, str]]:
        """Name pairs of parameters that are one tensor: [("head.out.weight", "embed.<tok>.weight")] or []."""
        if not self.cfg.tie_embeddings:
            return []
        return [("head.out.weight", f"embed.{self.token_embedding_name}.weight")]

    def num_params(self) -> int:
        """Number of parameters, a tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token, PaLM convention (Chowdhery et al. 2022, appendix B): 6·N + 12·L·h·s.

        N counts the parameters that take part in matrix multiplies: every parameter except lookup-only
        embedding tables (positions; tokens too unless tied, since then the output projection uses them).
        6·N is forward (2) plus backward (4) for the weight matmuls; 12·L·h·s is the attention scores and
        weighted sum (QKᵀ and AV, 2·2·s·h per token per layer forward, ×3 with backward), without causal
        halving. s defaults to cfg.seq_len.
        """
        s = self.cfg.seq_len if seq_len is None else seq_len
        lookups = {id(self.head.out.weight)} if self.head is not None and self.cfg.tie_embeddings else set()
        n = sum(
            p.numel()
            for m in self.modules()
            if isinstance(m, nn.Embedding)
            for p in m.parameters(recurse=False)
            if id(p) not in lookups
        )
        return 6 * (self.num_params() - n) + 12 * self.cfg.n_layers * self.cfg.d_model * s
