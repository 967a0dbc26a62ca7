"""Full checkpointing replays a block's forward but its MLP output projection: torch's non-reentrant checkpoint
stops once every tensor the backward saved is rebuilt, and nothing saves that Linear's output (unless a post-norm
does: Gemma 2 and 3 replay it). The runtime is
checked (forward-hook counts on tessera's own blocks) and the planner prices the same replay
(`cost.compute.layer_time`; Megatron's whole-forward replay under `Plan.replays_last_exit`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from tessera.config.sections import ModelConfig
from tessera.model.build import build_model
from tessera.parallel.checkpointing import apply_checkpointing
from tessera.planner.cost import ModelShape, Plan
from tessera.planner.cost.compute import layer_time
from tessera.planner.gemm import gemm_call_time
from tessera.planner.hardware import load_hardware
from tessera.traffic import replays_mlp_exit


@pytest.mark.parametrize("family, exit_name", [("gpt", "mlp.proj"), ("llama", "mlp.w_down")])
def test_full_checkpointing_skips_the_mlp_exit_on_replay(family: str, exit_name: str) -> None:
    calls = _linear_calls(family)
    assert calls.pop(exit_name) == 1  # the forward only
    assert calls and all(n == 2 for n in calls.values()), calls  # forward + replay


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_post_norm_makes_the_replay_run_the_mlp_exit(family: str) -> None:
    """Gemma's mlp_post_norm saves the MLP output projection's output, so the replay runs that Linear too
    (`traffic.replays_mlp_exit`: the planner prices its GEMM and its exit collective)."""
    calls = _linear_calls(family)
    assert calls["mlp.w_down"] == 2
    assert all(n == 2 for n in calls.values()), calls
    shape = ModelShape.from_config(ModelConfig(family=family, n_layers=1))
    assert replays_mlp_exit(shape) and not replays_mlp_exit(replace(shape, family="llama"))


def _linear_calls(family: str) -> dict[str, int]:
    """Forward calls of each nn.Linear of a one-block model's block in one full-checkpointing step."""
    model = build_model(ModelConfig(family=family, n_layers=1), seed=0)
    apply_checkpointing(model, "full")
    block = next(iter(model.blocks.values())) if isinstance(model.blocks, nn.ModuleDict) else model.blocks[0]
    calls: dict[str, int] = {}
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    logits = model(torch.randint(0, 256, (2, 16)))
    logits.float().sum().backward()
    return calls


def test_planner_replays_the_forward_less_the_exit_gemm() -> None:
    shape = ModelShape(
        n_layers=2, d_model=2048, n_heads=16, n_kv_heads=16, ffn_hidden=8192, vocab_size=50368, seq_len=2048
    )
    hw = load_hardware("a100-80gb")
    plan = Plan(tp=2, micro_batch=2, recompute="full", flash_attention=True)
    layer = layer_time(shape, hw, plan)
    exit_gemm = gemm_call_time(hw, 2 * 2048, 2048, 8192 / 2)  # fc2, row-parallel: input width split
    assert layer.recompute == pytest.approx(layer.forward - exit_gemm, rel=1e-12)
    megatron = layer_time(shape, hw, replace(plan, replays_last_exit=True))
    assert megatron.recompute == pytest.approx(megatron.forward, rel=1e-12)
