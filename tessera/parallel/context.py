"""Context parallelism: each micro-batch's sequence split over c ranks, attention over the whole of it.

This is the all-gather form Llama 3 trained with (Dubey et al. 2024, arXiv 2407.21783 §3.3.2): the sequence
of s tokens is cut into 2c chunks of s/(2c) and context rank i holds chunks i and 2c−1−i, so that under a
causal mask every rank has the same attention work (an early chunk, cheap, and a late one, expensive). Each
attention layer all-gathers K and V over the c ranks (grouped-query attention keeps them n_kv_heads/n_heads of
the queries' size), computes its own queries against all s keys with the mask of its tokens' global positions,
and in backward reduce-scatters dK and dV (`tessera.comm.all_gather_to_region`, one conjugate autograd pair,
counted as "context" traffic). Unlike a ring it supports any mask that depends on positions: documents,
sliding windows. Everything outside attention is per-token and runs on the rank's s/c tokens unchanged.

Every position-dependent piece reads *global* positions: RoPE and learned position tables at each token's
place in the full sequence (or within its document under document masking), the causal, document and band
masks from the query's and key's global indices (`ContextDocuments`). The batch is cut here
(`context_batch`), once, before any stepper sees it; the model reaches the group through the `Documents` it
builds per micro-batch (`apply_context` sets the factory), which the plain, 1D and pipeline-stage forwards
all call, so none of them needs a branch of its own.

docs/context-parallel.md has the design, the collectives' bytes and what is refused.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.model.documents import Batch, Documents, batch_parts

__all__ = ["ContextDocuments", "apply_context", "context_batch", "context_indices", "key_indices"]


def context_indices(seq_len: int, c: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global sequence indices context rank ``rank`` of ``c`` holds, int64 [seq_len/c]: chunk ``rank``
    then chunk 2c−1−``rank`` of the 2c chunks of seq_len/(2c) tokens (causal load balance)."""
    if seq_len % (2 * c):
        raise ValueError(
            f"context parallelism cuts the sequence into 2·{c} chunks, but its length is {seq_len}; "
            f"use a model.seq_len divisible by {2 * c}"
        )
    n = seq_len // (2 * c)
    first = torch.arange(rank * n, (rank + 1) * n, device=device)  # [s/2c]
    last = torch.arange((2 * c - 1 - rank) * n, (2 * c - rank) * n, device=device)  # [s/2c]
    return torch.cat((first, last))  # [s/c]


def key_indices(seq_len: int, c: int, device: torch.device | None = None) -> torch.Tensor:
    """The global index of each key of the all-gathered K/V, int64 [seq_len]: the gather concatenates the
    ranks' tokens in group-rank order, rank 0's two chunks first. The masks are built in this order rather
    than the gathered K/V permuted back (a copy of K and V per layer)."""
    return torch.cat([context_indices(seq_len, c, r, device) for r in range(c)])  # [s]


def context_batch(batch: Batch, c: int, rank: int) -> Batch:
    """This context rank's part of a micro-batch (tokens, targets[, positions]) [b, s]: its 2 chunks of each,
    and the positions its tokens have in the full sequence — within their documents when ``batch`` carries
    document positions, else their global indices — so always (tokens, targets, positions) [b, s/c]."""
    tokens, targets, positions = batch_parts(batch)
    b, s = tokens.shape  # tokens: [b, s]
    idx = context_indices(s, c, rank, tokens.device)  # idx: [s/c]
    if positions is None:
        positions = torch.arange(s, device=tokens.device).expand(b, s)  # [b, s]
    return tokens[:, idx], targets[:, idx], positions[:, idx]  # each [b, s/c]


class ContextDocuments(Documents):
    """What attention needs of a context rank's micro-batch: its tokens' positions (for RoPE and learned
    position tables), the mask of its queries against the gathered keys, and the K/V gather itself.

    ``positions`` [b, s/c]: each local token's position within its document, or (no document masking) its
    global index; either way query i sees key j iff 0 <= g_i − g_j <= p_i, with g the global indices: itself
    and the earlier tokens of its document (its whole prefix when p_i = g_i). ``indices`` holds g of the
    queries [s/c] and of the gathered keys [s], which the mask and a sliding window's band compare by
    broadcasting (`Documents.mask`, `Documents.bias`: [b, 1, s/c, s], built once per micro-batch and kind and
    shared by the layers)."""

    def __init__(self, positions: torch.Tensor, group: dist.ProcessGroup) -> None:
        super().__init__(positions)  # positions: [b, s/c]
        self.group = group
        c, rank = comm.group_size(group), dist.get_rank(group)
        s, device = positions.shape[1] * c, positions.device
        # the masks compare these two vectors (`Documents.mask`, `band_mask`); the checkpoints of full
        # recomputation keep this object until the micro-batch's last backward, so no [s/c, s] is kept here
        self.indices = (context_indices(s, c, rank, device), key_indices(s, c, device))  # [s/c], [s]

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather k, v [b, nkv, s/c, hd] over the context group → [b, nkv, s, hd] (ranks' tokens in
        group-rank order, `key_indices`); backward reduce-scatters dK, dV."""
        return comm.all_gather_to_region(k, 2, self.group), comm.all_gather_to_region(v, 2, self.group)


def apply_context(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Make ``model`` (plain or 1D tensor-parallel) build `ContextDocuments` over ``group`` for every
    micro-batch: its forward, and a pipeline stage's (which reads ``model.documents``), then gather K/V per
    attention layer. Parameters are untouched: context ranks hold the same replicas. Returns ``model``."""
    # an instance attribute shadows the class's staticmethod `documents`
    object.__setattr__(model, "documents", partial(ContextDocuments, group=group))
    return model
