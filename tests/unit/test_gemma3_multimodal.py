"""Gemma 3 4B/12B/27B: linear RoPE scaling on the global layers, and the language model of a
`Gemma3ForConditionalGeneration` folder (model_type "gemma3": a text_config, a vision tower, a projector).

Against transformers 5.24 in the test: the global layers' inverse frequencies (bit for bit); the logits of a
text-only folder whose global layers scale, in both spellings transformers reads (the per-layer-type
``rope_parameters`` and the older top-level ``rope_scaling``); the language-model logits of a random-weight
Gemma3ForConditionalGeneration in both weight layouts, tied and untied, read lazily (the vision tower's shard is
never opened); its export to a text-only Gemma3ForCausalLM folder that transformers reloads with the same logits;
a released text_config's defaults; the released 4B/12B/27B shapes' parameter counts; ``sliding_window: null``,
which transformers cannot run. Tolerance: 1e-5 relative (test_hf's LOGIT_RTOL: the same fp32 arithmetic in another
order); the scaling left out misses by more than 100 times that.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tessera.config import ModelConfig, load_config
from tessera.errors import ConfigError
from tessera.hf.export import save_hf
from tessera.hf.families import GEMMA3_TEXT_DEFAULTS
from tessera.hf.weights import load_init
from tessera.model.build import build_model, meta_model
from tessera.model.layers import rope_inv_freq
from tessera.model.sizes import SIZES
from tessera.planner.cost import ModelShape
from tests.hf_models import GEMMA3_LINEAR, VOCAB, hf_config, make_gemma3_multimodal, make_hf, rel_err
from tests.unit.test_hf import LOGIT_RTOL

LINEAR = {"type": "linear", "factor": 8.0}


def _tokens(seed: int = 1, length: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def _imported(folder: Path, *overrides: str):
    cfg = load_config(None, [f'model.init="hf:{folder}"', *overrides])
    return cfg, load_init(cfg.model).eval()


def _unscaled_misses(cfg, model, tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """The relative error of the same weights with unscaled RoPE: the scaling is what makes the logits agree."""
    plain = build_model(replace(cfg.model, rope_scaling=None)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        return rel_err(plain(tokens), expected)


@pytest.mark.parametrize("head_dim", [16, 128, 256])
def test_linear_inverse_frequencies_equal_transformers(head_dim: int) -> None:
    """The global layers' table of transformers' Gemma3RotaryEmbedding (linear, factor 8) is tessera's, bit for
    bit; the local layers' is the unscaled one."""
    config = transformers.Gemma3TextConfig(
        head_dim=head_dim, num_hidden_layers=6, rope_parameters=json.loads(json.dumps(GEMMA3_LINEAR))
    )
    rotary = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    assert torch.equal(rotary.full_attention_inv_freq, rope_inv_freq(head_dim, 1e6, LINEAR))
    assert torch.equal(rotary.sliding_attention_inv_freq, rope_inv_freq(head_dim, 10.0))
    assert not torch.equal(rotary.full_attention_inv_freq, rope_inv_freq(head_dim, 1e6))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0}
SPELLINGS = {  # name: config.json RoPE keys of a gemma3_text folder; the model.rope_scaling they import as
    "rope_parameters": ({"rope_parameters": GEMMA3_LINEAR}, LINEAR),
    # the older configs (transformers 4): top-level bases, the global layers' scaling as rope_scaling
    "rope_scaling": (
        {
            "rope_theta": 1e6,
            "rope_local_base_freq": 10.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
        LINEAR,
    ),
    # llama3 on the global layers: tessera computes it for any RoPE, so Gemma 3's per-layer tables take it too
    "llama3": (
        {"rope_parameters": {**GEMMA3_LINEAR, "full_attention": {**LLAMA3, "rope_theta": 1e6}}},
        {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0}
        | {
            "original_max_position_embeddings": 32
        },  # absent: max_position_embeddings, as transformers reads it
    ),
}


@pytest.mark.parametrize("name", SPELLINGS)
def test_scaled_global_layers_equal_transformers(tmp_path: Path, name: str) -> None:
    """A gemma3_text folder whose global layers scale RoPE (local layers unscaled): imported logits equal
    transformers' Gemma3ForCausalLM, which the same weights unscaled miss; the export writes the tables back,
    and transformers reloads them with the same logits."""
    keys, scaling = SPELLINGS[name]
    make_hf(tmp_path / "hf", "gemma3_tied")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw.pop("rope_parameters")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw | keys))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert hf.config.rope_parameters["full_attention"]["rope_type"] == scaling["type"]
    cfg, model = _imported(tmp_path / "hf")
    assert (cfg.model.rope_scaling, cfg.model.rope_theta, cfg.model.rope_local_theta) == (scaling, 1e6, 10.0)
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(tokens).logits
        assert rel_err(model(tokens), expected) < LOGIT_RTOL
    assert _unscaled_misses(cfg, model, tokens, expected) > 100 * LOGIT_RTOL
    save_hf(tmp_path / "out", cfg, dict(model.named_parameters()).__getitem__)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    table = reloaded.config.rope_parameters
    assert table["full_attention"] == {"rope_type": scaling["type"], "rope_theta": 1e6} | {
        k: v for k, v in scaling.items() if k != "type"
    }
    assert table["sliding_attention"] == {"rope_type": "default", "rope_theta": 10.0}
    with torch.no_grad():
        assert rel_err(reloaded(tokens).logits, expected) < LOGIT_RTOL


