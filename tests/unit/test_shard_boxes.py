"""`ShardSpec.boxes`: a range of a local tensor's elements as blocks of the global tensor, the geometry of the
layout-free checkpoints (a ZeRO shard's part of a tensor-parallel block, transposed in 2D, vocabulary padded)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tessera.model.materialize import ShardSpec

SPECS = {
    "whole": ShardSpec.replicated("w", (5, 7)),
    "vector": ShardSpec.replicated("b", (9,)),
    "rows_padded": ShardSpec.split("emb", (11, 4), {0: (4, 3)}),  # rows 9..11 of 12: the last is padding
    "cols": ShardSpec.split("w", (6, 8), {1: (2, 1)}),
    "2d_transposed_padded": ShardSpec.split("w", (5, 6), {0: (2, 1), 1: (3, 2)}, transpose=True),
}


def _local_block(spec: ShardSpec, full: torch.Tensor) -> torch.Tensor:
    """What a rank holding ``spec`` has, from the global tensor ``full``: its block, zero-padded, transposed."""
    padded = torch.zeros(tuple(max(b, n) for (_, b), n in zip(spec.index, spec.shape, strict=True)))
    padded[tuple(slice(0, n) for n in spec.shape)] = full
    block = padded[tuple(slice(a, b) for a, b in spec.index)]
    return block.t().contiguous() if spec.transpose else block.contiguous()


@pytest.mark.parametrize("name", SPECS)
def test_boxes_of_every_range_place_every_real_element_once(name: str) -> None:
    spec = SPECS[name]
    full = torch.arange(1, 1 + torch.Size(spec.shape).numel(), dtype=torch.float32).reshape(spec.shape)
    local = _local_block(spec, full).reshape(-1)
    n = local.numel()
    for start, stop in itertools.combinations(range(n + 1), 2):
        rebuilt = torch.zeros_like(full)
        for box in spec.boxes(start, stop):
            size = torch.Size(box.local_sizes).numel()
            assert start <= box.flat and box.flat + size <= stop  # inside the range
            view = local[box.flat : box.flat + size].view(box.local_sizes)
            view = view.t() if spec.transpose else view
            view = view[tuple(slice(0, k) for k in box.sizes)]
            target = rebuilt[tuple(slice(o, o + k) for o, k in zip(box.offsets, box.sizes, strict=True))]
            assert not target.any(), "two boxes cover the same element"
            target.copy_(view)
        placed = rebuilt != 0
        assert torch.equal(rebuilt[placed], full[placed])  # each value at its global position
        real = local[start:stop]
        assert sorted(rebuilt[placed].tolist()) == sorted(
            real[real != 0].tolist()
        )  # all of them; padding dropped


def test_a_range_is_at_most_2_ndim_minus_1_contiguous_blocks() -> None:
    spec = ShardSpec.replicated("w", (4, 5, 6))
    assert max(len(spec.boxes(a, b)) for a, b in itertools.combinations(range(121), 2)) == 5
