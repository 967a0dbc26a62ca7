"""Gemma 3 text models (Gemma Team 2025, "Gemma 3 Technical Report", arXiv 2503.19786).

Gemma 2's decoder (`tessera.model.gemma2`: four (1 + w) RMSNorms per block, embeddings × sqrt(d_model), GeGLU,
scores scaled by ``query_pre_attn_scalar``^-0.5) with, as transformers' ``modeling_gemma3.py`` (Gemma3ForCausalLM)
computes it:

- an RMSNorm x̂·(1 + w) over each query and key head (``q_norm``, ``k_norm``) before RoPE, as Qwen3's but offset;
- local and global layers (`tessera.model.family.is_global_layer`): with ``sliding_window`` set, layer i is global
  when (i + 1) is a multiple of ``sliding_window_pattern`` (5 local : 1 global in the released models), else
  local. A local layer attends within the window (`tessera.model.layers.band_mask`: query i sees keys j with
  i - window < j <= i) and rotates with RoPE base ``rope_local_theta``; a global layer attends to every earlier
  position with base ``rope_theta``;
- no soft-caps by default (``attn_softcap`` and ``final_softcap`` still apply when set, as in Gemma 2).

Each layer's window and RoPE table are fixed when its `Attention` is built from its global index here; the 1D,
2D and pipeline layouts reuse the plain model's attention cores and RoPE modules, so they keep them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.model.family import GEMMA3 as PLAN
from tessera.model.family import FamilyPlan, is_global_layer
from tessera.model.gemma2 import Gemma2Embedding, gemma_block, gemma_norm
from tessera.model.layers import Attention, Head, Rope, TransformerLM

if TYPE_CHECKING:
    from tessera.config import ModelConfig

__all__ = ["Gemma3", "layer_window"]


def layer_window(cfg: ModelConfig, layer: int) -> int | None:
    """The sliding window of layer ``layer``, None for a global layer."""
    return None if is_global_layer(cfg, layer) else cfg.sliding_window


class Gemma3(TransformerLM):
    """Gemma 3: `embed` (tok, scaled), blocks with four norms and per-head q/k norms, local or global attention,
    `head` (norm, `out`); `model.rope` (global layers' base) and `model.rope_local` (local layers')."""

    token_embedding_name = PLAN.token_embedding
    plan: FamilyPlan = PLAN

    def __init__(self, cfg: ModelConfig) -> None:
        rope = Rope(cfg.head_size, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling)
        rope_local = Rope(cfg.head_size, cfg.seq_len, cfg.rope_local_theta)
        blocks = [
            gemma_block(
                cfg,
                Attention(
                    cfg,
                    bias=PLAN.qkv_bias,
                    out_bias=PLAN.out_bias,
                    rope=rope if is_global_layer(cfg, i) else rope_local,
                    qk_norm=PLAN.qk_norm,
                    norm_offset=PLAN.norm_offset,
                    window=layer_window(cfg, i),
                ),
            )
            for i in range(cfg.n_layers)
        ]
        head = Head(gemma_norm(cfg), cfg.d_model, cfg.vocab_size, softcap=cfg.final_softcap)
        super().__init__(cfg, embed=Gemma2Embedding(cfg), blocks=blocks, head=head)
        self.rope, self.rope_local = rope, rope_local
