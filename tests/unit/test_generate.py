"""`generate`: the KV cache computes what the uncached model computes; top-p keeps the nucleus; the CLI rejects
unknown flags of generate, plot, export, schedule and prepare, and names a wrong run folder (or checkpoint, or
--ranks) of generate, export, plot and dryrun before importing torch.

Tolerance for cached vs uncached logits: the same fp32 arithmetic with the attention over a different number of
queries (one new token vs the whole context), so rounding only (measured ~1e-7); 1e-5 relative is stated.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.cli import main
from tessera.config import from_dict
from tessera.model.build import _nucleus, build_model, generate
from tessera.model.layers import KVCache
from tessera.train.generate import TokenProgress


def _model(size: str):
    torch.manual_seed(0)
    cfg = from_dict({"model": {"size": size, "seq_len": 16}}).model
    return build_model(cfg).eval(), cfg


@pytest.mark.parametrize("size", ["gpt2-tiny", "llama-tiny", "qwen3-tiny"])  # Qwen3: keys cached normalised
def test_cached_decoding_matches_the_full_forward(size: str) -> None:
    model, cfg = _model(size)
    tokens = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = KVCache(cfg.n_layers)
    with torch.no_grad():
        model(tokens[:, :3], cache=cache)  # prefill three positions, then one token at a time
        for t in range(3, tokens.shape[1]):
            step = model(tokens[:, t : t + 1], cache=cache)[:, -1]
            torch.testing.assert_close(step, model(tokens[:, : t + 1])[:, -1], rtol=1e-5, atol=1e-6)
    assert cache.length == tokens.shape[1]


@pytest.mark.parametrize("size", ["gpt2-tiny", "llama-tiny"])
def test_greedy_generation_is_the_same_with_and_without_the_cache(size: str) -> None:
    model, cfg = _model(size)
    prompt = torch.randint(0, cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(2))
    # 20 new tokens run past seq_len = 16: the cached path hands over to the sliding window
    cached = generate(model, prompt, 20, temperature=0)
    plain = generate(model, prompt, 20, temperature=0, kv_cache=False)
    assert torch.equal(cached, plain)


def _first_stop(row: list[int], stop: set[int]) -> int:
    """How many tokens of ``row`` generation keeps when it ends at a token of ``stop``: through the first one."""
    return next((i + 1 for i, t in enumerate(row) if t in stop), len(row))


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cached", "uncached"])
def test_generation_ends_once_every_row_has_sampled_a_stop_token(kv_cache: bool) -> None:
    """Greedy, so the run with stops is the run without them cut: one row ends through its first stop token; two
    rows end when the later of their first stops is sampled (the earlier row samples on, as before)."""
    model, cfg = _model("llama-tiny")
    prompt = torch.randint(0, cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3))
    full = generate(model, prompt, 12, temperature=0, kv_cache=kv_cache)[:, 4:]  # [2, 12]
    rows = full.tolist()
    stop = {rows[0][3]}  # a token of row 0's continuation, at or before its 4th place
    one = generate(model, prompt[:1], 12, temperature=0, kv_cache=kv_cache, stop=frozenset(stop))
    assert torch.equal(one[0, 4:], full[0, : _first_stop(rows[0], stop)])
    both = generate(model, prompt, 12, temperature=0, kv_cache=kv_cache, stop=frozenset(stop))
    assert torch.equal(both[:, 4:], full[:, : max(_first_stop(r, stop) for r in rows)])
    assert _first_stop(rows[0], stop) < 12  # the cut is real


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    assert torch.equal(_nucleus(probs, 0.7), torch.tensor([[0.0, 0.5, 0.0, 0.3]]))
    assert torch.equal(_nucleus(probs, 0.81), torch.tensor([[0.0, 0.5, 0.15, 0.3]]))
    assert torch.equal(_nucleus(probs, 0.01), torch.tensor([[0.0, 0.5, 0.0, 0.0]]))  # the top one always


def test_a_tiny_top_p_samples_the_most_likely_token() -> None:
    model, cfg = _model("llama-tiny")
    prompt = torch.randint(0, cfg.vocab_size, (3, 4), generator=torch.Generator().manual_seed(3))
    sampled = generate(
        model, prompt, 6, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(sampled, generate(model, prompt, 6, temperature=0))
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 1, top_p=1.5)


UNKNOWN_FLAG_COMMANDS = [
    ["generate", "runs/x"],
    ["plot", "runs/x"],
    ["export", "runs/x"],
    ["schedule", "show", "gpipe", "--pp", "2", "--microbatches", "2"],
    ["prepare", "texts", "--out", "tokens.bin"],
]


@pytest.mark.parametrize("command", UNKNOWN_FLAG_COMMANDS)
def test_unknown_flags_are_rejected(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--bogus", "1"]) == 2
    assert "unrecognised arguments ['--bogus', '1']" in capsys.readouterr().err


def test_bad_top_p_is_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "runs/x", "--top-p", "0"]) == 2
    assert "--top-p 0.0 must be in (0, 1]" in capsys.readouterr().err


SHARDED_LAYOUT = "data 1 × pipeline 1 × tensor 2 = 2 ranks"
BAD_INPUT = [  # (command, with {run folder} placeholders, then the words its message must hold)
    (
        ["generate", "{missing}"],
        "run directory {missing} does not exist; pass the run directory that `tessera train` wrote",
    ),
    (["generate", "{torn}"], "config.json is not a JSON object of config sections"),
    (["generate", "{untrained}", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["generate", "{untrained}", "--tokens", "0"], "--tokens 0 must be at least 1"),
    (["generate", "{untrained}", "--tokens", "-5"], "--tokens -5 must be at least 1"),
    (["generate", "{untrained}", "--temperature", "nan"], "--temperature nan must be a finite number"),
    (["generate", "{untrained}", "--top-k", "0"], "--top-k 0 must be at least 1"),
    (["generate", "{untrained}", "--top-k", "-1"], "--top-k -1 must be at least 1"),
    (["generate", "{untrained}", "--seed", str(2**64)], f"--seed {2**64} must fit in 64 bits"),
    (
        ["generate", "{untrained}"],
        "no complete checkpoint in {untrained}/checkpoints; train with checkpoint.every",
    ),
    (["generate", "{sharded}"], "holds the weights split over 2 ranks (" + SHARDED_LAYOUT + ")"),
    (
        ["generate", "{empty}"],
        "{empty} has no config.json; pass the run directory that `tessera train` wrote",
    ),
    # generate --chat's conversation: --messages names its file's problem and the fix, before the run is read
    (
        ["generate", "{missing}", "--system", "Be brief."],
        "--system builds a chat prompt, which needs --chat; add --chat",
    ),
    (
        ["generate", "{missing}", "--messages", "{chat_ok}"],
        "--messages builds a chat prompt, which needs --chat",
    ),
    (
        ["generate", "{missing}", "--chat", "--system", "Be brief."],
        "--chat needs the user's turn: pass --prompt",
    ),
    (
        ["generate", "{missing}", "--chat", "--messages", "{chat_record}"],
        "--messages '{chat_record}': the file has type dict, not a list of messages; write the chat so far as a "
        'JSON list of {{"role": ..., "content": ...}} objects',
    ),
    (
        ["generate", "{missing}", "--chat", "--messages", "{chat_no_role}"],
        "--messages '{chat_no_role}': message 2 has role None; the roles are system, user, assistant, tool",
    ),
    (
        ["generate", "{missing}", "--chat", "--messages", "{chat_answered}"],
        "--messages '{chat_answered}' ends with the assistant's turn (message 2), so there is no turn to answer; "
        "add the user's next turn (or the results of its tool calls) to the file, or pass it with --prompt TEXT",
    ),
    (
        ["generate", "{missing}", "--chat", "--messages", "{chat_text}"],
        "--messages '{chat_text}' is not JSON",
    ),
    (
        ["generate", "{missing}", "--chat", "--messages", "{missing}.json", "--prompt", "Hi"],
        "--messages '{missing}.json' cannot be read (No such file or directory)",
    ),
    (
        ["generate", "{missing}", "--chat", "--messages", "{chat_system}", "--system", "Be brief."],
        "--messages '{chat_system}' opens with a system turn and --system gives another; pass one of them",
    ),
    (
        ["generate", "{missing}", "--tools", "{tools_ok}"],
        "--tools builds a chat prompt, which needs --chat; add --chat",
    ),
    (
        ["generate", "{missing}", "--chat", "--prompt", "Hi", "--tools", "{missing}.json"],
        "--tools '{missing}.json' cannot be read (No such file or directory); pass an existing JSON file",
    ),
    (
        ["generate", "{missing}", "--chat", "--prompt", "Hi", "--tools", "{chat_text}"],
        "--tools '{chat_text}' is not JSON",
    ),
    (
        ["generate", "{missing}", "--chat", "--prompt", "Hi", "--tools", "{tools_one}"],
        "--tools '{tools_one}': the file is not a list of tool objects (JSON schemas such as "
        '{{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}); write the tools as a JSON '
        "list of schemas",
    ),
    (
        ["generate", "{missing}", "--chat", "--messages", "{chat_ok}", "--tools", "{tools_ok}"],
        "run directory {missing} does not exist",
    ),
    (["export", "{missing}"], "run directory {missing} does not exist"),
    (["export", "{empty}", "--nproc", "2"], "{empty} has no config.json"),  # the launcher's path
    (["export", "{untrained}"], "no complete checkpoint in {untrained}/checkpoints"),
    (["export", "{untrained}", "--checkpoint", "{missing}"], "checkpoint directory {missing} does not exist"),
    (["export", "{untrained}", "--nproc", "0"], "--nproc 0 must be at least 1"),
    (["export", "{untrained}", "--out", "{missing}"], "--out {missing} applies to --format hf"),
    (
        ["export", "{sharded}", "--nproc", "3"],
        "was saved by 2 ranks (" + SHARDED_LAYOUT + "), but export was",
    ),
    (["export", "{exported}", "--checkpoint", "{exported}/export/step_00000004"], "is already an export"),
    (["plot", "{missing}"], "{missing}/metrics.jsonl does not exist"),
    (["plot", "{untrained}"], "{untrained}/metrics.jsonl has no loss records"),
    (
        ["dryrun", "--world-size", "2", "--model.size=gpt2-tiny", "--ranks", "5"],
        "--ranks entry '5' is not a rank",
    ),
]


def _checkpoint(folder: Path, **meta: object) -> None:
    """A complete checkpoint as the lookups see it: meta.json marked complete next to DCP's index."""
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"step": 4, "complete": True, **meta}))
    (folder / ".metadata").write_bytes(b"")


