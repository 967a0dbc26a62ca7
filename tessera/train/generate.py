"""``tessera generate``: sample text from a run's latest checkpoint, so a user sees what was learned.

The text goes to stdout whole, once decoded (what scripts read). A long run draws a progress line on stderr
when stderr is a terminal (`TokenProgress`); the text is not streamed token by token because decoding a
prefix need not give a prefix of the whole text (a UTF-8 character split over byte tokens, a BPE merge).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

import torch

from tessera.errors import DataError
from tessera.model.build import build_model, generate
from tessera.train import checkpoint as ckpt
from tessera.train.chat import ChatTemplate
from tessera.train.run_files import newest_weights, run_config
from tessera.train.tokenizer import Tokenizer, load_tokenizer

__all__ = ["TokenProgress", "generate_text", "newest_weights"]


def generate_text(
    run_dir: Path,
    prompt: str | list[dict],
    tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    top_p: float | None = None,
    kv_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
    stop: Sequence[str] = (),
    chat: bool = False,
    tools: list[dict] | None = None,
) -> str:
    """Load ``run_dir``'s config and newest weights in one process and continue ``prompt``; ``on_token(n)``
    is called after the n-th new token. Sampling ends early at a token of ``stop`` (each a text that is one
    token), which the text then leaves out. With ``chat`` the prompt is rendered with the run's tokenizer folder's
    chat template and the assistant header: a text as a user turn, a list as the messages so far (`chat_prompt`
    builds it from generate's flags), with ``tools`` (`chat_tools` reads --tools) given to the template; sampling
    ends at the template's end of turn, and the text is the reply alone. Otherwise the prompt is a text, and the
    text is the prompt and its continuation."""
    if tools is not None and not chat:
        raise DataError("tools are given to a chat template: pass chat=True (--chat) with them")
    cfg = run_config(run_dir)
    tok = load_tokenizer(cfg.data.tokenizer)
    stop_ids = {_one_token(tok, text) for text in stop}
    if chat:
        template = ChatTemplate(cfg.data.tokenizer)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        prompt_ids = template.prompt_ids(messages, tools)
        stop_ids.add(template.end_of_turn())
    elif isinstance(prompt, str):
        prompt_ids = tok.encode(prompt) or [0]
    else:
        raise DataError("a list of messages is a chat prompt: pass chat=True (--chat) to render it")
    model = build_model(cfg.model)
    ckpt.load_model_weights(newest_weights(run_dir), model)
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, t]
    out = generate(
        model,
        ids,
        tokens,
        temperature,
        top_k,
        torch.Generator().manual_seed(seed),
        top_p,
        kv_cache,
        on_token,
        frozenset(stop_ids),
    )[0].tolist()
    if out[-1] in stop_ids and len(out) > len(prompt_ids):
        out = out[:-1]
    return tok.decode(out[len(prompt_ids) :] if chat else out)


def _one_token(tok: Tokenizer, text: str) -> int:
    """The id of ``text``, which must be one token of ``tok`` (a stop is compared token by token)."""
    ids = tok.encode(text)
    if len(ids) != 1:
        raise DataError(
            f"--stop {text!r} is {len(ids)} tokens of the run's tokenizer, not one; pass a single token's text "
            "(e.g. a special token such as '<|im_end|>', or one character with the byte tokenizer)"
        )
    return ids[0]


class TokenProgress:
    """``generated 1,200/100,000 tokens, 35.2 tokens/s, 47 min left`` on ``stream``, redrawn in place (``\\r``)
    at most every ``interval`` seconds, the first time ``delay`` after the first token (a short run draws
    nothing); `close` erases it. Called once per token; ``clock`` is read once per call, so the writes are
    bounded by the run's time, not its tokens. The rate counts from the first token, so loading the model and
    the prompt's first pass are not in it."""

    def __init__(
        self,
        total: int,
        stream: TextIO,
        *,
        interval: float = 0.5,
        delay: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.stream, self.interval, self.delay, self.clock = total, stream, interval, delay, clock
        self.start: tuple[float, int] | None = None  # (time, tokens) at the first call
        self.due = 0.0
        self.width = 0  # of the line drawn last; 0 while none is shown
        self.writes = 0

    def __call__(self, done: int) -> None:
        now = self.clock()
        if self.start is None:
            self.start, self.due = (now, done), now + self.delay
        if now < self.due or done >= self.total:
            return
        self.due = now + self.interval
        rate = (done - self.start[1]) / max(now - self.start[0], 1e-9)
        left = _duration((self.total - done) / rate) if rate > 0 else "?"
        line = f"generated {done:,}/{self.total:,} tokens, {rate:.1f} tokens/s, {left} left"
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = len(line)
        self.writes += 1

    def close(self) -> None:
        """Erase the line (if one was drawn), so the terminal holds only the text."""
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
