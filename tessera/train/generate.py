"""``tessera generate``: sample text from a run's latest checkpoint, so a user sees what was learned."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tessera.config import from_dict
from tessera.errors import CheckpointError
from tessera.model.build import build_model, generate
from tessera.train import checkpoint as ckpt
from tessera.train.tokenizer import load_tokenizer

__all__ = ["generate_text"]


def generate_text(
    run_dir: Path, prompt: str, tokens: int, temperature: float = 0.8, top_k: int | None = None, seed: int = 0
) -> str:
    """Load ``run_dir``'s config and newest checkpoint in one process and continue ``prompt``."""
    config_file = run_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{run_dir} has no config.json; pass the run directory that `tessera train` wrote"
        )
    cfg = from_dict(json.loads(config_file.read_text()))
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    path = ckpt.latest_checkpoint(ckpt_dir)
    if path is None:
        raise CheckpointError(
            f"no complete checkpoint in {ckpt_dir}; train with checkpoint.every > 0 or to the end"
        )
    model = build_model(cfg.model)
    ckpt.load_model_weights(path, model)
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = torch.tensor([tok.encode(prompt) or [0]], dtype=torch.long)
    out = generate(model, ids, tokens, temperature, top_k, torch.Generator().manual_seed(seed))
    return tok.decode(out[0].tolist())
