"""Hugging Face in and out at parallel layouts: ``model.init = "hf:DIR"`` loads a random-weight transformers model
into dp, ZeRO-3, 1D+SP, 2D, pipeline and pipeline×tensor layouts, and ``tessera export --format hf`` of the
trained run loads in transformers.

Per layout: the first step's loss (computed before any update, from the imported weights) equals transformers'
loss on the same step-0 batch; after training, the HF export loads with `from_pretrained` and its logits equal
tessera's (the plain model loaded from the tessera export of the same checkpoint), and importing the HF export
gives bit-for-bit the tessera export's weights.

Tolerances: relative 1e-5 (the issue's bound) for loss and logits; the arithmetic is the same fp32 in another
order (measured ~1e-7). The HF weights are drawn with std 0.2 so logits are of order one and a mis-loaded shard
changes the loss by far more than that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tessera.config import from_dict
from tessera.hf.weights import HFCheckpoint, load_init
from tessera.model.build import build_model
from tessera.train import checkpoint as ckpt
from tessera.train.export import export_weights
from tessera.train.trainer import TrainingRun, train
from tests.distributed.conftest import trainer_config
from tests.harness import run_distributed
from tests.hf_models import VOCAB, make_hf, rel_err

RTOL = 1e-5
STEPS = 2

LAYOUTS = {  # name: (world size, HF model kind, parallel section)
    "dp2": (2, "gpt2", {"data": 2}),
    "dp2_zero3": (2, "llama", {"data": 2, "zero": 3}),
    "tp1d_2_sp": (2, "gpt2_untied", {"tensor": 2, "sequence_parallel": True}),
    "tp2x2": (4, "llama", {"tensor": "2x2"}),
    "pp2_1f1b_tied": (2, "gpt2", {"pipeline": 2, "schedule": "1f1b"}),
    "pp2_tp1d_2_tied": (4, "llama_tied", {"pipeline": 2, "tensor": 2}),
    "qwen2_tp1d_2_sp": (2, "qwen2", {"tensor": 2, "sequence_parallel": True}),
    "llama3_pp2_tp1d_2": (4, "llama3", {"pipeline": 2, "tensor": 2}),  # Llama 3.1's RoPE scaling
    "mistral_tp2x2": (4, "mistral", {"tensor": "2x2"}),  # exported back as Mistral
    "qwen3_tp2x2": (4, "qwen3", {"tensor": "2x2"}),  # q/k norms read whole by every grid rank, exported once
    # head_dim 16 / 12 ≠ hidden / heads = 8 (Qwen3-0.6B's, Mistral NeMo's kind): q_proj / o_proj sliced 2D and 1D
    "qwen3_hd_tp2x2": (4, "qwen3_hd", {"tensor": "2x2"}),
    "llama_hd_tp1d_2_sp": (2, "llama_hd", {"tensor": 2, "sequence_parallel": True}),
    # Gemma 2 (soft-caps, four (1 + w) norms per block, scaled embedding, GeGLU; exported back as Gemma 2), every
    # gradient against one process: tests/distributed/test_gemma2.py
    "gemma2_tp1d_2_sp": (2, "gemma2_tied", {"tensor": 2, "sequence_parallel": True}),
    "gemma2_qpas_tp2x2": (4, "gemma2_qpas", {"tensor": "2x2"}),  # query_pre_attn_scalar ≠ head_dim, untied
    "gemma2_pp2_tied": (2, "gemma2_tied", {"pipeline": 2, "schedule": "1f1b"}),
    "gemma2_dp2_zero3": (2, "gemma2_nocap_tied", {"data": 2, "zero": 3}),
    # Gemma 3 (windows 4 / 5 narrower than the context, local and global RoPE bases, (1 + w) q/k norms), every
    # gradient against one process: tests/distributed/test_gemma3.py
    "gemma3_tp1d_2_sp": (2, "gemma3_tied", {"tensor": 2, "sequence_parallel": True}),
    "gemma3_qpas_tp2x2": (4, "gemma3_qpas", {"tensor": "2x2"}),
    "gemma3_qpas_pp2": (2, "gemma3_qpas", {"pipeline": 2, "schedule": "1f1b"}),  # layers L, L | G, L
}


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    kinds = {kind for _, kind, _ in LAYOUTS.values()}
    for kind in kinds:
        make_hf(root / kind, kind)
    return {kind: root / kind for kind in kinds}


def _export(run_dir: Path, hf_out: Path) -> Path | None:
    """Export the run as tessera weights and as an HF folder; the tessera export's folder (on rank 0)."""
    path = export_weights(run_dir)
    export_weights(run_dir, fmt="hf", out=hf_out)
    return path


