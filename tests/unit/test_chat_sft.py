"""Chat records (`tessera prepare --messages-key`): conversations rendered with a tokenizer folder's chat template,
and a loss mask keeping exactly the assistant turns and their end-of-turn tokens. The tokenizer folders are built
here (a byte-level BPE trained on a few strings, wrapped in transformers' PreTrainedTokenizerFast with a
template), nothing is downloaded."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from tessera.cli import main
from tessera.errors import DataError
from tessera.train.data import TokenDataset, mask_path, prepare
from tessera.train.metrics import read_metrics
from tessera.train.tokenizer import load_tokenizer

pytest.importorskip("transformers")

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's ChatML layout: each turn ends with <|im_end|> and a newline."""

CHATML_MARKED = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""The same rendering as `CHATML`, with {% generation %} markers around each reply and its <|im_end|>."""

LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3 Instruct's layout: a header per turn, each turn ended by <|eot_id|> with nothing after it."""

STRIP_REASONING = (
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML that drops an earlier assistant turn's reasoning (as Qwen3's template does): the conversation through
a turn is then not a prefix of the whole conversation."""

SYSTEM = "You are a helpful assistant."
CONVERSATIONS = [
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "Thanks! And of Spain?"},
        {"role": "assistant", "content": "Madrid."},
    ],
    [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And goodbye?"},
        {"role": "assistant", "content": ""},  # an empty reply still trains its end of turn
        {"role": "user", "content": "A last question, unanswered."},  # context only: no target after it
    ],
]


def _tokenizer(folder: Path, template: str | None, eos: str = "<|endoftext|>") -> Path:
    """A save_pretrained folder: a byte-level BPE (every byte has a token) trained on the conversations' words,
    with the `SPECIAL` tokens, EOS ``eos`` and chat template ``template`` (none when None)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CONVERSATIONS for m in c] + ["system user assistant"]
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts * 10, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token=eos, additional_special_tokens=SPECIAL
    )
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _chats(tmp_path: Path, records: list | None = None, name: str = "chat.jsonl") -> Path:
    return _jsonl(tmp_path / name, records or [{"messages": c} for c in CONVERSATIONS])


def _prepare(src: Path, out: Path, folder: Path, **kwargs) -> dict:
    return prepare(
        [src], out, str(folder), messages_key="messages", workers=kwargs.pop("workers", 1), **kwargs
    )


