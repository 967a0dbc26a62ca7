"""Seeded search for disagreements when a run starts from Hugging Face weights (``model.init = "hf:DIR"``).

Draws random-weight `transformers` models (GPT-2 tied/untied; Llama with grouped-query attention, explicit
``head_dim``, tied/untied, some with Llama 3.1's llama3 RoPE scaling; Mistral with or without a sliding window;
Qwen2 with drawn q/k/v biases; Qwen3 with drawn per-head q/k norm weights) of odd vocabularies and head counts,
saved with ``save_pretrained`` (nothing downloaded), and layouts within 4 ranks (dp, 1D tensor 2/4 with or
without sequence parallelism, 2D 2x2, pipeline 2 with even or uneven ``stage_layers``, ZeRO 1-3 and their
combinations). Each config
is judged by `tessera.execution.violations` (after the config load, which refuses HF configs tessera cannot
represent); properties:

- a refused config (at load or by a rule) is refused by ``tessera train --nproc N`` with exit status 2 and
  every problem's text;
- a feature-spread sample of the accepted ones trains one step on gloo; the step-0 loss equals transformers' own
  fp32 loss on the same step-0 batch within relative 1e-5, and, for those without ZeRO (where the trainer's hook
  sees whole gradients), every gradient equals transformers' autograd gradient within 1e-5 of its largest
  element (GPT-2's key bias, whose exact gradient is 0: of the model's largest gradient);
- ``--imports`` folders with drawn extra settings (attention/MLP biases, activations, RoPE scaling, sliding
  windows, GPT-2's attention options, dropout) and config.json keys dropped as an older or hand-edited folder
  lacks them: each one validate accepts imports with logits equal to transformers' (relative 1e-5), or is
  refused by both at the weight load.

Then the same three checks again on Llama, Mistral and Qwen3 folders whose per-head width differs from hidden /
heads (``head_dim`` in config.json, or Qwen3's absent key, which transformers reads as 128; tessera's
``model.head_dim``): ``--head-dim-cases`` imports and layout configs and ``--head-dim-runs`` runs, drawn from
their own seeded stream after the rest, so the draws above are each seed's as before. Then likewise on Gemma 2
folders (`hf_gemma2_case`: attention and final soft-caps null or set, query_pre_attn_scalar at or other than
head_dim, head_dim at or other than hidden / heads, a sliding window at least the context or narrower, with
layer_types alternating, all full, all sliding or absent, tied or untied, the (1 + w) norm weights drawn):
``--gemma2-cases`` imports and layout configs and ``--gemma2-runs`` runs, from a stream of their own. Then on
Gemma 3 text folders (`hf_gemma3_case`: windows narrower than the context or not, layer_types patterns, absent,
or no pattern, which tessera must refuse by name: counted, not a disagreement, `check_unpatterned`),
rope_parameters per layer type, linear scaling on the global layers half the time, factor 2 or 8 as the 4B-27B):
``--gemma3-cases`` and ``--gemma3-runs``.

    python benchmarks/hf_search.py [--seed 0] [--configs 300] [--runs 60] [--imports 200] [--head-dim-cases 80]
    python benchmarks/hf_search.py --imports 0 --configs 0 --runs 0 --head-dim-cases 0 --gemma2-cases 60
    python benchmarks/hf_search.py --imports 0 --configs 0 --runs 0 --head-dim-cases 0 --gemma2-cases 0 --gemma3-cases 60

Prints one line per disagreement and a summary; the results are in benchmarks/results/hf_search.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tessera.cli import main as cli_main
from tessera.config import as_overrides, from_dict
from tessera.errors import CheckpointError, ConfigError
from tessera.execution import resolve, violations
from tests.distributed.conftest import trainer_config
from tests.harness import DistributedTestError, run_distributed

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5


def hf_case(rng: random.Random) -> dict[str, Any]:
    """Keyword arguments of a tiny transformers config (``kind`` says which class)."""
    kind = rng.choice(["gpt2", "llama", "llama", "mistral", "qwen2", "qwen3"])
    vocab = rng.choice([257, 259, 300, 512, 1000, 1031, 4099, 50257])
    heads = rng.choice([1, 2, 3, 4, 6, 8])
    head_dim = rng.choice([4, 6, 8, 16])
    hidden = heads * head_dim if rng.random() < 0.85 else rng.choice([20, 30, 36, 40])
    layers = rng.choice([1, 2, 3, 4])
    tie = rng.random() < 0.5
    saved = dict(bf16=rng.random() < 0.2, shard=rng.random() < 0.2)  # bf16 file; shards with an index
    if kind == "gpt2":
        return dict(
            **saved,
            kind=kind,
            vocab_size=vocab,
            n_embd=hidden,
            n_head=heads,
            n_layer=layers,
            n_positions=rng.choice([16, 32]),
            n_inner=rng.choice([None, 2 * hidden, 3 * hidden + 2]),
            tie_word_embeddings=tie,
        )
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    out = dict(
        **saved,
        kind=kind,
        vocab_size=vocab,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        intermediate_size=rng.choice([2 * hidden, 3 * hidden + 2, 64]),
        max_position_embeddings=rng.choice([16, 32]),
        tie_word_embeddings=tie,
        rope_theta=rng.choice([10000.0, 1e6]),
        rms_norm_eps=rng.choice([1e-5, 1e-6]),
    )
    if kind in ("llama", "mistral") and rng.random() < 0.4:
        out["llama3"] = llama3_tag(rng)
    if kind == "mistral":  # MistralConfig's default 4096 is wider than the context; 8 is narrower (refused)
        out["sliding_window"] = rng.choice([None, 4096, 8])
    r = rng.random()
    if r < 0.25 or (kind == "qwen3" and r >= 0.32 and r < 0.9):
        out["head_dim"] = hidden // heads  # explicit, as transformers 5 writes it
    elif r < 0.32:
        out["head_dim"] = rng.choice([8, 16])  # may differ from hidden / heads (model.head_dim)
    # else Qwen3: Qwen3Config's default head_dim 128, never hidden / heads here (model.head_dim = 128)
    return out


HEAD_DIM_KINDS = ("llama", "mistral", "qwen3")
"""The kinds `hf_head_dim_case` draws: those whose transformers attention reads a head_dim of its own."""
HEAD_DIMS = (4, 6, 12, 16, 24, 32)
"""Even widths (RoPE), narrower and wider than hidden / heads (4 to 16 here)."""


def hf_head_dim_case(rng: random.Random) -> dict[str, Any]:
    """An `hf_case` of a `HEAD_DIM_KINDS` kind whose per-head width differs from hidden / heads: an explicit
    ``head_dim`` from `HEAD_DIMS`, or for a quarter of the Qwen3 cases none, so transformers reads Qwen3Config's
    128. Sizes stay tiny at 128: at most 8 heads, so q/k/v/o are at most 128 × 1024."""
    hf = hf_case(rng)
    while hf["kind"] not in HEAD_DIM_KINDS:
        hf = hf_case(rng)
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf["kind"] == "qwen3" and rng.random() < 0.25:
        hf.pop("head_dim", None)  # never hidden / heads: 128 · heads > 128 ≥ hidden
    else:
        hf["head_dim"] = rng.choice([w for w in HEAD_DIMS if w * heads != hidden])
    return hf


GEMMA2_ATTN_CAPS = (None, 1.5, 50.0)
"""attn_logit_softcapping draws: null (no cap), one that bites at these shapes (weights std 0.2: scores of order
one), Gemma 2's released 50."""
GEMMA2_FINAL_CAPS = (None, 2.0, 30.0)
"""final_logit_softcapping draws: null, one that bites (logits of order one), Gemma 2's released 30."""


