"""The global gradient norm and the one clipping rule, for every way a rank holds its gradients.

A rank's gradients are full tensors (the direct loop and the pipeline runtime, `clip_grad_norm`) or its shards of
flat ZeRO buffers (`tessera.parallel.zero.ShardedAdamW`). Either way the global norm is the square root of a sum
of ``weight·‖g‖²`` over what this rank holds, summed over the groups whose ranks hold the rest: a tensor held
identically by r ranks of such a group weighs 1/r so that it counts once (`tessera.parallel.apply.norm_weights`),
and weight 0 leaves a tensor out (the other pipeline rank's copy of a tied embedding). The gradients are then
scaled by torch's rule (`clip_grads_`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm

__all__ = ["clip_grad_norm", "clip_grads_", "global_norm", "squared_norm"]


def squared_norm(grads: Iterable[tuple[torch.Tensor, float]], device: torch.device) -> torch.Tensor:
    """Σ ``weight·‖g‖²`` over ``(gradient, weight)`` pairs, in fp32 on ``device``; weight 0 leaves one out."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g, weight in grads:
        if weight:
            total += weight * g.detach().float().pow(2).sum()
    return total


def global_norm(sq: torch.Tensor, groups: Iterable[dist.ProcessGroup | None]) -> float:
    """The global norm from this rank's ``squared_norm``: summed over each of ``groups`` (None: none), rooted."""
    for group in groups:
        if group is not None:
            comm.all_reduce(sq, group)
    return math.sqrt(float(sq))


def clip_grads_(grads: Iterable[torch.Tensor], norm: float, max_norm: float) -> float:
    """Scale ``grads`` so that a global norm of ``norm`` becomes at most ``max_norm``; returns ``norm``.

    torch's rule: the coefficient max_norm / (norm + 1e-6), applied only when below 1. A NaN or infinite norm
    leaves the gradients as they were (torch's clip_grad_norm_ would scale them all by NaN), so that the health
    check can name the tensors that overflowed."""
    coef = max_norm / (norm + 1e-6)
    if math.isfinite(norm) and coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def clip_grad_norm(
    params: Iterable[nn.Parameter],
    max_norm: float,
    *,
    weights: Mapping[int, float] | None = None,
    groups: Iterable[dist.ProcessGroup | None] = (),
) -> float:
    """Clip the full gradients of ``params`` by their global norm (weights by ``id(param)``, 1 when absent, summed
    over ``groups``); returns the norm before clipping."""
    weights = weights or {}
    held = [p for p in params if p.grad is not None]
    device = held[0].grad.device if held else torch.device("cpu")  # type: ignore[union-attr]
    sq = squared_norm(((p.grad, weights.get(id(p), 1.0)) for p in held), device)  # type: ignore[misc]
    return clip_grads_((p.grad for p in held), global_norm(sq, groups), max_norm)  # type: ignore[misc]
