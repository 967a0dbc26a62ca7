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


def _tool_template(marked: bool) -> str:
    """A ChatML template with tool support, written after Qwen2.5 Instruct's public template logic: the tools'
    JSON schemas in the system turn inside <tools></tools>, each assistant tool call as <tool_call>{"name": ...,
    "arguments": ...}</tool_call> after the reply's text, and consecutive tool results in one user turn, each in
    <tool_response></tool_response>. With ``marked``, {% generation %} markers around each assistant turn's text,
    calls and <|im_end|> (the same rendering)."""
    start, end = ("{%- generation %}", "{%- endgeneration %}") if marked else ("", "")
    return (
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
        "{{- '# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>' }}"
        "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
        "{{- '\\n</tools>\\n\\nReturn each call as a JSON object in <tool_call></tool_call> tags.<|im_end|>\\n' }}"
        "{%- elif messages[0]['role'] == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' }}"
        + start
        + "{%- if message.content %}{{- message.content }}{%- endif %}"
        "{%- for tool_call in message.tool_calls or [] %}"
        "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
        "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
        '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' + (call.arguments | tojson) + \'}'
        "\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>' }}" + end + "{{- '\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


TOOLS_CHATML = _tool_template(marked=False)
TOOLS_CHATML_MARKED = _tool_template(marked=True)


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


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The temperature in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _call(city: str, as_text: bool = False) -> dict:
    arguments = {"city": city}
    return {
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(arguments) if as_text else arguments},
    }


TOOL_CHATS = [
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("Paris")]},
        {"role": "tool", "content": "18C", "name": "get_weather"},
        {"role": "assistant", "content": "It is 18C in Paris."},
        {"role": "user", "content": "And in Madrid and Rome?"},
        {  # two calls in one turn, the second's arguments a JSON string (as OpenAI's API returns them)
            "role": "assistant",
            "content": "Let me check both.",
            "tool_calls": [_call("Madrid"), _call("Rome", as_text=True)],
        },
        {"role": "tool", "content": "25C", "name": "get_weather"},
        {"role": "tool", "content": "21C", "name": "get_weather"},
        {"role": "assistant", "content": "Madrid is at 25C, Rome at 21C."},
    ],
    [  # a call without content (null, as OpenAI writes it), the conversation ending at the call
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("Oslo")]},
    ],
]
TOOL_REPLIES = [  # what each assistant turn of TOOL_CHATS renders as, by TOOLS_CHATML's layout
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "It is 18C in Paris.<|im_end|>",
    'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Madrid"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
    "Madrid is at 25C, Rome at 21C.<|im_end|>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
]


def _tokenizer(
    folder: Path,
    template: str | None,
    eos: str = "<|endoftext|>",
    special: list[str] = SPECIAL,
    bos: str | None = "<|begin_of_text|>",
    pad: str | None = None,
) -> Path:
    """A save_pretrained folder: a byte-level BPE (every byte has a token) trained on the conversations' words,
    with the ``special`` tokens (default `SPECIAL`), EOS ``eos``, BOS ``bos``, padding ``pad`` and chat template
    ``template`` (none when None)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in CONVERSATIONS for m in c] + ["system user assistant"]
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts * 10, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, additional_special_tokens=special
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
    (
        {"messages": [{"role": "function", "content": "x"}, *CONVERSATIONS[0][1:3]]},
        "message 1 has role 'function'",
    ),
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


QWEN_LIKE = {"special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos": None, "pad": "<|endoftext|>"}
"""Qwen2.5 Instruct's special tokens: EOS <|im_end|> (given apart), padding <|endoftext|>, no BOS."""
LLAMA3_LIKE = {
    "special": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
    "bos": "<|begin_of_text|>",
}
"""Llama 3 Instruct's: BOS <|begin_of_text|> (which its template writes), <|end_of_text|>, EOS <|eot_id|>."""