def hf_gemma2_case(rng: random.Random) -> dict[str, Any]:
    """A Gemma2Config of an `hf_case`'s Llama-like shape: head_dim hidden / heads or another even width,
    query_pre_attn_scalar at head_dim or not, caps from `GEMMA2_ATTN_CAPS` / `GEMMA2_FINAL_CAPS`, a sliding
    window as wide as the context, wider, or 8 (narrower: refused unless no layer slides or model.seq_len <= 8),
    layer_types alternating (Gemma 2's), all full, all sliding or absent (transformers fills in alternating; a
    config.json without it slides every other layer). No pad token: Gemma2Config's pad_token_id 0 would make
    transformers' embedding drop that row's gradient, which tessera trains (docs/huggingface.md)."""
    hf = hf_case(rng)
    while hf["kind"] == "gpt2":
        hf = hf_case(rng)
    hf.pop("llama3", None)
    hf.pop("sliding_window", None)
    heads, hidden, layers = hf["num_attention_heads"], hf["hidden_size"], hf["num_hidden_layers"]
    width = rng.choice([hidden // heads] * 2 + [w for w in HEAD_DIMS if w * heads != hidden])
    ctx = hf["max_position_embeddings"]
    sliding = [("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(layers)]
    layer_types = rng.choice([sliding, ["full_attention"] * layers, ["sliding_attention"] * layers, None])
    hf |= {
        "kind": "gemma2",
        "head_dim": width,
        "query_pre_attn_scalar": rng.choice([width, width, 24, 256]),
        "attn_logit_softcapping": rng.choice(GEMMA2_ATTN_CAPS),
        "final_logit_softcapping": rng.choice(GEMMA2_FINAL_CAPS),
        "sliding_window": rng.choice([ctx, 2 * ctx, 4096, 8]),
        "pad_token_id": None,
    }
    if layer_types is not None:
        hf["layer_types"] = layer_types
    return hf


GEMMA3_ROPE_BASES = (100.0, 10000.0, 1000000.0)
"""Gemma 3's rope_parameters draws per layer type: its released 10⁴ (sliding) and 10⁶ (full), and 100, whose low
frequencies turn visibly within 16 positions."""


def gemma3_pattern(layers: int, p: int) -> list[str]:
    """Gemma 3's layer_types: every p-th layer full attention, the others sliding (p > layers: all sliding)."""
    return ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(layers)]


def hf_gemma3_case(rng: random.Random) -> dict[str, Any]:
    """A Gemma3TextConfig of an `hf_gemma2_case`'s shape, scalar, head_dim and ties: caps null in most cases
    (Gemma 3's default), a sliding window narrower than the context (2, 5, 8, context - 1) or not (the context,
    4096), layer_types a repeating pattern (every p-th layer full, p from 2 to layers + 1, all sliding at
    layers + 1), absent (transformers derives it from sliding_window_pattern 6: all sliding at these depths) or,
    with 2+ layers, full then sliding (not a pattern: tessera must refuse it by name), and rope_parameters with a
    base per layer type (``rope_local``: the sliding layers')."""
    hf = hf_gemma2_case(rng)
    layers, ctx = hf["num_hidden_layers"], hf["max_position_embeddings"]
    hf.pop("layer_types", None)
    hf |= {
        "kind": "gemma3",
        "attn_logit_softcapping": rng.choice([None, None, None, *GEMMA2_ATTN_CAPS[1:]]),
        "final_logit_softcapping": rng.choice([None, None, None, *GEMMA2_FINAL_CAPS[1:]]),
        "sliding_window": rng.choice([2, 5, 8, ctx - 1, ctx, 4096]),
        "rope_local": rng.choice(GEMMA3_ROPE_BASES),
        "rope_theta": rng.choice(GEMMA3_ROPE_BASES),
    }
    r = rng.random()
    if r < 0.7:
        hf["layer_types"] = gemma3_pattern(layers, rng.randint(2, layers + 1))
    elif r < 0.85 and layers >= 2:
        hf["layer_types"] = ["full_attention"] + ["sliding_attention"] * (layers - 1)  # not a pattern
    # linear RoPE scaling on the global layers, as Gemma 3 4B/12B/27B (factor 8) or another factor; the local
    # layers stay unscaled (drawn last, so the draws above are each case's as before ff1ae3b)
    hf["global_linear"] = rng.choice([None, None, 2.0, 8.0])
    return hf


def gemma3_unpatterned(hf: dict[str, Any]) -> bool:
    """Whether a Gemma 3 folder's layer_types is no repeating pattern (tessera refuses it)."""
    types = hf.get("layer_types")
    if hf["kind"] != "gemma3" or not types:
        return False
    p = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    return list(types) != gemma3_pattern(len(types), p)


UNPATTERNED_REFUSED: list[str] = []
"""Tags of the Gemma 3 folders whose non-pattern layer_types tessera refused (`check_unpatterned`): counted, not
disagreements."""


def check_unpatterned(hf: dict[str, Any], problems: list[str], tag: str, found: list[str]) -> None:
    """A Gemma 3 folder whose layer_types is no pattern must be refused by name (its local and global layers
    differ in RoPE base, so no model.sliding_window_pattern computes it); a refusal is counted, an acceptance or a
    refusal that does not name layer_types is a disagreement."""
    if not gemma3_unpatterned(hf):
        return
    if any("layer_types" in p for p in problems):
        UNPATTERNED_REFUSED.append(tag)
    else:
        found.append(f"a layer_types that is no pattern is not refused by name ({problems}): {tag}")


PHASES = {"head_dim": hf_head_dim_case, "gemma2": hf_gemma2_case, "gemma3": hf_gemma3_case}
"""The phases after the plain draws: each draws its folders from a function of its own and a stream of its own."""


def draw_hf(rng: random.Random, phase: str = "") -> dict[str, Any]:
    """A case of ``phase`` (`PHASES`; "": the plain `hf_case`)."""
    return PHASES[phase](rng) if phase else hf_case(rng)


def free_head_dim(hf: dict[str, Any]) -> bool:
    """Whether the folder's heads are other than hidden / heads wide, as transformers reads its config."""
    if hf["kind"] == "gpt2":
        return False  # GPT2Attention: n_embd / n_head always
    width = hf.get("head_dim", 128 if hf["kind"] == "qwen3" else None)
    return width is not None and width * hf["num_attention_heads"] != hf["hidden_size"]


def llama3_tag(rng: random.Random) -> str:
    """A llama3 RoPE scaling as a folder-name tag "factor_low_high_original": Llama 3.1's and 3.2's factors and
    band, and pre-training contexts that put the tiny head dims' wavelengths (6 to ~10⁶ positions) on every side
    of the band."""
    factor = rng.choice([8.0, 32.0, 2.5])
    low, high = rng.choice([(1.0, 4.0), (1.0, 4.0), (0.5, 3.0)])
    return f"{factor}_{low}_{high}_{rng.choice([16, 64, 1024, 8192])}"


def llama3_rope(tag: str, theta: float) -> dict[str, Any]:
    """transformers 5's rope_parameters of a `llama3_tag`."""
    factor, low, high, original = tag.split("_")
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": float(factor),
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(original),
    }


def hf_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """The transformers config arguments of a drawn case (the llama3 tag as rope_parameters)."""
    kw = {
        k: v
        for k, v in hf.items()
        if k not in ("kind", "bf16", "shard", "llama3", "rope_local", "global_linear")
    }
    if "llama3" in hf:
        kw["rope_parameters"] = llama3_rope(hf["llama3"], kw.pop("rope_theta"))
    if "rope_local" in hf:  # Gemma 3: a base per layer type
        full = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
        if hf.get("global_linear"):
            full |= {"rope_type": "linear", "factor": hf["global_linear"]}
        kw["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": hf["rope_local"]},
        }
    return kw


CONFIG_CLASSES = {
    "gpt2": "GPT2Config",
    "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


def layout_case(rng: random.Random, layers: int) -> tuple[int, dict[str, Any]]:
    """(world size, parallel section) within 4 ranks."""
    world = rng.choice([1, 2, 2, 3, 4, 4, 4])
    tensor: Any = rng.choice([t for t in (1, 2, 4) if world % t == 0] + (["2x2"] if world == 4 else []))
    if rng.random() < 0.1:
        tensor = rng.choice([2, 3, 4, "2x2"])  # sometimes one the world does not fit
    ranks = 4 if tensor == "2x2" else int(tensor)
    rest = world // ranks if world % ranks == 0 else 1
    pipeline = rng.choice([p for p in (1, 2) if rest % p == 0])
    par: dict[str, Any] = {"tensor": tensor, "pipeline": pipeline}
    if tensor not in (1, "2x2") and rng.random() < 0.5:
        par["sequence_parallel"] = True
    if rng.random() < 0.5:
        par["zero"] = rng.choice([1, 2, 3])
    if pipeline > 1:
        par["schedule"] = rng.choice(["1f1b", "gpipe"])
        if rng.random() < 0.5:
            first = rng.randint(0, layers)
            par["stage_layers"] = [first, layers - first]
    return world, par


def sample(
    rng: random.Random, root: Path, token_file: Path, i: int, phase: str = ""
) -> tuple[int, dict, dict]:
    """(world, raw config, HF kwargs) of sample ``i``; with a ``phase`` that phase's folder (`PHASES`), whose
    explicit ``[model]`` keys may be ``head_dim`` (and Gemma 2's scalar and caps) too."""
    hf = draw_hf(rng, phase)
    layers = hf.get("n_layer", hf.get("num_hidden_layers"))
    world, parallel = layout_case(rng, layers)
    model: dict[str, Any] = {"init": f"hf:{root / folder_name(hf)}"}
    ctx = hf.get("n_positions", hf.get("max_position_embeddings"))
    if hf["kind"] != "gpt2" and rng.random() < 0.2:
        model["seq_len"] = ctx // 2  # a shorter training context (RoPE)
    r = rng.random()
    if r < 0.25:  # an explicit [model] key that agrees with config.json (accepted) or not (refused)
        keys = explicit_keys(hf) + ([("head_dim", hf.get("head_dim", 128))] if phase else [])
        key, value = rng.choice(keys)
        model[key] = value if r < 0.18 else alter(value)
    micro = rng.choice([1, 2, 2, 4])
    run = root / f"{phase}run{i}"
    raw = trainer_config(token_file, run, model, parallel, steps=1, lr=1e-3)
    dp = max(
        1, world // ((4 if parallel["tensor"] == "2x2" else int(parallel["tensor"])) * parallel["pipeline"])
    )
    raw["train"].update(micro_batch=micro, global_batch=micro * dp * rng.choice([1, 2, 3]), dtype="fp32")
    return world, raw, hf


def explicit_keys(hf: dict[str, Any]) -> list[tuple[str, Any]]:
    """(tessera [model] key, the value config.json implies) pairs."""
    if hf["kind"] == "gpt2":
        return [
            ("family", "gpt"),
            ("d_model", hf["n_embd"]),
            ("n_heads", hf["n_head"]),
            ("n_kv_heads", hf["n_head"]),
            ("ffn_hidden", hf["n_inner"] or 4 * hf["n_embd"]),
            ("vocab_size", hf["vocab_size"]),
            ("tie_embeddings", hf["tie_word_embeddings"]),
            ("seq_len", hf["n_positions"]),
        ]
    gemma2 = [
        (name, hf[key])
        for name, key in (
            ("query_pre_attn_scalar", "query_pre_attn_scalar"),
            ("attn_softcap", "attn_logit_softcapping"),
            ("final_softcap", "final_logit_softcapping"),
        )
        if hf.get(key) is not None
    ]
    if (
        "rope_local" in hf
    ):  # Gemma 3's window, pattern (none for a layer_types that is not one) and local base
        gemma2 += [("sliding_window", hf["sliding_window"]), ("rope_local_theta", hf["rope_local"])]
        if hf.get("global_linear"):
            gemma2.append(("rope_scaling", {"type": "linear", "factor": hf["global_linear"]}))
        if not gemma3_unpatterned(hf):
            types = hf.get("layer_types") or gemma3_pattern(hf["num_hidden_layers"], 6)
            p = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
            gemma2.append(("sliding_window_pattern", p))
    return [
        ("family", "llama" if hf["kind"] == "mistral" else hf["kind"]),
        ("n_layers", hf["num_hidden_layers"]),
        ("n_kv_heads", hf["num_key_value_heads"]),
        ("ffn_hidden", hf["intermediate_size"]),
        ("vocab_size", hf["vocab_size"]),
        ("tie_embeddings", hf["tie_word_embeddings"]),
        ("rope_theta", hf["rope_theta"]),
        ("norm_eps", hf["rms_norm_eps"]),
        *gemma2,  # empty for the other kinds: their draws are as before
    ]


def alter(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return "llama" if value != "llama" else "gpt"
    if isinstance(value, dict):  # a RoPE scaling table: another factor
        return {**value, "factor": value["factor"] * 2}
    return value * 2


def folder_name(hf: dict[str, Any]) -> str:
    """One folder per drawn case: its kind and a digest of every setting (spelled out, the names grew past
    the 255 bytes a file name may hold)."""
    digest = hashlib.sha1(json.dumps(sorted(hf.items())).encode()).hexdigest()[:16]
    return f"hf_{hf['kind']}_{digest}"


def make_folder(folder: Path, hf: dict[str, Any]) -> None:
    """A random-weight model of ``hf`` saved with save_pretrained (skipped if present); weights std 0.2."""
    import transformers

    if (folder / "config.json").is_file():
        return
    kw = hf_kwargs(hf)
    common = dict(initializer_range=0.2, bos_token_id=0, eos_token_id=1)
    cls = getattr(transformers, CONFIG_CLASSES[hf["kind"]])
    torch.manual_seed(len(folder.name))
    try:
        model = transformers.AutoModelForCausalLM.from_config(cls(**kw, **common))
    except Exception as e:  # transformers itself refuses the shape: config.json alone, written by hand
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": cls.model_type, **kw, **common}))
        (folder / "transformers_refused.txt").write_text(f"{type(e).__name__}: {e}")
        return
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") and hf["kind"] == "qwen2":
                p.normal_(0.0, 0.2)  # transformers starts them at 0: a mis-mapped one would not show
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.5)  # transformers starts them at 1: q and k swapped would not show
            if hf["kind"] in ("gemma2", "gemma3") and name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)  # Gemma's (1 + w) norms start at 0: four norms swapped would not show
    if hf["bf16"]:
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="20KB" if hf["shard"] else "5GB")


