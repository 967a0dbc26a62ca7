"""A local Hugging Face tokenizers JSON file, trained here from text (no download), drives `prepare`."""

from __future__ import annotations

from pathlib import Path

from tessera.train.data import TokenDataset, prepare
from tessera.train.tokenizer import load_tokenizer
from tests.hf_models import train_bpe


def test_prepare_with_hf_tokenizer(tmp_path: Path) -> None:
    text = "def add(a, b):\n    return a + b\n" * 50
    train_bpe(tmp_path / "tok.json", text)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(text)
    info = prepare([tmp_path / "src"], tmp_path / "t.bin", str(tmp_path / "tok.json"))
    tok = load_tokenizer(str(tmp_path / "tok.json"))
    assert info["vocab_size"] == tok.vocab_size <= 300
    ds = TokenDataset(tmp_path / "t.bin")
    ids = ds.tokens[: ds.n_tokens].tolist()
    assert len(ids) < len(text)  # BPE merges: fewer tokens than bytes
    assert text.startswith(tok.decode(ids[:20]))


def test_a_save_pretrained_folder_is_a_tokenizer_with_its_eos_as_separator(tmp_path: Path) -> None:
    text = "def add(a, b):\n    return a + b\n" * 50
    folder = tmp_path / "hf"
    folder.mkdir()
    train_bpe(folder / "tokenizer.json", text)
    # the folder's declared EOS wins over the built-in guess (<|endoftext|> is also in this vocabulary)
    (folder / "tokenizer_config.json").write_text('{"eos_token": {"content": "[UNK]"}}')
    tok = load_tokenizer(str(folder))
    assert tok.eot == 0 and tok.spec == str(folder.resolve())
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text(text)
    (tmp_path / "src" / "b.py").write_text(text)
    info = prepare([tmp_path / "src"], tmp_path / "t.bin", str(folder))
    ds = TokenDataset(tmp_path / "t.bin")
    ids = ds.tokens[: ds.n_tokens].tolist()
    assert info["eot"] == 0 and ids.count(0) == 2 and ids[-1] == 0  # one separator after each document
    (folder / "tokenizer_config.json").unlink()
    (folder / "config.json").write_text('{"eos_token_id": [1, 0]}')  # the model config's, when only it says
    assert load_tokenizer(str(folder)).eot == 1
