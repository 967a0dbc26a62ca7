"""Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size", arXiv 2408.00118).

Llama's decoder with, as transformers' ``modeling_gemma2.py`` computes it:

- RMSNorm x̂·(1 + w) in fp32 (weights stored as w, starting at 0), four per block: ``attn_norm`` and ``mlp_norm``
  before the sublayers, ``attn_post_norm`` and ``mlp_post_norm`` on their outputs before each residual add;
  the final norm the same (1 + w) form;
- token embeddings multiplied by sqrt(d_model), the factor cast to the embedding's dtype first;
- a GeGLU MLP: w_down(GELU_tanh(w_gate x) · w_up x);
- attention scores scaled by ``query_pre_attn_scalar``^-0.5 and soft-capped (``attn_softcap``), final logits
  soft-capped (``final_softcap``): `tessera.model.layers.AttentionCore`, `Head`.

Gemma 2's sliding window (4096 on every other layer) is not computed: a model is imported only where the training
context fits in the window, so it masks nothing (tessera/hf/config.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tessera.model.family import GEMMA2 as PLAN
from tessera.model.family import FamilyPlan
from tessera.model.layers import Attention, Block, Head, RMSNorm, Rope, TransformerLM, embed_scale
from tessera.model.llama import LlamaMLP

if TYPE_CHECKING:
    from tessera.config import ModelConfig
    from tessera.model.documents import Documents

__all__ = ["Gemma2", "Gemma2Embedding", "Gemma2MLP", "gemma_block", "gemma_norm"]


class Gemma2Embedding(nn.Module):
    """Token embedding `tok` times sqrt(d_model); positions enter through RoPE inside attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, tokens: torch.Tensor, start: int = 0, docs: Documents | None = None) -> torch.Tensor:
        del start, docs  # positions enter through RoPE
        x = self.tok(tokens)  # x: [b, s, h]
        return x * embed_scale(x.shape[-1], self.tok.weight.dtype)  # [b, s, h]


class Gemma2MLP(LlamaMLP):
    """GeGLU: w_down(GELU_tanh(w_gate x) · w_up x), no biases (transformers' ``gelu_pytorch_tanh``)."""

    @staticmethod
    def activate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """GELU (tanh approximation)(gate) · up on w_gate's and w_up's outputs (tensor-parallel MLPs call it on
        shards)."""
        return F.gelu(gate, approximate="tanh") * up


def gemma_norm(cfg: ModelConfig) -> RMSNorm:
    """Gemma's x̂·(1 + w) RMSNorm over the model width (blocks' four norms and the final one; Gemma 3 too)."""
    return RMSNorm(cfg.d_model, cfg.norm_eps, offset=PLAN.norm_offset)


def gemma_block(cfg: ModelConfig, attn: Attention) -> Block:
    """A Gemma block around ``attn``: norms before and after the attention and the GeGLU MLP (Gemma 2 and 3)."""
    return Block(
        attn_norm=gemma_norm(cfg),
        attn=attn,
        mlp_norm=gemma_norm(cfg),
        mlp=Gemma2MLP(cfg, bias=PLAN.mlp_bias),
        attn_post_norm=gemma_norm(cfg),
        mlp_post_norm=gemma_norm(cfg),
    )


class Gemma2(TransformerLM):
    """Gemma 2: `embed` (tok, scaled), blocks with four norms, `head` (norm, `out`, soft-capped); one shared
    `model.rope` as Llama's."""

    token_embedding_name = PLAN.token_embedding
    plan: FamilyPlan = PLAN

    def __init__(self, cfg: ModelConfig) -> None:
        rope = Rope(cfg.head_size, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling)
        blocks = [
            gemma_block(cfg, Attention(cfg, bias=PLAN.qkv_bias, out_bias=PLAN.out_bias, rope=rope))
            for _ in range(cfg.n_layers)
        ]
        head = Head(gemma_norm(cfg), cfg.d_model, cfg.vocab_size, softcap=cfg.final_softcap)
        super().__init__(cfg, embed=Gemma2Embedding(cfg), blocks=blocks, head=head)
        self.rope = rope
