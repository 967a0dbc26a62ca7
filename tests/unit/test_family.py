"""Each family's declaration (tessera/model/family.py) is what its model, its tensor-parallel versions and the
cost model actually hold."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tessera.config import ModelConfig
from tessera.errors import ConfigError
from tessera.model.build import build_model
from tessera.model.family import FAMILIES, FAMILY_PLANS, family_plan
from tessera.parallel.model_1d import TensorParallel1D
from tessera.parallel.model_2d import Model2D
from tessera.parallel.tensor_2d import Grid2D
from tessera.planner.cost import ModelShape


def _cfg(family: str, tie: bool = True, head_dim: int | None = None) -> ModelConfig:
    return ModelConfig(
        head_dim=head_dim,
        family=family,
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=50,
        seq_len=8,
        tie_embeddings=tie,
    )


def test_family_registry_imports_without_torch() -> None:
    code = "import sys, tessera.model.family; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_family_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("model.family = 'bert' is unknown; use one of gpt, llama")
    ):
        family_plan("bert")


# head_dim 12 only where the family has a free head width (GPT-2 has none: refused, tests/unit/test_config.py)
FAMILY_HEAD_DIMS = [(f, None) for f in FAMILIES] + [
    (f, 12) for f in FAMILIES if FAMILY_PLANS[f].free_head_dim
]


@pytest.mark.parametrize(("family", "head_dim"), FAMILY_HEAD_DIMS, ids=lambda v: str(v))
def test_model_holds_what_its_family_declares(family: str, head_dim: int | None) -> None:
    """Every parameter the declaration names, at its declared shape; with head_dim 12 ≠ 32 / 4 the attention is
    4·12 = 48 wide (wq [48, 32], wk/wv [24, 32], wo [32, 48]), as transformers' Llama lays it out."""
    cfg = _cfg(family, tie=False, head_dim=head_dim)
    model = build_model(cfg, seed=0)
    plan = family_plan(cfg)
    assert model.plan is plan and model.token_embedding_name == plan.token_embedding
    names = {n for n, _ in model.named_parameters()}
    expected = {"head.out.weight", f"embed.{plan.token_embedding}.weight", "head.norm.weight"}
    expected |= {f"embed.{plan.position_embedding}.weight"} if plan.has_position_embedding else set()
    expected |= {"head.norm.bias"} if plan.norm_bias else set()
    for i in range(cfg.n_layers):
        for norm in plan.block_norms:  # Gemma 2's post-norms too; (1 + w) norms start at w = 0
            w = model.get_parameter(f"blocks.{i}.{norm}.weight")
            assert bool((w == (0 if plan.norm_offset else 1)).all()), norm
            expected |= {f"blocks.{i}.{norm}.weight"} | (
                {f"blocks.{i}.{norm}.bias"} if plan.norm_bias else set()
            )
        for lin in plan.block_linears(cfg.d_model, cfg.attn_dim, cfg.kv_heads * cfg.head_size, cfg.ffn):
            w = model.get_parameter(f"blocks.{i}.{lin.name}.weight")
            assert tuple(w.shape) == (lin.d_out, lin.d_in), lin.name
            expected |= {f"blocks.{i}.{lin.name}.weight"} | (
                {f"blocks.{i}.{lin.name}.bias"} if lin.bias else set()
            )
        for norm in plan.head_norms:  # per-head q/k norms (Qwen3, Gemma 3): [head_dim], the identity scale
            w = model.get_parameter(f"blocks.{i}.{norm}")
            assert tuple(w.shape) == (cfg.head_size,) and bool((w == (0 if plan.norm_offset else 1)).all()), (
                norm
            )
            expected.add(f"blocks.{i}.{norm}")
    assert names == expected
    assert hasattr(model, "rope") == plan.rope
    assert ModelShape.from_config(cfg).n_params() == model.num_params()


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_layouts_follow_the_declaration(family: str) -> None:
    """The 1D split dims and the 2D shards the parallel models record are the declared placements."""
    cfg = _cfg(family)
    plan = family_plan(cfg)
    plain = build_model(cfg, seed=0)
    one_d = TensorParallel1D(plain, None)
    split = {"column": 0, "vocab": 0, "row": 1}
    for name, _ in one_d.named_parameters():
        where = plan.placement_1d(name)
        assert one_d._split.get(name, (None,))[0] == split.get(where), (name, where)
    two_d = Model2D(plain, Grid2D(q=1, i=0, j=0))
    for name, _ in two_d.named_parameters():
        shard, where = two_d._shards[name], plan.placement_2d(name)
        got = "vocab" if shard.rows is not None else "linear" if shard.transpose else "vector"
        got = "grid" if shard.dim_j is None else got
        assert got == where, name
        assert (shard.dim_i is None) == (where in ("vector", "grid")), name


def test_gpt_parameter_count_is_narayanans() -> None:
    """12h² + 13h per block (Narayanan et al. 2021, eq. 2) from the GPT declaration, f = 4h, g = a."""
    h = 64
    assert family_plan("gpt").block_params(h, h, h, 4 * h, h // 4) == 12 * h * h + 13 * h
    assert family_plan("llama").block_params(h, h, h, 4 * h, h // 4) == 4 * h * h + 3 * 4 * h * h + 2 * h
    assert (
        family_plan("qwen3").block_params(h, h, h, 4 * h, h // 4)
        == 4 * h * h + 3 * 4 * h * h + 2 * h + h // 2
    )


def test_mlp_activation_is_the_plain_forward() -> None:
    for family in FAMILIES:
        model = build_model(_cfg(family), seed=1)
        mlp, plan = model.blocks["0"].mlp, model.plan
        x = torch.randn(2, 3, 32)
        hidden = [getattr(mlp, n)(x) for n in plan.mlp_in]
        torch.testing.assert_close(getattr(mlp, plan.mlp_out)(mlp.activate(*hidden)), mlp(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("tensor", "world", "refused"),
    [
        (2, 2, None),
        ("2x2", 4, None),
        (4, 4, "n_kv_heads = 2 is not divisible by tensor 4"),
        ("4x4", 16, "2D grid"),
    ],
)
def test_qwen3_layouts_keep_whole_heads_or_are_refused(
    tensor: int | str, world: int, refused: str | None
) -> None:
    """The per-head q/k norms need each head's features on one rank: validate accepts a tensor degree only where
    it splits whole query and KV heads (qwen3-tiny: 4 heads, 2 KV heads), and names the KV heads otherwise."""
    from tessera.config import from_dict
    from tessera.execution import violations

    raw = {"model": {"size": "qwen3-tiny"}, "parallel": {"tensor": tensor}}
    found = violations(from_dict({**raw, "train": {"global_batch": 8, "micro_batch": 4}}), world)
    if refused is None:
        assert found == []
    else:
        assert any("model.n_kv_heads = 2" in v.problem and refused in v.problem for v in found), found
