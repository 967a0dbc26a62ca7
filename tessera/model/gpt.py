"""GPT-2 (Radford et al. 2019): learned positions, LayerNorm with bias, GELU (tanh) MLP, biased Linears."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tessera.model.family import GPT as PLAN
from tessera.model.layers import Attention, Block, Head, Linear, TransformerLM

if TYPE_CHECKING:
    from tessera.config import ModelConfig
    from tessera.model.documents import Documents

__all__ = ["GPT", "GPTMLP", "GPTEmbedding"]


class GPTEmbedding(nn.Module):
    """Token embedding `wte` plus learned absolute position embedding `wpe`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, tokens: torch.Tensor, start: int = 0, docs: Documents | None = None) -> torch.Tensor:
        """tokens [b, s] at positions start..start+s-1 (start > 0 when decoding after cached tokens), or at
        ``docs.positions`` [b, s] (document masking: they restart at every document)."""
        s = start + tokens.shape[1]  # tokens: [b, s - start]
        if s > self.wpe.num_embeddings:
            raise ValueError(f"sequence length {s} exceeds model.seq_len = {self.wpe.num_embeddings}")
        if docs is not None:
            return self.wte(tokens) + self.wpe(docs.positions)  # [b, s, h]
        pos = torch.arange(start, s, device=tokens.device)  # pos: [s - start]
        return self.wte(tokens) + self.wpe(pos)  # [b, s, h]


class GPTMLP(nn.Module):
    """fc (h → ffn, bias) → GELU (tanh approximation, as GPT-2) → proj (ffn → h, bias)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = Linear(cfg.d_model, cfg.ffn, bias=PLAN.mlp_bias)
        self.proj = Linear(cfg.ffn, cfg.d_model, bias=PLAN.mlp_bias)

    @staticmethod
    def activate(x: torch.Tensor) -> torch.Tensor:
        """The activation on fc's output [.., ffn] (tensor-parallel MLPs call it on their shard)."""
        return F.gelu(x, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.activate(self.fc(x))  # x: [b, s, ffn]
        return self.proj(x)  # [b, s, h]


def _block(cfg: ModelConfig) -> Block:
    return Block(
        attn_norm=nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps),
        attn=Attention(cfg, bias=PLAN.qkv_bias, out_bias=PLAN.out_bias, qk_norm=PLAN.qk_norm),
        mlp_norm=nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps),
        mlp=GPTMLP(cfg),
    )


class GPT(TransformerLM):
    """GPT-2: `embed` (wte, wpe), blocks, `head` (LayerNorm `norm`, `out` tied to wte by default)."""

    token_embedding_name = PLAN.token_embedding
    plan = PLAN

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            cfg,
            embed=GPTEmbedding(cfg),
            blocks=[_block(cfg) for _ in range(cfg.n_layers)],
            head=Head(nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps), cfg.d_model, cfg.vocab_size),
        )