def judge(world: int, raw: dict) -> list[str]:
    """Problems validate finds (config load + execution rules); empty when accepted."""
    try:
        cfg = from_dict(raw)
    except ConfigError as e:
        return [str(e)]
    problems = [str(v) for v in violations(cfg, world)]
    if not problems:
        resolve(cfg, world)
    return problems


def train_refuses(world: int, raw: dict, problems: list[str]) -> str | None:
    """None when ``tessera train --nproc N`` exits 2 naming every problem; else what it did."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(["train", *as_overrides(raw), "--nproc", str(world)])
    if code != 2:
        return f"exit status {code}"
    text = err.getvalue()
    missing = [p for p in problems if p.splitlines()[-1].strip() not in text and p not in text]
    return f"train's message lacks {missing[:1]}: {text[-400:]}" if missing else None


def record_step0(rank: int, world: int, raw: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """(step-0 loss, this rank's whole gradients by plain name before the update) of a one-step run."""
    from tessera.train.trainer import train

    grads: dict[str, torch.Tensor] = {}

    def hook(step: int, model: torch.nn.Module) -> None:
        if step != 0:
            return
        full = model.full_parameters(grad=True) if hasattr(model, "full_parameters") else None
        if full is None:
            full = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.numel() > 0}
        grads.update({n: g.detach().clone() for n, g in full.items()})

    losses = train(from_dict(raw), hook).losses
    return losses[0], grads


