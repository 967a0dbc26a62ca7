"""Chat records: a conversation rendered with a tokenizer folder's chat template, and the loss mask of its
assistant turns.

A record's ``messages`` field is a list of ``{"role": "system" | "user" | "assistant", "content": str}`` (the
OpenAI / Hugging Face convention). Its document is the template's rendering of the whole conversation, tokenized
(``transformers``' ``apply_chat_template``; Hugging Face, "Chat templates",
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

TRL's ``assistant_only_loss`` (https://huggingface.co/docs/trl/main/en/sft_trainer) is the same rule for templates
with generation markers.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import DataError
from tessera.train.tokenizer import _EOT_NAMES

__all__ = ["ROLES", "ChatError", "ChatTemplate", "messages_problem"]

ROLES = ("system", "user", "assistant")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


class ChatError(Exception):
    """A conversation the template cannot render, or whose assistant tokens cannot be told apart: a bad record."""


def messages_problem(value: Any, key: str) -> str | None:
    """What is wrong with a record's ``key`` field as a conversation to train on, or None: a list of messages
    with a role of `ROLES` and string content, holding an assistant turn, not opening with one (nothing would
    render before it as its prompt)."""
    if not isinstance(value, list):
        return f"field {key!r} has type {type(value).__name__}, not a list of messages"
    for n, message in enumerate(value, 1):
        if not isinstance(message, dict):
            return f"message {n} is a {type(message).__name__}, not an object with 'role' and 'content'"
        role = message.get("role")
        if role not in ROLES:
            return f"message {n} has role {role!r}; the roles are {', '.join(ROLES)}"
        content = message.get("content")
        if content is None:
            return f"message {n} ({role}) has no content"
        if not isinstance(content, str):
            return f"message {n} ({role}) has content of type {type(content).__name__}, not a string"
    if not any(m["role"] == "assistant" for m in value):
        return f"no assistant turn in {key!r} ({len(value)} message(s)): nothing to train on"
    if value[0]["role"] == "assistant":
        return "message 1 is the assistant's: nothing precedes it to be its prompt; open with a system or user turn"
    return None


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

    def encode(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 [n], mask uint8 [n]) of a conversation `messages_problem` accepted; ChatError naming the
        message when it cannot be rendered or its assistant tokens cannot be told apart."""
        self._check_text(messages)
        if self.marked:
            out = self._render(messages, return_assistant_tokens_mask=True)
            ids = np.asarray(out["input_ids"], dtype=np.int64)
            mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
            if not mask.any():
                raise ChatError(
                    "the template's {% generation %} markers keep no token of its assistant turns"
                )
            return ids, mask
        whole = self._ids(messages)
        mask = np.zeros(len(whole), np.uint8)
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                start, end = self._span(messages, i, whole)
                mask[start:end] = 1
        return np.asarray(whole, dtype=np.int64), mask

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The tokens a chat model continues: ``messages`` rendered with the assistant header (the generation
        prompt), as at inference."""
        try:
            return self._ids(messages, add_generation_prompt=True)
        except ChatError as e:
            raise DataError(str(e)) from None

    def end_of_turn(self) -> int:
        """The special token that ends an assistant turn (`<|im_end|>`, `<|eot_id|>`): the last special token of
        the reply `encode` keeps in a two-turn conversation. DataError when the template ends turns without one."""
        ids, mask = self.encode(_PROBE)
        kept = ids[mask.astype(bool)]
        special = kept[np.isin(kept, self._special_ids)]
        if not len(special):
            raise DataError(
                "the chat template ends an assistant turn without a special token, so generation cannot tell "
                "where a reply ends; pass --stop with the text that ends a turn"
            )
        return int(special[-1])

    def _span(self, messages: list[dict], i: int, whole: list[int]) -> tuple[int, int]:
        """[start, end) of assistant message i's tokens in ``whole``: the prefix difference, cut after its last
        special token (the end of turn)."""
        head = self._ids(messages[:i], add_generation_prompt=True)
        turn = self._ids(messages[: i + 1])
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

    def _check_text(self, messages: list[dict]) -> None:
        """A special token written in a message would be read as the template's own (a turn ended or begun
        inside a message): refused, as a document holding the end-of-text token is."""
        if self._special_text is None:
            return
        for n, message in enumerate(messages, 1):
            found = self._special_text.search(message["content"])
            if found:
                raise ChatError(
                    f"message {n} ({message['role']}) contains the special token {found.group()!r}, which the "
                    "template's tokens would not be told apart from; remove it from the text"
                )

    def _ids(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        return list(self._render(messages, add_generation_prompt=add_generation_prompt)["input_ids"])

    def _render(self, messages: list[dict], **options: Any) -> Any:
        try:
            return self.tok.apply_chat_template(messages, tokenize=True, return_dict=True, **options)
        # jinja2's TemplateError, a template's raise_exception, transformers' ValueError: all a bad record
        except Exception as e:
            raise ChatError(f"the chat template refused it: {e}") from None
