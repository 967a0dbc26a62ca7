"""Chat records: a conversation rendered with a tokenizer folder's chat template, and the loss mask of its
assistant turns.

A record's ``messages`` field is a list of ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``
(the OpenAI / Hugging Face convention); an assistant turn may call tools (``"tool_calls": [{"type": "function",
"function": {"name": str, "arguments": {...}}}]``, its content then optional), a ``tool`` turn holds a call's
result, and the record's ``tools`` field (JSON schemas of the functions) is passed to the template as ``tools``
(Hugging Face's tool-use guide, https://huggingface.co/docs/transformers/main/en/chat_extras). Its document is the
template's rendering of the whole conversation, tokenized (``transformers``' ``apply_chat_template``; Hugging
Face, "Chat templates",
https://huggingface.co/docs/transformers/main/en/chat_templating, and "Writing a chat template",
https://huggingface.co/docs/transformers/main/en/chat_templating_writing). Its mask keeps the assistant turns:

- a template with ``{% generation %}`` markers: the tokens ``return_assistant_tokens_mask=True`` marks, i.e.
  whatever the template author put between the markers;
- otherwise, the prefix difference: assistant message i's tokens are those of ``messages[: i + 1]`` beyond those
  of ``messages[:i]`` rendered with the generation prompt (the assistant header). The shorter rendering's tokens
  must be a prefix of the longer's, and the longer's of the whole conversation's; a record where they are not is
  refused by name. The difference is the reply, the template's end-of-turn token and whatever the template writes
  after it (ChatML's newline): the span is cut after its last special token (``<|im_end|>``, ``<|eot_id|>``,
  ``</s>``), which the model must learn to emit to stop, and the formatting after it is context only. A template
  whose turns end without a special token keeps the whole difference.

An assistant turn's tool calls are part of its reply, so they are kept with it; tool results are context. A
template that renders nothing for a record's tool calls or tools (one written without tool support: transformers
passes them on and the template ignores them) would train a reply whose call vanished, so such a record is refused.

TRL's ``assistant_only_loss`` (https://huggingface.co/docs/trl/main/en/sft_trainer) is the same rule for templates
with generation markers.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import DataError
from tessera.train.tokenizer import _EOT_NAMES

__all__ = [
    "ROLES",
    "SEPARATORS",
    "ChatError",
    "ChatTemplate",
    "Conversation",
    "chat_prompt",
    "chat_tools",
    "conversation",
]

ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
_CALL = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'
_TOOL = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
SEPARATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
"""Names of special tokens that end a document, in order of preference: GPT-2's and Qwen's, Llama 3's, Llama 2's
and Mistral's, Gemma's (tessera's end-of-text names without Llama 3's end of turn, <|eot_id|>). `prepare` may
separate conversations with one of them when the tokenizer's EOS is the template's end of turn
(`ChatTemplate.separator`)."""


class ChatError(Exception):
    """A conversation the template cannot render, or whose assistant tokens cannot be told apart: a bad record."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """A record's messages, checked and cleaned by `conversation`, and the tools its template is given."""

    messages: list[dict]
    tools: list[dict] | None = None


def conversation(
    messages: Any, tools: Any, key: str = "messages", tools_key: str = "tools"
) -> tuple[Conversation | None, str | None]:
    """A record's ``key`` field (and its ``tools_key`` field, None when absent) as a conversation to train on, or
    what is wrong with it: messages as `_message` accepts them, holding an assistant turn, not opening with one
    (nothing would render before it as its prompt); tools a list of objects (or a string holding one, as datasets
    often store them)."""
    cleaned, problem = _messages(messages, f"field {key!r}")
    if problem is not None:
        return None, problem
    if not any(m["role"] == "assistant" for m in cleaned):
        return None, f"no assistant turn in {key!r} ({len(cleaned)} message(s)): nothing to train on"
    if cleaned[0]["role"] == "assistant":
        return (
            None,
            "message 1 is the assistant's: nothing precedes it to be its prompt; open with a system or user turn",
        )
    schemas, problem = _tools(tools, f"field {tools_key!r}")
    if problem is not None:
        return None, f"{problem}; write it as a list of tool objects, or name the tools field: --tools-key"
    return Conversation(cleaned, schemas), None


