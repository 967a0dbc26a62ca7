"""Qwen3 dense models (Yang et al. 2025, "Qwen3 Technical Report"): Llama's block with an RMSNorm on each head.

Each query and key head is RMS-normalised over its head_dim features (``attn.q_norm``, ``attn.k_norm``, weights
[head_dim], the model's ``norm_eps``) after the q/k projections and before RoPE; no biases anywhere, RoPE base 10⁶
in the released sizes, grouped-query attention; the small sizes tie the embedding. Everything but the
declaration (tessera.model.family.QWEN3) is Llama's; the norms are applied in `tessera.model.layers.attend`.
"""

from __future__ import annotations

from tessera.model.family import QWEN3
from tessera.model.llama import Llama

__all__ = ["Qwen3"]


class Qwen3(Llama):
    """Llama built from the Qwen3 declaration (per-head q/k norms); same attribute and parameter names plus
    ``blocks.i.attn.{q,k}_norm.weight``."""

    plan = QWEN3
