"""Loss masks (data.loss_mask): what `prepare` writes for prompt/completion records, how a token file's mask is
checked, the masked loss, and the one normalizer (the global batch's target count) that makes the step's
gradient independent of how the batch is cut into micro-batches."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tessera.config import from_dict
from tessera.errors import DataError
from tessera.execution import violations
from tessera.model.build import build_model
from tessera.model.layers import TransformerLM
from tessera.model.targets import IGNORE_INDEX
from tessera.parallel.tensor_1d import vocab_parallel_cross_entropy
from tessera.train.data import TokenDataset, get_batch, mask_path, prepare, target_count, window_start
from tessera.train.metrics import read_metrics
from tessera.train.trainer import train

SUM_ORDER_RTOL, SUM_ORDER_ATOL = 1e-5, 1e-7
"""fp32 gradients of one masked batch summed in another order (4 micro-batches or 1, or by hand): tighter than
the distributed tests' 1e-4 / 1e-5, as no collective reorders anything here."""

RECORDS = [
    {"prompt": "ab", "completion": "cd"},  # a b | c d EOT
    {"prompt": "xyz", "completion": ""},  # x y z | EOT: an empty completion trains only its end
    {"prompt": "", "completion": "q"},  # | q EOT
]


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _prepare_pairs(tmp_path: Path, records: list = RECORDS, **kwargs) -> Path:
    src = _jsonl(tmp_path / "sft.jsonl", records)
    out = tmp_path / "sft.bin"
    prepare([src], out, "byte", prompt_key="prompt", completion_key="completion", workers=1, **kwargs)
    return out


def test_prepare_writes_the_mask_of_each_completion_and_its_end(tmp_path):
    out = _prepare_pairs(tmp_path)
    tokens = np.fromfile(out, dtype="<u2")
    mask = np.fromfile(mask_path(out), dtype=np.uint8)
    assert bytes(tokens.astype(np.uint8)) == b"abcd\0xyz\0q\0"
    # hand-checked: the prompt's bytes 0, the completion's and the end-of-text token after them 1
    assert mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["loss_mask"]["n_targets"] == 6 and meta["loss_mask"]["file"] == "sft.mask"
    data = TokenDataset(out)
    data.verify()
    assert data.has_mask


def test_prepare_refuses_half_a_pair_and_names_bad_records(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", [*RECORDS, {"prompt": "no completion"}])
    with pytest.raises(DataError, match="--completion-key too"):
        prepare([src], tmp_path / "x.bin", prompt_key="prompt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = prepare([src], tmp_path / "x.bin", prompt_key="prompt", completion_key="completion", workers=1)
    (message,) = [str(w.message) for w in caught]
    assert (
        "a.jsonl:4" in message and "missing field 'completion'" in message and "--completion-key" in message
    )
    assert meta["n_bad_records"] == 1 and meta["loss_mask"]["n_targets"] == 6
    with pytest.raises(DataError, match=r"a\.jsonl:4: missing field 'completion'"):
        prepare([src], tmp_path / "y.bin", prompt_key="prompt", completion_key="completion", strict=True)
    text = tmp_path / "notes.txt"
    text.write_text("plain text")
    with pytest.raises(DataError, match="no text found"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare([text], tmp_path / "z.bin", prompt_key="prompt", completion_key="completion", workers=1)
    assert any("no prompt and completion fields" in str(w.message) for w in caught)


def test_prepare_without_pairs_drops_a_stale_mask(tmp_path):
    out = _prepare_pairs(tmp_path)
    prepare([_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])], out, workers=1)
    assert not mask_path(out).exists() and not TokenDataset(out).has_mask


def test_a_mask_that_does_not_match_its_token_file_is_refused(tmp_path):
    out = _prepare_pairs(tmp_path)
    raw = {"model": {"size": "gpt2-tiny", "seq_len": 4}, "data": {"path": str(out), "loss_mask": True}}
    assert [str(v) for v in violations(from_dict(raw), 1)] == []
    mask = mask_path(out)
    good = mask.read_bytes()
    mask.write_bytes(good[:-1])  # one byte short
    with pytest.raises(DataError, match=r"has 10 bytes but token file .* holds 11 tokens"):
        TokenDataset(out)
    (problem,) = [str(v) for v in violations(from_dict(raw), 1)]
    assert "data.loss_mask" in problem and "10 bytes for 11 tokens" in problem
    mask.write_bytes(bytes([1 - good[0]]) + good[1:])  # same length, another mask
    with pytest.raises(DataError, match="does not match the checksum"):
        TokenDataset(out).verify()
    mask.unlink()
    with pytest.raises(DataError, match="is missing"):
        TokenDataset(out)


def test_loss_mask_needs_a_mask_in_every_file(tmp_path):
    plain = tmp_path / "plain.bin"
    prepare([_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}] * 3)], plain, workers=1)
    masked = _prepare_pairs(tmp_path)
    raw = {
        "model": {"size": "gpt2-tiny", "seq_len": 4},
        "data": {"path": [str(masked), str(plain)], "loss_mask": True},
    }
    (problem,) = [str(v) for v in violations(from_dict(raw), 1)]
    assert "plain.bin has no loss mask" in problem and "--prompt-key" in problem
    with pytest.raises(DataError, match=r"has no loss mask.*data.loss_mask = false"):
        TokenDataset(plain).target_mask(0, 4, 0)
    raw["data"] = {"loss_mask": True}  # the default corpus
    assert any("default corpus has no loss mask" in str(v) for v in violations(from_dict(raw), 1))