def hf_reference(raw: dict, hf_folder: Path, want_grads: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' mean loss over step 0's global batch (as the trainer samples it) and its gradients by
    tessera parameter name (HF tensors split along their output dimension, Conv1D transposed)."""
    import transformers

    from tessera.hf.weights import plan_tensors
    from tessera.model.build import meta_model
    from tessera.train.trainer import TrainingRun

    single = from_dict(
        {**raw, "parallel": {}, "log": {**raw["log"], "run_dir": raw["log"]["run_dir"] + "_ref"}}
    )
    batches = TrainingRun(single, 0, 1).batches(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    torch.set_grad_enabled(want_grads)
    losses = [F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()) for x, y in batches]
    loss = torch.stack(losses).mean()
    value = float(loss.detach())
    grads: dict[str, torch.Tensor] = {}
    if want_grads:
        loss.backward()
        named = dict(hf.named_parameters())
        for planned in plan_tensors(meta_model(single.model)):
            g = named[planned.name].grad if planned.name in named else None
            if g is None and planned.name == "lm_head.weight":
                continue
            g = g.t() if planned.out_dim == 1 else g
            for part, piece in zip(planned.parts, g.split(list(planned.part_sizes), dim=0), strict=True):
                grads[part] = piece.contiguous()
    torch.set_grad_enabled(True)
    return value, grads


def features(world: int, raw: dict, hf: dict) -> tuple:
    p = raw["parallel"]
    return (
        world,
        hf["kind"],
        str(p.get("tensor")),
        p.get("pipeline", 1) > 1,
        bool(p.get("sequence_parallel")),
        p.get("zero", 0),
        "stage_layers" in p,
        bool(hf.get("tie_word_embeddings")),
        "head_dim" in hf,
        "llama3" in hf,
        # Gemma 2's (constant for the other kinds: their spread is as before)
        hf.get("attn_logit_softcapping"),
        hf.get("final_logit_softcapping"),
        hf.get("query_pre_attn_scalar", hf.get("head_dim")) == hf.get("head_dim"),
        str(hf.get("layer_types", "-"))[:30],
        # Gemma 3's (likewise constant for the others)
        hf.get("sliding_window", 0) < hf.get("max_position_embeddings", 0) if "rope_local" in hf else None,
        gemma3_unpatterned(hf),
        hf.get("rope_local") == hf.get("rope_theta"),
        tuple(hf.get("layer_types") or ()),
        hf.get("global_linear"),
    )


def spread(accepted: list[tuple[int, dict, dict]], n: int) -> list[tuple[int, dict, dict]]:
    """n accepted configs, each new one differing most from those chosen (greedy over the feature tuple)."""
    chosen: list[tuple[int, dict, dict]] = []
    pool = list(accepted)
    while pool and len(chosen) < n:
        seen = [features(*c) for c in chosen]

        def novelty(c: tuple[int, dict, dict], seen: list[tuple] = seen) -> int:
            f = features(*c)
            return min((sum(a != b for a, b in zip(f, s, strict=True)) for s in seen), default=99)

        best = max(pool, key=novelty)
        chosen.append(best)
        pool.remove(best)
    return chosen


VARIANTS = {  # HF config keys beyond the shape, per model type: values users' folders hold
    "llama": {
        "attention_bias": [False, True],
        "mlp_bias": [False, True],
        "hidden_act": ["silu", "gelu"],
        "pretraining_tp": [1, 2],
        "rope_scaling": [
            None,
            {"rope_type": "default"},
            {"rope_type": "linear", "factor": 2.0},
            {"rope_type": "yarn", "factor": 4.0},
            # Llama 3.1 (transformers 4's spelling: no theta, read from rope_theta) and an incomplete one
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            {"rope_type": "llama3", "factor": 8.0},
        ],
        "attention_dropout": [0.0, 0.1],
    },
    "mistral": {
        "sliding_window": [None, 8, 16, 32, 64, 4096],
        "hidden_act": ["silu", "gelu"],
        "attention_bias": [False, True],  # not a Mistral key: MistralAttention has no biases whatever it says
        "attention_dropout": [0.0, 0.1],
    },
    "qwen2": {
        "use_sliding_window": [False, True],
        "sliding_window": [None, 8, 16, 32, 64],
        "max_window_layers": [0, 1, 28],
        "attention_dropout": [0.0, 0.1],
    },
    "qwen3": {
        "attention_bias": [False, True],
        "hidden_act": ["silu", "gelu"],
        "use_sliding_window": [False, True],
        "sliding_window": [None, 8, 16, 32, 64],
        "max_window_layers": [0, 1, 28],
        "attention_dropout": [0.0, 0.1],
    },
    "gemma2": {
        "hidden_activation": ["gelu_pytorch_tanh", "gelu"],
        "attention_bias": [False, True],
        "use_bidirectional_attention": [False, True],
        "sliding_window": [None, 8, 16, 32, 4096],
        "attention_dropout": [0.0, 0.1],
    },
    "gemma3": {
        "hidden_activation": ["gelu_pytorch_tanh", "gelu"],
        "attention_bias": [False, True],
        "use_bidirectional_attention": [False, True],
        "sliding_window": [None, 2, 8, 4096],
        "attention_dropout": [0.0, 0.1],
    },
    "gpt2": {
        "activation_function": ["gelu_new", "gelu_pytorch_tanh", "gelu", "relu"],
        "scale_attn_weights": [True, False],
        "scale_attn_by_inverse_layer_idx": [False, True],
        "reorder_and_upcast_attn": [False, True],
        "resid_pdrop": [0.1, 0.0],
    },
}
DROP = ("tie_word_embeddings", "num_key_value_heads", "head_dim", "rope_parameters", "layer_types")
"""config.json keys an older or hand-edited folder may lack (transformers then uses its defaults)."""


def import_case(
    rng: random.Random, root: Path, i: int, phase: str = ""
) -> tuple[Path, dict[str, Any], list[str]] | None:
    """A random-weight model with drawn extra settings saved to a folder, then config.json keys dropped; with a
    ``phase`` that phase's model (`PHASES`; head_dim: dropping its head_dim leaves transformers a width the weights
    do not have: both must refuse it)."""
    import transformers

    if phase:
        hf = draw_hf(rng, phase)
    else:  # the draws of the searches recorded before model.head_dim: hidden / heads wide
        hf = hf_case(rng)
        if hf["kind"] != "qwen3":
            hf.pop("head_dim", None)
        elif "head_dim" not in hf:  # keep one to drop from config.json
            hf["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    extra = {k: rng.choice(v) for k, v in VARIANTS[hf["kind"]].items() if rng.random() < 0.4}
    if "rope_scaling" in extra:
        hf.pop("llama3", None)  # the drawn variant replaces the case's own scaling
    drop = [k for k in DROP if rng.random() < 0.15]
    kw = hf_kwargs(hf)
    cls = getattr(transformers, CONFIG_CLASSES[hf["kind"]])
    try:
        config = cls(**kw, **extra, initializer_range=0.2)
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception:
        return None  # transformers refuses the combination itself
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.5)
            if hf["kind"] in ("gemma2", "gemma3") and name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    folder = root / (f"import_{phase}{i}" if phase else f"import{i}")
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    for k in drop:
        saved.pop(k, None)
    (folder / "config.json").write_text(json.dumps(saved))
    return folder, {**hf, **extra}, drop


def import_search(
    rng: random.Random, root: Path, n: int, phase: str = ""
) -> tuple[int, int, int, list[str], int]:
    """(imported, refused by validate, refused at the weight load, disagreements, imported with heads other than
    hidden / heads wide): every accepted folder's logits must equal transformers' own (``phase``: that phase's
    folders)."""
    import transformers

    from tessera.hf.weights import load_init

    imported = refused = at_load = free = 0
    found: list[str] = []
    for i in range(n):
        case = import_case(rng, root, i, phase)
        if case is None:
            continue
        folder, hf, drop = case
        tag = f"{hf} without {drop}"
        raw = {"model": {"init": f"hf:{folder}"}, "data": {"path": str(root / "tokens.bin")}}
        problems = judge(1, raw)
        if "layer_types" not in drop:
            check_unpatterned(hf, problems, tag, found)
        if problems:
            refused += 1
            continue
        cfg = from_dict(raw)
        try:
            theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        except Exception as e:
            theirs = f"{type(e).__name__}: {str(e)[:200]}"
        try:
            ours = load_init(cfg.model).eval()
        except CheckpointError as e:
            if "differs from the embedding" in str(e):
                at_load += 1  # by design: which values a saved head holds is known only as it is read
            elif not isinstance(theirs, str):
                found.append(f"accepted, transformers loads it, tessera's weight load fails ({e}): {tag}")
            continue  # refused by both (a config.json that contradicts the weights)
        if isinstance(theirs, str):
            found.append(f"tessera imports what transformers cannot load ({theirs}): {tag}")
            continue
        imported += 1
        free += free_head_dim(hf)
        tokens = torch.randint(
            0, hf["vocab_size"], (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(i)
        )
        with torch.no_grad():
            a, b = ours(tokens), theirs(tokens).logits
        err = float((a - b).abs().max() / b.abs().max())
        if err > LOSS_RTOL:
            found.append(f"imported logits differ from transformers' (rel {err:.1e}): {tag}")
    return imported, refused, at_load, found, free


def judge_configs(
    rng: random.Random, root: Path, token_file: Path, n: int, found: list[str], phase: str = ""
) -> tuple[list[tuple[int, dict, dict]], int]:
    """(accepted configs, refused count) of ``n`` drawn configs; a refusal ``tessera train`` does not repeat, or
    a folder transformers cannot build that validate accepts, goes to ``found``."""
    accepted, refused = [], 0
    for i in range(n):
        world, raw, hf = sample(rng, root, token_file, i, phase)
        make_folder(root / folder_name(hf), hf)
        problems = judge(world, raw)
        check_unpatterned(hf, problems, f"[{i}] {hf}", found)
        if (root / folder_name(hf) / "transformers_refused.txt").is_file() and not problems:
            found.append(f"[{i}] transformers cannot build {hf} but validate accepts it")
        if problems:
            refused += 1
            bad = train_refuses(world, raw, problems)
            if bad:
                found.append(
                    f"[{i}] validate refuses, train differs: {bad}; world {world} {raw['parallel']} {hf}"
                )
        else:
            accepted.append((world, raw, hf))
    return accepted, refused


def run_layouts(runs: list[tuple[int, dict, dict]], root: Path, found: list[str]) -> tuple[float, float, int]:
    """(worst loss rel, worst gradient rel, runs compared with gradients): each run's step-0 loss and (without
    ZeRO) gradients against transformers'."""
    worst_loss, worst_grad, compared = 0.0, 0.0, 0
    for j, (world, raw, hf) in enumerate(runs):
        folder = root / folder_name(hf)
        want_grads = not raw["parallel"].get("zero")
        tag = f"world {world} {raw['parallel']} {json.dumps(hf)}"
        try:
            results = run_distributed(record_step0, world, raw, timeout=300)
        except DistributedTestError as e:
            found.append(f"accepted but crashed: {tag}\n{str(e)[-1500:]}")
            print(found[-1], flush=True)
            continue
        expected, ref_grads = hf_reference(raw, folder, want_grads)
        loss = results[0][0]
        err = abs(loss - expected) / abs(expected)
        worst_loss = max(worst_loss, err)
        if err > LOSS_RTOL:
            found.append(f"loss {loss:.7f} != transformers {expected:.7f} (rel {err:.1e}): {tag}")
        if want_grads:
            got: dict[str, torch.Tensor] = {}
            for _, g in results:
                got.update(g)
            missing = sorted(set(ref_grads) - set(got))
            if missing:
                found.append(f"gradients missing for {missing[:3]}: {tag}")
            scale = max(float(r.abs().max()) for r in ref_grads.values())
            for name in sorted(set(ref_grads) & set(got)):
                ref, g = ref_grads[name], got[name]
                if ref.shape != g.shape:
                    found.append(f"gradient {name} shape {tuple(g.shape)} != {tuple(ref.shape)}: {tag}")
                    continue
                # relative to the tensor's largest element; GPT-2's key bias relative to the model's largest
                # gradient: its exact gradient is 0 (softmax is invariant to the per-query constant it adds)
                floor = scale if name.endswith("attn.wk.bias") else 0.0
                e = float((g - ref).abs().max() / max(float(ref.abs().max()), floor))
                worst_grad = max(worst_grad, e)
                if e > GRAD_RTOL:
                    found.append(f"gradient {name} rel {e:.1e}: {tag}")
            compared += 1
        print(f"[{j}] {tag}: loss {loss:.6f} vs {expected:.6f} rel {err:.1e}", flush=True)
    return worst_loss, worst_grad, compared


