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

from tessera.config import from_dict
from tessera.config.sections import ModelConfig
from tessera.dryrun import dry_run
from tessera.model.build import build_model
from tessera.parallel import tensor_2d
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


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_2d_replay_skips_the_mlp_exits_summa(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the 2D grid (2×2, one rank's dry run) the replay stops before the MLP output Linear's SUMMA (its
    operands are saved before it, `checkpointing.save_early`): full checkpointing runs that product once per block and
    micro-batch, every other block product twice; Gemma's post-norm saves its output, so there it runs twice."""
    (full, shape), (none, _) = (_summa_ab_calls(family, ckpt, monkeypatch) for ckpt in ("full", "none"))
    exit_operand = (shape.ffn_hidden // 2, shape.d_model // 2)  # w_down's block [f/q, h/q]
    replayed = {key: full[key] - none.get(key, 0) for key in full}
    assert none[exit_operand] == 2  # one block, two micro-batches: the exit's forward products
    assert replayed.pop(exit_operand) == (2 if replays_mlp_exit(shape) else 0), replayed
    # the block products (the head's logits backward, B = its [V/q, h/q] table, has more rows than any)
    blocks = {key: n for key, n in none.items() if key != exit_operand and key[0] <= shape.ffn_hidden // 2}
    assert blocks and all(replayed[key] == n for key, n in blocks.items()), (replayed, none)


def _summa_ab_calls(
    family: str, checkpointing: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[tuple[int, int], int], ModelShape]:
    """`tensor_2d._summa_ab` calls of a one-block 2×2 step (rank 0's dry run), by the B operand's block shape;
    and the model's shape."""
    calls: dict[tuple[int, int], int] = {}
    inner = tensor_2d._summa_ab

    def counting(a: torch.Tensor, b: torch.Tensor, grid: tensor_2d.Grid2D) -> torch.Tensor:
        calls[tuple(b.shape)] = calls.get(tuple(b.shape), 0) + 1
        return inner(a, b, grid)

    cfg = from_dict(
        {
            # f = 96: w_down's block [48, 16] is no other Linear's (Gemma's tiny f = 64 is its wo's width)
            "model": {"size": f"{family}-tiny", "n_layers": 1, "ffn_hidden": 96},
            "parallel": {"tensor": "2x2", "checkpointing": checkpointing},
            "train": {"global_batch": 4, "micro_batch": 2},
        }
    )
    with monkeypatch.context() as patch:  # undone before the next count wraps the original again
        patch.setattr(tensor_2d, "_summa_ab", counting)
        dry_run(cfg, 4, 0)
    return calls, ModelShape.from_config(cfg.model)


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