def test_batches_ignore_the_targets_the_mask_leaves_out(tmp_path):
    out = _prepare_pairs(tmp_path)
    data, s, seed, batch = TokenDataset(out), 4, 5, 4
    mask = np.fromfile(mask_path(out), dtype=np.uint8)
    counted = 0
    for micro in range(2):
        _, y = get_batch(data, 0, micro, 0, 1, 2, batch, s, seed, loss_mask=True)
        _, plain = get_batch(data, 0, micro, 0, 1, 2, batch, s, seed)
        for row in range(2):
            index = micro * 2 + row
            start = window_start(index, seed, data.n_tokens - s)
            keep = mask[start + 1 : start + s + 1] == 1  # the mask of the target tokens
            assert torch.equal(y[row], plain[row].masked_fill(torch.from_numpy(~keep), IGNORE_INDEX))
            counted += int(keep.sum())
    assert target_count(data, 0, batch, s, seed) == counted


def test_summed_loss_is_the_masked_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, :3] = IGNORE_INDEX
    targets[1, 4] = IGNORE_INDEX
    keep = targets != IGNORE_INDEX
    # by hand: -log softmax at each kept target, summed
    logp = torch.log_softmax(logits, dim=-1)
    by_hand = -sum(logp[b, t, targets[b, t]] for b in range(2) for t in range(5) if keep[b, t])
    torch.testing.assert_close(TransformerLM.loss(logits, targets, "sum"), by_hand)
    torch.testing.assert_close(TransformerLM.loss(logits, targets, "sum") / keep.sum(), by_hand / 6)


def test_vocab_parallel_sum_matches_the_plain_sum_with_padding():
    """The 1D vocabulary-parallel loss (here one rank with padded columns, which takes its autograd path) sums
    over kept targets and gives the same gradient as ``F.cross_entropy(reduction="sum")``."""
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 13)  # 13 columns, a vocabulary of 11: two padding columns
    targets = torch.randint(0, 11, (2, 6))
    targets[:, ::2] = IGNORE_INDEX
    a = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(a, targets, None, 0, 11, "sum")
    loss.backward()
    b = logits[..., :11].clone().requires_grad_()
    ref = F.cross_entropy(b.flatten(0, 1), targets.flatten(), reduction="sum")
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(a.grad[..., :11], b.grad)
    assert a.grad[..., 11:].abs().max() == 0 and a.grad[:, ::2].abs().max() == 0  # ignored rows: no gradient


# --- the normalizer: the global batch's target count, not each micro-batch's ---------------------------------


def _config(token_file: Path, run_dir: Path, micro_batch: int, accumulation: str = "layered") -> dict:
    return {
        "model": {"size": "gpt2-tiny", "n_layers": 1, "seq_len": 8},
        "parallel": {"accumulation": accumulation},
        "train": {"steps": 1, "global_batch": 4, "micro_batch": micro_batch, "warmup_steps": 0},
        "data": {"path": str(token_file), "loss_mask": True},
        "checkpoint": {"every": 0, "resume": False},
        "log": {"run_dir": str(run_dir), "progress": False, "tensorboard": False},
    }


