"""HF ``config.json`` ↔ tessera `ModelConfig`; torch-free (tessera.config derives ``model.init = "hf:DIR"``).

Import derives every shape field from the HF config; an explicit ``[model]`` key that disagrees is a problem,
not an override. What tessera would compute differently is refused by name, never approximated: RoPE scaling
other than llama3 and linear (dynamic, yarn, ...), a sliding window narrower than the context (except Gemma 3's,
which tessera computes), mixed attention,
mixture-of-experts, quantized weights, a head dim other than hidden/heads, and the per-architecture settings of
`HFFamily.required` (e.g. Llama's attention_bias, GPT-2's activation). Dropout probabilities are not part of the function a model
computes and are ignored (tessera trains without dropout).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.errors import ConfigError
from tessera.files import read_json_object
from tessera.hf.families import (
    FAMILIES,
    TIED_HEAD,
    HFFamily,
    family_for_model_type,
    family_for_tessera,
    weight_names,
)
from tessera.model.family import head_dim_of, is_global_layer
from tessera.model.rope_scaling import TYPE_KEYS, TYPES, scaling_problems

if TYPE_CHECKING:
    from tessera.config import ModelConfig

__all__ = [
    "INDEX",
    "PREFIX",
    "SINGLE",
    "derive_model",
    "hf_config",
    "init_folder",
    "name_problems",
    "read_hf_config",
    "refusals",
    "stored_names",
    "text_config",
    "text_weight_names",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

PREFIX = "hf:"
"""``model.init`` values naming a Hugging Face folder start with this."""

MAX_HEADER = 100 * 2**20
"""safetensors refuses headers above 100 MB; a larger length is a damaged file, left to the weight load."""

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_DERIVED = ("family", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "seq_len")


def init_folder(init: str) -> Path:
    """The folder of ``model.init = "hf:DIR"``; ConfigError for any other form."""
    if not init.startswith(PREFIX) or not init[len(PREFIX) :]:
        raise ConfigError(
            f'model.init = {init!r} is not understood\n    fix: use "hf:DIR" with DIR a folder written by '
            "`save_pretrained` (config.json and *.safetensors)"
        )
    return Path(init[len(PREFIX) :]).expanduser()


def read_hf_config(folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF folder."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"{folder} has no config.json; pass a folder written by `save_pretrained` (config.json, "
            "model.safetensors or model.safetensors.index.json with its shards)"
        )
    return read_json_object(path, ConfigError, "restore it, or save the model again with `save_pretrained`")


def _check_numbers(path: Path, hf: dict[str, Any], fam: HFFamily) -> None:
    """The shape keys are integers, the norm epsilon and RoPE settings numbers (JSON may hold anything):
    everything after computes with them."""
    rope = [("rope_parameters", hf.get("rope_parameters")), ("rope_scaling", hf.get("rope_scaling"))]
    for key, value in rope:
        if value is not None and not isinstance(value, dict):
            raise ConfigError(
                f"{path}: {key} = {value!r} is not an object; restore it or save the model again"
            )
    theta = [
        ("rope_theta", hf.get("rope_theta")),
        *((f"{key}.rope_theta", (value or {}).get("rope_theta")) for key, value in rope),
    ]
    numbers = [(fam.keys["norm_eps"], hf.get(fam.keys["norm_eps"])), *theta]
    numbers += [(key, hf.get(key)) for key, _ in fam.extra_keys.values()]
    for key, value in [(k, hf.get(k)) for n, k in fam.keys.items() if n != "norm_eps"]:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(
                f"{path}: {key} = {value!r} is not an integer; restore it or save the model again"
            )
    for key, value in numbers:
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
            raise ConfigError(
                f"{path}: {key} = {value!r} is not a number; restore it or save the model again"
            )


def _family(hf: dict[str, Any]) -> HFFamily:
    from tessera.model.family import FAMILIES as TESSERA_FAMILIES

    model_type = hf.get("model_type")
    fam = family_for_model_type(str(model_type))
    usable = [f.model_type for f in FAMILIES if f.family in TESSERA_FAMILIES]
    if fam is None or fam.family not in TESSERA_FAMILIES:
        why = "" if fam is None else f" (tessera has no {fam.family!r} model family yet)"
        raise ConfigError(
            f"HF model_type {model_type!r} is not supported{why}; tessera imports {', '.join(usable)}"
        )
    return fam


def text_config(hf: dict[str, Any], fam: HFFamily) -> dict[str, Any]:
    """The config of the language model ``fam`` imports from a folder's ``hf``: ``hf`` itself, or a multimodal
    folder's text config (`HFFamily.text_config`) as its config class reads it: transformers' defaults for the
    keys it leaves out, and the top-level ``tie_word_embeddings`` (Gemma3ForConditionalGeneration ties lm_head
    to the language model's embedding by it; the text config's own is not read) and ``quantization_config``."""
    if fam.text_config is None:
        return hf
    text = hf.get(fam.text_config)
    if not isinstance(text, dict):
        raise ConfigError(
            f"config.json of a {fam.architecture} folder has no {fam.text_config!r} object (the language model's "
            f"config; got {text!r}); restore it or save the model again"
        )
    kind = text.get("model_type", fam.text_model_type)
    if kind != fam.text_model_type:
        raise ConfigError(
            f"config.json {fam.text_config}.model_type = {kind!r}: a {fam.architecture} folder's language model "
            f"is {fam.text_model_type!r}, the only one tessera imports from it"
        )
    top = {"tie_word_embeddings": hf.get("tie_word_embeddings", fam.tie_default)}
    if hf.get("quantization_config"):
        top["quantization_config"] = hf["quantization_config"]
    return {**fam.text_defaults, **text, **top}


def _rope_table(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE table transformers 5 reads: ``rope_scaling`` (the older key) in place of ``rope_parameters`` when
    both are given (transformers 4 reads only ``rope_scaling``)."""
    return hf.get("rope_scaling") or hf.get("rope_parameters") or {}


