"""The example configs are valid at the world sizes they are written for (and say what is wrong at others), the
GPU examples fit the device their header names by `tessera memory`, and `tessera dryrun` builds and steps one of
their ranks at that world size.

The dry runs keep everything of the example — model shape, sequence length, micro-batch size, layout, world size,
schedule, ZeRO stage, checkpointing, dtype — except two things, to fit CI (on a loaded 2-core machine a full
llama-8b dry run took over 5 minutes; fake tensors cost about a millisecond per operation, so the time is one
forward, recomputation and backward of every local block per micro-batch):

- one micro-batch per data-parallel rank per step (``train.global_batch`` = micro_batch × data), instead of the
  example's 32 (llama-8b) or 16 (llama-70b): the memory of parameters, gradients and optimizer state and the
  traffic per micro-batch are the example's, the activations held at once by a layered (breadth-first) step are
  one micro-batch's;
- only rank 0 (the first pipeline rank, holding the embedding), not also the last one (the head).

The fine-tune example names a Hugging Face folder and a token file that a user makes; here a tiny random Llama
folder (with max_position_embeddings 512, so the example's seq_len stands) and a byte-token file stand in.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.config import load_config
from tessera.train.data import prepare

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WORLD = {"demo.toml": 2, "llama-8b-8gpu.toml": 8, "llama-70b-64gpu.toml": 64}
DRY_RUN = {  # example: (world size, its data-parallel size × micro_batch: one micro-batch per rank)
    "llama-8b-8gpu.toml": (8, 8 * 1),
    "llama-70b-64gpu.toml": (64, 2 * 2),  # data 2 × micro_batch 2
    "finetune.toml": (2, 2 * 4),
}


GPU_EXAMPLES = ("llama-70b-64gpu.toml", "llama-8b-8gpu.toml")
MEMORY_LINE = re.compile(r"^#\s+tessera memory (\S+) --world-size (\d+) --hardware (\S+)\s*$", re.M)
MARGIN = 0.9
"""A GPU example's estimate stays under this share of the device: the estimate leaves out the CUDA context,
NCCL's buffers and the caching allocator's fragmentation (a few GiB on an 80 GB device)."""


def test_gpu_examples_name_their_device() -> None:
    """Every example whose header names a device is checked below (a new one cannot slip past)."""
    named = {p.name for p in CONFIGS.glob("*.toml") if MEMORY_LINE.search(p.read_text())}
    assert named == set(GPU_EXAMPLES)


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_example_fits_the_device_its_header_names(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The header's own `tessera memory` command, run: it fits, with MARGIN to spare."""
    (path, world, hardware), *more = MEMORY_LINE.findall((CONFIGS / name).read_text())
    assert not more and path == f"configs/{name}"
    assert main(["memory", str(CONFIGS / name), "--world-size", world, "--hardware", hardware]) == 0
    out = capsys.readouterr().out
    fits = re.search(r"fits: ([\d.]+) GiB of ([\d.]+) GiB", out)
    assert fits, out
    assert float(fits[1]) <= MARGIN * float(fits[2]), out


@pytest.mark.parametrize("name", sorted(WORLD))
def test_example_config_is_valid_at_its_world_size(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert cfg.check(WORLD[name]) == []
    assert cfg.check(WORLD[name] * 3) != []  # the checks do run: three times the ranks leaves a wrong layout


def test_large_examples_use_their_layouts() -> None:
    big = load_config(CONFIGS / "llama-70b-64gpu.toml")
    assert (big.parallel.tensor, big.parallel.schedule, big.parallel.pipeline) == ("2x2", "breadth_first", 8)
    assert big.model.n_layers == 80 and load_config(CONFIGS / "llama-8b-8gpu.toml").parallel.zero == 3


def _finetune_inputs(root: Path) -> None:
    """What configs/finetune.toml names, relative to the working directory: models/base (an HF folder with its
    tokenizer) and data/finetune.tokens, prepared with that tokenizer as the example's first line says."""
    import transformers

    from tests.hf_models import VOCAB, hf_config, train_bpe

    base = root / "models" / "base"
    config = hf_config("llama")
    config.max_position_embeddings = 512  # the example's seq_len: not longer than the base model's context
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(base)
    texts = [f"text {i} " * 10 for i in range(100)]
    train_bpe(base / "tokenizer.json", "\n".join(texts), vocab_size=VOCAB)
    (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    # enough tokens for a window of the example's seq_len (512), which `validate` asks of the data
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (root / "data").mkdir()
    prepare([root / "texts.jsonl"], root / "data" / "finetune.tokens", str(base), workers=1)


@pytest.mark.parametrize("name", sorted(DRY_RUN))
def test_example_config_dry_runs_at_its_world_size(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    world, one_micro_batch_each = DRY_RUN[name]
    if name == "finetune.toml":
        _finetune_inputs(tmp_path)
        monkeypatch.chdir(tmp_path)
        assert main(["validate", str(CONFIGS / name), "--world-size", str(world)]) == 0
    args = ["dryrun", str(CONFIGS / name), "--world-size", str(world), "--ranks", "0"]
    assert main([*args, f"--train.global_batch={one_micro_batch_each}"]) == 0
    out = capsys.readouterr().out
    assert f"= {world} ranks, ranks [0]" in out and "rank 0 (" in out, out
    assert "memory, " in out and "traffic, bytes" in out, out
