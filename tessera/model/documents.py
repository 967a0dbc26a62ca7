"""Document masking for packed sequences: position ids that restart at each document, and the attention mask.

A training window of ``s`` tokens cut from a token file usually spans several documents (each ends with the
end-of-text token). By default the model sees the window as one sequence: positions 0..s-1 and causal attention
across document boundaries. With ``data.document_mask`` every document in the window is a sequence of its own,
as if packed without padding ("variable-length packing"): its tokens are numbered from 0 and attend only to
earlier tokens of the same document.

Everything follows from the positions ``p`` [b, s] (`document_positions`): a query at index i with position p_i
sees exactly the keys j with ``i - p_i <= j <= i`` — its own document's tokens up to itself. That is the
block-diagonal causal mask, built here once per micro-batch and shared by every layer (`Documents`). Hugging
Face's packing collator (``DataCollatorWithFlattening``) passes packed documents the same way, as position ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Batch", "Documents", "additive_mask", "batch_parts", "document_positions"]

Batch = Sequence[torch.Tensor]
"""One micro-batch: (tokens, targets), or (tokens, targets, positions) with document masking."""


def batch_parts(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(tokens, targets, positions or None) of a micro-batch."""
    tokens, targets, *rest = batch
    return tokens, targets, (rest[0] if rest else None)


def document_positions(tokens: torch.Tensor, eot: int) -> torch.Tensor:
    """Each token's position within its document, int64 [b, s]: a document starts at the window's first token
    and right after every ``eot`` token (which ends the document before it)."""
    b, s = tokens.shape  # tokens: [b, s]
    index = torch.arange(s, device=tokens.device).expand(b, s)  # index: [b, s]
    starts = torch.zeros_like(tokens, dtype=torch.bool)  # starts: [b, s]
    starts[:, 1:] = tokens[:, :-1] == eot
    first = torch.where(starts, index, 0).cummax(dim=1).values  # first: [b, s], index of the document's start
    return index - first  # [b, s]


class Documents:
    """The documents of a micro-batch's sequences, as the attention layers need them.

    ``positions`` [b, s]: position of each token within its document; ``mask`` [b, 1, s, s] (True: may attend),
    causal within each document, built on first use (a stage that only embeds never builds it).

    ``bias(window, dtype)`` is the form attention runs with: the additive mask (0 where a query may attend, −inf
    elsewhere, a sliding window's band ANDed in) in the compute dtype, built once per micro-batch and kind (global
    layers, local layers) and handed to every layer as the same tensor. SDPA converts a boolean mask to this form
    on every call and saves its copy for backward (one [b, 1, s, s] per layer); given the additive mask in its own
    dtype it saves the caller's tensor by reference, so every layer's backward shares one storage
    (docs/memory.md, "Attention masks: one per micro-batch").
    """

    distance: torch.Tensor | None = None
    """Query's minus key's global index [L, S] when the keys are not the queries' own positions in order
    (context parallelism: `tessera.parallel.context.ContextDocuments`); None here, where they are."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions  # positions: [b, s]
        self._mask: torch.Tensor | None = None
        self._biases: dict[tuple[int | None, torch.dtype], torch.Tensor] = {}

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention runs against: these (a context-parallel rank gathers every rank's)."""
        return k, v

    def back(self) -> torch.Tensor:
        """How far each key lies before each query, [L, S] (i − j; by global index under context parallelism)."""
        if self.distance is not None:
            return self.distance  # [s/c, s]
        index = torch.arange(self.positions.shape[1], device=self.positions.device)
        return index[:, None] - index[None, :]  # [s, s]

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            back = self.back()  # back: [L, S]
            # key j is visible to query i iff 0 <= i - j <= p_i: itself and its own document's earlier tokens
            self._mask = ((back >= 0) & (back <= self.positions[:, :, None])).unsqueeze(1)  # [b, 1, L, S]
        return self._mask

    def bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask [b, 1, L, S] in ``dtype`` (0: may attend, −inf: may not) of the layers with sliding
        window ``window`` (None: global layers), the band 0 <= i − j < window ANDed into `mask` (within a document
        the distance is the window's). One tensor per (window, dtype) until `release`."""
        key = (window, dtype)
        if key not in self._biases:
            allowed = self.mask  # allowed: [b, 1, L, S]
            if window is not None:
                back = self.back()  # back: [L, S]
                allowed = allowed & (back < window)  # back >= 0 is in the mask already
            self._biases[key] = additive_mask(allowed, dtype)  # [b, 1, L, S]
        return self._biases[key]

    def release(self) -> None:
        """Drop the masks held here (the model calls it when its blocks' forward is done). What a layer saved for
        backward stays alive through autograd; under full recomputation, whose checkpoints keep this object until
        backward, nothing else would free them, and the replayed blocks build them again, once."""
        self._mask = None
        self._biases.clear()


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as an additive mask in ``dtype``: a boolean one (True: may attend) becomes 0 / −inf, an
    additive one is returned as it is if already in ``dtype``."""
    if mask.dtype != torch.bool:
        return mask if mask.dtype == dtype else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
