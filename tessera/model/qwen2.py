"""Qwen2 (Yang et al. 2024, "Qwen2 Technical Report"): Llama's block with biases on the q, k, v projections.

RMSNorm, SwiGLU, RoPE (its own base, 10⁶ in the released sizes), grouped-query attention; the attention output
projection and the MLP have no biases; the 0.5B/1.5B sizes tie the embedding, the larger ones do not. Everything
but the declaration (tessera.model.family.QWEN2) is Llama's.
"""

from __future__ import annotations

from tessera.model.family import QWEN2
from tessera.model.llama import Llama

__all__ = ["Qwen2"]


class Qwen2(Llama):
    """Llama built from the Qwen2 declaration (q/k/v biases); same attribute and parameter names plus
    ``blocks.i.attn.w{q,k,v}.bias``."""

    plan = QWEN2
