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

Without document masking every forward makes the same kind of per-micro-batch holder, `AttentionMasks`, whose only
mask is a sliding window's band (Gemma 3's local layers), likewise built once and shared by the layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "AttentionMasks",
    "Batch",
    "Documents",
    "additive_mask",
    "band_mask",
    "batch_parts",
    "document_positions",
]

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


class AttentionMasks:
    """The attention masks of one micro-batch's forward through the blocks, built on first use and handed to every
    layer that needs one as the same tensor (docs/memory.md, "Attention masks: one per micro-batch").

    The model (or the pipeline runtime, for a rank's stages) makes one per micro-batch, passes it to every block
    and calls `release` when the blocks' forward is done. This base is the micro-batch without document masking:
    its sequences attended causally at positions 0..s-1. Global layers need no mask (SDPA's ``is_causal``, which
    the flash kernel takes); the layers of a sliding window (Gemma 3's local layers) need the band, the same
    [L, S] for every sequence. SDPA converts a boolean mask to the compute dtype on every call and saves that copy
    for backward, so a band built in each layer cost one [s, s] per local layer and micro-batch; `bias` builds the
    additive band once, which SDPA saves by reference in every layer. `Documents` adds the positions and the
    document mask.
    """

    positions: torch.Tensor | None = None
    """Each token's position [b, s] (within its document, or under context parallelism its global index), which
    RoPE and learned position tables read; None here: positions 0..s-1, the tables' leading rows."""
    indices: tuple[torch.Tensor, torch.Tensor] | None = None
    """The queries' and the keys' global indices, int64 [L] and [S], when the keys are not the queries' own
    positions in order (context parallelism: `tessera.parallel.context.ContextDocuments`); None where they are.
    Two vectors, not their [L, S] difference: the checkpoints of full recomputation keep this object from a
    micro-batch's first forward to its last backward, and an int64 [s/c, s] was 8·s²/c bytes (17.2 GB at
    s = 128K, c = 8) per micro-batch in flight. The masks compare the vectors by broadcasting, straight into
    booleans (`band_mask`, `Documents.mask`)."""

    def __init__(self) -> None:
        self._biases: dict[tuple[int | None, torch.dtype, int, int], torch.Tensor] = {}

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention runs against: these (a context-parallel rank gathers every rank's)."""
        return k, v

    def allowed(self, window: int | None, L: int, S: int, device: torch.device) -> torch.Tensor | None:
        """Where the layers with sliding window ``window`` may attend (True), for L queries against S keys: None
        for global layers (causal attention needs no mask), the band [L, S] for a window (`band_mask`)."""
        if window is None:
            return None
        return band_mask(L, S, window, device, self.indices)  # [L, S]

    def bias(
        self, window: int | None, dtype: torch.dtype, L: int, S: int, device: torch.device
    ) -> torch.Tensor | None:
        """The additive mask (0: may attend, −inf: may not) in ``dtype`` of the layers with sliding window
        ``window`` (None: global layers) for L queries against S keys: `allowed` in additive form, one tensor per
        kind until `release`; None where `allowed` is (causal: SDPA's is_causal)."""
        key = (window, dtype, L, S)
        if key not in self._biases:
            allowed = self.allowed(window, L, S, device)  # allowed: [L, S] or [b, 1, L, S], or None
            if allowed is None:
                return None
            self._biases[key] = additive_mask(allowed, dtype)
        return self._biases[key]

    def release(self) -> None:
        """Drop the masks held here (called when the blocks' forward is done). What a layer saved for backward
        stays alive through autograd; under full recomputation, whose checkpoints keep this object until
        backward, nothing else would free them, and the replayed blocks build them again, once."""
        self._biases.clear()


class Documents(AttentionMasks):
    """The documents of a micro-batch's sequences, as the attention layers need them.

    ``positions`` [b, s]: position of each token within its document; ``mask`` [b, 1, s, s] (True: may attend),
    causal within each document, built on first use (a stage that only embeds never builds it).

    ``bias(window, dtype, L, S, device)`` is the form attention runs with: the additive mask (0 where a query may
    attend, −inf elsewhere, a sliding window's band ANDed in) in the compute dtype, built once per micro-batch and
    kind (global layers, local layers) and handed to every layer as the same tensor. SDPA converts a boolean mask
    to this form on every call and saves its copy for backward (one [b, 1, s, s] per layer); given the additive
    mask in its own dtype it saves the caller's tensor by reference, so every layer's backward shares one storage
    (docs/memory.md, "Attention masks: one per micro-batch").
    """

    def __init__(self, positions: torch.Tensor) -> None:
        super().__init__()
        self.positions = positions  # positions: [b, s]
        self._mask: torch.Tensor | None = None

    def _query_key(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries' and keys' global indices, int64 [L] and [S]: ``indices``, else 0..s-1 for both."""
        if self.indices is not None:
            return self.indices  # [s/c], [s]
        index = torch.arange(self.positions.shape[1], device=self.positions.device)  # index: [s]
        return index, index

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            query, key = self._query_key()  # query: [L], key: [S]
            # key j is visible to query i iff 0 <= i - j <= p_i, i.e. i - p_i <= j <= i: itself and its own
            # document's earlier tokens; compared by broadcasting into booleans (1 byte an element), never an
            # [L, S] of distances (int64: 8)
            first = query - self.positions  # first: [b, L], global index of each query's document's start
            mask = key >= first[:, :, None]  # mask: [b, L, S]
            mask &= key <= query[:, None]  # the causal [L, S] broadcast over b
            self._mask = mask.unsqueeze(1)  # [b, 1, L, S]
        return self._mask

    def allowed(self, window: int | None, L: int, S: int, device: torch.device) -> torch.Tensor:
        """`mask` [b, 1, L, S], with a sliding window's band ANDed in (within a document the distance is the
        window's); L, S and device are the documents' own (their positions and indices fix them)."""
        if window is None:
            return self.mask  # [b, 1, L, S]
        return self.mask & band_mask(L, S, window, device, self.indices)  # [b, 1, L, S]

    def release(self) -> None:
        super().release()
        self._mask = None


def band_mask(
    L: int,
    S: int,
    window: int,
    device: torch.device | None = None,
    indices: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal sliding-window mask [L, S] (True: may attend) for L queries that are the last L of S positions
    (cached decoding: L < S): query position i sees key j iff i - window < j <= i, transformers'
    ``sliding_window_overlay`` (kv_idx > q_idx - sliding_window) on its causal mask. Within a document (document
    masking) the distance i - j is the same as in the window, so the band and the document mask combine by AND.
    ``indices`` (the queries' [L] and keys' [S] global indices: context parallelism's queries and gathered keys)
    replaces the last-L-of-S frame."""
    if indices is not None:
        query, key = indices  # query: [L], key: [S]
        # the same inequality by broadcasting two index vectors into booleans, no [L, S] of int64 distances
        band = key <= query[:, None]  # band: [L, S]
        band &= key > query[:, None] - window
        return band  # [L, S]
    # diagonals of a boolean [L, S] (1 byte an element) rather than an int64 [L, S] of distances (8): query i sits
    # at position S - L + i and sees keys j with S - L + i - window < j <= S - L + i
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(S - L).triu_(S - L - window + 1)  # [L, S]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as an additive mask in ``dtype``: a boolean one (True: may attend) becomes 0 / −inf, an
    additive one is returned as it is if already in ``dtype``."""
    if mask.dtype != torch.bool:
        return mask if mask.dtype == dtype else mask.to(dtype)
    # −inf, then 0 where allowed: the same values as zeros filled at ~mask, without that boolean copy of the mask
    return torch.full(mask.shape, float("-inf"), dtype=dtype, device=mask.device).masked_fill_(mask, 0.0)