def _train_and_export(rank: int, world: int, raw: dict, hf_out: str) -> tuple[dict[int, float], str | None]:
    """(losses, the tessera export folder on rank 0): train, then export if the checkpoint holds shards (a
    replicated one is exported by one process, as `tessera export` does)."""
    run_dir = Path(raw["log"]["run_dir"])
    losses = train(from_dict(raw)).losses
    if not ckpt.is_sharded(ckpt.checkpoint_meta(run_dir / "checkpoints")):
        return losses, None
    path = _export(run_dir, Path(hf_out))
    return losses, str(path) if path is not None else None


def _hf_step0_loss(raw: dict, hf: torch.nn.Module) -> float:
    """transformers' mean loss over the global batch of step 0, as the trainer samples it."""
    single = {**raw, "parallel": {}}
    batches = TrainingRun(from_dict(single), 0, 1).batches(0)
    with torch.no_grad():
        losses = [F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()) for x, y in batches]
    return float(torch.stack(losses).mean())


@pytest.mark.parametrize("name", LAYOUTS)
def test_hf_import_train_export(
    token_file: Path, tmp_path: Path, hf_folders: dict[str, Path], name: str
) -> None:
    import transformers  # here, not at the top: the spawned ranks import this module and do not need it

    world, kind, parallel = LAYOUTS[name]
    model = {"init": f"hf:{hf_folders[kind]}"}
    raw = trainer_config(token_file, tmp_path / "run", model, parallel, steps=STEPS, lr=1e-3)
    losses, exported = run_distributed(_train_and_export, world, raw, str(tmp_path / "out"), timeout=300)[0]
    exported = exported or _export(tmp_path / "run", tmp_path / "out")

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folders[kind]).eval()
    expected = _hf_step0_loss(raw, hf)
    print(f"{name}: step-0 loss {losses[0]:.6f}, transformers {expected:.6f}")
    assert abs(losses[0] - expected) <= RTOL * expected

    cfg = from_dict(raw)
    tessera_model = build_model(cfg.model)
    ckpt.load_model_weights(Path(exported), tessera_model)
    exported_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(exported_hf(tokens).logits, tessera_model.eval()(tokens)) < RTOL
    reimported = load_init(from_dict({**raw, "model": {"init": f"hf:{tmp_path / 'out'}"}}).model)
    trained = dict(tessera_model.named_parameters())
    for n, p in reimported.named_parameters():
        assert torch.equal(p, trained[n]), n


READ_LAYOUTS = {  # name: (world size, parallel section, ranks each parameter is split over)
    "tp2x2": (4, {"tensor": "2x2"}, 4),
    "dp2_pp2_zero3": (4, {"data": 2, "pipeline": 2, "zero": 3}, 4),
}


def _elements_read(rank: int, world: int, raw: dict) -> int:
    """How many elements this rank reads from the HF folder while building its part of the model."""
    read = [0]
    original = HFCheckpoint.__call__

    def counting(self: HFCheckpoint, name: str, slices: tuple | None = None) -> torch.Tensor:
        t = original(self, name, slices)
        read[0] += t.numel()
        return t

    HFCheckpoint.__call__ = counting
    try:
        TrainingRun(from_dict(raw), rank, world)
    finally:
        HFCheckpoint.__call__ = original
    return read[0]


@pytest.mark.parametrize("name", READ_LAYOUTS)
def test_each_rank_reads_only_its_slices(
    token_file: Path, tmp_path: Path, hf_folders: dict[str, Path], name: str
) -> None:
    """A rank reads its 1/n share of the weights, plus at most one parameter's worth where a shard boundary
    cuts through a parameter or a small tensor is replicated; reading the whole model exceeds that bound."""
    world, parallel, n = READ_LAYOUTS[name]
    init = f"hf:{hf_folders['llama']}"
    raw = trainer_config(token_file, tmp_path, {"init": init}, parallel)
    plain = load_init(from_dict(raw).model)
    total = plain.num_params()
    largest = max(p.numel() for p in plain.parameters())
    read = run_distributed(_elements_read, world, raw, timeout=180)
    print(f"{name}: elements read per rank {read} of {total}")
    assert all(0 < r <= total / n + largest for r in read), (read, total / n + largest)
    assert total > total / n + largest  # the bound excludes a full read