@pytest.mark.parametrize(
    ("template", "eos", "tokens", "separator"),
    [
        (CHATML, "<|im_end|>", QWEN_LIKE, "<|endoftext|>"),
        (LLAMA3, "<|eot_id|>", LLAMA3_LIKE, "<|end_of_text|>"),
    ],
    ids=["qwen2.5", "llama3"],
)
def test_an_end_of_text_token_the_template_writes_gives_way_to_a_separator(
    tmp_path, capsys, template, eos, tokens, separator
):
    """Qwen2.5 Instruct declares <|im_end|> as its EOS, Llama 3 Instruct <|eot_id|>: separating conversations with
    it would split them at every turn, so prepare separates them with the tokenizer's <|endoftext|> /
    <|end_of_text|>, which the template never writes, says so in a note, and records it as the metadata's eot.
    Document starts (window_start = "document") and document masking's positions then restart once per
    conversation, not once per turn; the files equal those of naming the separator with --eot-token."""
    import torch

    from tessera.model.documents import document_positions
    from tessera.train.data import PrepareNote

    folder = _tokenizer(tmp_path / "tok", template, eos=eos, **tokens)
    src, out = _chats(tmp_path), tmp_path / "a.bin"
    with pytest.warns(PrepareNote) as notes:
        meta = _prepare(src, out, folder)
    (note,) = [str(w.message) for w in notes]
    tok = load_tokenizer(str(folder))
    sep = tok.token_to_id(separator)
    assert note == (
        f"the tokenizer's end-of-text token {eos!r} ends the chat template's turns, so conversations are "
        f"separated by {separator!r} (id {sep}), a special token the template never writes; pass --eot-token to "
        "choose another"
    )
    assert meta["eot"] == sep != tok.token_to_id(eos) and meta["n_documents"] == 2
    assert _kept_runs(out, folder) == _replies(eos)
    data = TokenDataset(out, window_start="document")
    tokens_ = np.asarray(data.tokens, dtype=np.int64)
    first_end = int(np.flatnonzero(tokens_ == sep)[0])
    assert data.document_starts.tolist() == [0, first_end + 1]  # two conversations, ten turns
    assert (tokens_ == tok.token_to_id(eos)).sum() >= 5  # the turns' ends stay inside their conversation
    positions = document_positions(torch.from_numpy(tokens_)[None], data.eot)[0]
    assert np.flatnonzero(positions.numpy() == 0).tolist() == [0, first_end + 1]
    _prepare(src, tmp_path / "named.bin", folder, eot_token=separator)
    for name in ("bin", "mask"):
        assert (tmp_path / f"named.{name}").read_bytes() == (tmp_path / f"a.{name}").read_bytes()
    # `tessera prepare` prints the choice as a note, not as a warning
    argv = ["prepare", str(src), "--out", str(tmp_path / "c.bin"), "--tokenizer", str(folder)]
    assert main([*argv, "--messages-key", "messages"]) == 0
    assert f"note: {note}\n" in capsys.readouterr().err