def _rope(hf: dict[str, Any], fam: HFFamily) -> tuple[float, dict[str, Any] | None, list[str]]:
    """(rope theta, `model.rope_scaling` or None, refusals) from either spelling of the RoPE settings: the theta
    from the table, else the top-level ``rope_theta``, else 10000 (as transformers 5 reads them); a llama3
    table without ``original_max_position_embeddings`` takes ``max_position_embeddings``, as transformers does."""
    params = hf.get("rope_parameters") or {}
    if params and "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
        return (
            0.0,
            None,
            [f"per-layer-type RoPE parameters ({', '.join(params)}) are not implemented by tessera"],
        )
    table = _rope_table(hf)
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    theta = float(table.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = table.get("rope_type", table.get("type", "default"))
    partial = _partial_rotary(hf, table, key)
    if partial:
        return theta, None, partial
    if kind == "default":
        return theta, None, []
    scaling, refused = _scaling(table, kind, key, hf.get(fam.keys["seq_len"]))
    if scaling is None:
        return theta, None, refused
    top = hf.get("original_max_position_embeddings")
    if kind == "llama3" and top is not None and top != scaling["original_max_position_embeddings"]:
        refused.append(
            f"original_max_position_embeddings = {top!r} outside {key} differs from the one transformers 5 uses "
            f"({scaling['original_max_position_embeddings']!r}); put the intended value into {key}"
        )
    return theta, scaling, refused


def _scaling(
    table: dict[str, Any], kind: str, key: str, context: Any
) -> tuple[dict[str, Any] | None, list[str]]:
    """(`model.rope_scaling`, refusals) of an HF RoPE table ``key`` whose rope_type ``kind`` is not "default": a
    type tessera computes (`tessera.model.rope_scaling.TYPE_KEYS`) with its keys, a llama3 table without
    ``original_max_position_embeddings`` taking the model's context ``context`` as transformers 5 does; any other
    type (None) or key is refused by name."""
    if kind not in TYPES:
        return None, [
            f"RoPE scaling type {kind!r} ({key}) is not implemented by tessera; only default, "
            f"{' and '.join(TYPES)} import"
        ]
    keys = TYPE_KEYS[kind]
    scaling = {"type": kind} | {k: table[k] for k in keys if k in table}
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", context)
    refused = [problem for problem, _ in scaling_problems(scaling, f"config.json {key}")]
    extra = sorted(set(table) - {"rope_type", "type", "rope_theta", "partial_rotary_factor", *keys})
    if extra:
        refused.append(f"{key} keys {extra} are not implemented by tessera (a {kind} table has {keys})")
    return scaling, refused


def _partial_rotary(hf: dict[str, Any], table: dict[str, Any], key: str) -> list[str]:
    """A ``partial_rotary_factor`` other than 1 (in the RoPE table or top-level, where transformers 5 reads it for
    every rope type) rotates only part of each head's dimensions; tessera rotates all of them."""
    where, factor = (key, table["partial_rotary_factor"]) if "partial_rotary_factor" in table else ("", None)
    if factor is None and hf.get("partial_rotary_factor") is not None:
        where, factor = "config.json", hf["partial_rotary_factor"]
    if factor is None or factor == 1:
        return []
    return [
        f"partial_rotary_factor = {factor!r} ({where}) rotates only part of each head; tessera's RoPE rotates the "
        "whole head (only 1 imports)"
    ]


def refusals(hf: dict[str, Any], fam: HFFamily, seq_len: int | None = None) -> list[str]:
    """Everything in ``hf`` that tessera's model would compute differently, each named; ``seq_len``: the training
    context when ``model.seq_len`` is given (else the folder's ``max_position_embeddings``)."""
    out = []
    for key, allowed in fam.required.items():
        if hf.get(key, allowed[0]) not in allowed:
            out.append(
                f"{key} = {hf[key]!r} is not supported for {fam.model_type}; tessera computes {allowed}"
            )
    if fam.local_layers:  # Gemma 3: windows computed, a RoPE table per layer type
        out += _local_rope(hf)[3] + _pattern(hf)[1] + _null_window(hf)
    else:
        out += _rope(hf, fam)[2] if fam.rope else []
        out += _sliding_window(hf, fam, seq_len)
    kinds = set(hf.get("layer_types") or []) - {"full_attention", "sliding_attention"}  # sliding: just above
    if kinds:
        out.append(f"layer_types {sorted(kinds)}: only full attention in every layer is implemented")
    moe = [k for k in _MOE_KEYS if hf.get(k)]
    if moe:
        out.append(f"mixture-of-experts ({', '.join(f'{k} = {hf[k]}' for k in moe)}) is not implemented")
    if hf.get("quantization_config"):
        out.append("quantized weights (quantization_config) cannot be imported; use an unquantized folder")
    return out


def _head_dim(hf: dict[str, Any], fam: HFFamily) -> int | None:
    """``model.head_dim`` of an HF config: transformers' per-head width where it differs from hidden / heads,
    else None (tessera's default). That width is config.json's "head_dim" when set, else the architecture's class
    default (Qwen3Config: 128; Llama, Mistral, Qwen2: hidden / heads). GPT-2 reads no head_dim (GPT2Attention:
    n_embd / n_head always), so its key is ignored as transformers ignores it."""
    if not fam.rope:
        return None
    heads, hidden = hf.get(fam.keys["n_heads"]), hf.get(fam.keys["d_model"])
    width = hf.get("head_dim") if "head_dim" in hf else fam.head_dim_absent
    if width is None or width * heads == hidden:
        return None
    return int(width)


def _sliding_window(hf: dict[str, Any], fam: HFFamily, seq_len: int | None = None) -> list[str]:
    """Sliding-window attention is refused when a window narrower than the context applies to some layer.

    Which layers slide: ``layer_types`` if given (transformers 5), else Qwen2's rule (``use_sliding_window`` and
    layer index ≥ ``max_window_layers``). A window at least as wide as every position the model takes masks
    nothing: that is full attention, and imports. Those positions are the training context ``seq_len`` when
    ``model.seq_len`` is given (RoPE models may train shorter than the folder's context; tessera's RoPE table, and
    so its generation, ends there), else ``max_position_embeddings``. Mistral's window applies to every layer
    (`HFFamily.window_everywhere`: transformers' MistralModel masks all layers with it); Gemma 2's, without
    ``layer_types``, to every other layer (`HFFamily.window_without_layer_types`); another architecture's
    ``sliding_window`` with neither key is refused whatever its width, as tessera cannot tell where it applies.
    """
    window = hf.get("sliding_window")
    context = seq_len or hf.get(fam.keys["seq_len"]) or 0
    if fam.window_everywhere or (fam.window_without_layer_types and not hf.get("layer_types")):
        # Mistral: every layer slides when the window is set, whatever layer_types says; Gemma 2: every other one
        if window is None or window >= context:
            return []
    elif hf.get("layer_types") or "use_sliding_window" in hf:
        if hf.get("layer_types"):
            slides = "sliding_attention" in hf["layer_types"]
        else:
            layers = hf.get(fam.keys["n_layers"]) or 0
            slides = bool(hf["use_sliding_window"]) and (hf.get("max_window_layers") or 0) < layers
        if not slides or (window is not None and window >= context):
            return []
    elif window is None:
        return []
    where = f"model.seq_len = {context}" if seq_len else f"{fam.keys['seq_len']} = {context}"
    fix = (
        f"\n    fix: set model.seq_len to at most {window}: a window as wide as the training context masks nothing"
        if isinstance(window, int) and window > 0
        else ""
    )
    return [
        f"sliding-window attention (sliding_window = {window}, narrower than the context {where}) is not "
        f"implemented; tessera attends to every earlier position{fix}"
    ]


def _values(hf: dict[str, Any], fam: HFFamily) -> dict[str, Any]:
    """tessera ModelConfig values of an HF config, every shape field concrete."""
    values: dict[str, Any] = {"family": fam.family}
    for name, key in fam.keys.items():
        if hf.get(key) is None and name not in ("n_kv_heads", "ffn_hidden"):
            raise ConfigError(f"HF config.json has no {key!r}, which {fam.model_type} needs")
        values[name] = hf.get(key)
    kv_key = fam.keys.get("n_kv_heads")
    if kv_key is not None and kv_key not in hf and fam.kv_heads_absent is not None:
        values["n_kv_heads"] = fam.kv_heads_absent  # what transformers reads from such a folder
    values["n_kv_heads"] = values.get("n_kv_heads") or values["n_heads"]
    values["ffn_hidden"] = values["ffn_hidden"] or 4 * values["d_model"]  # GPT-2's n_inner = null
    values["tie_embeddings"] = bool(hf.get("tie_word_embeddings", fam.tie_default))
    values["head_dim"] = _head_dim(hf, fam)
    for name, (key, absent) in fam.extra_keys.items():
        values[name] = hf.get(key, absent)  # null: None (no soft-cap), as transformers reads it
    for name in fam.unapplied:
        values[name] = None  # whatever config.json says: transformers' model does not compute it
    if fam.local_layers:
        values["rope_theta"], values["rope_local_theta"], values["rope_scaling"], _ = _local_rope(hf)
        values["sliding_window"] = hf.get("sliding_window", 4096)  # Gemma3TextConfig's default
        values["sliding_window_pattern"] = _pattern(hf)[0]
    elif fam.rope:
        values["rope_theta"], values["rope_scaling"], _ = _rope(hf, fam)
    return values


_LAYER_TYPES = ("full_attention", "sliding_attention")


def _local_rope(hf: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None, list[str]]:
    """(global RoPE base, local RoPE base, the global layers' `model.rope_scaling`, refusals) of a Gemma 3 config,
    as transformers 5.24's Gemma3TextConfig reads them (`_gemma3_rope_tables`). The global layers' table may scale
    (the 4B and larger: linear, factor 8; llama3 too, which tessera computes for any RoPE); the local layers' must
    not (tessera scales only the global layers, as those models do); any other type is refused by name."""
    tables, out = _gemma3_rope_tables(hf)
    full, local = tables["full_attention"], tables["sliding_attention"]
    theta, local_theta = _theta(full, "full_attention", out), _theta(local, "sliding_attention", out)
    key = "rope_scaling" if hf.get("rope_scaling") is not None else "rope_parameters.full_attention"
    kind = full.get("rope_type", "default")
    scaling = None
    if kind != "default":
        scaling, refused = _scaling(full, kind, key, hf.get("max_position_embeddings"))
        out += [f"{r} (Gemma 3's global layers)" for r in refused]
    if local.get("rope_type", "default") != "default":
        out.append(
            f"rope_parameters.sliding_attention.rope_type = {local['rope_type']!r} (RoPE scaling on the local "
            "layers) is not implemented by tessera: model.rope_scaling scales Gemma 3's global layers only"
        )
    for kind, table in tables.items():
        out += _partial_rotary(hf, table, f"rope_parameters.{kind}")
    return theta, local_theta, scaling, out


def _gemma3_rope_tables(hf: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """({layer type: RoPE table}, refusals) as Gemma3TextConfig.convert_rope_params_to_dict and
    standardize_rope_params (transformers 5.24) build them: ``rope_parameters`` (absent: a default table per layer
    type), a top-level ``rope_scaling`` merged into the full_attention table (its keys replacing the table's: the
    older configs of the 4B and larger spell their scaling so), the older top-level ``rope_theta`` (global) and
    ``rope_local_base_freq`` (local) where a table has no theta, else 10⁶ and 10⁴, then each table's rope_type from
    its ``type`` when it has none. A merged ``type`` that differs from the table's rope_type is refused:
    transformers 5.24 ignores it (its default tables already say rope_type "default"), transformers 4 applied it."""
    params = hf.get("rope_parameters")
    tables = (
        copy.deepcopy(params) if params is not None else {k: {"rope_type": "default"} for k in _LAYER_TYPES}
    )
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        if not isinstance(tables.get("full_attention"), dict):
            return {k: {"rope_type": "default", "rope_theta": 0.0} for k in _LAYER_TYPES}, [
                "rope_scaling is given next to a rope_parameters without a full_attention table, which "
                "transformers 5.24's Gemma3TextConfig cannot read\n    fix: put the scaling into "
                "rope_parameters.full_attention"
            ]
        tables["full_attention"].update(scaling)
    thetas = {
        "full_attention": hf.get("rope_theta", 1e6),
        "sliding_attention": hf.get("rope_local_base_freq", 1e4),
    }
    result, out = {}, []
    for kind in _LAYER_TYPES:
        if not isinstance(tables.get(kind) or {}, dict):
            out.append(
                f"rope_parameters.{kind} = {tables[kind]!r} is not an object; restore it or save the model again"
            )
            tables[kind] = None
        table = dict(tables.get(kind) or {"rope_type": "default"})
        table.setdefault("rope_theta", thetas[kind])
        table.setdefault("rope_type", table.get("type", "default"))
        if "type" in table and table["type"] != table["rope_type"]:
            where = "rope_scaling" if scaling is not None and "type" in scaling else f"rope_parameters.{kind}"
            out.append(
                f"{where}.type = {table['type']!r} next to rope_type = {table['rope_type']!r}: transformers 5.24's "
                f"Gemma3TextConfig computes rope_type and ignores type (transformers 4 applied type)\n    fix: "
                f'spell the scaling meant as "rope_type" in {where}, and remove "type"'
            )
        result[kind] = table
    return result, out


def _theta(table: dict[str, Any], kind: str, out: list[str]) -> float:
    """A Gemma 3 table's RoPE base as a float; one that is no number is a refusal appended to ``out``."""
    value = table["rope_theta"]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    out.append(
        f"rope_parameters.{kind}.rope_theta = {value!r} is not a number; restore it or save the model again"
    )
    return 0.0


def _null_window(hf: dict[str, Any]) -> list[str]:
    """``sliding_window: null``: transformers 5.24's Gemma3TextModel cannot compute such a config whatever its
    layer_types (every forward builds the sliding-window mask, and that raises), so there is no function to
    import; tessera would otherwise attend globally where layer_types says sliding."""
    if "sliding_window" not in hf or hf["sliding_window"] is not None:
        return []
    return [
        "sliding_window = null: transformers 5.24's Gemma3TextModel cannot run such a config (its forward "
        "raises 'Could not find a `sliding_window` argument in the config'), so there is no model to import"
        "\n    fix: set sliding_window to the window the model was trained with (one at least "
        "max_position_embeddings wide masks nothing)"
    ]


def _pattern(hf: dict[str, Any]) -> tuple[int, list[str]]:
    """(``model.sliding_window_pattern``, refusals) of a Gemma 3 config: every p-th layer global. ``layer_types``
    when given must be such a pattern (p: the first global layer's index + 1; all local: n_layers + 1); without
    it, Gemma3TextConfig's ``sliding_window_pattern`` (default 6)."""
    n = hf.get("num_hidden_layers") or 0
    types = hf.get("layer_types")
    if not types:
        return int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))), []
    p = types.index("full_attention") + 1 if "full_attention" in types else n + 1
    expected = ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n)]
    if list(types) == expected:
        return p, []
    return p, [
        f"layer_types {types!r} is not a repeating pattern of local layers then one global layer (every "
        "p-th layer full_attention), the only arrangement tessera's model.sliding_window_pattern expresses"
    ]


