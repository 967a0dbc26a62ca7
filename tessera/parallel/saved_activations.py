"""Measure the activation memory a forward pass keeps for backward on this rank.

`SavedActivationCounter` hooks `torch.autograd.graph.saved_tensors_hooks`: every tensor autograd saves for backward
passes through it, and the bytes of each distinct storage are counted once (views such as a transposed weight or a
slice share their base's storage; a tensor saved by two operations is counted once). Model state (parameters and
buffers, including those of modules passed in) is not an activation and is left out.

    with SavedActivationCounter(model) as saved:
        loss = model(tokens, targets)
    print(saved.bytes)          # bytes held alive for backward by this forward
    loss.backward()

Only tensors saved through autograd are seen: a custom `autograd.Function` that stashes tensors as `ctx`
attributes instead of `ctx.save_for_backward` hides them (tessera's own functions use save_for_backward).
"""

from __future__ import annotations

from types import TracebackType

import torch
from torch import nn

__all__ = ["SavedActivationCounter", "SavedStorages"]


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, storage identity) of t's storage, or None for tensors without real storage (meta, empty).

    The identity is the storage object's address (``_cdata``), not its data pointer: fake tensors (the dry run,
    tessera/fake.py) have no data, so every data pointer reads 0 there.
    """
    local = getattr(t, "_local_tensor", None)  # a DTensor saves its local shard
    if isinstance(local, torch.Tensor):
        t = local
    if t.is_meta or t.layout != torch.strided:
        return None
    try:
        storage = t.untyped_storage()
    except RuntimeError:  # wrapper tensors without a storage of their own (e.g. a pending async collective)
        return None
    if storage.nbytes() == 0:
        return None
    return (str(t.device), storage._cdata)


class SavedActivationCounter:
    """Context manager summing the bytes of unique storages saved for backward inside it (``.bytes``).

    ``modules``: their parameters and buffers are excluded (model state, not activations); pass the model, or its
    weights count too. Other leaves are counted: a pipeline stage's received input is an activation it keeps.
    ``.tensors`` is the number of distinct storages.
    """

    def __init__(self, *modules: nn.Module) -> None:
        self._state = {
            key
            for m in modules
            for t in (*m.parameters(), *m.buffers())
            if (key := _storage_key(t)) is not None
        }
        self._seen: dict[tuple[str, int], int] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    @property
    def bytes(self) -> int:
        """Bytes of the distinct activation storages saved so far."""
        return sum(self._seen.values())

    @property
    def tensors(self) -> int:
        return len(self._seen)

    @property
    def storages(self) -> dict[tuple[str, int], int]:
        """Bytes of each distinct storage saved so far, by storage identity (for `SavedStorages`)."""
        return dict(self._seen)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._state:
            self._seen[key] = max(self._seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedActivationCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(exc_type, exc, tb)
            self._hooks = None


class SavedStorages:
    """The storages several forwards hold for backward at once (a pipeline's micro-batches in flight), each counted
    once however many forwards saved it: under autocast every micro-batch saves the same cached bf16 copy of a
    weight. ``add`` a forward's `SavedActivationCounter.storages` under a name; ``release`` it at its backward;
    ``bytes`` is what is held now."""

    def __init__(self) -> None:
        self._held: dict[object, dict[tuple[str, int], int]] = {}
        self._refs: dict[tuple[str, int], int] = {}
        self.bytes = 0

    def add(self, owner: object, storages: dict[tuple[str, int], int]) -> None:
        self.release(owner)
        self._held[owner] = storages
        for key, nbytes in storages.items():
            self._refs[key] = self._refs.get(key, 0) + 1
            if self._refs[key] == 1:  # a storage alive while held: its identity cannot be reused meanwhile
                self.bytes += nbytes

    def release(self, owner: object) -> None:
        for key, nbytes in self._held.pop(owner, {}).items():
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]
                self.bytes -= nbytes