def _kept_runs(out: Path, folder: Path) -> list[str]:
    """The decoded runs of consecutive kept tokens of a prepared file, in order."""
    tokens = np.fromfile(out, dtype=TokenDataset(out).tokens.dtype).astype(np.int64)
    mask = np.fromfile(mask_path(out), dtype=np.uint8)
    assert len(mask) == len(tokens)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask, [0]))))  # starts and ends of the runs of 1
    tok = load_tokenizer(str(folder))
    return [tok.decode(tokens[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _replies(end_of_turn: str) -> list[str]:
    return [m["content"] + end_of_turn for c in CONVERSATIONS for m in c if m["role"] == "assistant"]


@pytest.mark.parametrize(
    ("template", "end_of_turn"), [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>")], ids=["chatml", "llama3"]
)
def test_the_mask_keeps_exactly_the_replies_and_their_end_of_turn(tmp_path, template, end_of_turn):
    """Decoded, the kept tokens are each assistant reply followed by the end-of-turn token, and nothing else:
    not the system or user turns, not the assistant headers, not ChatML's newline after <|im_end|>, not the
    end-of-text token between conversations."""
    folder = _tokenizer(tmp_path / "tok", template)
    out = tmp_path / "chat.bin"
    meta = _prepare(_chats(tmp_path), out, folder)
    assert _kept_runs(out, folder) == _replies(end_of_turn)  # the empty reply: its end-of-turn token alone
    tok = load_tokenizer(str(folder))
    tokens = np.fromfile(out, dtype=np.uint16).astype(np.int64)
    mask = np.fromfile(mask_path(out), dtype=np.uint8)
    eot = tok.token_to_id("<|endoftext|>")
    assert meta["eot"] == eot and (tokens == eot).sum() == 2 and not mask[tokens == eot].any()
    whole = tok.decode(tokens.tolist())
    assert whole.count(SYSTEM) == 1 and SYSTEM not in "".join(_kept_runs(out, folder))
    assert meta["loss_mask"]["n_targets"] == int(mask.sum())
    assert meta["loss_mask"]["messages_key"] == "messages"
    assert meta["loss_mask"]["assistant_tokens"] == "prefix difference"
    assert meta["n_documents"] == 2 and meta["n_bad_records"] == 0
    TokenDataset(out).verify()


@pytest.mark.parametrize(
    ("template", "end_of_turn"), [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>")], ids=["chatml", "llama3"]
)
def test_generation_prompt_and_end_of_turn(tmp_path, template, end_of_turn):
    """`tessera generate --chat` continues the user turn rendered with the assistant header, as transformers
    renders it for inference, and stops at the token that ends the template's assistant turns."""
    from transformers import AutoTokenizer

    from tessera.train.chat import ChatTemplate

    folder = _tokenizer(tmp_path / "tok", template)
    chat = ChatTemplate(str(folder))
    messages = [{"role": "user", "content": "Hi"}]
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert chat.prompt_ids(messages) == list(expected["input_ids"])
    assert chat.end_of_turn() == load_tokenizer(str(folder)).token_to_id(end_of_turn)


def test_generation_markers_and_the_prefix_difference_agree(tmp_path):
    """One template with {% generation %} markers and the same one without: transformers' assistant mask and the
    prefix difference give the same tokens and the same mask."""
    marked = _prepare(_chats(tmp_path), tmp_path / "m.bin", _tokenizer(tmp_path / "marked", CHATML_MARKED))
    plain = _prepare(_chats(tmp_path), tmp_path / "p.bin", _tokenizer(tmp_path / "plain", CHATML))
    assert marked["loss_mask"]["assistant_tokens"] == "generation markers"
    assert plain["loss_mask"]["assistant_tokens"] == "prefix difference"
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
    assert mask_path(tmp_path / "m.bin").read_bytes() == mask_path(tmp_path / "p.bin").read_bytes()
    assert _kept_runs(tmp_path / "m.bin", tmp_path / "marked") == _replies("<|im_end|>")


BAD = [  # (record, words of its warning)
    ({"messages": [{"role": "tool", "content": "x"}, *CONVERSATIONS[0][1:3]]}, "message 1 has role 'tool'"),
    (
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
        "message 1 (user) has no content",
    ),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ({"messages": "hello"}, "field 'messages' has type str, not a list"),
    ({"text": "hello"}, "missing field 'messages' (fields: text); see --messages-key"),
    ({"messages": CONVERSATIONS[0][2:3]}, "message 1 is the assistant's"),
    (
        {"messages": [{"role": "user", "content": "end it<|im_end|>"}, CONVERSATIONS[0][2]]},
        "message 1 (user) contains the special token '<|im_end|>'",
    ),
]


def test_bad_records_are_skipped_by_line_and_strict_stops(tmp_path):
    folder = _tokenizer(tmp_path / "tok", CHATML)
    src = _chats(tmp_path, [{"messages": CONVERSATIONS[0]}, *(r for r, _ in BAD)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = _prepare(src, tmp_path / "a.bin", folder)
    (message,) = [str(w.message) for w in caught]
    assert f"{len(BAD)} bad record(s) skipped" in message
    for line, (_, words) in enumerate(BAD, 2):  # the first five are shown, by line
        if line <= 6:
            assert f"chat.jsonl:{line}: {words}" in message
    assert meta["n_documents"] == 1 and meta["n_bad_records"] == len(BAD)
    for record, words in BAD:  # each alone, with --strict: an error naming it
        one = _chats(tmp_path, [{"messages": CONVERSATIONS[0]}, record], "one.jsonl")
        with pytest.raises(DataError, match=r"--strict stops at the first\): .*one\.jsonl:2: " + _re(words)):
            _prepare(one, tmp_path / "s.bin", folder, strict=True)


def _re(words: str) -> str:
    import re

    return re.escape(words)


def test_a_template_that_rewrites_earlier_turns_is_refused_by_turn(tmp_path):
    """Reasoning dropped from an earlier assistant turn breaks the prefix property: the record is named with the
    turn and the fix; a conversation with one assistant turn is not affected."""
    folder = _tokenizer(tmp_path / "tok", STRIP_REASONING)
    thinking = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "<think>France, so Paris.</think>The capital of France is Paris."},
        {"role": "user", "content": "Thanks! And of Spain?"},
        {"role": "assistant", "content": "Madrid."},
    ]
    src = _chats(tmp_path, [{"messages": thinking}, {"messages": thinking[:2]}])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = _prepare(src, tmp_path / "t.bin", folder)
    (message,) = [str(w.message) for w in caught]
    assert (
        "chat.jsonl:1: message 2 (assistant): the template's tokens of the conversation through it" in message
    )
    assert "are not a prefix of those of the conversation as a whole" in message
    assert "{% generation %}" in message and "strip reasoning" in message
    assert meta["n_documents"] == 1
    assert _kept_runs(tmp_path / "t.bin", folder) == [thinking[1]["content"] + "<|im_end|>"]
    with pytest.raises(DataError, match=r"chat\.jsonl:1: message 2 \(assistant\)"):
        _prepare(src, tmp_path / "s.bin", folder, strict=True)


def test_tokenizers_without_a_chat_template_are_refused(tmp_path):
    src = _chats(tmp_path)
    folder = _tokenizer(tmp_path / "tok", None)
    with pytest.raises(DataError, match=r"has no chat template .*copy chat_template\.jinja"):
        _prepare(src, tmp_path / "a.bin", folder)
    with pytest.raises(DataError, match="is a tokenizer file, not a folder"):
        _prepare(src, tmp_path / "a.bin", folder / "tokenizer.json")
    with pytest.raises(DataError, match="is byte tokens"):
        _prepare(src, tmp_path / "a.bin", Path("byte"))
    with pytest.raises(DataError, match="two kinds of fine-tuning record"):
        _prepare(src, tmp_path / "a.bin", folder, prompt_key="prompt")
    assert not (tmp_path / "a.bin").exists()


def test_an_end_of_text_token_the_template_writes_is_refused_with_another(tmp_path):
    """Qwen2.5 Instruct declares <|im_end|> as its EOS: separating conversations with it would split them at
    every turn, so prepare names a special token the template does not write."""
    folder = _tokenizer(tmp_path / "tok", CHATML, eos="<|im_end|>")
    src = _chats(tmp_path)
    with pytest.raises(
        DataError, match=r"'<\|im_end\|>' .* written by the chat template.*--eot-token '<\|endoftext"
    ):
        _prepare(src, tmp_path / "a.bin", folder)
    with pytest.raises(DataError, match=r"--eot-token '<\|im_start\|>'"):
        _prepare(src, tmp_path / "a.bin", folder, eot_token="<|im_start|>")
    meta = _prepare(src, tmp_path / "a.bin", folder, eot_token="<|endoftext|>")
    assert _kept_runs(tmp_path / "a.bin", folder) == _replies("<|im_end|>") and meta["n_documents"] == 2


def test_parquet_conversations_and_two_workers(tmp_path):
    """A list<struct<role, content>> column is read as messages (a missing content is a null); two spawned
    workers write the same files as one."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    folder = _tokenizer(tmp_path / "tok", LLAMA3)
    rows = [*CONVERSATIONS, [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]]
    pq.write_table(pa.table({"messages": rows}), tmp_path / "chat.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = _prepare(tmp_path / "chat.parquet", tmp_path / "p.bin", folder)
    assert "chat.parquet:row 3: message 1 (user) has no content" in str(caught[0].message)
    assert meta["n_documents"] == 2 and _kept_runs(tmp_path / "p.bin", folder) == _replies("<|eot_id|>")
    src = _chats(tmp_path, [{"messages": c} for c in CONVERSATIONS * 3])
    _prepare(src, tmp_path / "one.bin", folder)
    _prepare(src, tmp_path / "two.bin", folder, workers=2)
    for name in ("bin", "mask"):
        assert (tmp_path / f"one.{name}").read_bytes() == (tmp_path / f"two.{name}").read_bytes()


def test_prepare_and_train_on_the_assistant_turns(tmp_path, capsys):
    """`tessera prepare --messages-key` then `tessera train` with data.loss_mask: one window spans the whole file
    (model.seq_len = tokens - 1, so every sample starts at token 0), so each step's target count is the global
    batch times the mask's count (the first token, <|im_start|>, is no target)."""
    folder = _tokenizer(tmp_path / "tok", CHATML)
    out = tmp_path / "chat" / "train.bin"
    argv = ["prepare", str(_chats(tmp_path)), "--out", str(out), "--tokenizer", str(folder)]
    assert main([*argv, "--messages-key", "messages"]) == 0
    printed = capsys.readouterr().out
    data = TokenDataset(out)
    kept = int(np.fromfile(mask_path(out), dtype=np.uint8).sum())
    assert (
        f"{kept} target tokens (assistant turns and their end-of-turn tokens, by prefix difference)"
        in printed
    )
    assert data.mask[0] == 0 and kept == data.meta["loss_mask"]["n_targets"] > 0
    run = tmp_path / "run"
    overrides = [
        "--model.size=gpt2-tiny",
        "--model.n_layers=1",
        f"--model.vocab_size={data.vocab_size}",
        f"--model.seq_len={data.n_tokens - 1}",
        f'--data.path="{out}"',
        f'--data.tokenizer="{folder}"',
        "--data.loss_mask=true",
        "--train.steps=3",
        "--train.global_batch=2",
        "--train.micro_batch=1",
        "--train.warmup_steps=0",
        "--checkpoint.every=3",
        f'--log.run_dir="{run}"',
        "--log.progress=false",
        "--log.tensorboard=false",
    ]
    assert main(["train", *overrides]) == 0
    records = [m for m in read_metrics(run) if "loss" in m]
    assert [m["step"] for m in records] == [0, 1, 2]
    assert all(m["target_tokens"] == 2 * kept and np.isfinite(m["loss"]) for m in records)
    # the fine-tuned run answers a user turn: the reply alone (the rendered prompt opens with <|im_start|>),
    # ended at <|im_end|> (left out) or by --tokens
    capsys.readouterr()
    argv = ["generate", str(run), "--chat", "--prompt", "Hi", "--tokens", "6", "--temperature", "0"]
    assert main(argv) == 0
    reply = capsys.readouterr().out
    assert "<|im_start|>" not in reply and "<|im_end|>" not in reply
    assert main(["generate", str(run), "--stop", "Hello there"]) == 2  # a stop is compared token by token
    assert "--stop 'Hello there' is" in capsys.readouterr().err
