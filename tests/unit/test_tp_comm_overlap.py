"""parallel.tp_comm_overlap reaches every layer whose collective becomes a ring; without sequence parallelism it is a
clear error. The rings' numerics and bytes are checked multi-process in tests/distributed/test_tensor_1d.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tessera.config import Config, ModelConfig, ParallelConfig
from tessera.model.build import build_model
from tessera.parallel.model_1d import TensorParallel1D, apply_tensor_1d
from tessera.parallel.tensor_1d import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
)

RING_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelOutput)
"""Layers with a GEMM at a sequence-parallel boundary (the token embedding's exit has none)."""


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_flag_reaches_every_gemm_boundary_from_the_config(family: str) -> None:
    cfg = ModelConfig(family=family, n_layers=2, d_model=32, n_heads=4, vocab_size=50, seq_len=8)
    run = Config(parallel=ParallelConfig(tensor=2, sequence_parallel=True, tp_comm_overlap=True))
    groups = SimpleNamespace(tp=None)  # a size-1 group: the construction path without torch.distributed
    model = apply_tensor_1d(build_model(cfg, seed=0), groups, run)
    layers = [m for m in model.modules() if isinstance(m, RING_LAYERS)]
    assert (
        len(layers) == cfg.n_layers * (3 + 1 + len(model.plan.mlp_in) + 1) + 1
    )  # q,k,v, o, mlp in, out; head
    assert all(m.tp_comm_overlap for m in layers)
    assert not any(
        hasattr(m, "tp_comm_overlap") for m in model.modules() if isinstance(m, VocabParallelEmbedding)
    )
    plain = apply_tensor_1d(build_model(cfg, seed=0), groups, Config())
    assert not any(m.tp_comm_overlap for m in plain.modules() if isinstance(m, RING_LAYERS))


def test_overlap_without_sequence_parallelism_names_the_fix() -> None:
    cfg = ModelConfig(family="gpt", n_layers=1, d_model=32, n_heads=4, vocab_size=50, seq_len=8)
    with pytest.raises(ValueError, match=r"needs sequence_parallel=True.*or set tp_comm_overlap=False"):
        TensorParallel1D(build_model(cfg, seed=0), None, tp_comm_overlap=True)