def chat_prompt(
    prompt: str | None, system: str | None = None, messages: str | Path | None = None
) -> list[dict]:
    """The conversation `tessera generate --chat` continues: ``system`` as the system turn, the chat so far from
    the JSON file ``messages`` (a list of messages, checked as a record's are), then ``prompt`` as the user's
    turn; the model writes the next assistant turn. DataError naming the flag and the fix: no user turn at all, a
    file that is not a list of messages, two system turns, a conversation ending with the assistant's turn (there
    is nothing to answer)."""
    if prompt is None and messages is None:
        raise DataError("--chat needs the user's turn: pass --prompt TEXT, or --messages FILE.json")
    history: list[dict] = []
    if messages is not None:
        source = f"--messages {str(messages)!r}"
        shape = '; write the chat so far as a JSON list of {"role": ..., "content": ...} objects'
        history, problem = _messages(_json_file(messages, source, shape), "the file")
        if problem is not None:
            raise DataError(f"{source}: {problem}{shape}")
        if history and history[0]["role"] == "system" and system is not None:
            raise DataError(f"{source} opens with a system turn and --system gives another; pass one of them")
        if prompt is None and not history:
            raise DataError(f"{source} holds no message; add the user's turn to it, or pass --prompt TEXT")
        if prompt is None and history[-1]["role"] == "assistant":
            raise DataError(
                f"{source} ends with the assistant's turn (message {len(history)}), so there is no turn to "
                "answer; add the user's next turn (or the results of its tool calls) to the file, or pass it "
                "with --prompt TEXT"
            )
    system_turn = [{"role": "system", "content": system}] if system is not None else []
    user_turn = [{"role": "user", "content": prompt}] if prompt is not None else []
    return [*system_turn, *history, *user_turn]


def chat_tools(path: str | Path) -> list[dict] | None:
    """The tools `tessera generate --chat --tools FILE.json` gives the template: the file's JSON list of tool
    schemas, as a record's tools field holds them (None for an empty list). DataError naming the flag and the fix
    when the file cannot be read, is not JSON or is not a list of objects."""
    source = f"--tools {str(path)!r}"
    shape = f"; write the tools as a JSON list of schemas such as [{_TOOL}]"
    tools, problem = _tools(_json_file(path, source, shape), "the file")
    if problem is not None:
        raise DataError(f"{source}: {problem}{shape}")
    return tools


