"""Training: data (tokenizers, token files, deterministic sampling), the trainer, checkpoints and metrics.

`tessera.train` names both this package and the function `tessera.train.trainer.train` (the Python API, see
tessera/__init__.py). Whichever of the two the attribute holds — Python sets it to this package whenever a
module under it is imported first — calling it trains, so the package is made callable.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from tessera.train.trainer import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
