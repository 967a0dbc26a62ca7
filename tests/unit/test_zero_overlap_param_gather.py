"""parallel.overlap_param_gather's bookkeeping on one process (the collectives are tested on gloo in
tests/distributed/test_zero.py): ZeRO-3 refuses it, and with one data-parallel rank there is nothing to gather."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.parallel.zero import ShardedAdamW
from tessera.pipeline.stage_comm import ZeroStageComm


def test_zero3_refuses_overlap_param_gather_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="overlap_param_gather=False"):
        ZeroStageComm([nn.Linear(2, 2)], None, 3, overlap_param_gather=True)


def test_one_rank_has_no_gather_in_flight_after_a_step() -> None:
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4), nn.Linear(4, 1)]
    zero = ZeroStageComm(stages, None, 2, overlap_param_gather=True)
    opt = ShardedAdamW(zero, lr=0.1)
    before = [p.detach().clone() for s in stages for p in s.parameters()]
    stages[1](stages[0](torch.ones(2, 4))).sum().backward()
    for s in (1, 0):
        zero.reduce(s)
    zero.finish()
    opt.step()
    assert not any(f.gather_pending for f in zero.flats.values())
    after = [p.detach() for s in stages for p in s.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    stages[0].state_dict()  # nothing in flight: the stale-read guard lets it run
    zero.close()