def _json_file(path: str | Path, source: str, shape: str) -> Any:
    """The JSON value of file ``path``; DataError naming ``source`` (the flag) when it cannot be read or is not
    JSON, with ``shape`` (what to write)."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8-sig"))  # a leading BOM ignored
    except OSError as e:
        raise DataError(f"{source} cannot be read ({e.strerror}); pass an existing JSON file") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{source} is not JSON ({e}){shape}") from None


def _messages(value: Any, what: str) -> tuple[list[dict] | None, str | None]:
    """The messages of ``value`` (``what`` names it in a problem), each cleaned by `_message`, with every tool
    result after a tool call (or another result), or what is wrong."""
    if not isinstance(value, list):
        return None, f"{what} has type {type(value).__name__}, not a list of messages"
    cleaned: list[dict] = []
    for n, raw in enumerate(value, 1):
        message, problem = _message(raw, n)
        if problem is not None:
            return None, problem
        if message["role"] == "tool" and not (
            cleaned and (cleaned[-1]["role"] == "tool" or "tool_calls" in cleaned[-1])
        ):
            before = f"the {cleaned[-1]['role']}'s" if cleaned else "nothing"
            return None, (
                f"message {n} (tool) is a tool result with no call before it (before it: {before}); put the "
                "assistant turn whose tool_calls it answers before it"
            )
        cleaned.append(message)
    return cleaned, None


def _message(value: Any, n: int) -> tuple[dict | None, str | None]:
    """Message ``n`` as the template is given it, or what is wrong: an object with a role of `ROLES` and string
    content, or an assistant turn with tool calls (`_tool_calls`) and optional content. Null fields are left out,
    as absent ones (a Parquet or Arrow struct column holds a null for each field a message lacks), and an empty
    ``tool_calls`` is no calls."""
    if not isinstance(value, dict):
        return None, f"message {n} is a {type(value).__name__}, not an object with 'role' and 'content'"
    message = {k: v for k, v in value.items() if v is not None and not (k == "tool_calls" and v == [])}
    role = message.get("role")
    if role not in ROLES:
        return None, f"message {n} has role {role!r}; the roles are {', '.join(ROLES)}"
    if "tool_calls" in message:
        if role != "assistant":
            return None, f"message {n} ({role}) has tool_calls; only an assistant turn calls tools"
        calls, problem = _tool_calls(message["tool_calls"], n)
        if problem is not None:
            return None, problem
        message["tool_calls"] = calls
    content = message.get("content")
    if content is None and "tool_calls" not in message:
        return None, f"message {n} ({role}) has no content"
    if content is not None and not isinstance(content, str):
        return None, f"message {n} ({role}) has content of type {type(content).__name__}, not a string"
    for field in ("name", "tool_call_id"):
        if role == "tool" and not isinstance(message.get(field, ""), str):
            return (
                None,
                f"message {n} (tool) has a {field!r} of type {type(message[field]).__name__}, not a string",
            )
    return message, None


def _tool_calls(value: Any, n: int) -> tuple[list[dict] | None, str | None]:
    """An assistant turn's tool calls as transformers' templates take them (``{"type": "function", "function":
    {"name", "arguments"}}``, the arguments an object), or what is wrong. Arguments given as a string holding a
    JSON object (what OpenAI's API returns) are parsed: templates write ``arguments | tojson`` and would quote
    a string."""
    if not isinstance(value, list):
        return (
            None,
            f"message {n} (assistant) has tool_calls of type {type(value).__name__}, not a list of {_CALL}",
        )
    calls = []
    for c, raw in enumerate(value, 1):
        where = f"message {n} (assistant) tool call {c}"
        if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
            return None, f"{where} is not {_CALL}"
        call = {k: v for k, v in raw.items() if v is not None}
        if call.get("type", "function") != "function":
            return None, f"{where} has type {call['type']!r}; a chat template renders 'function' calls"
        function = {k: v for k, v in call["function"].items() if v is not None}
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            return None, f"{where} has no function name (a non-empty string at function.name)"
        arguments = function.get("arguments")
        if arguments is None:
            return None, f"{where} ({name}) has no arguments; write {{}} for a call without any"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return (
                    None,
                    f"{where} ({name}) has arguments that are a string but not JSON; write them as an object",
                )
        if not isinstance(arguments, dict):
            return None, (
                f"{where} ({name}) has arguments of type {type(arguments).__name__}; write them as an object of "
                "parameter names and values"
            )
        calls.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return calls, None


def _tools(value: Any, what: str) -> tuple[list[dict] | None, str | None]:
    """Tools (JSON schemas of the functions a conversation may call), None when there are none, or what is wrong
    with ``what`` (a record's field, generate's file); a string holding the list is read, as datasets often store
    it."""
    if value is None or value == [] or value == "":
        return None, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            return None, f"{what} is a string but not JSON ({e})"
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        return None, f"{what} is not a list of tool objects (JSON schemas such as {_TOOL})"
    return value or None, None


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value (object keys too), depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _rank(name: str) -> int:
    return _EOT_NAMES.index(name) if name in _EOT_NAMES else len(_EOT_NAMES)


class ChatTemplate:
    """The chat template of a `save_pretrained` tokenizer folder, loaded from local files only."""

    def __init__(self, spec: str) -> None:
        folder = Path(spec)
        if spec == "byte" or not folder.is_dir():
            what = "byte tokens" if spec == "byte" else "a tokenizer file, not a folder"
            raise DataError(
                f"--messages-key renders conversations with the model's chat template, but --tokenizer {spec!r} is "
                f"{what}; pass the chat model's tokenizer folder (as save_pretrained writes it: tokenizer.json "
                "with tokenizer_config.json or chat_template.jinja)"
            )
        try:
            from transformers import AutoTokenizer  # optional dependency, imported only for chat records
        except ImportError:
            raise DataError(
                "--messages-key needs the `transformers` package (chat templates), which is not installed; run "
                "`pip install 'tessera[hf]'`"
            ) from None
        try:
            self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # transformers raises many types (OSError, ValueError, its own)
            raise DataError(f"tokenizer folder {spec!r} could not be loaded by transformers: {e}") from None
        self.template = self._template(spec)
        self.marked = bool(_GENERATION.search(self.template))
        """The template has {% generation %} markers: its own assistant mask is used."""
        self.sha256 = hashlib.sha256(self.template.encode()).hexdigest()
        special = {i: t.content for i, t in self.tok.added_tokens_decoder.items() if t.special}
        special.update(zip(self.tok.all_special_ids, self.tok.all_special_tokens, strict=True))
        self._special_ids = np.array(sorted(special), dtype=np.int64)
        names = sorted(set(special.values()), key=len, reverse=True)  # longest first: '<|im_end|>' over '<'
        self._special_text = re.compile("|".join(map(re.escape, names))) if names else None

    def _template(self, spec: str) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise DataError(
                f"tokenizer folder {spec!r} has no chat template (no chat_template in tokenizer_config.json, no "
                "chat_template.jinja), so its conversations cannot be rendered as the model will see them; copy "
                "chat_template.jinja (or tokenizer_config.json) from the chat model's folder into it, or prepare "
                "prompt/completion records with --prompt-key/--completion-key"
            )
        try:
            return self.tok.get_chat_template()
        except ValueError as e:  # several named templates and no "default"
            raise DataError(f"tokenizer folder {spec!r}: {e}") from None

    def probe(self) -> list[int]:
        """The tokens of a two-turn conversation: what the template writes around every turn. DataError when it
        cannot render a user turn and an assistant turn at all."""
        try:
            return self._ids(_PROBE)
        except ChatError as e:
            raise DataError(
                f"the chat template cannot render a user turn and an assistant turn: {e}"
            ) from None

    def special_name(self, token: int) -> str:
        """The text of token id ``token``."""
        return self.tok.convert_ids_to_tokens(int(token))

    def special_tokens(self) -> list[int]:
        """The special token ids, those named like an end of text (`_EOT_NAMES`) first."""
        ids = [int(i) for i in self._special_ids]
        return sorted(ids, key=lambda i: (_rank(self.special_name(i)), i))

    def never_writes(self, token: int, written: list[int]) -> bool:
        """Whether the template never writes special token ``token``: it is not in ``written`` (a rendering, the
        probe's), its text is nowhere in the template's source, and it is no named special token (bos_token,
        eos_token, pad_token, ...) whose variable the template reads (transformers passes them to the template).
        The source check catches what a two-turn probe does not render (a branch for tools or a system turn)."""
        name = self.special_name(token)
        variables = [attr for attr, text in self.tok.special_tokens_map.items() if text == name]
        return (
            token not in written
            and name not in self.template
            and not any(re.search(rf"\b{attr}\b", self.template) for attr in variables)
        )

    def separator(self, written: list[int]) -> int | None:
        """A special token to end each conversation with when the tokenizer's EOS ends turns: the first, in the
        order of `SEPARATORS`, of the tokenizer's special tokens named as a document's end that the template never
        writes (`never_writes`); None when none is."""
        by_name = {self.special_name(t): t for t in self.special_tokens()}
        return next(
            (by_name[n] for n in SEPARATORS if n in by_name and self.never_writes(by_name[n], written)), None
        )

    def encode(self, chat: Conversation) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 [n], mask uint8 [n]) of a conversation `conversation` accepted; ChatError naming the
        message when it cannot be rendered, its tools or tool calls are not rendered, or its assistant tokens
        cannot be told apart."""
        self._check_text(chat)
        self._check_tools_rendered(chat)
        if self.marked:
            out = self._render(chat.messages, chat.tools, return_assistant_tokens_mask=True)
            ids = np.asarray(out["input_ids"], dtype=np.int64)
            mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
            if not mask.any():
                raise ChatError(
                    "the template's {% generation %} markers keep no token of its assistant turns"
                )
            return ids, mask
        whole = self._ids(chat.messages, chat.tools)
        mask = np.zeros(len(whole), np.uint8)
        for i, message in enumerate(chat.messages):
            if message["role"] == "assistant":
                start, end = self._span(chat, i, whole)
                mask[start:end] = 1
        return np.asarray(whole, dtype=np.int64), mask

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The tokens a chat model continues: ``messages`` (and ``tools``, generate's --tools) rendered with the
        assistant header (the generation prompt), as at inference. DataError when the template refuses them, or
        renders the tools as nothing (a template without tool support: the model would never see them)."""
        try:
            if tools is not None and self._text(messages, tools) == self._text(messages, None):
                raise DataError(
                    f"the run's chat template renders the {len(tools)} tool(s) of --tools as nothing (it has no "
                    "tool support: the conversation reads the same without them), so the model would never see "
                    "them; use the model's own chat template, one that reads `tools`, or leave --tools out"
                )
            return self._ids(messages, tools, add_generation_prompt=True)
        except ChatError as e:
            raise DataError(str(e)) from None

    def end_of_turn(self) -> int:
        """The special token that ends an assistant turn (`<|im_end|>`, `<|eot_id|>`): the last special token of
        the reply `encode` keeps in a two-turn conversation. DataError when the template ends turns without one."""
        ids, mask = self.encode(Conversation(_PROBE))
        kept = ids[mask.astype(bool)]
        special = kept[np.isin(kept, self._special_ids)]
        if not len(special):
            raise DataError(
                "the chat template ends an assistant turn without a special token, so generation cannot tell "
                "where a reply ends; pass --stop with the text that ends a turn"
            )
        return int(special[-1])

    def _span(self, chat: Conversation, i: int, whole: list[int]) -> tuple[int, int]:
        """[start, end) of assistant message i's tokens in ``whole``: the prefix difference, cut after its last
        special token (the end of turn)."""
        head = self._ids(chat.messages[:i], chat.tools, add_generation_prompt=True)
        turn = self._ids(chat.messages[: i + 1], chat.tools)
        for short, long, what in (
            (head, turn, "before it with the assistant header"),
            (turn, whole, "through it"),
        ):
            if long[: len(short)] != short:
                at = next((k for k, (a, b) in enumerate(zip(short, long, strict=False)) if a != b), len(long))
                raise ChatError(
                    f"message {i + 1} (assistant): the template's tokens of the conversation {what} are not a "
                    f"prefix of those of the conversation {'through it' if short is head else 'as a whole'} "
                    f"(they differ at token {at}), so its reply cannot be told apart: the template renders earlier "
                    "turns differently from the last (as templates that strip reasoning from earlier assistant "
                    "turns do), or the tokenizer merges tokens across the boundary; put "
                    "{% generation %}...{% endgeneration %} around the assistant content and end-of-turn token in "
                    "the template (chat_template.jinja), or drop the record"
                )
        reply = np.asarray(turn[len(head) :], dtype=np.int64)
        special = np.flatnonzero(np.isin(reply, self._special_ids))
        return len(head), len(head) + (int(special[-1]) + 1 if len(special) else len(reply))

    def _check_tools_rendered(self, chat: Conversation) -> None:
        """A template written without tool support renders nothing for a record's tools and tool calls (they are
        variables it never reads): refused, since the model would learn replies whose calls vanished, or calls of
        functions it is never shown. A call counts as rendered when its function's name appears once more in the
        rendering of the conversation through its turn than in the same rendering without the turn's calls."""
        fix = (
            "use the model's own chat template, one with tool support (it reads `tools` and `tool_calls`), or "
            "drop the record"
        )
        if chat.tools is not None and self._text(chat.messages, chat.tools) == self._text(
            chat.messages, None
        ):
            raise ChatError(
                f"the chat template renders the record's {len(chat.tools)} tool(s) as nothing (the conversation "
                f"reads the same without them), so the calls would be trained on functions the model is never "
                f"shown; {fix}"
            )
        for i, message in enumerate(chat.messages):
            if "tool_calls" not in message:
                continue
            with_calls = self._text(chat.messages[: i + 1], chat.tools)
            bare = {k: v for k, v in message.items() if k != "tool_calls"}
            try:
                without = self._text(
                    [*chat.messages[:i], {**bare, "content": bare.get("content", "")}], chat.tools
                )
            except ChatError:  # the template refuses an assistant turn without calls: count every occurrence
                without = ""
            calls = Counter(call["function"]["name"] for call in message["tool_calls"])
            for name, count in calls.items():
                if with_calls.count(name) - without.count(name) < count:
                    raise ChatError(
                        f"message {i + 1} (assistant): its tool call {name!r} is not in the chat template's "
                        f"rendering of the turn, so the reply would be trained without its call; {fix}"
                    )

    def _check_text(self, chat: Conversation) -> None:
        """A special token written in a message (its content, tool calls or fields) or in a tool's schema would be
        read as the template's own (a turn ended or begun inside a message): refused, as a document holding the
        end-of-text token is."""
        if self._special_text is None:
            return
        parts = [(f"message {n} ({m['role']})", m) for n, m in enumerate(chat.messages, 1)]
        for where, value in [*parts, *((f"tool {n}", t) for n, t in enumerate(chat.tools or (), 1))]:
            for text in _strings(value):
                found = self._special_text.search(text)
                if found:
                    raise ChatError(
                        f"{where} contains the special token {found.group()!r}, which the template's tokens "
                        "would not be told apart from; remove it from the text"
                    )

    def _ids(self, messages: list[dict], tools: list[dict] | None = None, **options: Any) -> list[int]:
        return list(self._render(messages, tools, **options)["input_ids"])

    def _text(self, messages: list[dict], tools: list[dict] | None) -> str:
        return self._render(messages, tools, tokenize=False)

    def _render(self, messages: list[dict], tools: list[dict] | None, **options: Any) -> Any:
        options = {"tokenize": True, "return_dict": True, **options}
        if not options["tokenize"]:
            options.pop("return_dict")
        try:
            return self.tok.apply_chat_template(messages, tools=tools, **options)
        # jinja2's TemplateError, a template's raise_exception, transformers' ValueError: all a bad record
        except Exception as e:
            raise ChatError(f"the chat template refused it: {e}") from None
