"""Gemma 3 text (tessera/model/gemma3.py): what test_hf's transformers comparison does not reach on its own.

The sliding window (`band_mask`) under cached decoding (fewer queries than keys) and document masking; that the
window and the per-layer RoPE bases change the function (so the transformers comparisons test them); the folder's
values; `tessera validate`'s refusals (a Gemma3ForConditionalGeneration folder without its text config, RoPE
scaling tessera does not compute, a layer_types that is no pattern, a null window, the local-layer keys on other
families); (the multimodal folders and the global layers' RoPE scaling: tests/unit/test_gemma3_multimodal.py); the export's layer_types; the released 1B's parameter
count against transformers' own class and the planner's ModelShape.

Tolerances: 1e-5 relative (test_hf's LOGIT_RTOL: the same fp32 arithmetic in another order).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import transformers

from tessera.config import ModelConfig, load_config
from tessera.errors import ConfigError
from tessera.hf.weights import load_init
from tessera.model.build import build_model, meta_model
from tessera.model.layers import KVCache, band_mask
from tessera.model.sizes import SIZES
from tessera.planner.cost import ModelShape
from tests.hf_models import VOCAB, hf_config, make_hf, rel_err

RTOL = 1e-5


def _tiny(**over: object) -> ModelConfig:
    """gemma3-tiny (window 4, local / global / local) with weights at std 0.3: logits of order one."""
    return ModelConfig(**{**SIZES["gemma3-tiny"], "init_std": 0.3, **over})


def _drawn(cfg: ModelConfig, seed: int) -> torch.nn.Module:
    model = build_model(cfg, seed=seed).eval()
    with torch.no_grad():  # norm weights drawn away from 0 so every (1 + w) matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return model


def test_band_mask_is_transformers_inequality() -> None:
    """Query i sees key j iff i - window < j <= i (transformers' sliding_window_overlay on its causal mask); with
    fewer queries than keys the queries are the last positions."""
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    assert torch.equal(band_mask(7, 7, 3), (j <= i) & (j > i - 3))
    assert torch.equal(band_mask(2, 7, 3), band_mask(7, 7, 3)[5:])


def test_cached_decoding_keeps_the_band() -> None:
    """Prefill then one token at a time well past the window: each step's logits are the full forward's."""
    model = _drawn(_tiny(), 3)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.cfg.n_layers)
        first = model(tokens[:, :6], cache=cache)
        steps = [model(tokens[:, k : k + 1], cache=cache) for k in range(6, 20)]
    assert rel_err(torch.cat([first, *steps], dim=1), full) < RTOL


def test_document_masking_with_the_band_attends_within_each_document() -> None:
    """Packed documents longer than the window give each document's own logits: band AND document mask."""
    model = _drawn(_tiny(), 4)
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(9), torch.arange(15)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, positions=positions)
        alone = torch.cat([model(tokens[:, :9]), model(tokens[:, 9:])], dim=1)
    assert rel_err(packed, alone) < RTOL


def test_window_and_local_rope_change_the_function() -> None:
    """Without the window (every layer then global, RoPE base 1e6) or with the global base on the local layers
    (the same weights), the logits move far beyond the tolerance: so the transformers comparisons (test_hf) test
    both. Within the first window the band masks nothing: there the windowed model is the unwindowed one."""
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = _drawn(_tiny(), 5)(tokens)
        one_base = _drawn(_tiny(rope_local_theta=1e6), 5)(tokens)
        no_window = _drawn(_tiny(sliding_window=None), 5)(tokens)
    assert rel_err(one_base, base) > 1e-2
    assert rel_err(no_window, one_base) > 1e-2
    assert rel_err(no_window[:, :4], one_base[:, :4]) < RTOL


def test_generate_reproduces_transformers_greedy_decoding(tmp_path: Path) -> None:
    """tessera's cached generation of an imported model past the window: the tokens transformers' own greedy
    generate picks (its sliding-window cache)."""
    from tessera.model.build import generate

    hf = make_hf(tmp_path / "hf", "gemma3_tied")
    cfg = load_config(None, [f'model.init="hf:{tmp_path / "hf"}"'])
    model = load_init(cfg.model).eval()
    prompt = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        ours = generate(model, prompt, 20, temperature=0.0)
    assert torch.equal(ours, theirs[:, : ours.shape[1]]), (ours, theirs)


