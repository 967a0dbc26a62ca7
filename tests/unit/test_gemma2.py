"""Gemma 2 (tessera/model/gemma2.py): what test_hf's transformers comparison does not reach on its own.

The soft-capped attention written out (`AttentionCore`) under cached decoding (fewer queries than keys) and
document masking; the final cap in generation; the sliding window: refused by name with the fix where the
training context is wider, imported where it is not (same logits as transformers there); `tessera validate`'s
refusals; the export's window; the released sizes' parameter counts against transformers' own class; the
settings only Gemma 2 has refused on other families.

Tolerances: 1e-5 relative (test_hf's LOGIT_RTOL, the issue's bound: the same fp32 arithmetic in another order);
cached decoding and document masking against the uncached / separate runs: 1e-5 too (the same model, a
different mask shape and matmul extent).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from tessera.config import ModelConfig, load_config
from tessera.errors import ConfigError
from tessera.hf.weights import load_init
from tessera.model.build import build_model, meta_model
from tessera.model.layers import KVCache
from tessera.model.sizes import SIZES
from tessera.planner.cost import ModelShape
from tests.hf_models import VOCAB, hf_config, make_hf, rel_err

RTOL = 1e-5


def _tiny(**over: object) -> ModelConfig:
    """gemma2-tiny with weights drawn at std 0.3: scores and logits of order one, where its caps bite."""
    return ModelConfig(**{**SIZES["gemma2-tiny"], "init_std": 0.3, **over})


def test_cached_decoding_with_capped_attention_equals_the_full_forward() -> None:
    """Queries after cached keys: the written-out attention's causal mask is bottom-right aligned, as SDPA's."""
    model = build_model(_tiny(), seed=3).eval()
    with torch.no_grad():  # norm weights drawn away from 0 so every (1 + w) matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.cfg.n_layers)
        first = model(tokens[:, :12], cache=cache)
        steps = [model(tokens[:, k : k + 1], cache=cache) for k in range(12, 20)]
    assert rel_err(torch.cat([first, *steps], dim=1), full) < RTOL
    assert float(full.abs().max()) <= model.cfg.final_softcap  # the final cap holds


def test_document_masking_with_capped_attention_attends_within_each_document() -> None:
    """Two packed documents give each document's own logits (the documents' mask replaces the causal one)."""
    model = build_model(_tiny(), seed=4).eval()
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, positions=positions)
        alone = torch.cat([model(tokens[:, :10]), model(tokens[:, 10:])], dim=1)
    assert rel_err(packed, alone) < RTOL


def test_soft_caps_change_the_function() -> None:
    """The tiny caps bite, and a scalar (24) other than head_dim (16) matters: without each (the same weights) the
    logits move by far more than the tolerance, so test_hf's agreement with transformers rests on them."""
    capped = build_model(_tiny(query_pre_attn_scalar=24), seed=5).eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for over in ({"attn_softcap": None}, {"final_softcap": None}, {"query_pre_attn_scalar": None}):
            other = build_model(_tiny(**{"query_pre_attn_scalar": 24, **over}), seed=5).eval()
            assert rel_err(other(tokens), capped(tokens)) > 100 * RTOL, over


WINDOW = 16  # of a 32-position folder


def _windowed(folder: Path, layer_types: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config("gemma2_tied", sliding_window=WINDOW)).eval()
    hf.save_pretrained(folder)
    if not layer_types:  # a transformers 4 folder: Gemma2Config then slides every other layer
        raw = json.loads((folder / "config.json").read_text())
        del raw["layer_types"]
        (folder / "config.json").write_text(json.dumps(raw))
    return hf


@pytest.mark.parametrize("layer_types", [True, False])
def test_a_window_narrower_than_the_context_is_refused_with_the_fix(
    tmp_path: Path, layer_types: bool
) -> None:
    hf = _windowed(tmp_path / "hf", layer_types)
    init = f'model.init="hf:{tmp_path / "hf"}"'
    with pytest.raises(ConfigError) as e:
        load_config(None, [init])
    assert (
        "sliding-window attention (sliding_window = 16, narrower than the context max_position_embeddings = 32)"
        in (str(e.value))
    )
    assert "fix: set model.seq_len to at most 16" in str(e.value)
    with pytest.raises(ConfigError, match=re.escape("narrower than the context model.seq_len = 17")):
        load_config(None, [init, "model.seq_len=17"])
    # the fix: a training context no wider than the window, where it masks nothing
    cfg = load_config(None, [init, f"model.seq_len={WINDOW}"])
    model = load_init(cfg.model).eval()
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel_err(model(tokens[:, :WINDOW]), hf(tokens[:, :WINDOW]).logits) < RTOL
        # ... and the window is real beyond it: full attention over 32 positions is not transformers' function
        full = build_model(cfg.model.__class__(**{**_fields(cfg.model), "seq_len": 32})).eval()
        full.load_state_dict(model.state_dict())
        assert rel_err(full(tokens), hf(tokens).logits) > 100 * RTOL


