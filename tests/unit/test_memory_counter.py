"""SavedActivationCounter on small cases whose saved tensors are known."""

from __future__ import annotations

import torch
from torch import nn

from tessera.parallel.saved_activations import SavedActivationCounter, SavedStorages

FP32 = 4


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 6)


def test_linear_saves_its_input() -> None:
    lin, x = _linear(), torch.randn(5, 8)
    with SavedActivationCounter(lin) as saved:
        lin(x).sum().backward()
    assert saved.bytes == x.numel() * FP32
    assert saved.tensors == 1


def test_weights_count_unless_their_module_is_given() -> None:
    lin, x = _linear(), torch.randn(5, 8, requires_grad=True)  # input needs grad: the weight is saved too
    with SavedActivationCounter() as saved:
        lin(x).sum().backward()
    assert saved.bytes == (x.numel() + lin.weight.numel()) * FP32
    with SavedActivationCounter(lin) as saved:
        lin(x).sum().backward()
    assert saved.bytes == x.numel() * FP32


def test_a_storage_saved_twice_or_through_views_counts_once() -> None:
    lin, x = _linear(), torch.randn(5, 8)
    with SavedActivationCounter(lin) as saved:
        y = lin(x)  # saves x; y: [5, 6]
        z = y * y  # saves y twice
        w = y[:, :3] * y[:, 3:]  # saves two views of y's storage
        (z.sum() + w.sum()).backward()
    assert saved.bytes == (x.numel() + y.numel()) * FP32
    assert saved.tensors == 2


def test_nothing_counted_without_grad_or_outside() -> None:
    lin, x = _linear(), torch.randn(5, 8)
    with SavedActivationCounter(lin) as saved, torch.no_grad():
        lin(x)
    assert saved.bytes == 0
    lin(x).sum().backward()  # after the context: hooks are gone
    assert saved.bytes == 0


def test_storages_held_by_several_forwards_count_once() -> None:
    """A pipeline's micro-batches in flight can save one storage (autocast's cached weight copy): held once,
    freed when the last forward holding it has run its backward."""
    held = SavedStorages()
    shared, own_a, own_b = ("cpu", 1), ("cpu", 2), ("cpu", 3)
    held.add("a", {shared: 100, own_a: 10})
    held.add("b", {shared: 100, own_b: 20})
    assert held.bytes == 130
    held.release("a")
    assert held.bytes == 120  # b still holds the shared storage
    held.release("b")
    assert held.bytes == 0
