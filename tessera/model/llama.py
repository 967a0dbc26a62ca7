"""Llama (Touvron et al. 2023; Llama 3 shapes): RMSNorm, SwiGLU MLP, RoPE, GQA, no biases."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tessera.model.family import LLAMA as PLAN
from tessera.model.family import FamilyPlan
from tessera.model.layers import Attention, Block, Head, Linear, RMSNorm, Rope, TransformerLM

if TYPE_CHECKING:
    from tessera.config import ModelConfig
    from tessera.model.documents import Documents

__all__ = ["Llama", "LlamaEmbedding", "LlamaMLP"]


class LlamaEmbedding(nn.Module):
    """Token embedding `tok` only; positions enter through RoPE inside attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, tokens: torch.Tensor, start: int = 0, docs: Documents | None = None) -> torch.Tensor:
        del start, docs  # positions enter through RoPE (the attention's cache or the documents give them)
        return self.tok(tokens)  # tokens: [b, s] -> [b, s, h]


class LlamaMLP(nn.Module):
    """SwiGLU: w_down(SiLU(w_gate x) * w_up x), no biases."""

    def __init__(self, cfg: ModelConfig, bias: bool = PLAN.mlp_bias) -> None:
        super().__init__()
        self.w_gate = Linear(cfg.d_model, cfg.ffn, bias=bias)
        self.w_up = Linear(cfg.d_model, cfg.ffn, bias=bias)
        self.w_down = Linear(cfg.ffn, cfg.d_model, bias=bias)

    @staticmethod
    def activate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) · up on w_gate's and w_up's outputs [.., ffn] (tensor-parallel MLPs call it on shards)."""
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.activate(self.w_gate(x), self.w_up(x))  # x: [b, s, ffn]
        return self.w_down(x)  # [b, s, h]


class Llama(TransformerLM):
    """Llama: `embed` (tok), blocks, `head` (RMSNorm `norm`, `out`; tied only if cfg.tie_embeddings).

    One `Rope` module (`model.rope`) holds the cos/sin tables and is shared by every block's attention, so a
    pipeline stage keeping any subset of blocks still has it.
    """

    token_embedding_name = PLAN.token_embedding
    plan: FamilyPlan = PLAN
    """The family's declaration; a Llama variant subclasses with its own (Qwen2: biases; Qwen3: q/k norms)."""

    def __init__(self, cfg: ModelConfig) -> None:
        plan = self.plan
        rope = Rope(cfg.head_size, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling)
        blocks = [
            Block(
                attn_norm=RMSNorm(cfg.d_model, cfg.norm_eps),
                attn=Attention(
                    cfg, bias=plan.qkv_bias, out_bias=plan.out_bias, rope=rope, qk_norm=plan.qk_norm
                ),
                mlp_norm=RMSNorm(cfg.d_model, cfg.norm_eps),
                mlp=LlamaMLP(cfg, bias=plan.mlp_bias),
            )
            for _ in range(cfg.n_layers)
        ]
        head = Head(RMSNorm(cfg.d_model, cfg.norm_eps), cfg.d_model, cfg.vocab_size)
        super().__init__(cfg, embed=LlamaEmbedding(cfg), blocks=blocks, head=head)
        self.rope = rope
