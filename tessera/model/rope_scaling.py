"""RoPE frequency scaling: the kinds tessera computes, their keys, and the checks on them (torch-free, so the
config and the HF import read it; the frequencies themselves are `tessera.model.layers.rope_inv_freq`).

``model.rope_scaling`` is a table in the spelling of Hugging Face's ``rope_scaling`` (``type`` for its
``rope_type``), e.g. Llama 3.1's ``{type = "llama3", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0,
original_max_position_embeddings = 8192}``; unset means the unscaled RoPE of Su et al. (2021). Family gemma3
applies it to its global layers only (Gemma 3 4B/12B/27B: ``{type = "linear", factor = 8.0}``).

llama3 (Meta, Llama 3.1, July 2024; the reference ``apply_scaling`` of github.com/meta-llama/llama-models and
transformers' ``_compute_llama3_parameters``): with wavelength λ = 2π / f of each inverse frequency f and
L = original_max_position_embeddings, frequencies with λ < L / high_freq_factor are kept, those with
λ > L / low_freq_factor are divided by ``factor``, and those between are interpolated,
f' = (1 - s) f / factor + s f with s = (L / λ - low_freq_factor) / (high_freq_factor - low_freq_factor).

linear (position interpolation, Chen et al. 2023, arXiv 2306.15595; transformers'
``_compute_linear_scaling_rope_parameters``): every inverse frequency divided by ``factor``, which is position
m rotated as m / factor.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LLAMA3_KEYS", "REFUSED_TYPES", "TYPES", "TYPE_KEYS", "scaling_problems"]

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The keys of a llama3 scaling, each required, besides ``type``."""

TYPE_KEYS = {"llama3": LLAMA3_KEYS, "linear": ("factor",)}
"""Each scaling type tessera computes and its keys, each required, besides ``type``."""

TYPES = tuple(TYPE_KEYS)
"""Scaling types tessera computes."""

REFUSED_TYPES = ("dynamic", "yarn", "longrope", "proportional")
"""The other types transformers 5 computes (its ``ROPE_INIT_FUNCTIONS``): refused by name, never approximated."""

_EXAMPLES = {
    "llama3": "factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position_embeddings = 8192"
    " (Llama 3.1)",
    "linear": "factor = 8.0 (Gemma 3 4B's global layers)",
}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def scaling_problems(scaling: dict[str, Any], where: str = "model.rope_scaling") -> list[tuple[str, str]]:
    """(problem, fix) for everything wrong with a scaling table ``where`` names; empty when tessera computes it.

    factor > 0 (below 1 shortens wavelengths, which transformers computes too, with a warning); llama3 also
    0 < low_freq_factor < high_freq_factor (the interpolation divides by their difference; equal factors leave
    no band to interpolate), original_max_position_embeddings a positive integer."""
    kind = scaling.get("type")
    if kind not in TYPES:
        why = " is not implemented by tessera" if kind in REFUSED_TYPES else " is unknown"
        types = " or ".join(f'type = "{t}"' for t in TYPES)
        if kind is None:
            return [(f"{where} has no type", f"add {types} to {where}, or leave {where} unset")]
        return [(f"{where}.type = {kind!r}{why}", f"use {types}, or leave {where} unset for unscaled RoPE")]
    keys = TYPE_KEYS[kind]
    out = []
    unknown = sorted(set(scaling) - {"type", *keys})
    if unknown:
        out.append(
            (f"{where} has unknown key(s) {unknown}", f"remove them; a {kind} scaling has {', '.join(keys)}")
        )
    missing = [k for k in keys if k not in scaling]
    if missing:
        out.append((f"{where} lacks {', '.join(missing)}", f"give every {kind} key, e.g. {_EXAMPLES[kind]}"))
    bad = [k for k in keys if k in scaling and not _number(scaling[k])]
    out += [
        (f"{where}.{k} = {scaling[k]!r} is not a finite number", f"set {where}.{k} to a number") for k in bad
    ]
    if missing or bad:
        return out
    if scaling["factor"] <= 0:
        out.append(
            (
                f"{where}.factor = {scaling['factor']!r} must be > 0",
                f"set {where}.factor > 0 (Llama 3.1: 8.0)",
            )
        )
    return out + (_llama3_problems(scaling, where) if kind == "llama3" else [])


def _llama3_problems(scaling: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """A llama3 table's band: 0 < low_freq_factor < high_freq_factor, a positive integer context."""
    out = []
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    if low <= 0:
        out.append(
            (
                f"{where}.low_freq_factor = {low!r} must be > 0",
                f"set {where}.low_freq_factor > 0 (Llama 3.1: 1.0)",
            )
        )
    if high <= low:
        out.append(
            (
                f"{where}.high_freq_factor = {high!r} must exceed low_freq_factor = {low!r}",
                f"set {where}.high_freq_factor above low_freq_factor (Llama 3.1: 4.0 and 1.0)",
            )
        )
    if not isinstance(original, int) or original <= 0:
        out.append(
            (
                f"{where}.original_max_position_embeddings = {original!r} must be a positive integer",
                f"set {where}.original_max_position_embeddings to the pre-training context (Llama 3.1: 8192)",
            )
        )
    return out
