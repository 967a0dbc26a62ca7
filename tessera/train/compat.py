"""What a checkpoint must agree with to be resumed: the model's shape and the tokenizer.

Each checkpoint records these settings (meta.json ``extra.settings``); resuming with any of them changed is
refused naming the key, the saved value and the new one, because the weights would load into the wrong places
or not at all (a block dropped, heads reinterpreted) without an error. ``model.init_std`` (used only before the
first step) and ``model.size`` (a name for the other fields, compared one by one) may change.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tessera.config import Config
from tessera.errors import CheckpointError

__all__ = ["check_compatible", "run_settings"]

_MAY_CHANGE = frozenset({"model.size", "model.init_std"})


def run_settings(cfg: Config, tokenizer: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"model.n_layers": 12, ..., "data.tokenizer": "byte", "tokens.tokenizer": ..., "tokens.vocab_size": ...}
    as JSON values; ``tokenizer`` is what the token file says about the tokenizer that wrote it."""
    settings = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items()}
    settings["data.tokenizer"] = cfg.data.tokenizer
    settings |= {f"tokens.{k}": v for k, v in (tokenizer or {}).items()}
    return json.loads(json.dumps(settings))  # as they come back from meta.json (tuples become lists)


def check_compatible(path: Path, saved: dict[str, Any] | None, now: dict[str, Any]) -> None:
    """Refuse to resume ``path`` when a recorded setting changed; checkpoints without settings pass."""
    if not isinstance(saved, dict):
        return
    changed = [
        f"{k}: {saved[k]!r} in the checkpoint, {now[k]!r} now"
        for k in sorted(now)
        if k in saved and saved[k] != now[k] and k not in _MAY_CHANGE
    ]
    if changed:
        raise CheckpointError(
            f"checkpoint {path} was trained with other settings: {'; '.join(changed)}\n    fix: resume with "
            "the saved values (RUN_DIR/config.json holds them), or start a new run in a fresh run directory"
        )
