"""`precision.cast_operand`: a weight is cast once per tessera autocast region, as autocast's own cache casts the
weights of F.linear, and never served stale (an in-place update, the region's end, ZeRO-3's FREE); activations are
cast on every call; gradients reach the fp32 weight through the shared copy exactly as through separate casts, and
as soon as each call's matmul backward has run."""

from __future__ import annotations

import torch

from tessera.parallel.precision import autocast, cast_operand, clear_weight_casts

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def _shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two casts are one copy (the same storage)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _weight() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))


def test_a_weight_is_cast_once_per_region() -> None:
    w = _weight()
    with autocast("bf16", CPU):
        first = cast_operand(w, BF16)
        assert _shared(cast_operand(w, BF16), first) and first.dtype == BF16
        assert torch.equal(first, w.detach().to(BF16))
    with autocast("bf16", CPU):  # a new region casts again
        assert not _shared(cast_operand(w, BF16), first)


def test_activations_and_casts_outside_a_region_are_not_cached() -> None:
    w = _weight()
    x = w * 2  # not a leaf: an activation
    with autocast("bf16", CPU):
        assert not _shared(cast_operand(x, BF16), cast_operand(x, BF16))
        with torch.no_grad():  # a copy without grad_fn must not serve a later differentiable call
            assert not _shared(cast_operand(w, BF16), cast_operand(w, BF16))
    with torch.autocast("cpu", dtype=BF16):  # torch's region alone: nothing clears tessera's cache at its end
        assert not _shared(cast_operand(w, BF16), cast_operand(w, BF16))
    with autocast("fp32", CPU):
        assert not _shared(cast_operand(w, BF16), cast_operand(w, BF16))


def test_an_updated_or_cleared_weight_is_cast_again() -> None:
    w = _weight()
    with autocast("bf16", CPU):
        before = cast_operand(w, BF16)
        with torch.no_grad():
            w.add_(1.0)  # an optimizer step bumps the version counter
        after = cast_operand(w, BF16)
        assert not _shared(after, before) and torch.equal(after, w.detach().to(BF16))
        clear_weight_casts()  # ZeRO-3's FREE
        assert not _shared(cast_operand(w, BF16), after)


def test_gradients_through_the_shared_copy_equal_separate_casts() -> None:
    """Three micro-batches' forwards, then their backwards: the cached copy's ToCopyBackward is shared by all three
    graphs, and the accumulated fp32 gradient is bit-identical to three separate casts'."""
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    grads = []
    for region in (autocast("bf16", CPU), torch.autocast("cpu", dtype=BF16)):  # cached, then per-call casts
        w = _weight()
        with region:
            losses = [(x.to(BF16) @ cast_operand(w, BF16)).float().pow(2).sum() for x in xs]
        for loss in losses:
            loss.backward()
        grads.append(w.grad)
    assert grads[0].dtype == torch.float32
    assert torch.equal(grads[0], grads[1])


def test_the_weight_gradient_is_accumulated_as_soon_as_the_matmul_backward_ran() -> None:
    """The autograd engine runs ready nodes newest first. A cast node shared with an earlier forward (autocast's
    own cache) is older than everything a later forward built, so it would run only at that backward's end,
    holding its bf16 weight gradient until then; each call's own node runs right after its matmul's backward,
    before a branch made between the two forwards."""
    w, x = _weight(), torch.randn(3, 8)
    other = torch.randn(3, requires_grad=True)
    seen = []
    other.register_hook(lambda g: seen.append(w.grad is not None))
    with autocast("bf16", CPU):
        cast_operand(w, BF16)  # an earlier micro-batch's forward casts the weight
        z = (other * 2).sum()  # built between the two forwards
        y = (x.to(BF16) @ cast_operand(w, BF16)).float().sum()
        (y + z).backward()
    assert seen == [True]