def test_an_explicit_eot_token_wins(tmp_path):
    """With several separators the template never writes, --eot-token picks one without a note; an --eot-token
    the template writes is refused, not replaced."""
    from tessera.train.data import PrepareNote

    folder = _tokenizer(tmp_path / "tok", CHATML, eos="<|im_end|>")  # <|endoftext|> and <|end_of_text|> both
    src = _chats(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = _prepare(src, tmp_path / "a.bin", folder, eot_token="<|end_of_text|>")
    assert not [w for w in caught if issubclass(w.category, PrepareNote)]
    assert meta["eot"] == load_tokenizer(str(folder)).token_to_id("<|end_of_text|>")
    assert _kept_runs(tmp_path / "a.bin", folder) == _replies("<|im_end|>") and meta["n_documents"] == 2
    with pytest.warns(PrepareNote, match=r"separated by '<\|endoftext\|>'"):
        _prepare(src, tmp_path / "b.bin", folder)
    for written in ("<|im_end|>", "<|im_start|>"):
        with pytest.raises(
            DataError,
            match=rf"--eot-token '{_re(written)}', .* written by the chat template.*--eot-token '<\|endoftext",
        ):
            _prepare(src, tmp_path / "c.bin", folder, eot_token=written)
    assert not (tmp_path / "c.bin").exists()


NOTHING_QUALIFIES = [  # (template, special tokens, padding token): no separator the template never writes
    # none named as a document's end; an unwritten special token of another name (Qwen's fill-in-the-middle) is
    # not taken for one
    (CHATML, ["<|im_start|>", "<|im_end|>", "<|fim_prefix|>"], None),
    (  # <|endoftext|> written in a branch the two-turn probe does not reach
        CHATML + "{%- if tools %}{{- '<|endoftext|>' }}{%- endif %}",
        QWEN_LIKE["special"],
        None,
    ),
    (  # <|endoftext|> is the padding token, whose variable the template reads
        CHATML + "{%- if tools %}{{- pad_token }}{%- endif %}",
        QWEN_LIKE["special"],
        "<|endoftext|>",
    ),
]


@pytest.mark.parametrize(
    ("template", "special", "pad"), NOTHING_QUALIFIES, ids=["none", "literal", "variable"]
)
def test_an_end_of_text_token_the_template_writes_is_refused_without_a_separator(
    tmp_path, template, special, pad
):
    folder = _tokenizer(tmp_path / "tok", template, eos="<|im_end|>", special=special, bos=None, pad=pad)
    with pytest.raises(
        DataError,
        match=r"the tokenizer's end-of-text token, '<\|im_end\|>' \(id \d+\), .* written by the chat template .* "
        r"no special token named as a document's end .* that the template never writes; pass --eot-token",
    ) as refused:
        _prepare(_chats(tmp_path), tmp_path / "a.bin", folder)
    assert "e.g. --eot-token '<|endoftext|>'" not in str(refused.value)
    assert not (tmp_path / "a.bin").exists()


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


def test_prepare_and_train_on_the_assistant_turns(tmp_path, capsys, monkeypatch):
    """`tessera prepare --messages-key` then `tessera train` with data.loss_mask: one window spans the whole file
    (model.seq_len = tokens - 1, so every sample starts at token 0), so each step's target count is the global
    batch times the mask's count (the first token, <|im_start|>, is no target). The template is the tool-capable
    ChatML one, which renders these conversations as `CHATML` does, so generate --tools has tools to render."""
    folder = _tokenizer(tmp_path / "tok", TOOLS_CHATML)
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
    # --system and --messages: the model is given [system, *file, user --prompt] with the assistant header, the
    # ids transformers renders for inference
    from transformers import AutoTokenizer

    import tessera.train.generate as generate_module

    given: list[list[int]] = []
    sample = generate_module.generate

    def spy(model, ids, *args):
        given.append(ids[0].tolist())
        return sample(model, ids, *args)

    monkeypatch.setattr(generate_module, "generate", spy)
    history = CONVERSATIONS[1][1:4]  # assistant, user, assistant: answered by --prompt's user turn
    (tmp_path / "history.json").write_text(json.dumps([CONVERSATIONS[1][0], *history]))
    argv = ["generate", str(run), "--chat", "--tokens", "3", "--temperature", "0", "--system", SYSTEM]
    assert main([*argv, "--messages", str(tmp_path / "history.json"), "--prompt", "Bye?"]) == 0
    messages = [
        {"role": "system", "content": SYSTEM},
        CONVERSATIONS[1][0],
        *history,
        {"role": "user", "content": "Bye?"},
    ]
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert given == [list(expected["input_ids"])]
    assert main([*argv, "--messages", str(tmp_path / "history.json")]) == 2  # it ends with the assistant's
    assert "ends with the assistant's turn (message 4)" in capsys.readouterr().err
    # --tools: the schemas are given to the template, as transformers renders them for inference
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    assert main([*argv, "--prompt", "Weather in Paris?", "--tools", str(tmp_path / "tools.json")]) == 0
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"}]
    expected = hf.apply_chat_template(
        messages, tools=[WEATHER], tokenize=True, add_generation_prompt=True, return_dict=True
    )
    assert given[-1] == list(expected["input_ids"])
    assert json.dumps(WEATHER) in hf.decode(given[-1])


def _tool_records(key: str = "tools") -> list[dict]:
    return [{"messages": c, key: [WEATHER]} for c in TOOL_CHATS]


@pytest.mark.parametrize("template", [TOOLS_CHATML, TOOLS_CHATML_MARKED], ids=["prefix", "markers"])
def test_tool_calls_are_kept_with_their_turn_and_tool_results_are_not(tmp_path, template):
    """Decoded, the kept tokens are each assistant turn's text and tool calls (a JSON-string arguments parsed, as
    the template renders an object) and its <|im_end|>, and nothing else: not the tools' schemas in the system
    turn, not the tool results, not the user turns. The tools are rendered (they are context)."""
    folder = _tokenizer(tmp_path / "tok", template)
    out = tmp_path / "tools.bin"
    meta = _prepare(_chats(tmp_path, _tool_records()), out, folder)
    assert _kept_runs(out, folder) == TOOL_REPLIES
    whole = load_tokenizer(str(folder)).decode(np.fromfile(out, dtype=np.uint16).tolist())
    assert whole.count("<tools>\n" + json.dumps(WEATHER) + "\n</tools>") == 2
    assert "<|im_start|>user\n<tool_response>\n25C\n</tool_response>\n<tool_response>\n21C\n" in whole
    assert meta["n_documents"] == 2 and meta["n_bad_records"] == 0
    assert meta["loss_mask"]["tools_key"] == "tools"
    # the tools field is named with --tools-key; a record without it has no tools (then none are rendered)
    again = _prepare(
        _chats(tmp_path, _tool_records("functions"), "f.jsonl"),
        tmp_path / "f.bin",
        folder,
        tools_key="functions",
    )
    assert (tmp_path / "f.bin").read_bytes() == out.read_bytes() and again["loss_mask"][
        "tools_key"
    ] == "functions"
    with pytest.raises(
        DataError, match="--tools-key 'functions' names the tools field of chat records; add --messages-key"
    ):
        prepare([tmp_path / "f.jsonl"], tmp_path / "g.bin", str(folder), tools_key="functions")


def _caught(fn, *args, **kwargs) -> tuple[list[str], object]:
    """``fn``'s warnings (their messages) and its result."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    return [str(w.message) for w in caught], result


def _files(tmp_path: Path, stem: str) -> dict[str, bytes]:
    """A prepared file's token, mask and metadata bytes, the metadata's name of the mask file left out."""
    files = {n: (tmp_path / f"{stem}.{n}").read_bytes() for n in ("bin", "mask", "json")}
    files["json"] = files["json"].replace(f'"{stem}.mask"'.encode(), b"")
    return files


def test_a_tools_key_no_record_has_is_named(tmp_path, monkeypatch):
    """--tools-key names a field no record has (the records call tools from a 'tools' field): the conversations
    are prepared without tools and a warning at the end names the field, the fields the records have and the fix;
    with --strict it is an error and an earlier output stays as it was. Counted per unit, so one worker and two
    give the same outcome; a single record with the field, in the last of many units, is enough. Records without
    tools and no --tools-key are not warned about."""
    from tessera.train import ingest

    monkeypatch.setattr(ingest, "JSONL_CHUNK", 256)  # one file in many units
    folder = _tokenizer(tmp_path / "tok", TOOLS_CHATML)
    records = _tool_records() * 4
    src = _chats(tmp_path, records)
    assert len(ingest.find_units([src], ingest.Messages("messages", "functions"))) > 4
    expected = (
        "--tools-key 'functions': no record has a field 'functions' (their fields: messages, tools), so every "
        "conversation was prepared without tools (tool calls trained with no schema); name the records' tools "
        "field with --tools-key, or leave --tools-key out for records without tools"
    )
    outcomes = []
    for workers in (1, 2):
        caught, meta = _caught(
            _prepare, src, tmp_path / f"w{workers}.bin", folder, tools_key="functions", workers=workers
        )
        assert caught == [expected] and meta["n_documents"] == len(records)
        outcomes.append((caught, _files(tmp_path, f"w{workers}")))
    assert outcomes[0] == outcomes[1]
    # --strict: an error, raised before anything is replaced
    before = _files(tmp_path, "w1")
    for workers, out in ((2, tmp_path / "w1.bin"), (1, tmp_path / "new.bin")):
        with pytest.raises(DataError, match=_re(expected) + r" \(an error with --strict"):
            _prepare(src, out, folder, tools_key="functions", workers=workers, strict=True)
    assert _files(tmp_path, "w1") == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("w1", "new"))) == [
        "w1.bin",
        "w1.json",
        "w1.mask",
    ]
    # one record with the field, in the last unit: no warning, whatever the workers
    last = {"messages": TOOL_CHATS[1], "functions": [WEATHER]}
    one = _chats(tmp_path, [*records, last], "one.jsonl")
    for workers in (1, 2):
        caught, meta = _caught(
            _prepare, one, tmp_path / "o.bin", folder, tools_key="functions", workers=workers, strict=True
        )
        assert caught == [] and meta["n_documents"] == len(records) + 1
    # no --tools-key and no record with tools: nothing to say
    assert _caught(_prepare, _chats(tmp_path, name="plain.jsonl"), tmp_path / "p.bin", folder)[0] == []


def test_a_tools_key_no_parquet_column_has_is_named(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    folder = _tokenizer(tmp_path / "tok", TOOLS_CHATML)
    pq.write_table(pa.table({"messages": CONVERSATIONS, "id": [1, 2]}), tmp_path / "c.parquet")
    caught, _ = _caught(_prepare, tmp_path / "c.parquet", tmp_path / "p.bin", folder, tools_key="functions")
    assert caught == [
        "--tools-key 'functions': no record has a field 'functions' (their fields: id, messages), so every "
        "conversation was prepared without tools (tool calls trained with no schema); name the records' tools "
        "field with --tools-key, or leave --tools-key out for records without tools"
    ]


def test_tool_calls_by_generation_markers_and_by_prefix_difference_agree(tmp_path):
    src = _chats(tmp_path, _tool_records())
    marked = _prepare(src, tmp_path / "m.bin", _tokenizer(tmp_path / "marked", TOOLS_CHATML_MARKED))
    plain = _prepare(src, tmp_path / "p.bin", _tokenizer(tmp_path / "plain", TOOLS_CHATML))
    assert marked["loss_mask"]["assistant_tokens"] == "generation markers"
    assert plain["loss_mask"]["assistant_tokens"] == "prefix difference"
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
    assert mask_path(tmp_path / "m.bin").read_bytes() == mask_path(tmp_path / "p.bin").read_bytes()


def test_a_template_without_tool_support_is_refused_by_record(tmp_path):
    """ChatML without tool support renders nothing for tool calls and tools (transformers passes them, the
    template never reads them): a record whose call would vanish from its reply, or whose tools would, is skipped
    by name; a plain conversation is not affected."""
    folder = _tokenizer(tmp_path / "tok", CHATML)
    mentioned = {"role": "assistant", "content": "Calling get_weather.", "tool_calls": [_call("Paris")]}
    records = [
        {"messages": TOOL_CHATS[0]},
        {"messages": CONVERSATIONS[0], "tools": [WEATHER]},
        {"messages": CONVERSATIONS[0]},
        {"messages": [TOOL_CHATS[0][1], mentioned]},  # the name in the text does not stand for the call
    ]
    src = _chats(tmp_path, records)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = _prepare(src, tmp_path / "a.bin", folder)
    (message,) = [str(w.message) for w in caught]
    assert (
        "chat.jsonl:1: message 3 (assistant): its tool call 'get_weather' is not in the chat template's rendering "
        "of the turn, so the reply would be trained without its call; use the model's own chat template, one with "
        "tool support" in message
    )
    assert "chat.jsonl:2: the chat template renders the record's 1 tool(s) as nothing" in message
    assert (
        "chat.jsonl:4: message 2 (assistant): its tool call 'get_weather' is not in the chat template's"
        in message
    )
    assert meta["n_documents"] == 1 and meta["n_bad_records"] == 3
    assert _kept_runs(tmp_path / "a.bin", folder) == _replies("<|im_end|>")[:2]
    with pytest.raises(
        DataError, match=r"chat\.jsonl:1: message 3 \(assistant\): its tool call 'get_weather'"
    ):
        _prepare(src, tmp_path / "s.bin", folder, strict=True)


_USER = {"role": "user", "content": "What is the weather in Paris?"}
_RESULT = {"role": "tool", "content": "18C", "name": "get_weather"}
_ANSWER = {"role": "assistant", "content": "It is 18C in Paris."}


def _with_call(**function) -> dict:
    return {
        "messages": [_USER, {"role": "assistant", "content": "", "tool_calls": [function]}, _RESULT, _ANSWER]
    }


BAD_TOOLS = [  # (record, words of its warning)
    (
        {"messages": [_USER, {"role": "assistant", "tool_calls": {"name": "get_weather"}}]},
        "message 2 (assistant) has tool_calls of type dict, not a list of",
    ),
    (
        _with_call(name="get_weather", arguments={}),
        'message 2 (assistant) tool call 1 is not {"type": "function"',
    ),
    (_with_call(type="function", function={"arguments": {}}), "tool call 1 has no function name"),
    (
        _with_call(type="function", function={"name": "get_weather"}),
        "tool call 1 (get_weather) has no arguments; write {} for a call without any",
    ),
    (
        _with_call(type="function", function={"name": "get_weather", "arguments": ["Paris"]}),
        "tool call 1 (get_weather) has arguments of type list; write them as an object",
    ),
    (
        _with_call(type="function", function={"name": "get_weather", "arguments": "city=Paris"}),
        "tool call 1 (get_weather) has arguments that are a string but not JSON",
    ),
    (
        _with_call(type="code", function={"name": "get_weather", "arguments": {}}),
        "tool call 1 has type 'code'; a chat template renders 'function' calls",
    ),
    (
        {"messages": [{**_USER, "tool_calls": [_call("Paris")]}, _ANSWER]},
        "message 1 (user) has tool_calls; only an assistant turn calls tools",
    ),
    (
        {"messages": [_USER, _RESULT, _ANSWER]},
        "message 2 (tool) is a tool result with no call before it (before it: the user's)",
    ),
    (
        {
            "messages": [
                _USER,
                {"role": "assistant", "content": "", "tool_calls": [_call("Paris")]},
                {"role": "tool"},
            ]
        },
        "message 3 (tool) has no content",
    ),
    (
        {
            "messages": [
                _USER,
                {"role": "assistant", "tool_calls": [_call("Paris")]},
                {**_RESULT, "content": {"t": 18}},
            ]
        },
        "message 3 (tool) has content of type dict, not a string",
    ),
    ({"messages": [_USER, {"role": "assistant", "tool_calls": []}]}, "message 2 (assistant) has no content"),
    (
        {**_with_call(**_call("Paris")), "tools": {"get_weather": WEATHER}},
        "field 'tools' is not a list of tool objects",
    ),
    ({**_with_call(**_call("Paris")), "tools": "[get_weather]"}, "field 'tools' is a string but not JSON"),
    (_with_call(**_call("<|im_end|>")), "message 2 (assistant) contains the special token '<|im_end|>'"),
]


def test_bad_tool_records_are_skipped_by_line_and_strict_stops(tmp_path):
    folder = _tokenizer(tmp_path / "tok", TOOLS_CHATML)
    good = {"messages": TOOL_CHATS[0], "tools": [WEATHER]}
    src = _chats(tmp_path, [good, *(r for r, _ in BAD_TOOLS)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = _prepare(src, tmp_path / "a.bin", folder)
    (message,) = [str(w.message) for w in caught]
    assert f"{len(BAD_TOOLS)} bad record(s) skipped" in message
    assert meta["n_documents"] == 1 and meta["n_bad_records"] == len(BAD_TOOLS)
    for record, words in BAD_TOOLS:  # each alone, with --strict: an error naming its line and the problem
        one = _chats(tmp_path, [good, record], "one.jsonl")
        with pytest.raises(
            DataError, match=r"--strict stops at the first\): .*one\.jsonl:2: .*" + _re(words)
        ):
            _prepare(one, tmp_path / "s.bin", folder, strict=True)


def _arguments_as_text(message: dict) -> dict:
    """``message`` with its tool calls' arguments written as JSON strings."""
    if "tool_calls" not in message:
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": _json_text(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _json_text(value: dict | str) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def test_parquet_tool_records_match_jsonl(tmp_path):
    """A Parquet list<struct> column holds a null for every field a message lacks (tool_calls of a user turn,
    content of a call, name of a reply): read as absent, the files equal those of the same records in JSONL.
    Arguments and tools are stored as JSON strings, as a struct column could not hold each call's own fields."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    folder = _tokenizer(tmp_path / "tok", TOOLS_CHATML)
    as_text = [[_arguments_as_text(m) for m in chat] for chat in TOOL_CHATS]
    pq.write_table(
        pa.table({"messages": as_text, "tools": [json.dumps([WEATHER])] * 2}), tmp_path / "t.parquet"
    )
    _prepare(tmp_path / "t.parquet", tmp_path / "p.bin", folder)
    _prepare(_chats(tmp_path, _tool_records()), tmp_path / "j.bin", folder)
    for name in ("bin", "mask"):
        assert (tmp_path / f"p.{name}").read_bytes() == (tmp_path / f"j.{name}").read_bytes()


def test_a_chat_prompt_of_system_messages_and_prompt_is_transformers_generation_prompt(tmp_path):
    """`generate --chat --system S --messages F --prompt P` continues [system S, *F, user P] rendered with the
    assistant header, exactly as transformers renders it for inference; without --prompt the file's last turn (a
    tool result here) is answered."""
    from transformers import AutoTokenizer

    from tessera.train.chat import ChatTemplate, chat_prompt

    folder = _tokenizer(tmp_path / "tok", TOOLS_CHATML)
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    chat = ChatTemplate(str(folder))
    history = TOOL_CHATS[0][1:4]  # user, assistant's call, tool result
    (tmp_path / "chat.json").write_text(json.dumps(history))
    system = {"role": "system", "content": SYSTEM}
    cases = [  # (--prompt, --system, --messages, the conversation)
        (
            "Thanks!",
            SYSTEM,
            tmp_path / "chat.json",
            [system, *history, {"role": "user", "content": "Thanks!"}],
        ),
        (None, None, tmp_path / "chat.json", history),
        ("Hi", SYSTEM, None, [system, {"role": "user", "content": "Hi"}]),
    ]
    for prompt, system_text, messages_file, messages in cases:
        conversation = chat_prompt(prompt, system_text, messages_file)
        assert conversation == messages
        expected = hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True
        )
        assert chat.prompt_ids(conversation) == list(expected["input_ids"])
    assert chat.prompt_ids(history) != chat.prompt_ids(history[:1])  # the history is rendered, not dropped


def test_a_chat_prompt_with_tools_is_transformers_generation_prompt(tmp_path):
    """`generate --chat --tools FILE.json` gives the file's schemas to the template: the prompt ids are
    transformers' `apply_chat_template(messages, tools=..., add_generation_prompt=True)`, with the schemas in
    them; a template without tool support is refused, since the model would never see the tools."""
    from transformers import AutoTokenizer

    from tessera.train.chat import ChatTemplate, chat_tools

    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    tools = chat_tools(tmp_path / "tools.json")
    assert tools == [WEATHER]
    (tmp_path / "empty.json").write_text("[]")
    assert chat_tools(tmp_path / "empty.json") is None
    folder = _tokenizer(tmp_path / "tok", TOOLS_CHATML)
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    chat = ChatTemplate(str(folder))
    for messages in ([TOOL_CHATS[0][1]], TOOL_CHATS[0][:4]):  # a question; the chat through a tool's result
        expected = hf.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=True
        )
        ids = chat.prompt_ids(messages, tools)
        assert ids == list(expected["input_ids"]) != chat.prompt_ids(messages)
        assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in hf.decode(ids)
    with pytest.raises(
        DataError,
        match=r"the run's chat template renders the 1 tool\(s\) of --tools as nothing .* or leave --tools out",
    ):
        ChatTemplate(str(_tokenizer(tmp_path / "plain", CHATML))).prompt_ids([TOOL_CHATS[0][1]], tools)