def test_rope_scaling_type_spelling_is_unscaled_in_transformers(tmp_path: Path) -> None:
    """The refusal of a gemma3_text ``rope_scaling`` spelled with "type" (test_gemma3's REFUSED) is what
    transformers 5.24 computes: its global layers stay unscaled, where transformers 4 scaled them."""
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=6, rope_scaling={"type": "linear", "factor": 8.0}
    )
    assert config.rope_parameters["full_attention"]["rope_type"] == "default"
    rotary = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    assert torch.equal(rotary.full_attention_inv_freq, rope_inv_freq(256, 1e6))


def test_null_sliding_window_cannot_run_in_transformers() -> None:
    """``sliding_window: null`` (refused on import, test_gemma3's REFUSED): transformers 5.24's Gemma3TextModel
    raises on every forward, whatever layer_types says, so there is no function tessera could match."""
    for layer_types in (None, ["full_attention"] * 3):
        config = hf_config("gemma3_tied", sliding_window=None, layer_types=layer_types)
        model = transformers.Gemma3ForCausalLM(config).eval()
        with pytest.raises(ValueError, match="Could not find a `sliding_window` argument"), torch.no_grad():
            model(_tokens(length=8), use_cache=False)


@pytest.mark.parametrize(
    ("layout", "tied"),
    [
        ("language_model", True),
        ("language_model", False),
        ("model.language_model", True),
        ("model.language_model", False),
    ],
)
def test_multimodal_folder_imports_its_language_model(tmp_path: Path, layout: str, tied: bool) -> None:
    """A Gemma3ForConditionalGeneration folder (vision tower, projector, linear-scaled global layers), in either
    weight layout, tied or untied (the top-level tie_word_embeddings): the config comes from text_config, the
    weights from the language-model prefix, one warning says the vision tower and projector are not imported, and
    the logits equal transformers' language-model logits (its forward on text alone). transformers itself reads
    the rewritten layout with the same logits, so both layouts are ones it loads."""
    hf = make_gemma3_multimodal(tmp_path / "hf", layout=layout, tied=tied)
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        reloaded = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
        assert torch.equal(reloaded(input_ids=tokens).logits, expected)
    with pytest.warns(
        UserWarning, match=r"importing its language model only; its \d+ vision tower and projector"
    ):
        cfg, model = _imported(tmp_path / "hf")
    m = cfg.model
    assert (m.family, m.n_layers, m.d_model, m.head_dim, m.vocab_size, m.tie_embeddings) == (
        "gemma3",
        3,
        32,
        16,
        VOCAB,
        tied,
    )
    assert (m.rope_scaling, m.sliding_window, m.sliding_window_pattern, m.rope_local_theta) == (
        LINEAR,
        4,
        2,
        10.0,
    )
    with torch.no_grad():
        assert rel_err(model(tokens), expected) < LOGIT_RTOL
    assert _unscaled_misses(cfg, model, tokens, expected) > 100 * LOGIT_RTOL


