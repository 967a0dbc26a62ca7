"""Seeded fuzzing of config loading and the CLI: any input gives a message and an exit status, never a traceback.

Each case mutates a valid config (values of the wrong type, zero, negative, huge, NaN and infinite numbers,
over-long strings and NUL bytes, sections that are not tables, non-UTF-8 bytes, torn TOML) and runs
`tessera validate` / `tessera memory` on it in process. A case passes when `main` returns an exit status (or
argparse exits with its usage status 2); any other exception, or a case running past its bound (an unbounded
loop on a huge number), fails the test and prints the case so it can be replayed.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import random
import signal
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera import cli
from tessera.cli import main

SEED = 20261130
CASES = 2400
CASE_BOUND_S = 20  # a hang guard, not a timing assertion: a normal case takes milliseconds

BASE: dict[str, dict[str, Any]] = {
    "model": {"size": "gpt2-mini", "n_layers": 4, "d_model": 64, "n_heads": 4, "seq_len": 32},
    "parallel": {"tensor": 1, "pipeline": 1, "zero": 0, "schedule": "1f1b"},
    "train": {"steps": 10, "global_batch": 8, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 2},
    "data": {"tokenizer": "byte", "default_corpus_mb": 1.0},
    "checkpoint": {"every": 5, "keep": 2},
    "log": {"run_dir": "runs/fuzz", "every": 1},
}
KEYS = {
    "model": [
        "size", "family", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "seq_len",
        "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "init_std",
    ],
    "parallel": [
        "data", "tensor", "sequence_parallel", "pipeline", "schedule", "stages_per_rank", "stage_layers", "zero",
        "accumulation", "checkpointing",
    ],
    "train": [
        "steps", "global_batch", "micro_batch", "lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2",
        "eps", "grad_clip", "seed", "dtype", "device", "grad_reduce_dtype", "fp16_init_scale", "bucket_mb",
    ],
    "data": ["path", "tokenizer", "seed", "default_corpus_mb"],
    "checkpoint": ["dir", "every", "keep", "resume"],
    "log": ["run_dir", "every", "progress", "tensorboard"],
}  # fmt: skip
NASTY: list[Any] = [
    0, 1, -1, -4, 2, 3, 7, 64, 2**31, 2**62, 10**30, 10**300, -(10**30),
    0.0, -0.0, 0.5, -1.5, 1e15, 1e-300, 1e300, math.nan, math.inf, -math.inf,
    True, False, "", "x", "2x2", "3x2", "0x0", "gpt2-mini", "llama-tiny", "a\x00b", "é" * 3, "x" * 5000,
    "/" + "d" * 300, [], [1, 2], [0], ["a"], [[1]], {"a": 1}, {},
    {"type": "llama3", "factor": math.nan, "low_freq_factor": 0.0, "high_freq_factor": -math.inf,
     "original_max_position_embeddings": 10**30},
    {"type": "llama3", "factor": 1e300, "low_freq_factor": 1e-300, "high_freq_factor": 1e300,
     "original_max_position_embeddings": 2**62},
]  # fmt: skip


def _toml(value: Any) -> str:
    """A TOML literal for the fuzz values (tomllib has no writer)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(c if c.isalnum() or c in " -_/.é×" else f"\\u{ord(c):04x}" for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"


def _render(doc: dict[str, Any]) -> str:
    scalars = [f"{k} = {_toml(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    tables = [
        f"[{k}]\n" + "\n".join(f"{kk} = {_toml(vv)}" for kk, vv in v.items())
        for k, v in doc.items()
        if isinstance(v, dict)
    ]
    return "\n".join(scalars + tables) + "\n"


def _mutate(rng: random.Random) -> tuple[bytes, list[str]]:
    """A config file's bytes and a list of dotted overrides, each with a few random mutations."""
    doc: dict[str, Any] = {s: dict(v) for s, v in BASE.items()}
    overrides: list[str] = []
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        section = rng.choice(list(KEYS))
        roll = rng.random()
        if roll < 0.06:
            doc[section] = rng.choice([3, "x", [1, 2], True])  # a section that is not a table
        elif roll < 0.1:
            doc[rng.choice(["extra", "Model", "model.sub"])] = {"a": 1}
        elif roll < 0.35:
            value = rng.choice(NASTY)
            overrides.append(f"--{section}.{rng.choice(KEYS[section])}={_toml(value)}")
        elif isinstance(doc[section], dict):
            doc[section][rng.choice(KEYS[section])] = rng.choice(NASTY)
    text = _render(doc).encode()
    roll = rng.random()
    if roll < 0.05:
        text += b"\n# \xff\xfe not utf-8 \x80\n"
    elif roll < 0.1:
        cut = rng.randrange(len(text))
        text = text[:cut] + bytes([rng.randrange(256)]) + text[cut + 1 :]
    elif roll < 0.12:
        text = text[: rng.randrange(len(text))]
    if rng.random() < 0.05:
        overrides.append(rng.choice(["--train.lr", "train=3", "--x.y=", "--model.n_layers=\xff", "--a=b"]))
    return text, overrides


def _argv(rng: random.Random, config: str, overrides: list[str]) -> list[str]:
    world = rng.choice(["1", "2", "4", "8", "16", "0", "-4", "3", "1000000000", "abc"])
    command = rng.choice(["validate", "validate", "memory"])
    argv = [command, config, "--world-size", world, *overrides]
    if command == "memory" and rng.random() < 0.3:
        argv += ["--device-memory", rng.choice(["80", "0", "-1", "nan", "1e308"])]
    return argv


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _bounded(seconds: int) -> Iterator[None]:
    def alarm(signum: int, frame: Any) -> None:
        raise _Hang

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _run(argv: list[str]) -> int:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            return main(argv)
        except SystemExit as e:  # argparse's usage error (e.g. --world-size abc): a message, status 2
            assert e.code == 2, f"SystemExit({e.code!r})"
            return 2


def test_fuzzed_configs_and_cli_never_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `main` builds its argparse parser anew per call (~80 % of this test's time, mostly argparse's gettext
    # look-ups); the parser does not depend on the input, so the cases share one, built by the same `_parser`.
    monkeypatch.setattr(cli, "_parser", functools.cache(cli._parser))
    rng = random.Random(SEED)
    failures: list[str] = []
    statuses: dict[int, int] = {}
    for case in range(CASES):
        text, overrides = _mutate(rng)
        config = tmp_path / f"case{case % 7}.toml"
        config.write_bytes(text)
        argv = _argv(rng, str(config), overrides)
        try:
            with _bounded(CASE_BOUND_S):
                status = _run(argv)
        except _Hang:
            failures.append(f"case {case}: no answer within {CASE_BOUND_S}s: {argv} {text!r}")
            continue
        except Exception as e:  # the point of the test: report every uncaught exception
            where = traceback.extract_tb(e.__traceback__)[-1]
            failures.append(
                f"case {case}: {type(e).__name__} at {where.name}:{where.lineno}: {e!s:.120} <- {argv} {text!r:.300}"
            )
            continue
        statuses[status] = statuses.get(status, 0) + 1
    causes = sorted({f.split(": ", 2)[1] for f in failures})
    assert not failures, f"{len(failures)} of {CASES} cases failed, causes {causes}:\n" + "\n".join(
        failures[:8]
    )
    # the generator must produce both accepted and refused configs, or it is not exercising anything
    assert statuses.get(0, 0) > 50 and statuses.get(1, 0) + statuses.get(2, 0) > 500, statuses


@pytest.mark.parametrize(
    ("text", "overrides", "world", "needle"),
    [
        (b'[model]\nsize = "gpt2-mini" # \xff\n', [], "2", "not UTF-8"),
        (b"model = 3\n", [], "2", "[model] must be a table"),
        (b"[parallel]\npipeline = 0\n", [], "2", "parallel.pipeline = 0"),
        (b"[parallel]\nstages_per_rank = 0\n", [], "2", "parallel.stages_per_rank = 0"),
        (b"[model]\nn_heads = 0\n", [], "2", "model.n_heads = 0"),
        (b"[model]\nsize = [1, 2]\n", [], "2", "model.size"),
        (b"[model]\nd_model = 1000000000000000003\n", [], "1", "model.d_model"),
        (b"[model]\ninit_std = -1.0\n", [], "1", "model.init_std"),
        (b"[model]\nn_kv_heads = -2\n", [], "1", "model.n_kv_heads"),
        (b"[model]\nffn_hidden = -4\n", [], "1", "model.ffn_hidden"),
        (b'[checkpoint]\ndir = "a\\u0000b"\n', [], "1", "checkpoint.dir"),
        (b"[train]\nlr = nan\n", [], "1", "train.lr"),
        (b"[train]\nbeta2 = 1e15\n", [], "1", "train.beta2"),
        (b"[train]\nfp16_init_scale = 0.0\n", [], "1", "train.fp16_init_scale"),
        (b"[train]\nwarmup_steps = -3\n", [], "1", "train.warmup_steps"),
        (b"", [], "-4", "world size -4"),
        (b"", ['--data.path="' + "d" * 5000 + '"'], "1", "data.path"),
    ],
)
def test_each_known_cause_is_a_message(
    tmp_path: Path, text: bytes, overrides: list[str], world: str, needle: str
) -> None:
    """The causes the first fuzzing found, each named in the message instead of a traceback or a later crash."""
    config = tmp_path / "c.toml"
    config.write_bytes(text)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), _bounded(CASE_BOUND_S):
        status = main(["validate", str(config), "--world-size", world, *overrides])
    assert status in (1, 2), out.getvalue()
    assert needle in out.getvalue(), out.getvalue()


def test_over_long_config_path_is_a_message(capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", "/" + "x" * 5000 + ".toml", "--world-size", "1"]) == 2
    assert "config file" in capsys.readouterr().err
