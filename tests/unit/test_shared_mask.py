"""One attention mask per micro-batch and kind, shared by every layer (docs/memory.md, "Attention masks: one per
micro-batch"): the storages autograd saves for backward of a 4-layer model with document masking hold one
[b, 1, s, s] mask, not one per layer. SDPA converts a boolean mask to the compute dtype on every call and saves
that copy (4 storages before this change); given `Documents.bias`, the additive mask in its own dtype, it saves
the same tensor by reference in every layer."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig
from tessera.model.build import build_model
from tessera.model.documents import Documents, document_positions
from tessera.model.sizes import SIZES
from tessera.parallel.checkpointing import apply_checkpointing
from tessera.parallel.precision import autocast

EOT = 0
torch.set_num_threads(1)


def _mask_storages(
    name: str, checkpointing: str = "none", dtype: str = "fp32", **overrides: object
) -> dict[int, torch.dtype]:
    """The distinct storages of the [b, 1, s, s] tensors a forward of a 4-layer ``name`` with documents saves for
    backward (the masks: no other saved tensor has that shape), with their dtypes."""
    cfg = ModelConfig(**{**SIZES[name], "n_layers": 4, **overrides})
    model = build_model(cfg, seed=0)
    apply_checkpointing(model, checkpointing)
    s = cfg.seq_len
    tokens = torch.randint(1, cfg.vocab_size, (2, s), generator=torch.Generator().manual_seed(0))
    tokens[:, s // 3] = EOT  # two documents per sequence
    tokens[1, s // 2] = EOT  # a third in the second
    found: dict[int, torch.dtype] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4 and t.shape[1] == 1 and tuple(t.shape[-2:]) == (s, s):
            found[t.untyped_storage()._cdata] = t.dtype
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(dtype, tokens.device):
        loss = model(tokens, tokens, positions=document_positions(tokens, EOT))
    loss.backward()  # the saved masks are usable: backward runs
    return found


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_four_layers_save_one_document_mask(name: str, checkpointing: str, dtype: str) -> None:
    """Every layer's SDPA (none), or every checkpointed core's inputs (selective), keep the same storage: one
    additive mask in the compute dtype."""
    found = _mask_storages(name, checkpointing, dtype)
    assert list(found.values()) == [torch.float32 if dtype == "fp32" else torch.bfloat16]


def test_gemma3_saves_one_mask_per_kind() -> None:
    """Gemma 3 with documents: the global layers share one mask, the local layers (their band ANDed in) another."""
    found = _mask_storages("gemma3-tiny", dtype="bf16")
    assert list(found.values()) == [torch.bfloat16, torch.bfloat16]


def test_capped_attention_saves_no_mask() -> None:
    """Gemma 2's written-out soft-capped attention adds the additive mask (the add saves nothing), where
    masked_fill(~mask) kept an inverted boolean mask per layer; with and without documents."""
    assert _mask_storages("gemma2-tiny") == {}
    assert _mask_storages("gemma2-tiny", dtype="bf16") == {}


def test_full_recomputation_releases_the_masks() -> None:
    """The forward drops the masks it built (`Documents.release`): under full recomputation each block's
    checkpoint keeps the documents object until backward, which must not keep a mask per micro-batch alive."""
    docs = Documents(document_positions(torch.tensor([[3, EOT, 4, 5, EOT, 6]]), EOT))
    first = docs.bias(None, torch.float32)
    assert docs.bias(None, torch.float32) is first  # one tensor per kind while the forward runs
    docs.release()
    assert docs._mask is None and not docs._biases


def test_bias_equals_the_boolean_mask_with_its_band() -> None:
    """The additive form is 0 exactly where the boolean mask (and the band, for a window) lets a query attend."""
    positions = document_positions(torch.tensor([[3, 1, 2, 4, EOT, 6, 7, 8, 9, EOT, 5]]), EOT)
    docs = Documents(positions)
    s = positions.shape[1]
    back = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    for window, allowed in ((None, docs.mask), (3, docs.mask & (back < 3))):
        bias = docs.bias(window, torch.bfloat16)
        assert bias.dtype == torch.bfloat16 and bias.shape == (1, 1, s, s)
        assert torch.equal(bias == 0, allowed) and bool((bias[~allowed] == float("-inf")).all())
