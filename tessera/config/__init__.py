"""Typed run configuration: TOML files, dotted command-line overrides, and validation that lists every violation.

Three modules, one job each:

- `tessera.config.sections`: the section dataclasses (every key, its type, default and documentation) and what
  they derive (``ParallelConfig.tensor_shape``, ``TrainConfig.micro_batches``, ...). A new key goes here.
- `tessera.config.checks`: the rules of each section on its own (ranges, known names, paths, token files), as
  `Violation` lists. A new key's allowed range or values go here.
- `tessera.config.loading`: TOML, ``section.key=value`` overrides, unknown or mistyped keys, ``model.size`` and
  ``model.init``.

The rules across sections live in `tessera.execution`. This package must import without torch: the planner,
`tessera validate` and the tests of the layout use it on machines with no PyTorch.
"""

from tessera.config.checks import ARITHMETIC_RULES, MAX_MICRO_BATCHES, Violation
from tessera.config.loading import apply_overrides, as_overrides, from_dict, load_config
from tessera.config.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    even_split,
    key_name,
    parse_tensor,
)
from tessera.model.family import FAMILIES  # noqa: F401  (the family registry)
from tessera.modes import (  # noqa: F401  (as before the split; the mode names live in tessera.modes)
    ACCUMULATION,
    CHECKPOINTING,
    DTYPES,
    NONFINITE,
    SCHEDULES,
    STOP_SIGNALS,
)

__all__ = [
    "ARITHMETIC_RULES",
    "MAX_MICRO_BATCHES",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LogConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "Violation",
    "apply_overrides",
    "as_overrides",
    "even_split",
    "from_dict",
    "key_name",
    "load_config",
    "parse_tensor",
]
