"""One attention mask per micro-batch and kind, shared by every layer (docs/memory.md, "Attention masks: one per
micro-batch"): the storages autograd saves for backward of a 4-layer model with document masking hold one
[b, 1, s, s] mask, not one per layer. SDPA converts a boolean mask to the compute dtype on every call and saves
that copy (4 storages before this change); given `Documents.bias`, the additive mask in its own dtype, it saves
the same tensor by reference in every layer. Without documents Gemma 3's local layers share one [s, s] band the
same way (`AttentionMasks.bias`; each cut its own boolean band before, one saved copy per local layer)."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ModelConfig
from tessera.model import documents
from tessera.model.build import build_model
from tessera.model.documents import AttentionMasks, Documents, additive_mask, band_mask, document_positions
from tessera.model.sizes import SIZES
from tessera.parallel.checkpointing import apply_checkpointing
from tessera.parallel.precision import autocast

EOT = 0
torch.set_num_threads(1)


def _mask_storages(
    name: str, checkpointing: str = "none", dtype: str = "fp32", documents: bool = True, **overrides: object
) -> dict[int, torch.dtype]:
    """The distinct storages of the masks a forward of a 4-layer ``name`` (with documents unless told) saves for
    backward, with their dtypes: the saved tensors of shape [b, 1, s, s] (documents) or [s, s] (a band without
    documents) that require no gradient, which no other saved tensor is."""
    cfg = ModelConfig(**{**SIZES[name], "n_layers": 4, **overrides})
    model = build_model(cfg, seed=0)
    apply_checkpointing(model, checkpointing)
    s = cfg.seq_len
    tokens = torch.randint(1, cfg.vocab_size, (2, s), generator=torch.Generator().manual_seed(0))
    tokens[:, s // 3] = EOT  # two documents per sequence
    tokens[1, s // 2] = EOT  # a third in the second
    found: dict[int, torch.dtype] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        square = tuple(t.shape[-2:]) == (s, s) and (t.dim() == 2 or (t.dim() == 4 and t.shape[1] == 1))
        if square and not t.requires_grad:  # a [s, s] weight (d_model = s) or its cast requires grad
            found[t.untyped_storage()._cdata] = t.dtype
        return t

    positions = document_positions(tokens, EOT) if documents else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(dtype, tokens.device):
        loss = model(tokens, tokens, positions=positions)
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


GEMMA3_LOCAL = {"sliding_window_pattern": 4}
"""gemma3-tiny at 4 layers, pattern 4: layers 0-2 local (window 4 < s = 32), layer 3 global."""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gemma3_local_layers_share_one_band_without_documents(dtype: str) -> None:
    """Without documents the three local layers' SDPA keep one additive [s, s] band in the compute dtype (each
    kept its own cast of a boolean band before: three storages), and the global layer none (is_causal)."""
    found = _mask_storages("gemma3-tiny", dtype=dtype, documents=False, **GEMMA3_LOCAL)
    assert list(found.values()) == [torch.float32 if dtype == "fp32" else torch.bfloat16]


@pytest.mark.parametrize("checkpointing", ["selective", "full"])
def test_recomputed_gemma3_keeps_no_band_without_documents(checkpointing: str) -> None:
    """Selective recomputation's cores cut their band themselves, again in backward, and keep none (a shared band
    would be kept as every checkpointed core's input); full recomputation keeps only the blocks' inputs."""
    assert _mask_storages("gemma3-tiny", checkpointing, "bf16", documents=False, **GEMMA3_LOCAL) == {}


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_band_is_built_once_per_forward_and_replay(
    checkpointing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The band's additive form is made once per micro-batch forward for all three local layers, and under full
    recomputation once more for their replays (the model drops it after the forward, `AttentionMasks.release`)."""
    made = []

    def counted(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        made.append(tuple(mask.shape))
        return additive_mask(mask, dtype)

    monkeypatch.setattr(documents, "additive_mask", counted)
    _mask_storages("gemma3-tiny", checkpointing, "bf16", documents=False, **GEMMA3_LOCAL)
    s = SIZES["gemma3-tiny"]["seq_len"]
    assert made == [(s, s)] * (2 if checkpointing == "full" else 1)


def test_masks_without_documents_hold_the_band_until_released() -> None:
    """`AttentionMasks`: no mask for global layers (causal: SDPA's is_causal), for a window the band in additive
    form (0 exactly where `band_mask` lets a query attend), one tensor per kind until `release`."""
    masks, cpu = AttentionMasks(), torch.device("cpu")
    assert masks.bias(None, torch.bfloat16, 7, 7, cpu) is None
    band = masks.bias(3, torch.bfloat16, 7, 7, cpu)
    assert band.dtype == torch.bfloat16 and band.shape == (7, 7)
    assert torch.equal(band == 0, band_mask(7, 7, 3)) and bool(
        (band[~band_mask(7, 7, 3)] == float("-inf")).all()
    )
    assert masks.bias(3, torch.bfloat16, 7, 7, cpu) is band
    masks.release()
    assert not masks._biases and masks.bias(3, torch.bfloat16, 7, 7, cpu) is not band


def test_capped_attention_saves_no_mask() -> None:
    """Gemma 2's written-out soft-capped attention adds the additive mask (the add saves nothing), where
    masked_fill(~mask) kept an inverted boolean mask per layer; with and without documents."""
    assert _mask_storages("gemma2-tiny") == {}
    assert _mask_storages("gemma2-tiny", dtype="bf16") == {}
    assert _mask_storages("gemma2-tiny", dtype="bf16", documents=False) == {}


def test_full_recomputation_releases_the_masks() -> None:
    """The forward drops the masks it built (`Documents.release`): under full recomputation each block's
    checkpoint keeps the documents object until backward, which must not keep a mask per micro-batch alive."""
    docs = Documents(document_positions(torch.tensor([[3, EOT, 4, 5, EOT, 6]]), EOT))
    first = docs.bias(None, torch.float32, 6, 6, torch.device("cpu"))
    assert (
        docs.bias(None, torch.float32, 6, 6, torch.device("cpu")) is first
    )  # one per kind while the forward runs
    docs.release()
    assert docs._mask is None and not docs._biases


def test_bias_equals_the_boolean_mask_with_its_band() -> None:
    """The additive form is 0 exactly where the boolean mask (and the band, for a window) lets a query attend."""
    positions = document_positions(torch.tensor([[3, 1, 2, 4, EOT, 6, 7, 8, 9, EOT, 5]]), EOT)
    docs = Documents(positions)
    s = positions.shape[1]
    back = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    for window, allowed in ((None, docs.mask), (3, docs.mask & (back < 3))):
        bias = docs.bias(window, torch.bfloat16, s, s, torch.device("cpu"))
        assert bias.dtype == torch.bfloat16 and bias.shape == (1, 1, s, s)
        assert torch.equal(bias == 0, allowed) and bool((bias[~allowed] == float("-inf")).all())
