"""Per-parameter deterministic init: any block drawn alone equals that block of the single-device model.

The distributed trainer tests prove the layouts end to end; these check the pieces in one process: the value
source's blocks, the shard declarations of the 2D model on every grid position (built on meta, compared with the
blocks the 2D layers cut from a real model), and that building never touches the global RNG beyond one draw.
"""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig
from tessera.model.build import build_model, meta_model
from tessera.model.init import BLOCK_ELEMENTS, InitSource, block_rows
from tessera.model.materialize import ShardSpec, declare, materialize, read_local, replicated_specs
from tessera.parallel.model_2d import Model2D
from tessera.parallel.tensor_2d import Grid2D

torch.set_num_threads(1)

# odd vocabulary: the 2D vocabulary table is padded; several row blocks per embedding (BLOCK_ELEMENTS rows)
GPT = ModelConfig(family="gpt", n_layers=2, d_model=32, n_heads=4, vocab_size=51, seq_len=16)
LLAMA = ModelConfig(
    family="llama", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=51, seq_len=16
)
QWEN3 = ModelConfig(  # per-head q/k norms: whole on every grid rank, initialised to one
    family="qwen3", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=51, seq_len=16
)
QWEN3_HD = ModelConfig(  # head_dim 16 ≠ 32 / 4: wq [64, 32], wo [32, 64] cut into 2D blocks of that width
    family="qwen3",
    n_layers=2,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_hidden=64,
    vocab_size=51,
    seq_len=16,
)
BIG_ROWS = ModelConfig(family="gpt", n_layers=1, d_model=8, n_heads=2, vocab_size=3 * BLOCK_ELEMENTS // 8 + 5)


def test_any_block_equals_the_slice_of_the_whole() -> None:
    model = meta_model(BIG_ROWS)
    source = InitSource.for_model(model, seed=7)
    name = "embed.wte.weight"
    shape = source.shapes[name]
    assert block_rows(shape) * 3 < shape[0]  # the table spans four row blocks
    whole = source(name, (slice(None), slice(None)))
    for rows, cols in [
        (slice(5, 9), slice(None)),
        (slice(block_rows(shape) - 2, 2 * block_rows(shape) + 3), slice(2, 6)),
        (slice(shape[0] - 3, shape[0]), slice(0, 1)),
    ]:
        assert torch.equal(source(name, (rows, cols)), whole[rows, cols])


def test_tied_names_draw_one_tensor_and_kinds_follow_the_modules() -> None:
    model = meta_model(GPT)  # GPT ties the head to wte
    source = InitSource.for_model(model, seed=3)
    full = (slice(None), slice(None))
    assert torch.equal(source("head.out.weight", full), source("embed.wte.weight", full))
    assert torch.all(source("blocks.0.attn_norm.weight", (slice(None),)) == 1)
    assert torch.all(source("blocks.0.attn.wq.bias", (slice(None),)) == 0)
    wq, wo = source("blocks.0.attn.wq.weight", full), source("blocks.0.attn.wo.weight", full)
    assert wo.std() < wq.std()  # residual projections are scaled by 1/sqrt(2L)
    assert not torch.equal(wq, source("blocks.1.attn.wq.weight", full))


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_build_model_is_a_function_of_the_seed(cfg: ModelConfig) -> None:
    a, b, c = build_model(cfg, seed=11), build_model(cfg, seed=11), build_model(cfg, seed=12)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.wq.weight"], sc["blocks.0.attn.wq.weight"])
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    build_model(cfg, seed=11)
    assert torch.equal(torch.random.get_rng_state(), state)  # a given seed leaves the global RNG alone


@pytest.mark.parametrize("cfg", [GPT, LLAMA, QWEN3, QWEN3_HD], ids=["gpt", "llama", "qwen3", "qwen3_hd16"])
@pytest.mark.parametrize(("i", "j"), [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_2d_shard_declarations_match_the_blocks_cut_from_the_full_model(
    cfg: ModelConfig, i: int, j: int
) -> None:
    grid = Grid2D(q=2, i=i, j=j)
    cut = Model2D(build_model(cfg, seed=5), grid)  # the old path: cut blocks from a full model
    with torch.device("meta"):
        sharded = Model2D(meta_model(cfg), grid)  # the new path: declare, then read only the blocks
    source = InitSource.for_model(meta_model(cfg), seed=5)
    declare(sharded, sharded.shard_specs(), source, "cpu")
    materialize(sharded)
    mine, theirs = dict(sharded.named_parameters()), dict(cut.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in theirs.items():
        assert torch.equal(mine[name], p), name
    for name in (n for n in mine if n.endswith(("q_norm.weight", "k_norm.weight"))):
        assert mine[name].shape == (cfg.head_size,) and bool((mine[name] == 1).all()), name
    if cfg.tie_embeddings:
        table = getattr(sharded.embed, sharded.embed.token_name)
        assert sharded.head.out.weight is table.weight  # materialised once, still tied


def test_read_local_pads_and_transposes() -> None:
    full = torch.arange(15.0).view(5, 3)

    def source(name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return full[index]

    spec = ShardSpec.split("w", (5, 3), {0: (2, 1)})  # rows 3..5 of a table padded to 6 rows
    assert torch.equal(read_local(spec, source), torch.cat((full[3:], torch.zeros(1, 3))))
    spec = ShardSpec.split("w", (5, 3), {0: (1, 0), 1: (3, 2)}, transpose=True)
    assert torch.equal(read_local(spec, source), full[:, 2:3].t())
    assert spec.local_shape == (1, 5)


def test_declare_rejects_a_wrong_declaration() -> None:
    model = meta_model(LLAMA)
    specs = replicated_specs(model)
    specs["blocks.0.attn.wq.weight"] = ShardSpec.replicated("blocks.0.attn.wq.weight", (1, 1))
    with pytest.raises(RuntimeError, match="disagree"):
        declare(model, specs, InitSource.for_model(model, 0), "cpu")