def derive_model(init: str, explicit: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the [model] values derived from ``init``'s config.json, problems): refusals and explicit keys that
    contradict it. A folder that is gone is tolerated when ``explicit`` already holds every shape field (the
    resolved config a finished run saved)."""
    try:
        folder = init_folder(init)
        if not folder.is_dir() and all(explicit.get(k) is not None for k in _DERIVED):
            return {}, []
        raw = read_hf_config(folder)
        fam = _family(raw)
        hf = text_config(raw, fam)  # a multimodal folder: its language model's
        _check_numbers(folder / "config.json", hf, fam)
        seq_len = explicit.get("seq_len") if fam.rope else None  # a shorter training context (RoPE)
        where = f"model.init = {init!r}: " + (f"{fam.text_config}: " if fam.text_config else "")
        problems = [where + r for r in refusals(hf, fam, seq_len)]
        values = _values(hf, fam)
        problems += [where + r for r in _absent_kv_heads(hf, fam, values)]
    except ConfigError as e:
        return {}, [str(e)]
    stored = None if problems else stored_names(folder)
    if stored is not None:  # the weights' names, so that validate refuses what the load would
        names, _, mixed = text_weight_names(fam, stored)
        wanted = weight_names(fam, values["n_layers"], values["tie_embeddings"])
        problems = [f"{folder}: {m}" for m in mixed] or name_problems(folder, fam, wanted, set(names))
    for name, value in values.items():
        if name not in explicit or explicit[name] == value:
            continue
        if name == "seq_len" and fam.rope and 0 < explicit[name] <= value:
            continue  # a shorter training context is fine with RoPE; learned positions fix it
        if name == "head_dim" and explicit[name] == head_dim_of(values["d_model"], values["n_heads"], value):
            continue  # hidden / heads given explicitly: the width the folder's model has
        problems.append(
            f"model.{name} = {explicit[name]!r} contradicts {init} (config.json {_text_key(name, fam)}"
            f"{_source(name, fam, hf)} "
            f"gives {value!r})\n    fix: remove model.{name}; model.init derives it"
        )
    return values, problems


def _text_key(name: str, fam: HFFamily) -> str:
    """The prefix of a derived value's config.json key in a multimodal folder ("text_config."), none for the tie,
    which is read at the top level (`text_config`)."""
    return f"{fam.text_config}." if fam.text_config and name != "tie_embeddings" else ""


def text_weight_names(fam: HFFamily, stored: Iterable[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """({text-only name: stored name}, the stored names not imported, problems) of a folder's weights.

    A text-only architecture's names are its own. A multimodal one's language-model weights are renamed from the
    `HFFamily.text_layouts` layout the folder uses ("language_model.model.layers.0..." → "model.layers.0..."), its
    `HFFamily.not_imported` weights (vision tower, projector) are set aside unread, and any other name is kept as it
    is, for `name_problems` to refuse. A folder mixing two layouts is a problem: which copy is the model?"""
    stored = set(stored)
    if fam.text_config is None:
        return {n: n for n in stored}, [], []
    skipped = sorted(n for n in stored if n.startswith(fam.not_imported))
    rest = stored - set(skipped)
    layouts = [
        pairs for pairs in fam.text_layouts if any(n.startswith(p) for _, p in pairs[:1] for n in rest)
    ]
    if len(layouts) > 1:
        prefixes = [pairs[0][1] for pairs in layouts]
        return {}, skipped, [f"the weights name the language model under both {prefixes}; keep one copy"]
    names = {}
    for name in rest:
        pairs = layouts[0] if layouts else ()
        text = next((t + name[len(p) :] for t, p in pairs if name.startswith(p)), name)
        names[text] = name
    return names, skipped, []


def _absent_kv_heads(hf: dict[str, Any], fam: HFFamily, values: dict[str, Any]) -> list[str]:
    """A folder without its KV head count, where transformers' default for the architecture cannot hold."""
    kv_key = fam.keys.get("n_kv_heads")
    if kv_key in hf or fam.kv_heads_absent is None or values["n_heads"] % fam.kv_heads_absent == 0:
        return []
    return [
        f"config.json has no {kv_key!r}: transformers then takes {fam.model_type}'s default "
        f"{fam.kv_heads_absent}, which does not divide {fam.keys['n_heads']} = {values['n_heads']}\n    fix: add "
        f'"{kv_key}" to config.json (the rows of k_proj.weight / the head dim)'
    ]


def stored_names(folder: Path) -> set[str] | None:
    """The tensor names of an HF folder's weights, read torch-free: the index's weight map, or the one file's
    safetensors header (an 8-byte little-endian length, then a JSON object of the tensors). None when there is
    no such file or it cannot be read: the weight load names that problem (tessera.hf.weights)."""
    index, single = folder / INDEX, folder / SINGLE
    try:
        if index.is_file():
            names = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        elif single.is_file():
            with single.open("rb") as f:
                length = int.from_bytes(f.read(8), "little")
                names = json.loads(f.read(length).decode("utf-8")) if length <= MAX_HEADER else None
        else:
            return None
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError):
        return None
    return {str(n) for n in names if n != "__metadata__"} if isinstance(names, dict) else None


