"""RoPE frequency scaling: the kinds tessera computes, their keys, and the checks on them (torch-free, so the
config and the HF import read it; the frequencies themselves are `tessera.model.layers.rope_inv_freq`).

``model.rope_scaling`` is a table in the spelling of Hugging Face's ``rope_scaling`` (``type`` for its
``rope_type``), e.g. Llama 3.1's ``{type = "llama3", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0,
original_max_position_embeddings = 8192}``; unset means the unscaled RoPE of Su et al. (2021).

llama3 (Meta, Llama 3.1, July 2024; the reference ``apply_scaling`` of github.com/meta-llama/llama-models and
transformers' ``_compute_llama3_parameters``): with wavelength λ = 2π / f of each inverse frequency f and
L = original_max_position_embeddings, frequencies with λ < L / high_freq_factor are kept, those with
λ > L / low_freq_factor are divided by ``factor``, and those between are interpolated,
f' = (1 - s) f / factor + s f with s = (L / λ - low_freq_factor) / (high_freq_factor - low_freq_factor).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LLAMA3_KEYS", "REFUSED_TYPES", "TYPES", "scaling_problems"]

TYPES = ("llama3",)
"""Scaling types tessera computes."""

REFUSED_TYPES = ("linear", "dynamic", "yarn", "longrope", "proportional")
"""The other types transformers 5 computes (its ``ROPE_INIT_FUNCTIONS``): refused by name, never approximated."""

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The keys of a llama3 scaling, each required, besides ``type``."""


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def scaling_problems(scaling: dict[str, Any], where: str = "model.rope_scaling") -> list[tuple[str, str]]:
    """(problem, fix) for everything wrong with a scaling table ``where`` names; empty when tessera computes it.

    factor > 0 (below 1 shortens wavelengths, which transformers computes too, with a warning),
    0 < low_freq_factor < high_freq_factor (the interpolation divides by their difference; equal factors leave
    no band to interpolate), original_max_position_embeddings a positive integer."""
    kind = scaling.get("type")
    if kind not in TYPES:
        why = " is not implemented by tessera" if kind in REFUSED_TYPES else " is unknown"
        if kind is None:
            return [(f"{where} has no type", f'add type = "llama3" to {where}, or leave {where} unset')]
        return [
            (
                f"{where}.type = {kind!r}{why}",
                f'use type = "llama3", or leave {where} unset for unscaled RoPE',
            )
        ]
    out = []
    unknown = sorted(set(scaling) - {"type", *LLAMA3_KEYS})
    if unknown:
        out.append(
            (
                f"{where} has unknown key(s) {unknown}",
                f"remove them; a llama3 scaling has {', '.join(LLAMA3_KEYS)}",
            )
        )
    missing = [k for k in LLAMA3_KEYS if k not in scaling]
    if missing:
        example = "factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, original_max_position_embeddings = 8192"
        out.append(
            (f"{where} lacks {', '.join(missing)}", f"give every llama3 key, e.g. {example} (Llama 3.1)")
        )
    bad = [k for k in LLAMA3_KEYS if k in scaling and not _number(scaling[k])]
    out += [
        (f"{where}.{k} = {scaling[k]!r} is not a finite number", f"set {where}.{k} to a number") for k in bad
    ]
    if missing or bad:
        return out
    factor, low, high, original = (scaling[k] for k in LLAMA3_KEYS)
    if factor <= 0:
        out.append((f"{where}.factor = {factor!r} must be > 0", f"set {where}.factor > 0 (Llama 3.1: 8.0)"))
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
