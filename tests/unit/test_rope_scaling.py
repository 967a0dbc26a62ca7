"""RoPE scaling (``model.rope_scaling``, llama3): the inverse frequencies against transformers' own computation,
the config's refusals, the released sizes, and a model configured without HF exporting to transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import _compute_llama3_parameters
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from tessera.cli import main
from tessera.config import load_config
from tessera.errors import ConfigError
from tessera.model.layers import rope_inv_freq
from tessera.model.sizes import SIZES
from tests.hf_models import VOCAB, rel_err
from tests.unit.test_hf import LOGIT_RTOL  # the same fp32 arithmetic as transformers', in another order

CASES = {  # name: (theta, head dim, factor, low_freq_factor, high_freq_factor, original context)
    "llama3.1-8b": (500000.0, 128, 8.0, 1.0, 4.0, 8192),
    "llama3.2-1b": (500000.0, 64, 32.0, 1.0, 4.0, 8192),
    "llama3.2-3b": (500000.0, 128, 32.0, 1.0, 4.0, 8192),
    "tiny_theta_1e4": (10000.0, 8, 8.0, 1.0, 8.0, 128),
    "odd_band": (50000.0, 16, 2.5, 0.5, 3.0, 100),
    "int_values": (1000000, 32, 4, 1, 4, 4096),
}


def _hf_config(theta: float, head_dim: int, scaling: dict | None) -> transformers.LlamaConfig:
    params = {"rope_type": "default", "rope_theta": theta} | (scaling or {})
    heads = 4
    return transformers.LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        max_position_embeddings=131072,
        rope_parameters=params,
    )


@pytest.mark.parametrize("name", CASES)
def test_llama3_inverse_frequencies_equal_transformers(name: str) -> None:
    theta, head_dim, factor, low, high, original = CASES[name]
    keys = dict(
        factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original
    )
    expected, attention_factor = _compute_llama3_parameters(
        _hf_config(theta, head_dim, {"rope_type": "llama3", **keys})
    )
    got = rope_inv_freq(head_dim, theta, {"type": "llama3", **keys})
    assert attention_factor == 1.0  # llama3 scales the frequencies only, never cos/sin
    assert got.dtype == expected.dtype == torch.float32
    assert torch.equal(got, expected), float(((got - expected).abs() / expected).max())
    unscaled, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(_hf_config(theta, head_dim, None))
    assert torch.equal(rope_inv_freq(head_dim, theta), unscaled)
    # and what LlamaForCausalLM holds: its rotary embedding picks _compute_llama3_parameters for llama3
    config = _hf_config(theta, head_dim, {"rope_type": "llama3", **keys})
    assert torch.equal(LlamaRotaryEmbedding(config).inv_freq, got)
    # the case scales something: a formula that ignored the scaling would fail the comparison above
    assert not torch.equal(expected, unscaled)


def _violations(*overrides: str) -> list[str]:
    cfg = load_config(None, ['model.family="llama"', *overrides])
    return [str(v) for v in cfg.check(world_size=1) if v.rule == "model.rope_scaling"]


LLAMA31 = (
    "factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position_embeddings = 8192"
)

REFUSED = {  # name: (model.rope_scaling, texts the violation must hold: the key and the fix)
    "refused_type": (
        '{type = "yarn", factor = 4.0}',
        ["model.rope_scaling.type = 'yarn' is not implemented"],
    ),
    "unknown_type": (
        '{type = "llama4"}',
        ["model.rope_scaling.type = 'llama4' is unknown", 'use type = "llama3"'],
    ),
    "no_type": ("{factor = 8.0}", ["model.rope_scaling has no type", 'add type = "llama3"']),
    "missing": (
        '{type = "llama3", factor = 8.0}',
        ["model.rope_scaling lacks low_freq_factor, high_freq_factor, original_max_position_embeddings"],
    ),
    "zero_factor": (
        f'{{type = "llama3", {LLAMA31.replace("factor = 8.0", "factor = 0.0", 1)}}}',
        ["model.rope_scaling.factor = 0.0 must be > 0", "set model.rope_scaling.factor > 0"],
    ),
    "low_above_high": (
        '{type = "llama3", factor = 8.0, low_freq_factor = 4.0, high_freq_factor = 1.0, '
        "original_max_position_embeddings = 8192}",
        ["model.rope_scaling.high_freq_factor = 1.0 must exceed low_freq_factor = 4.0", "fix: set"],
    ),
    "fractional_context": (
        f'{{type = "llama3", {LLAMA31.replace("8192", "8192.5")}}}',
        ["model.rope_scaling.original_max_position_embeddings = 8192.5 must be a positive integer"],
    ),
    "not_a_number": (
        f'{{type = "llama3", {LLAMA31.replace("= 1.0", "= true")}}}',
        ["model.rope_scaling.low_freq_factor = True is not a finite number"],
    ),
    "unknown_key": (
        f'{{type = "llama3", scale = 2.0, {LLAMA31}}}',
        ["model.rope_scaling has unknown key(s) ['scale']", "remove them"],
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_config_refuses_what_tessera_does_not_compute(name: str) -> None:
    value, texts = REFUSED[name]
    found = _violations(f"model.rope_scaling={value}")
    assert found, value
    for text in texts:
        assert any(text in v for v in found), (text, found)
    assert all("fix: " in v for v in found)


def test_config_rope_scaling_needs_a_rope_family_and_a_table() -> None:
    cfg = load_config(None, ['model.family="gpt"', f'model.rope_scaling={{type = "llama3", {LLAMA31}}}'])
    (v,) = [v for v in cfg.check(world_size=1) if v.rule == "model.rope_scaling"]
    assert "model.family = 'gpt' has no RoPE" in v.problem and "remove model.rope_scaling" in v.fix
    with pytest.raises(ConfigError, match=r"model\.rope_scaling = 'llama3' should be of type dict"):
        load_config(None, ['model.rope_scaling="llama3"'])
    assert _violations(f'model.rope_scaling={{type = "llama3", {LLAMA31}}}') == []


def test_validate_cli_names_the_key_and_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    bad = '--model.rope_scaling={type = "llama3", factor = -1.0}'
    assert main(["validate", "--world-size", "1", '--model.family="llama"', bad]) == 1
    out = capsys.readouterr().out
    assert "[model.rope_scaling] model.rope_scaling lacks low_freq_factor" in out
    assert "fix: give every llama3 key" in out


RELEASED = {  # size: (layers, hidden, heads, MLP, tied, factor), from the released config.json files
    "llama3.2-1b": (16, 2048, 32, 8192, True, 32.0),
    "llama3.2-3b": (28, 3072, 24, 8192, True, 32.0),
    "llama3.1-8b": (32, 4096, 32, 14336, False, 8.0),
    "llama3.1-70b": (80, 8192, 64, 28672, False, 8.0),
    "llama3.1-405b": (126, 16384, 128, 53248, False, 8.0),
}


@pytest.mark.parametrize("size", RELEASED)
def test_released_llama3_sizes_are_valid_and_scaled(size: str) -> None:
    layers, hidden, heads, ffn, tied, factor = RELEASED[size]
    m = load_config(None, [f'model.size="{size}"']).model
    assert (m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn, m.tie_embeddings) == (
        layers,
        hidden,
        heads,
        8,
        ffn,
        tied,
    )
    assert (m.rope_theta, m.vocab_size, m.norm_eps) == (500000.0, 128256, 1e-5)
    assert m.rope_scaling == {
        "type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert [str(v) for v in m.check()] == []
    assert "rope_scaling" not in SIZES["llama-8b"]  # the Llama 3 names keep their unscaled RoPE


def test_a_config_set_scaling_exports_to_transformers(tmp_path: Path) -> None:
    """model.rope_scaling set without HF: the model computes it, and the HF export carries it, so transformers
    loads the same rope_parameters and computes the same logits."""
    from tessera.hf.export import save_hf
    from tessera.model.build import build_model

    shape = [
        "model.n_layers=2",
        "model.d_model=32",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.seq_len=32",
    ]
    scaling = (
        'model.rope_scaling={type = "llama3", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 8.0, '
        "original_max_position_embeddings = 128}"
    )
    cfg = load_config(None, ['model.family="llama"', *shape, f"model.vocab_size={VOCAB}", scaling])
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    save_hf(tmp_path / "hf", cfg, dict(model.named_parameters()).__getitem__)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.rope_parameters == {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 128,
    }
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(model(tokens), hf(tokens).logits) < LOGIT_RTOL
