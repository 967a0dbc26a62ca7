"""Document masking (data.document_mask): positions per document, the block-diagonal causal mask, and a packed
sequence giving each document the logits it gets alone, for every family and checkpointing mode."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from tessera.config import ModelConfig, from_dict
from tessera.errors import DataError
from tessera.execution import violations
from tessera.model.build import build_model
from tessera.model.documents import Documents, document_positions
from tessera.model.sizes import SIZES
from tessera.parallel.checkpointing import apply_checkpointing
from tessera.train.data import Blend, TokenDataset, prepare

# fp32: the packed run and the lone runs do the same maths over the same keys, with SDPA's masked kernel
# instead of its causal one, and softmax sums over extra zeros (masked keys)
LOGITS_TOL = 1e-5

EOT = 0
torch.set_num_threads(1)


def test_positions_restart_after_each_end_of_text():
    tokens = torch.tensor([[5, 6, EOT, 7, EOT, EOT, 8, 9], [EOT, 1, 2, 3, 4, 5, 6, 7]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]])
    assert torch.equal(document_positions(tokens, EOT), expected)


def test_mask_is_causal_within_each_document():
    positions = document_positions(torch.tensor([[3, EOT, 4, 5, EOT, 6]]), EOT)  # documents {0,1} {2,3,4} {5}
    doc = [0, 0, 1, 1, 1, 2]
    mask = Documents(positions).mask
    assert mask.shape == (1, 1, 6, 6)
    for i in range(6):
        for j in range(6):
            assert bool(mask[0, 0, i, j]) == (j <= i and doc[i] == doc[j]), (i, j)


def _three_documents(vocab: int, lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """Documents of the given lengths, each ending with EOT and holding no other EOT."""
    g = torch.Generator().manual_seed(1)
    return [torch.cat((torch.randint(1, vocab, (n - 1,), generator=g), torch.tensor([EOT]))) for n in lengths]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_packed_documents_match_each_document_alone(name, checkpointing):
    cfg = ModelConfig(**SIZES[name])
    model = build_model(cfg, seed=0)
    apply_checkpointing(model, checkpointing)
    docs = _three_documents(cfg.vocab_size, (cfg.seq_len // 4, cfg.seq_len // 2, cfg.seq_len // 4))
    packed = torch.cat(docs).unsqueeze(0)  # packed: [1, s]
    assert packed.shape[1] == cfg.seq_len
    logits = model(packed, positions=document_positions(packed, EOT))  # logits: [1, s, V]
    start = 0
    for doc in docs:
        alone = model(doc.unsqueeze(0))  # alone: [1, n, V]
        got = logits[:, start : start + len(doc)]
        assert torch.allclose(got, alone, atol=LOGITS_TOL, rtol=0), (start, (got - alone).abs().max())
        start += len(doc)
    # and without the mask the later documents do see the earlier ones (the test can fail)
    unmasked = model(packed)
    assert not torch.allclose(unmasked[:, docs[0].numel() :], logits[:, docs[0].numel() :], atol=1e-3)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_packed_gradients_match_each_document_alone(name):
    """The loss of a packed sequence (mean over its tokens) has the gradient of the lone documents' losses
    weighted by their share of the tokens."""
    cfg = ModelConfig(**SIZES[name])
    docs = _three_documents(cfg.vocab_size, (cfg.seq_len // 2, cfg.seq_len // 4, cfg.seq_len // 4 + 1))
    window = torch.cat(docs)[: cfg.seq_len + 1]
    x, y = window[:-1].unsqueeze(0), window[1:].unsqueeze(0)  # x, y: [1, s]
    packed = build_model(cfg, seed=0)
    packed(x, y, positions=document_positions(x, EOT)).backward()
    alone = build_model(cfg, seed=0)
    starts = [0, len(docs[0]), len(docs[0]) + len(docs[1]), cfg.seq_len]
    for a, b in itertools.pairwise(starts):
        loss = alone(x[:, a:b], y[:, a:b]) * (b - a) / cfg.seq_len
        loss.backward()
    for (pname, p), q in zip(packed.named_parameters(), alone.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=LOGITS_TOL, rtol=1e-4), pname


def test_document_mask_refuses_a_kv_cache():
    from tessera.model.layers import KVCache

    cfg = ModelConfig(**SIZES["llama-tiny"])
    model = build_model(cfg, seed=0)
    tokens = torch.tensor([[1, 2, EOT, 3]])
    with pytest.raises(ValueError, match="decode without it"):
        model(tokens, cache=KVCache(cfg.n_layers), positions=document_positions(tokens, EOT))


# --- the config key: documents need a known end-of-text token -------------------------------------------------


def _token_file(tmp_path: Path, name: str, eot: int | None) -> Path:
    """A byte token file whose metadata records ``eot`` (None: as a file prepared without one)."""
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": "ab" * (5 + i % 4)}) + "\n" for i in range(30)))
    prepare([src], tmp_path / f"{name}.bin", workers=1)
    meta_path = tmp_path / f"{name}.json"
    meta = json.loads(meta_path.read_text())
    meta["eot"] = eot
    meta_path.write_text(json.dumps(meta))
    return tmp_path / f"{name}.bin"


def _violations(paths: list[Path]) -> list[str]:
    raw = {"model": {"size": "llama-tiny"}, "data": {"path": [str(p) for p in paths], "document_mask": True}}
    return [str(v) for v in violations(from_dict(raw), 1)]


def test_document_mask_needs_an_end_of_text_token(tmp_path):
    good = _token_file(tmp_path, "good", EOT)
    assert _violations([good]) == []
    assert TokenDataset(good).eot == EOT
    bad = _token_file(tmp_path, "bad", None)
    (problem,) = _violations([good, bad])
    assert "data.document_mask" in problem and "records no end-of-text token" in problem
    assert "tessera prepare" in problem and "--eot-token" in problem  # the fix
    with pytest.raises(DataError, match="document_mask = false"):
        TokenDataset(bad).eot  # noqa: B018 (the trainer's check before the first step)


def test_document_mask_refuses_files_ending_documents_differently(tmp_path):
    files = [_token_file(tmp_path, "a", EOT), _token_file(tmp_path, "b", 10)]
    (problem,) = _violations(files)
    assert "different tokens" in problem and "same tokenizer" in problem
    with pytest.raises(DataError, match="different tokens"):
        Blend([TokenDataset(f) for f in files], [1.0, 1.0]).eot  # noqa: B018
