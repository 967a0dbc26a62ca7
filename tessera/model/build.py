"""Build a model from its config, and sample from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tessera.errors import ConfigError
from tessera.model.gemma2 import Gemma2
from tessera.model.gemma3 import Gemma3
from tessera.model.gpt import GPT
from tessera.model.init import InitSource, draw_seed
from tessera.model.layers import KVCache, TransformerLM
from tessera.model.llama import Llama
from tessera.model.materialize import declare, materialize, replicated_specs
from tessera.model.qwen2 import Qwen2
from tessera.model.qwen3 import Qwen3

if TYPE_CHECKING:
    from collections.abc import Callable

    from tessera.config import ModelConfig

__all__ = ["build_model", "generate", "meta_model"]

_FAMILIES: dict[str, type[TransformerLM]] = {
    cls.plan.name: cls for cls in (GPT, Llama, Qwen2, Qwen3, Gemma2, Gemma3)
}
"""The model class of each family (its declaration: tessera.model.family)."""


def meta_model(cfg: ModelConfig) -> TransformerLM:
    """The GPT or Llama for cfg on the meta device: shapes and counts only, no storage, no initialisation."""
    violations = cfg.check()
    if violations:
        raise ConfigError("invalid model config:\n" + "\n".join(f"  - {v}" for v in violations))
    with torch.device("meta"):
        return _FAMILIES[cfg.family](cfg)


def build_model(cfg: ModelConfig, seed: int | None = None) -> TransformerLM:
    """A freshly initialised GPT or Llama for cfg, on torch's default device (`torch.get_default_device()`).

    Every parameter's values are a pure function of (seed, its name) (tessera.model.init), the same numbers any
    tensor-parallel or pipeline rank draws for its slice. Without ``seed`` one is drawn from the global torch
    RNG, so ``torch.manual_seed(s)`` then ``build_model(cfg)`` is reproducible. Under
    ``with torch.device("meta"):`` the model stays on the meta device, uninitialised (see `meta_model`).
    """
    model = meta_model(cfg)
    seed = draw_seed() if seed is None else seed
    device = torch.get_default_device()
    if device.type == "meta":
        return model
    declare(model, replicated_specs(model), InitSource.for_model(model, seed), device)
    materialize(model)
    return model


@torch.no_grad()
def generate(
    model: TransformerLM,
    tokens: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    top_p: float | None = None,
    kv_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
    stop: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """Sample max_new_tokens continuations of tokens [b, t]; returns [b, t + n], n = max_new_tokens, or fewer
    when every sequence has sampled a token of ``stop`` (a chat model's end of turn; rows that stopped earlier
    go on sampling until then).

    With ``kv_cache`` each step runs the model on the new token only, attending to the cached keys and values
    of the earlier ones; once the text outgrows model.cfg.seq_len (no positions left) and without the cache,
    each step re-runs the model on the last seq_len tokens. temperature <= 0 means greedy (argmax); top_k keeps
    the k most likely tokens, top_p the smallest set of most likely tokens whose probability reaches p (nucleus
    sampling, Holtzman et al. 2020), before sampling. ``on_token(n)`` is called after the n-th new token (a
    progress display). The model's train/eval mode is restored.
    """
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p} must be in (0, 1]")
    was_training = model.training
    model.eval()
    cache = KVCache(model.cfg.n_layers) if kv_cache else None
    stop_ids = torch.tensor(sorted(stop), dtype=tokens.dtype, device=tokens.device)
    stopped = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)  # [b]
    try:
        for n in range(1, max_new_tokens + 1):
            if cache is not None and tokens.shape[1] <= model.cfg.seq_len:
                logits = model(tokens[:, cache.length :], cache=cache)[:, -1, :].float()  # logits: [b, V]
            else:
                context = tokens[:, -model.cfg.seq_len :]  # context: [b, ≤s]
                logits = model(context)[:, -1, :].float()  # logits: [b, V]
            next_token = _pick(logits, temperature, top_k, top_p, generator)  # [b, 1]
            tokens = torch.cat((tokens, next_token), dim=1)  # [b, t+1]
            if on_token is not None:
                on_token(n)
            if stop:
                stopped = stopped | torch.isin(next_token[:, 0], stop_ids)  # stopped: [b]
                if bool(stopped.all()):
                    break
    finally:
        model.train(was_training)
    return tokens


def _pick(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Next token [b, 1] from last-position logits [b, V]."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # kth: [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # probs: [b, V]
    if top_p is not None:
        probs = _nucleus(probs, top_p)
    return torch.multinomial(probs, 1, generator=generator)  # [b, 1]


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [b, V] restricted to the most likely tokens whose mass first reaches top_p (the top one always)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # sorted_probs, order: [b, V]
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # before: [b, V], mass of the more likely tokens
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)  # [b, V], unnormalised is fine