def test_the_folder_gives_window_pattern_and_bases(tmp_path: Path) -> None:
    make_hf(tmp_path / "hf", "gemma3_qpas")
    m = load_config(None, [f'model.init="hf:{tmp_path / "hf"}"']).model
    assert (m.family, m.sliding_window, m.sliding_window_pattern) == ("gemma3", 5, 3)
    assert (m.rope_theta, m.rope_local_theta, m.rope_scaling) == (1e6, 10.0, None)
    assert (m.query_pre_attn_scalar, m.attn_softcap, m.final_softcap) == (24, None, None)
    assert not m.tie_embeddings


def test_attn_logit_softcapping_imports_as_transformers_computes_it(tmp_path: Path) -> None:
    """transformers' Gemma3Attention stores attn_logit_softcapping but never applies it: a folder with a cap that
    bites (0.05: these scores are of order one) imports without it, logits equal to transformers' own; an
    explicit model.attn_softcap contradicts the folder, and a gemma3 model with one is refused by the export."""
    from tessera.hf.config import hf_config as export_config

    make_hf(tmp_path, "gemma3_tied")
    raw = json.loads((tmp_path / "config.json").read_text()) | {"attn_logit_softcapping": 0.05}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    cfg = load_config(None, [f'model.init="hf:{tmp_path}"'])
    assert cfg.model.attn_softcap is None
    tokens = torch.randint(0, VOCAB, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = rel_err(load_init(cfg.model).eval()(tokens), theirs(tokens).logits)
    assert err < RTOL, err
    with pytest.raises(ConfigError, match="attn_logit_softcapping, which Gemma3ForCausalLM never applies"):
        load_config(None, [f'model.init="hf:{tmp_path}"', "model.attn_softcap=0.05"])
    with pytest.raises(ConfigError, match="never applies attn_logit_softcapping"):
        export_config(_tiny(attn_softcap=50.0))
    assert export_config(_tiny())["attn_logit_softcapping"] is None


REFUSED = {  # name: (config.json changes, the message naming it)
    "multimodal_without_text_config": (
        {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
        "config.json of a Gemma3ForConditionalGeneration folder has no 'text_config' object",
    ),
    "yarn_rope": (
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        },
        "RoPE scaling type 'yarn' (rope_parameters.full_attention) is not implemented by tessera; only default, "
        "llama3 and linear import (Gemma 3's global layers)",
    ),
    "dynamic_rope_scaling": (
        {"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}},
        "RoPE scaling type 'dynamic' (rope_scaling) is not implemented by tessera",
    ),
    "scaled_local_layers": (
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            }
        },
        "rope_parameters.sliding_attention.rope_type = 'linear' (RoPE scaling on the local layers) is not "
        "implemented by tessera",
    ),
    "rope_scaling_type_spelling": (  # transformers 5.24 computes unscaled RoPE from it, transformers 4 scaled
        {"rope_scaling": {"type": "linear", "factor": 8.0}},
        "rope_scaling.type = 'linear' next to rope_type = 'default': transformers 5.24's Gemma3TextConfig computes "
        "rope_type and ignores type",
    ),
    "table_not_an_object": (
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": 4,
            }
        },
        "rope_parameters.sliding_attention = 4 is not an object",
    ),
    "null_window": (
        {"sliding_window": None},
        "sliding_window = null: transformers 5.24's Gemma3TextModel cannot run such a config",
    ),
    "layer_types": (
        {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
        "is not a repeating pattern",
    ),
    "bidirectional": ({"use_bidirectional_attention": True}, "use_bidirectional_attention = True"),
    "activation": (
        {"hidden_activation": "gelu"},
        "hidden_activation = 'gelu' is not supported for gemma3_text",
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_gemma3_settings_tessera_does_not_compute_are_refused(tmp_path: Path, name: str) -> None:
    change, message = REFUSED[name]
    raw = hf_config("gemma3_tied").to_dict() | change
    tmp_path.joinpath("config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_config(None, [f'model.init="hf:{tmp_path}"'])
    assert message in str(e.value)


def test_validate_refuses_what_tessera_does_not_compute(tmp_path: Path) -> None:
    """`tessera validate` names each refusal and its fix: the multimodal folder, Gemma 3's keys on another
    family, RoPE scaling on gemma3."""
    from tessera.cli import main

    def validate(*overrides: str) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = main(["validate", "--world-size", "1", *(f"--{o}" for o in overrides)])
        return status, out.getvalue()

    raw = hf_config("gemma3_tied").to_dict() | {"model_type": "gemma3"}
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text(json.dumps(raw))
    status, out = validate(f'model.init="hf:{tmp_path / "mm"}"')
    assert status != 0 and "Gemma3ForConditionalGeneration folder has no 'text_config' object" in out, out
    local = {"sliding_window": "4", "sliding_window_pattern": "2", "rope_local_theta": "10.0"}
    for key, value in local.items():
        status, out = validate('model.family="llama"', f"model.{key}={value}")
        assert status == 1 and "use family gemma3" in out
        assert f"model.{key} = {value} is set but model.family = 'llama'" in out
    scaling = 'model.rope_scaling={type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, '
    scaling += "original_max_position_embeddings=8}"
    # scaling on the global layers, as transformers' Gemma 3 4B and larger do
    assert validate('model.size="gemma3-tiny"', scaling)[0] == 0
    assert validate('model.size="gemma3-tiny"', 'model.rope_scaling={type="linear", factor=8.0}')[0] == 0
    status, out = validate('model.size="gemma3-tiny"', 'model.rope_scaling={type="linear", factor=-8.0}')
    assert status == 1 and "model.rope_scaling.factor = -8.0 must be > 0" in out, out
    status, out = validate('model.size="gemma3-tiny"', 'model.rope_scaling={type="linear"}')
    assert status == 1 and "model.rope_scaling lacks factor" in out and "give every linear key" in out, out
    status, out = validate('model.size="gemma3-tiny"', 'model.rope_scaling={type="linear", factor=8.0, x=1}')
    assert status == 1 and "model.rope_scaling has unknown key(s) ['x']" in out, out
    status, out = validate('model.size="gemma3-tiny"', 'model.rope_scaling={type="yarn", factor=8.0}')
    assert status == 1 and "model.rope_scaling.type = 'yarn' is not implemented by tessera" in out, out
    assert validate('model.size="gemma3-tiny"')[0] == 0


def test_export_writes_layer_types_window_and_bases() -> None:
    from tessera.hf.config import hf_config as export_config

    config = transformers.Gemma3TextConfig(**export_config(_tiny(rope_local_theta=10.0)))
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.sliding_window == 4
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    full = transformers.Gemma3TextConfig(**export_config(_tiny(sliding_window=None)))
    assert set(full.layer_types) == {"full_attention"}


def test_gemma3_1b_has_transformers_parameter_count() -> None:
    """The released 1B shape (head_dim 256 ≠ 1152 / 4, one KV head, four norms and q/k norms per block, tied),
    exported to a config.json and built by transformers' Gemma3ForCausalLM on the meta device, has tessera's
    parameter count and the planner's (ModelShape)."""
    from tessera.hf.config import hf_config as export_config

    cfg = ModelConfig(**SIZES["gemma3-1b"])
    config = transformers.Gemma3TextConfig(**export_config(cfg))
    assert (config.head_dim, config.sliding_window) == (256, 512)
    assert config.layer_types.count("full_attention") == 4  # layers 5, 11, 17, 23
    with torch.device("meta"):
        theirs = transformers.Gemma3ForCausalLM(config).num_parameters()
    assert meta_model(cfg).num_params() == theirs == ModelShape.from_config(cfg).n_params()
    assert theirs == 999_885_952