def name_problems(folder: Path, fam: HFFamily, wanted: set[str], stored: set[str]) -> list[str]:
    """A folder lacking a tensor the model needs, or holding one it has no place for (not dropped silently);
    the same text at validation (config.json's shape) and at the weight load (the built model's tensors)."""
    out = []
    missing = sorted(wanted - stored)
    if missing:
        out.append(
            f"{folder} lacks {len(missing)} weight(s) the model needs: {missing[:5]}{_tie_hint(missing)}"
        )
    extra = sorted(n for n in stored - wanted if n != TIED_HEAD and not n.endswith(fam.ignored))
    if extra:
        out.append(
            f"{folder} holds weight(s) tessera's {fam.model_type} has no place for: {extra[:5]}; "
            "refusing to drop them"
        )
    return out


def _tie_hint(missing: list[str]) -> str:
    if missing != [TIED_HEAD]:
        return ""
    return (
        '\n    fix: a model whose output projection is its embedding needs "tie_word_embeddings": true in '
        "config.json (absent, it takes the architecture's default)"
    )


def _source(name: str, fam: HFFamily, hf: dict[str, Any]) -> str:
    """The config.json key (or absence) a derived [model] value comes from, as a contradiction names it."""
    if name == "family":
        return f"model_type = {fam.model_type!r}"
    if name == "tie_embeddings":
        return "tie_word_embeddings" + (
            "" if "tie_word_embeddings" in hf else f" (absent: {fam.model_type}'s default)"
        )
    if name == "n_kv_heads" and name not in fam.keys:
        return f"{fam.keys['n_heads']} (no grouped-query attention)"
    if name == "rope_theta" and "rope_theta" in _rope_table(hf):
        return ("rope_scaling" if hf.get("rope_scaling") else "rope_parameters") + ".rope_theta"
    if name == "rope_scaling":
        table = "rope_parameters.full_attention" if fam.local_layers else "rope_parameters"
        return "rope_scaling" if hf.get("rope_scaling") else table
    if name in fam.unapplied:
        return f"{fam.unapplied[name]}, which {fam.architecture} never applies, so it"
    if name in fam.extra_keys:
        key = fam.extra_keys[name][0]
        return key if key in hf else f"{key} (absent: {fam.model_type}'s default)"
    if name == "head_dim" and "head_dim" not in hf:
        return f"head_dim (absent: {fam.model_type}'s default)"
    return fam.keys.get(name, name)


