"""``tessera generate``: sample text from a run's latest checkpoint, so a user sees what was learned."""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.errors import CheckpointError
from tessera.model.build import build_model, generate
from tessera.train import checkpoint as ckpt
from tessera.train.export import EXPORT_DIR, run_config
from tessera.train.tokenizer import load_tokenizer
from tessera.train.trainer import checkpoint_dir

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


def newest_weights(run_dir: Path) -> Path:
    """The run's newest checkpoint that one process can load: its newest training checkpoint (any layout's, once
    layout-free; of the older rank-local format only a replicated one), else the export of that step."""
    run_dir = Path(run_dir)
    ckpt_dir = checkpoint_dir(run_dir, run_config(run_dir))
    trained = ckpt.latest_checkpoint(ckpt_dir)
    exported = ckpt.latest_checkpoint(run_dir / EXPORT_DIR) if (run_dir / EXPORT_DIR).is_dir() else None
    if trained is None and exported is None:
        raise CheckpointError(
            f"no complete checkpoint in {ckpt_dir}; train with checkpoint.every > 0 or to the end"
        )
    if trained is None:
        return exported
    meta = ckpt.checkpoint_meta(trained)
    if not ckpt.is_sharded(meta):
        return trained
    export_step = ckpt.checkpoint_meta(exported)["step"] if exported is not None else None
    if export_step == meta["step"]:
        return exported
    older = f" (the newest export is of step {export_step})" if export_step is not None else ""
    raise CheckpointError(
        f"the newest checkpoint, {trained}, holds the weights split over {meta.get('world_size')} ranks "
        f"({meta.get('layout')}){older}\n    fix: run `tessera export {run_dir}` first; it merges them into "
        f"{run_dir / EXPORT_DIR}"
    )