def _fields(cfg: ModelConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


def test_validate_refuses_what_tessera_does_not_compute(tmp_path: Path) -> None:
    """`tessera validate` names each refusal and its fix: the narrow window (exit 1, before any rank starts), and
    Gemma 2's settings on another family."""
    from tessera.cli import main

    def validate(*overrides: str) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = main(["validate", "--world-size", "1", *(f"--{o}" for o in overrides)])
        return status, out.getvalue()

    _windowed(tmp_path / "hf")
    status, out = validate(f'model.init="hf:{tmp_path / "hf"}"')
    assert status != 0
    assert "sliding-window attention (sliding_window = 16" in out and "set model.seq_len to at most 16" in out
    assert validate(f'model.init="hf:{tmp_path / "hf"}"', f"model.seq_len={WINDOW}")[0] == 0
    for key in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
        status, out = validate('model.family="llama"', f"model.{key}=30.0")
        assert status == 1
        assert f"model.{key} is set but model.family = 'llama'" in out and "use family gemma2" in out, out
    status, out = validate('model.family="gemma2"', "model.attn_softcap=0.0")
    assert status == 1 and "model.attn_softcap" in out


REFUSED = {  # name: (config.json changes, the message naming it)
    "activation": ({"hidden_activation": "gelu"}, "hidden_activation = 'gelu' is not supported for gemma2"),
    "attention_bias": ({"attention_bias": True}, "attention_bias = True is not supported for gemma2"),
    "bidirectional": ({"use_bidirectional_attention": True}, "use_bidirectional_attention = True"),
    "scalar_not_a_number": (
        {"query_pre_attn_scalar": "big"},
        "query_pre_attn_scalar = 'big' is not a number",
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_gemma2_settings_tessera_does_not_compute_are_refused(tmp_path: Path, name: str) -> None:
    change, message = REFUSED[name]
    raw = hf_config("gemma2_tied").to_dict() | change
    tmp_path.joinpath("config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_config(None, [f'model.init="hf:{tmp_path}"'])
    assert message in str(e.value)


def test_the_folder_gives_the_caps_and_scalar(tmp_path: Path) -> None:
    """Read from config.json (a null cap is no cap; an absent key is Gemma2Config's default); an explicit key that
    contradicts them names the config.json key."""
    make_hf(tmp_path / "hf", "gemma2_qpas")
    init = f'model.init="hf:{tmp_path / "hf"}"'
    m = load_config(None, [init]).model
    assert (m.family, m.query_pre_attn_scalar, m.attn_softcap, m.final_softcap) == ("gemma2", 24, 1.5, 2.0)
    assert (m.head_dim, m.tie_embeddings) == (16, False)
    with pytest.raises(ConfigError, match=r"model\.attn_softcap = 3\.0 contradicts .*attn_logit_softcapping"):
        load_config(None, [init, "model.attn_softcap=3.0"])
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw["final_logit_softcapping"] = None
    del raw["attn_logit_softcapping"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    m = load_config(None, [init]).model
    assert (m.attn_softcap, m.final_softcap) == (50.0, None)


def test_export_writes_a_window_no_narrower_than_the_context() -> None:
    """A Gemma 2 trained from scratch has no window; its config.json must not give transformers one that masks:
    Gemma2Config's 4096 stays for a shorter context, a longer one gets a window as wide as itself."""
    from tessera.hf.config import hf_config as export_config

    short, long = _tiny(), _tiny(seq_len=5000)
    assert export_config(short)["sliding_window"] == 4096
    config = transformers.Gemma2Config(**export_config(long))
    assert config.sliding_window == config.max_position_embeddings == 5000
    scratch = export_config(_tiny(query_pre_attn_scalar=None))
    assert scratch["query_pre_attn_scalar"] == 16  # tessera's None is 1/sqrt(head_dim): the head width


@pytest.mark.parametrize("size", ["gemma2-2b", "gemma2-9b", "gemma2-27b"])
def test_sizes_have_transformers_parameter_count(size: str) -> None:
    """The released shapes (head_dim 256 / 128 ≠ hidden / heads, four norms per block, tied), exported to a
    config.json and built by transformers' Gemma2ForCausalLM on the meta device, have tessera's parameter count
    and the estimator's (ModelShape: the post-norms counted)."""
    from tessera.hf.config import hf_config as export_config

    cfg = ModelConfig(**SIZES[size])
    config = transformers.Gemma2Config(**export_config(cfg))
    assert (config.head_dim, config.query_pre_attn_scalar) == (cfg.head_dim, cfg.query_pre_attn_scalar)
    with torch.device("meta"):
        theirs = transformers.Gemma2ForCausalLM(config).num_parameters()
    assert meta_model(cfg).num_params() == theirs == ModelShape.from_config(cfg).n_params()
    two_norms = ModelShape.from_config(ModelConfig(**{**SIZES[size], "family": "llama"}))
    assert theirs - two_norms.n_params() == 2 * cfg.n_layers * cfg.d_model  # the post-norms