def _run_folders(root: Path) -> dict[str, Path]:
    """A missing run folder, an empty one, one with a torn config.json, one trained without a checkpoint (an empty metrics
    file), one whose checkpoint holds tensor-parallel shards (format 1) and one with only an export."""
    runs = {name: root / name for name in ("missing", "empty", "torn", "untrained", "sharded", "exported")}
    config = json.dumps(from_dict({"model": {"size": "gpt2-tiny"}}).to_dict())
    for name in ("torn", "untrained", "sharded", "exported"):
        runs[name].mkdir()
        (runs[name] / "config.json").write_text(config if name != "torn" else config[:20])
    runs["empty"].mkdir()
    (runs["untrained"] / "metrics.jsonl").write_text("")
    _checkpoint(
        runs["sharded"] / "checkpoints" / "step_00000004",
        format=1,
        world_size=2,
        layout=SHARDED_LAYOUT,
        shard_ids=["tensor0", "tensor1"],
    )
    _checkpoint(runs["exported"] / "export" / "step_00000004", format=2, world_size=1, weights_only=True)
    return runs


def _message_files(root: Path) -> dict[str, Path]:
    """--messages files: a good chat so far, one record object instead of a list, a message without a role, one
    ending with the assistant's turn, one opening with a system turn, and text that is not JSON; --tools files: a
    list of one schema, and the schema alone."""
    user, reply = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    values = {
        "tools_ok": [tool],
        "tools_one": tool,
        "chat_ok": [user],
        "chat_record": {"messages": [user]},
        "chat_no_role": [user, {"content": "Hello"}],
        "chat_answered": [user, reply],
        "chat_system": [{"role": "system", "content": "Be kind."}, user],
    }
    files = {name: root / f"{name}.json" for name in [*values, "chat_text"]}
    for name, value in values.items():
        files[name].write_text(json.dumps(value))
    files["chat_text"].write_text("user: Hi")
    return files


