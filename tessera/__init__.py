"""tessera: train transformer language models that outgrow one device.

The Python API (docs/python-api.md)::

    import tessera

    cfg = tessera.load_config("configs/demo.toml", ["train.steps=50"])
    result = tessera.train(cfg, hook=lambda step, model: None)  # hook: after backward, before the update

Importing ``tessera`` is light: the names below are loaded on first use, so ``tessera.load_config`` and
``tessera.Config`` work without importing torch (the planner and ``tessera validate`` rely on that).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY = {
    "Config": "tessera.config",
    "load_config": "tessera.config",
    "train": "tessera.train.trainer",
    "TrainResult": "tessera.train.trainer",
    "StepHook": "tessera.train.trainer",
    "read_metrics": "tessera.train.run_files",
}

__all__ = ["Config", "StepHook", "TrainResult", "__version__", "load_config", "read_metrics", "train"]

if TYPE_CHECKING:
    from tessera.config import Config, load_config
    from tessera.train.run_files import read_metrics
    from tessera.train.trainer import StepHook, TrainResult, train


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tessera' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
