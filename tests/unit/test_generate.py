"""`generate`: the KV cache computes what the uncached model computes; top-p keeps the nucleus; the CLI rejects
unknown flags of generate, plot, export, schedule and prepare.

Tolerance for cached vs uncached logits: the same fp32 arithmetic with the attention over a different number of
queries (one new token vs the whole context), so rounding only (measured ~1e-7); 1e-5 relative is stated.
"""

from __future__ import annotations

import pytest
import torch

from tessera.cli import main
from tessera.config import from_dict
from tessera.model.build import _nucleus, build_model, generate
from tessera.model.layers import KVCache


def _model(size: str):
    torch.manual_seed(0)
    cfg = from_dict({"model": {"size": size, "seq_len": 16}}).model
    return build_model(cfg).eval(), cfg


@pytest.mark.parametrize("size", ["gpt2-tiny", "llama-tiny"])
def test_cached_decoding_matches_the_full_forward(size: str) -> None:
    model, cfg = _model(size)
    tokens = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = KVCache(cfg.n_layers)
    with torch.no_grad():
        model(tokens[:, :3], cache=cache)  # prefill three positions, then one token at a time
        for t in range(3, tokens.shape[1]):
            step = model(tokens[:, t : t + 1], cache=cache)[:, -1]
            torch.testing.assert_close(step, model(tokens[:, : t + 1])[:, -1], rtol=1e-5, atol=1e-6)
    assert cache.length == tokens.shape[1]


@pytest.mark.parametrize("size", ["gpt2-tiny", "llama-tiny"])
def test_greedy_generation_is_the_same_with_and_without_the_cache(size: str) -> None:
    model, cfg = _model(size)
    prompt = torch.randint(0, cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(2))
    # 20 new tokens run past seq_len = 16: the cached path hands over to the sliding window
    cached = generate(model, prompt, 20, temperature=0)
    plain = generate(model, prompt, 20, temperature=0, kv_cache=False)
    assert torch.equal(cached, plain)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert torch.equal(_nucleus(probs, 0.7), torch.tensor([[0.0, 0.5, 0.0, 0.3]]))
    assert torch.equal(_nucleus(probs, 0.81), torch.tensor([[0.0, 0.5, 0.15, 0.3]]))
    assert torch.equal(_nucleus(probs, 0.01), torch.tensor([[0.0, 0.5, 0.0, 0.0]]))  # the top one always


def test_a_tiny_top_p_samples_the_most_likely_token() -> None:
    model, cfg = _model("llama-tiny")
    prompt = torch.randint(0, cfg.vocab_size, (3, 4), generator=torch.Generator().manual_seed(3))
    sampled = generate(
        model, prompt, 6, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(sampled, generate(model, prompt, 6, temperature=0))
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 1, top_p=1.5)


UNKNOWN_FLAG_COMMANDS = [
    ["generate", "runs/x"],
    ["plot", "runs/x"],
    ["export", "runs/x"],
    ["schedule", "show", "gpipe", "--pp", "2", "--microbatches", "2"],
    ["prepare", "texts", "--out", "tokens.bin"],
]


@pytest.mark.parametrize("command", UNKNOWN_FLAG_COMMANDS)
def test_unknown_flags_are_rejected(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--bogus", "1"]) == 2
    assert "unrecognised arguments ['--bogus', '1']" in capsys.readouterr().err


def test_bad_top_p_is_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "runs/x", "--top-p", "0"]) == 2
    assert "--top-p 0.0 must be in (0, 1]" in capsys.readouterr().err
