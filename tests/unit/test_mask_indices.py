"""The attention masks built from index vectors, never an [L, S] of integer distances (docs/memory.md, "Attention
masks: one per micro-batch"; docs/context-parallel.md, "Memory").

`Documents.mask`, `band_mask` and a context rank's `ContextDocuments` compare the queries' [L] and keys' [S]
global indices by broadcasting, straight into booleans. Before, `Documents.back()` built an int64 [s, s] of
distances per mask (512 MiB at s = 8192) and `ContextDocuments` kept an int64 [s/c, s] (17.2 GB at s = 128K,
c = 8) on the object that full recomputation's checkpoints hold until the micro-batch's last backward.

Checked here over random documents, windows, context degrees and ranks against a reference built the plain way:
the whole sequence's [s, s] mask from document ids (same document, key not after the query, within the window),
its rows and columns then taken in the rank's query order and the gathered keys' order. Also: no integer tensor
of L·S elements is made while the masks are built (a dispatch mode sees every op's output), and none is left on
the object.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.model.documents import AttentionMasks, Documents, band_mask, document_positions
from tessera.parallel import context
from tessera.parallel.context import ContextDocuments, context_batch, context_indices, key_indices

EOT = 0
CPU = torch.device("cpu")


def _reference(tokens: torch.Tensor, window: int | None, documents: bool) -> torch.Tensor:
    """The whole sequence's mask [b, s, s] (True: may attend), from each token's document id: a document starts
    at the first token and after every EOT; without ``documents`` one document per sequence."""
    b, s = tokens.shape  # tokens: [b, s]
    starts = torch.zeros(b, s, dtype=torch.long)
    if documents:
        starts[:, 1:] = (tokens[:, :-1] == EOT).long()
    doc = starts.cumsum(1)  # doc: [b, s]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (doc[:, :, None] == doc[:, None, :]) & (j <= i)  # [b, s, s]
    if window is not None:
        allowed &= i - j < window
    return allowed


def _tokens(b: int, s: int, seed: int) -> torch.Tensor:
    """Random tokens [b, s] with EOTs at random places (sometimes the first or last token, sometimes none)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (b, s), generator=g)
    eot = torch.rand(b, s, generator=g) < float(torch.rand(1, generator=g)) * 0.4
    return tokens.masked_fill(eot, EOT)


def _context_documents(
    positions: torch.Tensor, c: int, rank: int, monkeypatch: pytest.MonkeyPatch
) -> Documents:
    """Context rank ``rank`` of ``c``'s documents for its positions [b, s/c], without a process group (the
    group only gives c and the rank here)."""
    monkeypatch.setattr(context.comm, "group_size", lambda group: c)
    monkeypatch.setattr(context.dist, "get_rank", lambda group: rank)
    return ContextDocuments(positions, group=None)  # type: ignore[arg-type]


SWEEP = list(itertools.product([1, 2, 4], [None, 1, 3, 8], [True, False], range(3)))


