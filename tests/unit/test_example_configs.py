"""The example configs are valid at the world sizes they are written for (and say what is wrong at others), and
`tessera dryrun` builds and steps one of their ranks at that world size.

The dry runs keep everything of the example — model shape, sequence length, micro-batch size, layout, world size,
schedule, ZeRO stage, checkpointing, dtype — except two things, to fit CI (on a loaded 2-core machine a full
llama-8b dry run took over 5 minutes; fake tensors cost about a millisecond per operation, so the time is one
forward, recomputation and backward of every local block per micro-batch):

- one micro-batch per data-parallel rank per step (``train.global_batch`` = micro_batch × data), instead of the
  example's 32 (llama-8b) or 64 (llama-70b): the memory of parameters, gradients and optimizer state and the
  traffic per micro-batch are the example's, the activations held at once by a layered (breadth-first) step are
  one micro-batch's;
- only rank 0 (the first pipeline rank, holding the embedding), not also the last one (the head).

The fine-tune example names a Hugging Face folder and a token file that a user makes; here a tiny random Llama
folder (with max_position_embeddings 512, so the example's seq_len stands) and a byte-token file stand in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.config import load_config
from tessera.train.data import prepare

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WORLD = {"demo.toml": 2, "llama-8b-8gpu.toml": 8, "llama-70b-64gpu.toml": 64}
DRY_RUN = {  # example: (world size, its data-parallel size × micro_batch: one micro-batch per rank)
    "llama-8b-8gpu.toml": (8, 8 * 1),
    "llama-70b-64gpu.toml": (64, 2 * 2),
    "finetune.toml": (2, 2 * 4),
}


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
    """What configs/finetune.toml names, relative to the working directory: models/base (an HF folder) and
    data/finetune.tokens."""
    import transformers

    from tests.hf_models import hf_config

    base = root / "models" / "base"
    config = hf_config("llama")
    config.max_position_embeddings = 512  # the example's seq_len: not longer than the base model's context
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(base)
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": f"text {i}"}) + "\n" for i in range(50)))
    (root / "data").mkdir()
    prepare([root / "texts.jsonl"], root / "data" / "finetune.tokens", workers=1)


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