def _grads(raw: dict, weights: dict | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """Step 0's loss and gradients; ``weights`` receives the parameters they were computed at."""
    out: dict[str, torch.Tensor] = {}

    def hook(step: int, model: torch.nn.Module) -> None:
        out.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if weights is not None:
            weights.update({n: t.clone() for n, t in model.state_dict().items()})

    return train(from_dict(raw), hook).losses[0], out


@pytest.mark.parametrize("accumulation", ["layered", "depth_first"])  # the schedule runtime; the direct loop
def test_micro_batches_with_different_target_counts_give_the_global_batch_mean(tmp_path, accumulation):
    """Four samples in 4 micro-batches (accumulated) and in one: the same loss and gradient, both equal to the
    masked mean over the whole batch computed by hand here. The micro-batches hold different numbers of targets,
    so the per-micro-batch mean (what transformers did before v4.46) gives another gradient: checked too."""
    records = [{"prompt": "p" * (3 + i % 5), "completion": "c" * (1 + 3 * (i % 3))} for i in range(60)]
    out = _prepare_pairs(tmp_path, records)
    initial: dict[str, torch.Tensor] = {}
    one_loss, one = _grads(_config(out, tmp_path / "one", 4), initial)
    four_loss, four = _grads(_config(out, tmp_path / "four", 1, accumulation))
    assert one_loss == pytest.approx(four_loss, rel=1e-6)
    for n, g in one.items():
        torch.testing.assert_close(four[n], g, rtol=SUM_ORDER_RTOL, atol=SUM_ORDER_ATOL, msg=n)

    # by hand, from the initial model: the summed masked loss of the 4 samples over their target count
    cfg = from_dict(_config(out, tmp_path / "hand", 4))

    data = TokenDataset(out)
    x, y = get_batch(data, 0, 0, 0, 1, 4, 4, 8, cfg.train.seed, loss_mask=True)
    counts = (y != IGNORE_INDEX).sum(dim=1)
    assert len(set(counts.tolist())) > 1  # micro-batches of one sample each hold different target counts

    def grads_of(loss_fn) -> dict[str, torch.Tensor]:
        model = build_model(cfg.model, seed=0)
        model.load_state_dict(initial)  # the weights the trainer's step 0 ran at
        loss_fn(model).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    hand_loss = [0.0]

    def whole_batch(m: torch.nn.Module) -> torch.Tensor:
        loss = m(x, y, reduction="sum") / counts.sum()
        hand_loss[0] = loss.item()
        return loss

    hand = grads_of(whole_batch)
    assert one_loss == pytest.approx(hand_loss[0], rel=1e-6)
    per_micro = grads_of(
        lambda m: sum(m(x[i : i + 1], y[i : i + 1], reduction="sum") / counts[i] for i in range(4)) / 4
    )
    for n, g in one.items():
        torch.testing.assert_close(hand[n], g, rtol=SUM_ORDER_RTOL, atol=SUM_ORDER_ATOL, msg=n)
    assert any(not torch.allclose(per_micro[n], g, rtol=1e-3, atol=1e-6) for n, g in one.items())


def test_a_global_batch_without_targets_is_skipped(tmp_path, capsys):
    """Long prompts, empty completions: most one-sample windows of 8 hold no target (only each record's end of
    text is one). Those steps train nothing and say so; the others train on their targets."""
    records = [{"prompt": "p" * 40, "completion": ""} for _ in range(40)]
    out = _prepare_pairs(tmp_path, records)
    raw = _config(out, tmp_path / "run", 1)
    raw["train"].update(steps=12, global_batch=1)
    raw["log"]["every"] = 100  # the no-target steps are logged whatever log.every says
    cfg = from_dict(raw)
    counts = [target_count(TokenDataset(out), k, 1, 8, cfg.train.seed) for k in range(12)]
    assert 0 in counts and any(counts)  # both kinds of step
    losses = train(cfg).losses
    assert sorted(losses) == [k for k, n in enumerate(counts) if n]
    records = {m["step"]: m for m in read_metrics(tmp_path / "run")}
    for k, n in enumerate(counts):
        if n == 0:
            assert records[k]["target_tokens"] == 0 and "loss" not in records[k]
    assert f"step {counts.index(0)}'s global batch holds no target token" in capsys.readouterr().err


def test_prepare_reads_prompt_and_completion_columns_of_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.table({"prompt": ["ab", "xyz"], "completion": ["cd", None]})  # row 2: a missing completion
    pq.write_table(table, tmp_path / "sft.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = prepare(
            [tmp_path / "sft.parquet"], tmp_path / "p.bin", prompt_key="prompt", completion_key="completion"
        )
    assert "sft.parquet:row 2: column 'completion' is NoneType" in str(caught[0].message)
    assert np.fromfile(mask_path(tmp_path / "p.bin"), dtype=np.uint8).tolist() == [0, 0, 1, 1, 1]
    assert meta["n_bad_records"] == 1
    with pytest.raises(DataError, match=r"no column 'answer'.*--completion-key"):
        prepare([tmp_path / "sft.parquet"], tmp_path / "q.bin", prompt_key="prompt", completion_key="answer")