def head_dim_counts(cases: list[tuple[int, dict, dict]]) -> str:
    """How many of ``cases`` have heads other than hidden / heads wide, by kind."""
    kinds = [hf["kind"] for _, _, hf in cases if free_head_dim(hf)]
    by_kind = ", ".join(f"{k} {kinds.count(k)}" for k in sorted(set(kinds)))
    return f"{len(kinds)}" + (f" ({by_kind})" if kinds else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", type=int, default=300)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--imports", type=int, default=200)
    ap.add_argument(
        "--head-dim-cases",
        type=int,
        default=80,
        help="then this many imports and layout configs with head_dim != hidden / heads (own seeded stream)",
    )
    ap.add_argument("--head-dim-runs", type=int, default=16, help="runs among the head_dim layout configs")
    ap.add_argument(
        "--gemma2-cases",
        type=int,
        default=60,
        help="then this many imports and layout configs of Gemma 2 folders (own seeded stream)",
    )
    ap.add_argument("--gemma2-runs", type=int, default=12, help="runs among the Gemma 2 layout configs")
    ap.add_argument(
        "--gemma3-cases",
        type=int,
        default=60,
        help="then this many imports and layout configs of Gemma 3 text folders (own seeded stream)",
    )
    ap.add_argument("--gemma3-runs", type=int, default=12, help="runs among the Gemma 3 layout configs")
    ap.add_argument("--root", type=Path, default=None)
    args = ap.parse_args()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    from tessera.train.data import prepare
    from tests.distributed.conftest import synthetic_corpus

    root = args.root or Path(tempfile.mkdtemp(prefix="hf_search_"))
    root.mkdir(parents=True, exist_ok=True)
    token_file = root / "tokens.bin"
    if not token_file.is_file():
        (root / "corpus.txt").write_text(synthetic_corpus())
        prepare([root / "corpus.txt"], token_file, "byte")
    t0 = time.time()
    imported, import_refused, at_load, found, free = import_search(
        random.Random(args.seed), root, args.imports
    )
    print(
        f"imports: {args.imports} drawn, {imported} imported and compared ({free} with head_dim != hidden / heads), "
        f"{import_refused} refused by validate, {at_load} at the weight load (a saved head that differs from the "
        "tied embedding)"
    )
    accepted, refused = judge_configs(random.Random(args.seed), root, token_file, args.configs, found)
    print(
        f"judged {args.configs} configs in {time.time() - t0:.0f}s: {len(accepted)} accepted, {refused} refused; "
        f"head_dim != hidden / heads: {head_dim_counts(accepted)} accepted"
    )
    runs = spread(accepted, args.runs)
    worst_loss, worst_grad, compared = run_layouts(runs, root, found)
    print(
        f"seed {args.seed}: {args.configs} judged, {len(accepted)} accepted, {refused} refused; {len(runs)} run "
        f"({compared} with gradients; head_dim != hidden / heads: {head_dim_counts(runs)}); worst loss rel "
        f"{worst_loss:.1e}, worst gradient rel {worst_grad:.1e}; {len(found)} disagreement(s) in "
        f"{time.time() - t0:.0f}s"
    )
    if args.head_dim_cases:
        head_dim_phase(args, root, token_file, found)
    if args.gemma2_cases:
        gemma2_phase(args, root, token_file, found)
    if args.gemma3_cases:
        gemma3_phase(args, root, token_file, found)
    for f in found:
        print("DISAGREEMENT", f)


