"""``parallelize``: apply parallelism to a plain model from outside, in one fixed, documented order.

Order: tensor parallelism (1D or 2D) → context parallelism (no parameters: how attention sees the sequence) →
activation checkpointing → pipeline stages → ZeRO. Tensor parallelism goes
first because it decides which tensors exist on a rank; checkpointing wraps those sharded blocks; stages group
blocks; ZeRO shards whatever parameters a rank ends up holding. Data-parallel gradient synchronisation is attached
by the trainer (tessera/parallel/data.py), because when it fires depends on the accumulation order.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from tessera.config import Config
from tessera.groups import Groups
from tessera.layout import Layout
from tessera.model.materialize import ShardSpec, replicated_specs

__all__ = ["norm_weights", "parallelize", "shard_specs", "tensor_groups"]


def parallelize(model: nn.Module, layout: Layout, groups: Groups | None, cfg: Config) -> nn.Module:
    """Return the module this rank trains: ``module(tokens, targets) -> loss`` over the full micro-batch (its
    context rank's part of it with context parallelism, which is applied last: it changes no parameter, only
    how attention sees the sequence, `tessera.parallel.context`)."""
    if layout.tensor_size > 1:
        assert groups is not None, "tensor parallelism needs torch.distributed groups"
        if layout.is_2d:
            from tessera.parallel.model_2d import apply_tensor_2d

            model = apply_tensor_2d(model, groups, cfg)
        else:
            from tessera.parallel.model_1d import apply_tensor_1d

            model = apply_tensor_1d(model, groups, cfg)
    if layout.cp > 1:
        assert groups is not None, "context parallelism needs torch.distributed groups"
        from tessera.parallel.context import apply_context

        model = apply_context(model, groups.cp)
    return model


def shard_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """Which block of which plain-model parameter each of this rank's parameters is, by local name: the
    tensor-parallel models declare their own (`shard_specs()`); a plain model holds everything whole."""
    declared = getattr(module, "shard_specs", None)
    return declared() if declared is not None else replicated_specs(module)


def tensor_groups(layout: Layout, groups: Groups | None) -> list:
    """The groups a gradient norm must be summed over to cover the tensor-parallel shards."""
    if groups is None or layout.tensor_size == 1:
        return []
    return [groups.same_row, groups.same_col] if layout.is_2d else [groups.tp]


def norm_weights(module: nn.Module) -> dict[int, float]:
    """Weight of each parameter's squared gradient in the global norm, keyed by ``id(param)``.

    A tensor held identically by r ranks of the tensor group gets 1/r, so summing ``w·‖g‖²`` over the tensor
    group counts it once; shards get 1. Empty for a module without tensor parallelism.
    """
    from tessera.parallel.model_1d import TensorParallel1D
    from tessera.parallel.model_2d import Model2D

    if isinstance(module, TensorParallel1D):
        t = dist.get_world_size(module.group)
        return {id(p): 1.0 if n in module._split else 1.0 / t for n, p in module.named_parameters()}
    if isinstance(module, Model2D):
        q = module.grid.q
        # tensors without a row split (biases, norm weights, positions) are copied down each grid column; those
        # without a column split either (the per-head q/k norms) along each grid row too
        return {
            id(p): (1.0 if module._shards[n].dim_i is not None else 1.0 / q)
            * (1.0 if module._shards[n].dim_j is not None else 1.0 / q)
            for n, p in module.named_parameters()
        }
    return {}
