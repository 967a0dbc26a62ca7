"""The README's fine-tuning walk-through with configs/finetune.toml, as a user runs it: an HF folder (a tiny
random Llama with its own BPE tokenizer, made here) → prepare with the folder's tokenizer → train --nproc 2 →
generate with top-p → export --format hf → transformers loads the export and its tokenizer. Resuming, generate
and export work without the base weights (a checkpoint overwrites them, so they are not read)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.conftest import synthetic_corpus
from tests.distributed.test_cli_end_to_end import _concurrently, _tessera
from tests.hf_models import VOCAB, make_hf, train_bpe

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "finetune.toml"


def test_finetune_walkthrough(tmp_path: Path) -> None:
    import transformers

    text = synthetic_corpus(sentences=800)
    make_hf(tmp_path / "models" / "base", "llama")
    train_bpe(tmp_path / "models" / "base" / "tokenizer.json", text, vocab_size=VOCAB)
    (tmp_path / "models" / "base" / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>"})
    )
    (tmp_path / "my_texts").mkdir()
    for i in range(2):
        (tmp_path / "my_texts" / f"part{i}.txt").write_text(text[i::2])

    out = _tessera(
        "prepare", "my_texts", "--tokenizer", "models/base", "--out", "data/finetune.tokens", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    small = ["--model.seq_len=32", "--train.steps=2", "--train.warmup_steps=1", "--log.progress=false"]
    out = _tessera("train", str(CONFIG), "--nproc", "2", *small, "--log.tensorboard=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # the run's checkpoints no longer need the base weights: resume, generate and export must not read them
    (tmp_path / "models" / "base" / "model.safetensors").unlink()
    longer = [small[0], "--train.steps=3", *small[2:], "--log.tensorboard=false"]
    out = _tessera("train", str(CONFIG), "--nproc", "2", *longer, cwd=tmp_path)
    assert out.returncode == 0, out.stderr  # resumed from step 2
    # side by side: generate reads the run's checkpoint (or RUN/export, never models/), export writes models/
    out, exported_out = _concurrently(
        (("generate", "runs/finetune", "--prompt", "Et", "--tokens", "8", "--top-p", "0.9"), tmp_path),
        (("export", "runs/finetune", "--format", "hf", "--out", "models/finetuned"), tmp_path),
    )
    assert out.returncode == 0 and out.stdout.startswith("Et"), out.stderr
    assert exported_out.returncode == 0, exported_out.stderr
    exported = tmp_path / "models" / "finetuned"
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.model_type == "llama" and model.config.max_position_embeddings == 32
    assert (exported / "tokenizer.json").read_text() == (tmp_path / "models/base/tokenizer.json").read_text()
    assert (exported / "tokenizer_config.json").is_file()