def head_dim_phase(args: argparse.Namespace, root: Path, token_file: Path, found: list[str]) -> None:
    """The imports, configs and runs of `hf_head_dim_case` folders, from a stream of their own (a str seed is
    hashed the same way in every process), so that the draws before them stay each seed's."""
    t0, n = time.time(), args.head_dim_cases
    imported, import_refused, at_load, hd_found, free = import_search(
        random.Random(f"head_dim {args.seed}"), root, n, "head_dim"
    )
    accepted, refused = judge_configs(
        random.Random(f"head_dim layouts {args.seed}"), root, token_file, n, hd_found, "head_dim"
    )
    runs = spread(accepted, args.head_dim_runs)
    worst_loss, worst_grad, compared = run_layouts(runs, root, hd_found)
    print(
        f"head_dim seed {args.seed}: imports {n} drawn, {imported} compared ({free} with head_dim != hidden / "
        f"heads), {import_refused} refused by validate, "
        f"{at_load} at the weight load; {n} configs judged, {len(accepted)} accepted ({head_dim_counts(accepted)}), "
        f"{refused} refused; {len(runs)} run ({compared} with gradients; {head_dim_counts(runs)}); worst loss rel "
        f"{worst_loss:.1e}, worst gradient rel {worst_grad:.1e}; {len(hd_found)} disagreement(s) in "
        f"{time.time() - t0:.0f}s"
    )
    found += hd_found