@pytest.mark.parametrize(("command", "message"), BAD_INPUT)
def test_bad_input_is_named_before_torch(command: list[str], message: str, tmp_path: Path) -> None:
    """A wrong run folder, checkpoint, flag or --messages file of generate, export (the launcher and one process),
    plot and dryrun is named, with its fix, without importing torch (seconds to import, and more to exit) or
    matplotlib."""
    runs = {k: str(v) for k, v in {**_run_folders(tmp_path), **_message_files(tmp_path)}.items()}
    argv = [part.format(**runs) for part in command]
    code = (
        "import sys\n"
        "from tessera.cli import main\n"
        f"code = main({argv!r})\n"
        "heavy = sorted({'torch', 'matplotlib'} & set(sys.modules))\n"
        "assert not heavy, f'imported {heavy} before naming the problem'\n"
        "sys.exit(code)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 2, out.stderr
    assert message.format(**runs) in out.stderr, out.stderr


def test_on_token_counts_the_new_tokens_and_changes_nothing() -> None:
    model, cfg = _model("gpt2-tiny")
    prompt = torch.randint(0, cfg.vocab_size, (1, 3), generator=torch.Generator().manual_seed(4))
    seen: list[int] = []
    sampled = generate(model, prompt, 7, generator=torch.Generator().manual_seed(5), on_token=seen.append)
    assert seen == list(range(1, 8))
    assert torch.equal(sampled, generate(model, prompt, 7, generator=torch.Generator().manual_seed(5)))


class _Clock:
    """Advances ``step`` seconds per reading."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.parametrize("tokens", [10_000, 1_000_000])
def test_token_progress_redraws_by_time_not_by_token(tokens: int) -> None:
    """100 s of generation, a redraw at most every 0.5 s after a 1 s delay: under 200 redraws however many
    tokens (one clock reading per token); each redraw is one line in place, and `close` erases the last."""
    stream = io.StringIO()
    progress = TokenProgress(tokens, stream, clock=_Clock(100 / tokens))
    for done in range(1, tokens + 1):
        progress(done)
    assert 190 <= progress.writes < 200
    text = stream.getvalue()
    assert text.count("\r") == progress.writes and "\n" not in text
    last = text.rsplit("\r", 1)[1].rstrip()
    assert last.startswith("generated ") and f"/{tokens:,} tokens, " in last and last.endswith(" s left")
    assert f"{tokens / 100:.1f} tokens/s" in last  # one token per 100/tokens s
    progress.close()
    assert stream.getvalue() == text + "\r" + " " * len(last) + "\r"


def test_a_short_generation_draws_no_progress() -> None:
    stream = io.StringIO()
    progress = TokenProgress(50, stream, clock=_Clock(0.01))  # 0.5 s in all, under the 1 s delay
    for done in range(1, 51):
        progress(done)
    progress.close()
    assert stream.getvalue() == "" and progress.writes == 0