def test_vision_tower_is_never_read(tmp_path: Path) -> None:
    """The weights sharded as the released folders are (an index; here the vision tower and projector alone in
    the second shard), that shard overwritten with garbage: the import never opens it."""
    hf = make_gemma3_multimodal(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "model.safetensors").unlink()
    text = {n: t for n, t in tensors.items() if n.startswith("language_model.")}
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_file(text, tmp_path / "hf" / files[0], metadata={"format": "pt"})
    (tmp_path / "hf" / files[1]).write_bytes(b"not a safetensors file")
    index = {"weight_map": {n: files[0] if n in text else files[1] for n in tensors}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert len(text) < len(tensors)
    with pytest.warns(UserWarning, match="not imported"):
        _, model = _imported(tmp_path / "hf")
    with torch.no_grad():
        assert rel_err(model(_tokens()), hf(input_ids=_tokens()).logits) < LOGIT_RTOL


def test_multimodal_export_is_a_text_only_folder(tmp_path: Path) -> None:
    """`tessera export` of a run imported from a Gemma3ForConditionalGeneration folder writes Gemma3ForCausalLM
    (model_type gemma3_text, the global layers' linear scaling, the text config's other keys), which transformers
    reloads with the multimodal model's language-model logits; importing it again gives the same weights."""
    hf = make_gemma3_multimodal(tmp_path / "hf", bos_token_id=5)
    with pytest.warns(UserWarning, match="not imported"):
        cfg, model = _imported(tmp_path / "hf")
    save_hf(tmp_path / "out", cfg, dict(model.named_parameters()).__getitem__)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    assert config["bos_token_id"] == 5  # the text config's own key, kept
    assert config["rope_parameters"]["full_attention"] == {
        "rope_type": "linear",
        "rope_theta": 1e6,
        "factor": 8.0,
    }
    assert "text_config" not in config and "vision_config" not in config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    tokens = _tokens()
    with torch.no_grad():
        assert rel_err(reloaded(tokens).logits, hf(input_ids=tokens).logits) < LOGIT_RTOL
    _, again = _imported(tmp_path / "out")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_multimodal_text_config_applies_no_soft_cap(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration returns lm_head's logits uncapped whatever its text config's
    final_logit_softcapping (Gemma3ForCausalLM would cap them): the cap imports as None, with equal logits, and an
    explicit model.final_softcap contradicts the folder, naming the text config's key."""
    hf = make_gemma3_multimodal(tmp_path / "hf", final_logit_softcapping=0.5)
    with pytest.warns(UserWarning, match="not imported"):
        cfg, model = _imported(tmp_path / "hf")
    assert cfg.model.final_softcap is None
    with torch.no_grad():
        expected = hf(input_ids=_tokens()).logits
        assert float(expected.abs().max()) > 1.0  # a cap of 0.5 would bite
        assert rel_err(model(_tokens()), expected) < LOGIT_RTOL
    with pytest.raises(
        ConfigError, match=r"text_config\.final_logit_softcapping, which Gemma3ForConditionalGen"
    ):
        load_config(None, [f'model.init="hf:{tmp_path / "hf"}"', "model.final_softcap=0.5"])
    with pytest.raises(ConfigError, match=r"config\.json text_config\.rope_parameters\.full_attention gives"):
        load_config(None, [f'model.init="hf:{tmp_path / "hf"}"', "model.rope_scaling=null"])


def _multimodal_config(tmp_path: Path, **change: object) -> Path:
    """A Gemma3ForConditionalGeneration config.json (the tiny fixture's, with ``change``) and no weights."""
    make_gemma3_multimodal(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text()) | change
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    return tmp_path / "hf"


REFUSED = {  # name: (config.json changes to the multimodal fixture, the message naming it)
    "text_model_type": ({"text_config": {"model_type": "gemma2"}}, "text_config.model_type = 'gemma2'"),
    "text_config_missing": ({"text_config": None}, "folder has no 'text_config' object"),
    "yarn": (
        {"text_config": {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}},
        "text_config: RoPE scaling type 'yarn' (rope_scaling) is not implemented by tessera",
    ),
    "quantized": ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized weights"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_multimodal_refusals_name_the_text_config(tmp_path: Path, name: str) -> None:
    change, message = REFUSED[name]
    folder = _multimodal_config(tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in change.items():  # text_config changes merge into it; None replaces it
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and key == "text_config" else value
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_config(None, [f'model.init="hf:{folder}"'])
    assert message in str(e.value)


def test_a_folder_with_both_layouts_is_refused(tmp_path: Path) -> None:
    """Two copies of the language model (one under each prefix): which is the model? Refused at validation."""
    make_gemma3_multimodal(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    old = "language_model.model."
    copies = {
        "model.language_model." + n[len(old) :]: t.clone() for n, t in tensors.items() if n.startswith(old)
    }
    save_file(tensors | copies, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"name the language model under both \['language_model\.model\."):
        load_config(None, [f'model.init="hf:{tmp_path / "hf"}"'])


def test_text_defaults_are_gemma3_text_configs() -> None:
    """The keys a released text_config leaves out take Gemma3TextConfig's values (transformers 5.24)."""
    config = transformers.Gemma3TextConfig()
    assert {key: getattr(config, key) for key in GEMMA3_TEXT_DEFAULTS} == GEMMA3_TEXT_DEFAULTS


RELEASED = {  # size: the "text_config" of google/gemma-3-{4b,12b,27b}-pt's config.json (transformers 4.50)
    "gemma3-4b": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34},
    "gemma3-12b": {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
    },
    "gemma3-27b": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
    },
}
RELEASED_COMMON = {
    "model_type": "gemma3_text",
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}


@pytest.mark.parametrize("size", RELEASED)
def test_sizes_are_the_released_language_models(tmp_path: Path, size: str) -> None:
    """tessera's size has the parameter count of transformers' Gemma3ForCausalLM built on the meta device from
    the released text config (and of the estimator's ModelShape), and a Gemma3ForConditionalGeneration
    config.json holding that text config imports as exactly that size."""
    text = RELEASED[size] | RELEASED_COMMON
    config = transformers.Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    with torch.device("meta"):
        theirs = transformers.Gemma3ForCausalLM(config).num_parameters()
    cfg = ModelConfig(**SIZES[size])
    assert meta_model(cfg).num_params() == theirs == ModelShape.from_config(cfg).n_params()
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    derived = load_config(None, [f'model.init="hf:{tmp_path}"']).model
    assert asdict(derived) | {"init": None} == asdict(cfg)
