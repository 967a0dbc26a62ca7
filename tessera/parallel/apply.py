"""``parallelize``: apply parallelism to a plain model from outside, in one fixed, documented order.

Order: tensor parallelism (1D or 2D) → activation checkpointing → pipeline stages → ZeRO. Tensor parallelism goes
first because it decides which tensors exist on a rank; checkpointing wraps those sharded blocks; stages group
blocks; ZeRO shards whatever parameters a rank ends up holding. Data-parallel gradient synchronisation is attached
by the trainer (tessera/parallel/data.py), because when it fires depends on the accumulation order.
"""

from __future__ import annotations

from torch import nn

from tessera.config import Config
from tessera.groups import Groups
from tessera.layout import Layout

__all__ = ["parallelize"]


def parallelize(model: nn.Module, layout: Layout, groups: Groups | None, cfg: Config) -> nn.Module:
    """Return the module this rank trains: ``module(tokens, targets) -> loss`` over the full micro-batch."""
    if layout.tensor_size == 1:
        return model
    assert groups is not None, "tensor parallelism needs torch.distributed groups"
    if layout.is_2d:
        from tessera.parallel.model_2d import apply_tensor_2d

        return apply_tensor_2d(model, groups, cfg)
    from tessera.parallel.model_1d import apply_tensor_1d

    return apply_tensor_1d(model, groups, cfg)