def gemma2_phase(args: argparse.Namespace, root: Path, token_file: Path, found: list[str]) -> None:
    """The imports, configs and runs of `hf_gemma2_case` folders, from streams of their own (as `head_dim_phase`)."""
    t0, n = time.time(), args.gemma2_cases
    imported, import_refused, at_load, g_found, free = import_search(
        random.Random(f"gemma2 {args.seed}"), root, n, "gemma2"
    )
    accepted, refused = judge_configs(
        random.Random(f"gemma2 layouts {args.seed}"), root, token_file, n, g_found, "gemma2"
    )
    runs = spread(accepted, args.gemma2_runs)
    worst_loss, worst_grad, compared = run_layouts(runs, root, g_found)
    caps = sum(hf.get("attn_logit_softcapping") is not None for _, _, hf in runs)
    print(
        f"gemma2 seed {args.seed}: imports {n} drawn, {imported} compared ({free} with head_dim != hidden / "
        f"heads), {import_refused} refused by validate, {at_load} at the weight load; {n} configs judged, "
        f"{len(accepted)} accepted, {refused} refused; {len(runs)} run ({compared} with gradients, {caps} with an "
        f"attention cap; {head_dim_counts(runs)} with head_dim != hidden / heads); worst loss rel "
        f"{worst_loss:.1e}, worst gradient rel {worst_grad:.1e}; {len(g_found)} disagreement(s) in "
        f"{time.time() - t0:.0f}s"
    )
    found += g_found