def hf_config(cfg: ModelConfig, base: dict[str, Any] | None = None, dtype: str = "float32") -> dict[str, Any]:
    """An HF config.json for a tessera model; ``base`` (the imported folder's config) keeps the keys tessera
    does not own (token ids, positions beyond the training context, ...)."""
    fam = family_for_tessera(cfg.family)
    if fam is None:
        raise ConfigError(f"model.family = {cfg.family!r} has no Hugging Face export")
    imported = family_for_model_type(str((base or {}).get("model_type")))
    if imported is not None and imported.text_config is not None:
        # a multimodal folder (Gemma3ForConditionalGeneration): its text config is the base of the text-only export
        base = {**imported.text_defaults, **(base or {}).get(imported.text_config, {})}
        base["model_type"] = imported.text_model_type
        imported = family_for_model_type(imported.text_model_type)
    if imported is not None and imported.family == fam.family:
        fam = imported  # an imported Mistral exports as Mistral (the same weights as Llama's)
    if not fam.rope and cfg.kv_heads != cfg.n_heads:
        raise ConfigError(
            f"{fam.model_type} has no grouped-query attention, but model.n_kv_heads = {cfg.kv_heads} "
            f"differs from model.n_heads = {cfg.n_heads}; this model cannot be exported as {fam.model_type}"
        )
    out = dict(base or {}) if (base or {}).get("model_type") == fam.model_type else {}
    out.update(architectures=[fam.architecture], model_type=fam.model_type, dtype=dtype)
    resolved = {**_fields(cfg), "n_kv_heads": cfg.kv_heads, "ffn_hidden": cfg.ffn}
    for name, key in fam.keys.items():
        out[key] = resolved[name]
    out["tie_word_embeddings"] = cfg.tie_embeddings
    for key, allowed in fam.required.items():
        out.setdefault(key, allowed[0])
    if fam.local_layers:
        _export_local(out, cfg)
    elif fam.rope:
        seq_key = fam.keys["seq_len"]
        out[seq_key] = max(cfg.seq_len, int((base or {}).get(seq_key) or 0))
        out["head_dim"] = cfg.head_size
        out["rope_theta"] = cfg.rope_theta  # the pre-5 spelling, next to transformers 5's rope_parameters
        out["rope_parameters"] = _rope_parameters(cfg.rope_scaling, cfg.rope_theta)
        keys = {k: v for k, v in out["rope_parameters"].items() if k not in ("rope_type", "rope_theta")}
        out.pop("rope_scaling", None)
        out.pop("original_max_position_embeddings", None)  # transformers 5 reads the table's; 4 may not
        if cfg.rope_scaling is not None:  # transformers 4 reads only this (and the top-level rope_theta)
            out["rope_scaling"] = {"rope_type": cfg.rope_scaling["type"], **keys}
    for name, (key, _) in fam.extra_keys.items():
        value = getattr(cfg, name)
        # tessera's None scalar is 1/sqrt(head_dim): the scalar transformers needs for it is the head width
        out[key] = cfg.head_size if value is None and name == "query_pre_attn_scalar" else value
    for name, key in fam.unapplied.items():
        if getattr(cfg, name) is not None:
            raise ConfigError(
                f"model.{name} = {getattr(cfg, name)!r} is set, but transformers' {fam.architecture} never applies "
                f"{key}, so the exported model would compute without it; remove model.{name} (and retrain) to "
                f"export as {fam.model_type}"
            )
        out[key] = None
    if fam.window_without_layer_types:
        _export_window(out, cfg.seq_len)
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype
    return out