@pytest.mark.parametrize(("c", "window", "documents", "seed"), SWEEP)
def test_masks_are_the_reference_on_every_context_rank(
    c: int, window: int | None, documents: bool, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank's mask and additive mask (with its window's band) are the reference's rows of its queries and
    columns of the gathered keys, exactly; at c = 1 also the plain `Documents` of the whole sequence."""
    b, s = 2, 8 * c * (1 + seed % 2)  # 2c chunks of 4 or 8 tokens
    tokens = _tokens(b, s, seed * 10 + c)
    reference = _reference(tokens, window, documents)  # [b, s, s]
    batch = (tokens, tokens, document_positions(tokens, EOT)) if documents else (tokens, tokens)
    keys = key_indices(s, c)  # [s]
    for rank in range(c):
        _, _, positions = context_batch(batch, c, rank)  # positions: [b, s/c]
        docs = _context_documents(positions, c, rank, monkeypatch)
        expected = reference[:, context_indices(s, c, rank)][:, :, keys].unsqueeze(1)  # [b, 1, s/c, s]
        L = s // c
        assert torch.equal(docs.allowed(window, L, s, CPU), expected), rank
        bias = docs.bias(window, torch.bfloat16, L, s, CPU)
        assert torch.equal(bias == 0, expected) and bool((bias[~expected] == float("-inf")).all()), rank
    if c == 1 and documents:
        docs = Documents(document_positions(tokens, EOT))
        assert torch.equal(docs.allowed(window, s, s, CPU), reference.unsqueeze(1))


@pytest.mark.parametrize("seed", range(4))
def test_band_from_any_index_order_is_the_window_inequality(seed: int) -> None:
    """`band_mask` with index vectors (any order of queries and keys: the chunk layouts) is 0 <= i − j < window
    of their global indices; with none, the last-L-of-S frame (cached decoding) as before."""
    g = torch.Generator().manual_seed(seed)
    S = int(torch.randint(4, 40, (1,), generator=g))
    L = int(torch.randint(1, S + 1, (1,), generator=g))
    window = int(torch.randint(1, S + 2, (1,), generator=g))
    keys = torch.randperm(S, generator=g)  # [S]
    queries = torch.randperm(S, generator=g)[:L]  # [L]
    d = queries[:, None] - keys[None, :]  # the reference's int64 distances [L, S]
    assert torch.equal(band_mask(L, S, window, CPU, (queries, keys)), (d >= 0) & (d < window))
    last = torch.arange(S - L, S)  # the last L of S positions
    assert torch.equal(band_mask(L, S, window, CPU), band_mask(L, S, window, CPU, (last, torch.arange(S))))


def test_the_base_masks_band_is_the_reference() -> None:
    """Without documents (one sequence, positions 0..s-1) a window's additive band is the reference's."""
    tokens = _tokens(1, 12, 0)
    masks = AttentionMasks()
    bias = masks.bias(5, torch.float32, 12, 12, CPU)
    assert torch.equal(bias == 0, _reference(tokens, 5, documents=False)[0])


class _Outputs(TorchDispatchMode):
    """Every op's tensor outputs (dtype, element count) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(
        self, func: Callable[..., object], types: object, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((str(func), t.dtype, t.numel()))
        return out


def _integers(obj: object) -> dict[str, tuple[int, ...]]:
    """The integer tensors an object holds in its attributes (also inside tuples and dicts): name → shape."""
    found: dict[str, tuple[int, ...]] = {}

    def visit(name: str, value: object) -> None:
        if isinstance(value, torch.Tensor) and not (
            value.dtype.is_floating_point or value.dtype == torch.bool
        ):
            found[name] = tuple(value.shape)
        elif isinstance(value, (tuple, list)):
            for k, v in enumerate(value):
                visit(f"{name}[{k}]", v)
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{name}[{k}]", v)

    for name, value in vars(obj).items():
        visit(name, value)
    return found


@pytest.mark.parametrize(("c", "documents"), [(1, True), (2, True), (4, True), (4, False)])
def test_no_integer_lxs_tensor_is_made_or_kept(
    c: int, documents: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the masks (both kinds: global and a window's) makes no integer tensor of L·S elements or more,
    and the object keeps only its positions [b, L] and index vectors [L], [S] (full recomputation's checkpoints
    keep it until the micro-batch's last backward)."""
    b, s = 2, 64
    L = s // c
    tokens = _tokens(b, s, 7)
    batch = (tokens, tokens, document_positions(tokens, EOT)) if documents else (tokens, tokens)
    _, _, positions = context_batch(batch, c, c - 1)  # positions: [b, s/c]
    docs = _context_documents(positions, c, c - 1, monkeypatch) if c > 1 else Documents(positions)
    with _Outputs() as seen:
        for window in (None, 4):
            docs.bias(window, torch.bfloat16, L, s, CPU)
    big = [(f, d) for f, d, n in seen.made if not (d.is_floating_point or d == torch.bool) and n >= L * s]
    assert big == [], big
    held = _integers(docs)
    assert held.pop("positions") == (b, L)
    assert held == ({} if c == 1 else {"indices[0]": (L,), "indices[1]": (s,)})