def gemma3_phase(args: argparse.Namespace, root: Path, token_file: Path, found: list[str]) -> None:
    """The imports, configs and runs of `hf_gemma3_case` folders, from streams of their own (as `gemma2_phase`);
    the refusals of non-pattern layer_types are counted apart (`check_unpatterned`)."""
    t0, n = time.time(), args.gemma3_cases
    UNPATTERNED_REFUSED.clear()
    imported, import_refused, at_load, g_found, free = import_search(
        random.Random(f"gemma3 {args.seed}"), root, n, "gemma3"
    )
    import_unpatterned = len(UNPATTERNED_REFUSED)
    accepted, refused = judge_configs(
        random.Random(f"gemma3 layouts {args.seed}"), root, token_file, n, g_found, "gemma3"
    )
    runs = spread(accepted, args.gemma3_runs)
    worst_loss, worst_grad, compared = run_layouts(runs, root, g_found)
    narrow = sum(
        hf["sliding_window"] < raw["model"].get("seq_len", hf["max_position_embeddings"])
        for _, raw, hf in runs
    )
    scaled = sum(bool(hf.get("global_linear")) for _, _, hf in runs)
    print(
        f"gemma3 seed {args.seed}: imports {n} drawn, {imported} compared ({free} with head_dim != hidden / "
        f"heads), {import_refused} refused by validate ({import_unpatterned} a layer_types that is no pattern), "
        f"{at_load} at the weight load; {n} configs judged, {len(accepted)} accepted, {refused} refused "
        f"({len(UNPATTERNED_REFUSED) - import_unpatterned} no pattern); {len(runs)} run ({compared} with "
        f"gradients, {narrow} with a window narrower than the sequence, {scaled} with linear-scaled global "
        f"layers; {head_dim_counts(runs)} with head_dim != "
        f"hidden / heads); worst loss rel {worst_loss:.1e}, worst gradient rel {worst_grad:.1e}; "
        f"{len(g_found)} disagreement(s) in {time.time() - t0:.0f}s"
    )
    found += g_found


if __name__ == "__main__":
    main()