def _export_local(out: dict[str, Any], cfg: ModelConfig) -> None:
    """Gemma 3's RoPE tables per layer type (the global layers' scaled by `model.rope_scaling`), its window and its
    layer_types, written out explicitly (transformers' defaults would slide 5 of every 6 layers at 4096). Without
    a window every layer is full attention."""
    seq_key = "max_position_embeddings"
    out[seq_key] = max(cfg.seq_len, int(out.get(seq_key) or 0))
    out["head_dim"] = cfg.head_size
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"):
        out.pop(key, None)
    out["rope_parameters"] = {  # model.rope_scaling scales the global layers only
        "full_attention": _rope_parameters(cfg.rope_scaling, cfg.rope_theta),
        "sliding_attention": _rope_parameters(None, cfg.rope_local_theta),
    }
    out["sliding_window"] = cfg.sliding_window if cfg.sliding_window is not None else cfg.seq_len
    out["layer_types"] = [
        "full_attention" if is_global_layer(cfg, i) else "sliding_attention" for i in range(cfg.n_layers)
    ]


def _rope_parameters(scaling: dict[str, Any] | None, theta: float) -> dict[str, Any]:
    """A transformers 5 RoPE table: rope_type, rope_theta and the scaling's keys (`model.rope_scaling`, None:
    unscaled)."""
    scaling = scaling or {"type": "default"}
    keys = {k: scaling[k] for k in TYPE_KEYS.get(scaling["type"], ()) if k in scaling}
    return {"rope_type": scaling["type"], "rope_theta": theta, **keys}


def _export_window(out: dict[str, Any], seq_len: int) -> None:
    """tessera attends to every earlier position; a Gemma 2 config.json slides every other layer (its class default
    4096 when absent), so the window written is at least the training context: then it masks nothing in
    transformers either (an imported folder's window already is, or the import was refused)."""
    window = out.get("sliding_window", 4096)
    if window is not None and window < seq_len:
        out["sliding_window"] = seq_len
    else:
        out.setdefault("sliding_window", window)


def _fields(cfg: ModelConfig) -> dict[str, Any]:
    return {
        name: getattr(cfg, name) for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")
    } | {"norm_eps": cfg.norm_eps}
