"""ZeRO-3 keeps parameters sharded in memory, checked by the dry run's allocator count (tessera/fake.py).

Two ways a rank used to hold more than its shard, neither visible to the resident-memory test on CPU (an
``empty`` buffer of a CPU process is never touched, so it is never resident; on a GPU it is allocated):

- construction: each stage's full flat buffer was allocated (``empty``) to cut the parameter views from it, then
  released: a whole stage per rank for an instant, the whole model when one stage holds it;
- bf16 autocast: the step runs in one autocast region, whose cast cache kept the bf16 copy of every gathered
  weight until the step ended, 2 bytes per parameter of every stage.

The model is weight-heavy (h = 256, sequences of 8 tokens), so a leftover stage buffer or weight copy stands far
out of the rest of a rank's memory.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tessera.config import from_dict
from tessera.dryrun import RankResult, dry_run
from tessera.fake import FakeRank, fake_process_group
from tessera.parallel.zero import FlatStage
from tessera.planner.cost import ModelShape
from tessera.startup import startup_memory

WORLD = 4
MODEL = {"family": "gpt", "n_layers": 6, "d_model": 256, "n_heads": 4, "vocab_size": 256, "seq_len": 8}


def _raw(dtype: str, accumulation: str = "layered") -> dict:
    return {
        "model": MODEL,
        "parallel": {"data": WORLD, "zero": 3, "accumulation": accumulation, "checkpointing": "full"},
        "train": {"global_batch": 2 * WORLD, "micro_batch": 1, "dtype": dtype},
    }


def _block_params() -> float:
    shape = ModelShape.from_config(from_dict(_raw("fp32")).model)
    return shape.layer_params()


@pytest.fixture(scope="module")
def fp32() -> RankResult:
    return dry_run(from_dict(_raw("fp32")), WORLD, 0)


def test_zero3_build_allocates_no_full_stage_buffer(fp32: RankResult) -> None:
    cfg = from_dict(_raw("fp32"))
    estimate = startup_memory(cfg, WORLD).build
    # one block's full flat buffer (a stage of layered accumulation) would take the build past the estimate,
    # which leaves out only the device mesh's int32 rank table (4 bytes per rank, tests/unit/test_build_peak.py)
    assert fp32.build_peak <= estimate + 4 * WORLD, (
        f"build peak {fp32.build_peak} B, estimate {estimate:.0f} B"
    )
    assert fp32.build_peak < fp32.params + 4 * _block_params(), "a full stage buffer was allocated"


def test_zero3_bf16_keeps_no_weight_copies_across_stages(fp32: RankResult) -> None:
    bf16 = dry_run(from_dict(_raw("bf16")), WORLD, 0)
    # bf16 may hold one gathered stage's casts at a time; the cast cache held all six blocks' for the step
    excess = bf16.peak - fp32.peak
    assert excess < 2 * 2 * _block_params(), (
        f"bf16 peak {bf16.peak} B exceeds fp32's {fp32.peak} B by {excess} B; one block's bf16 weights are "
        f"{2 * _block_params():.0f} B"
    )


def test_a_launched_reduce_scatter_keeps_its_flat_input_until_waited() -> None:
    """ZeRO's reduce-scatter is asynchronous: its input, the stage's flattened gradients, must stay allocated
    until `wait_reduce` (a real backend's work keeps it: NCCL stashes a collective's inputs until it completes),
    and the rank's memory holds it there. The dry run's fake work keeps nothing, so `FlatStage` keeps the
    reference itself; without it the dry run's peak left out the reduction in flight beside the next stage's
    backward (tests/unit/test_peak_vs_dryrun.py's context + ZeRO-3 case, then 4.5 % under the estimate)."""
    n = 1000  # 4,000 bytes of fp32 gradients; over 2 ranks a 2,000-byte shard
    with fake_process_group(0, 2), FakeRank() as fr:
        weight = nn.Parameter(torch.zeros(n))
        stage = FlatStage([weight], dist.group.WORLD, 2)
        weight.grad = torch.ones(n)
        before = fr.live
        stage.launch_reduce(torch.float32, drop_grads=True)
        # the gradient dropped; its flattened copy (in flight) and the shard the collective writes alive
        assert fr.live == before - 4 * n + 4 * n + 2 * n
        stage.wait_reduce()
        assert fr.live == before - 4 * n + 2 * n  # the copy freed; the output is the gradient shard now
        assert stage.grad_shard is not None and stage.grad_shard.numel() == n // 2
