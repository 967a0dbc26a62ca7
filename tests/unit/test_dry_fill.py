"""The dry run builds without drawing initial values, and its memory figures stay those of a build that draws.

A real build reads each parameter a row block at a time (`tessera.model.materialize.read_local` over
`tessera.model.init.InitSource`): the local tensor, the source's answer and the drawn row block coexist for a
moment, and that transient is part of the start-up peak the dry run reports. Fake tensors hold no values, so
`tessera.dryrun.dry_run` reads from ``InitSource(values=False)``, which allocates the same tensors and draws none
(docs/dryrun.md). Here: the allocator's trace of a read is the same with and without values, a whole dry run
reports the same figures either way (on layouts where the row block sets the build peak), and it never seeds a
generator.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessera.config import Config, from_dict
from tessera.dryrun import RankResult, dry_run, measure_step
from tessera.fake import FakeRank, fake_process_group
from tessera.model import init
from tessera.model.build import meta_model
from tessera.model.init import BLOCK_ELEMENTS, InitSource
from tessera.model.materialize import ShardSpec, read_local

# several row blocks per table (vocab·d > BLOCK_ELEMENTS), a padded 2-way split of an odd vocabulary
VOCAB, D = 3 * BLOCK_ELEMENTS // 64 + 5, 64
MODEL = {"family": "llama", "n_layers": 2, "d_model": D, "n_heads": 4, "n_kv_heads": 2, "vocab_size": VOCAB}
MODEL |= {"seq_len": 16, "tie_embeddings": False}
SPECS = {  # name: (global parameter, its shard)
    "whole": ShardSpec.replicated("embed.tok.weight", (VOCAB, D)),
    "rows, padded": ShardSpec.split("embed.tok.weight", (VOCAB, D), {0: (2, 1)}),
    "columns, transposed": ShardSpec.split("head.out.weight", (VOCAB, D), {1: (2, 1)}, transpose=True),
    "a norm (constant)": ShardSpec.replicated("blocks.0.attn_norm.weight", (D,)),
}

LAYOUTS = {  # name: (world size, parallel section): the three ways a rank fills its parameters
    "direct, data parallel": (2, {"data": 2}),
    "pipeline, tensor parallel": (4, {"pipeline": 2, "tensor": 2}),
    "ZeRO-3 flat shards": (2, {"data": 2, "zero": 3}),
}


class _Trace(FakeRank):
    """FakeRank that also keeps every change of its live bytes: each allocation and free, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[int] = []

    def _note(self) -> None:
        if not self.trace or self.trace[-1] != self.live:
            self.trace.append(self.live)

    def _set(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        super()._set(storage, nbytes)
        self._note()

    def _drop(self, key: int) -> None:
        super()._drop(key)
        self._note()


def _read_trace(spec: ShardSpec, values: bool) -> tuple[list[int], int]:
    source = InitSource.for_model(meta_model(_cfg({}).model), seed=1, values=values)
    with _Trace() as tracker:
        local = read_local(spec, source)
        assert tuple(local.shape) == spec.local_shape
        del local
    return tracker.trace, tracker.peak


@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
def test_a_read_without_values_allocates_what_a_drawing_read_does(spec: str) -> None:
    drawn, drawn_peak = _read_trace(SPECS[spec], values=True)
    shapes_only, peak = _read_trace(SPECS[spec], values=False)
    assert shapes_only == drawn
    assert peak == drawn_peak
    local_bytes = 4 * torch.Size(SPECS[spec].local_shape).numel()
    assert peak > local_bytes  # the source's answer (and the row block) sit on top of the local tensor


def _measure(cfg: Config, world: int, values: bool) -> dict:
    with fake_process_group(0, world), FakeRank() as tracker:
        result = measure_step(cfg, world, 0, tracker, values=values)
    return _figures(result)


def _figures(result: RankResult) -> dict:
    return {k: v for k, v in dataclasses.asdict(result).items() if k != "seconds"}


def _cfg(parallel: dict) -> Config:
    return from_dict({"model": MODEL, "parallel": parallel, "train": {"global_batch": 2, "micro_batch": 1}})


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_dry_run_reports_what_a_drawing_build_does(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    world, parallel = LAYOUTS[layout]
    cfg = _cfg(parallel)
    drawn = _measure(cfg, world, values=True)
    assert _figures(dry_run(cfg, world, 0)) == drawn  # every figure: memory, build peak, traffic

    # the row block is part of this layout's build peak, so the equality above would catch its loss
    def no_row_block(self, name, shape, bounds, std) -> torch.Tensor:
        return torch.empty(tuple(len(range(*b)) for b in bounds), dtype=torch.float32)

    monkeypatch.setattr(InitSource, "_normal", no_row_block)
    assert _measure(cfg, world, values=True)["build_peak"] < drawn["build_peak"]


def test_dry_run_draws_no_values(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg({"data": 2, "zero": 3})

    def seeded(*args: object) -> int:
        raise AssertionError("a row block was drawn")

    monkeypatch.setattr(init, "stream_seed", seeded)
    dry_run(cfg, 2, 0)
    with pytest.raises(AssertionError, match="drawn"):  # the probe is on the drawing path
        _measure(cfg, 2, values=True)
