"""``tessera generate``: sample text from a run's latest checkpoint, so a user sees what was learned."""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.model.build import build_model, generate
from tessera.train import checkpoint as ckpt
from tessera.train.run_files import newest_weights, run_config
from tessera.train.tokenizer import load_tokenizer

__all__ = ["generate_text", "newest_weights"]


def generate_text(
    run_dir: Path,
    prompt: str,
    tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    top_p: float | None = None,
    kv_cache: bool = True,
) -> str:
    """Load ``run_dir``'s config and newest weights in one process and continue ``prompt``."""
    cfg = run_config(run_dir)
    model = build_model(cfg.model)
    ckpt.load_model_weights(newest_weights(run_dir), model)
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = torch.tensor([tok.encode(prompt) or [0]], dtype=torch.long)
    out = generate(
        model, ids, tokens, temperature, top_k, torch.Generator().manual_seed(seed), top_p, kv_cache
    )
    return tok.decode(out[0].tolist())
