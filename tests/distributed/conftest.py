"""Fixtures shared by the trainer tests."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from tessera.config import ModelConfig, from_dict
from tessera.model.build import meta_model
from tessera.parity import Record, Tolerance, compare_records
from tessera.train.data import prepare
from tessera.train.trainer import TrainingRun, train

CORPUS_SEED = 1234
CORPUS_SENTENCES = 6000


def synthetic_corpus(seed: int = CORPUS_SEED, sentences: int = CORPUS_SENTENCES) -> str:
    """Deterministic text with learnable structure: Zipf-distributed words from a fixed lexicon in sentences.

    The trainer tests' data must not change when unrelated code changes (it used to be tessera's own sources,
    so every edit changed every test's data) nor depend on the Python installation (the stdlib corpus)."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    lexicon = ["".join(rng.choices(letters[: rng.randint(6, 26)], k=rng.randint(1, 8))) for _ in range(400)]
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    lines = []
    for _ in range(sentences):
        words = rng.choices(lexicon, weights, k=rng.randint(3, 14))
        lines.append(" ".join(words).capitalize() + rng.choice(".!?,;"))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level token file of `synthetic_corpus` (no download, same on every machine and every commit)."""
    root = tmp_path_factory.mktemp("data")
    text = root / "corpus.txt"
    text.write_text(synthetic_corpus())
    prepare([text], root / "tokens.bin", "byte")
    return root / "tokens.bin"


def documents_corpus(root: Path, words: tuple[int, int]) -> Path:
    """Byte tokens (``root``/docs.bin) of 3000 short JSON records, each a document ended by the end-of-text token,
    of ``words`` = (fewest, most) words of 1 to 6 letters: windows of 16 or 32 tokens span several documents.
    Seeded: the same file on every machine and every commit for the same ``words``."""
    rng = random.Random(7)
    lexicon = ["".join(rng.choices("etaoinshrdlu", k=rng.randint(1, 6))) for _ in range(60)]
    lines = [json.dumps({"text": " ".join(rng.choices(lexicon, k=rng.randint(*words)))}) for _ in range(3000)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare([root / "docs.jsonl"], root / "docs.bin", "byte")
    return root / "docs.bin"


@pytest.fixture(scope="session")
def documents_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`documents_corpus` of records of 2 to 7 words (10 to 40 bytes): the document-mask tests' corpus
    (test_document_mask.py, test_gemma3.py)."""
    return documents_corpus(tmp_path_factory.mktemp("docs"), (2, 7))


def trainer_config(token_file: Path, run_dir: Path, model: dict, parallel: dict, **train: object) -> dict:
    """A raw config for a short, quiet test run: 8 sequences per step in micro-batches of 2.

    On tolerances: step 0's gradients come from identical weights, so a parallel run matches the reference to
    rounding (measured: within 2e-9 beyond rtol 1e-4 for tp1d 2). Two runs that each update freely compare
    trajectories after that, and Adam amplifies rounding there: an element whose gradient is at rounding level
    moves by up to ~lr in one run and not in the other, so step 1 differs by more than rounding on some CPUs with
    no parallel bug (test_context_parallel.py's gemma3_cp2_docs MLP: 4 of 2,048 elements at 2.3e-4 relative). So
    the tests that hold a layout to the reference's fp32 tolerances at steps > 0 record it with `record_layouts`
    following the reference's state (or `tessera.parity.run_config(..., follow=...)`), as `tessera compare` does
    (docs/parity.md): each step is then judged on its own arithmetic. What still compares free runs compares a
    run with itself bit for bit (resume, overlap twins), judges a trajectory with a tolerance or learning rate made
    for it (fp16 against fp32; resuming at another layout, at lr 1e-4), or is a component test whose AdamW eps
    (1e-6, test_zero.py, test_hsdp.py) bounds what a rounding-level gradient difference δ moves an element by
    (lr·δ/eps); the exported weights of test_export.py are a trajectory too, trained at lr 1e-4 for it (a wrong
    merge is off by the weights' own size at any lr)."""
    return {
        "model": model,
        "parallel": parallel,
        "train": {"steps": 3, "global_batch": 8, "micro_batch": 2, "warmup_steps": 1, "lr": 1e-2, **train},
        "data": {"path": str(token_file)},
        "checkpoint": {"every": 0, "resume": False},
        "log": {"run_dir": str(run_dir), "progress": False, "tensorboard": False},
    }


def train_losses(rank: int, world: int, raw: dict) -> dict[int, float]:
    """`train` a raw config on this rank (a `run_distributed` target); its loss per step."""
    return train(from_dict(raw)).losses


def train_recording(
    rank: int, world: int, raw: dict
) -> tuple[dict[int, float], list[dict[str, torch.Tensor]]]:
    """`train` a raw config; its losses and, per step, every full gradient by plain name as the trainer's hook
    sees it before the update (tensor-parallel models are unsharded with ``full_parameters``)."""
    grads: list[dict[str, torch.Tensor]] = []

    def hook(step: int, model: torch.nn.Module) -> None:
        full = model.full_parameters(grad=True) if hasattr(model, "full_parameters") else None
        full = full or {n: p.grad for n, p in model.named_parameters()}
        grads.append({n: g.detach().clone() for n, g in full.items()})

    return train(from_dict(raw), hook).losses, grads


class Recorded(NamedTuple):
    """One config's run on this rank (`record_layouts`)."""

    record: Record | None
    """`tessera.parity.record_run`'s Record on rank 0 (full tensors by plain name); None on the other ranks."""
    seen: list[Any]
    """Per step, what ``observe(run, step)`` returned on this rank right after the step's update ([] without)."""


def record_layouts(
    rank: int,
    world: int,
    configs: list[dict],
    follow: Path | None = None,
    keep_states: bool = False,
    observe: Callable[[TrainingRun, int], Any] | None = None,
) -> list[Recorded]:
    """Train each raw config in turn in this process group (a `run_distributed` target; also in-process with
    rank 0 of world 1) for its ``train.steps`` steps and record every loss, gradient norm, full gradient before and
    parameter after each update (`tessera.parity.record_run`, `tessera compare`'s recorder).

    ``follow``: a torch file (`follow_file`) holding per config the reference's `Record.states`, or None for a
    config that runs freely: step k > 0 then starts from the reference's state after step k − 1 (parameters and
    AdamW moments, loaded as a resume at this layout loads them), as `tessera compare` runs A after B
    (docs/parity.md, "B first, then A following B"; why: `trainer_config`). ``keep_states``: record this run's own states, for a layout to follow (or to compare bit for bit).
    ``observe(run, step)``: called on every rank right after each update, before anything else reads the run
    (e.g. the validation loss, evaluated while ZeRO's post-step all-gathers are in flight as `train` evaluates);
    communication counters (`tessera.comm.STATS`) are reset before each step as `train` resets them."""
    from tessera.parity import record_run

    to_follow = torch.load(follow, weights_only=True) if follow is not None else [None] * len(configs)
    out = []
    for raw, states in zip(configs, to_follow, strict=True):
        cfg = from_dict(raw)
        run = TrainingRun(cfg, rank, world)
        seen: list[Any] = []
        after = (lambda k, run=run, seen=seen: seen.append(observe(run, k))) if observe is not None else None
        try:
            rec = record_run(run, cfg.train.steps, None, states, keep_states, _reset_counters, after)
        finally:
            run.stepper.close()
        out.append(Recorded(rec if rank == 0 else None, seen))
    return out


def _reset_counters(step: int) -> None:
    from tessera import comm

    comm.STATS.reset()


def follow_file(path: Path, references: list[Record | None]) -> Path:
    """Write, per config of a `record_layouts` call, the states its run follows (a reference's `Record.states`,
    recorded with ``keep_states``; None: the config runs freely) to ``path``: tensors passed to the ranks as
    arguments would take one file descriptor each."""
    torch.save([r.states if r is not None else None for r in references], path)
    return path


class Interrupt(Exception):
    """Stands for a crash between a checkpoint and the end of a run."""


def train_until(raw: dict, crash_at: int) -> None:
    """Train ``raw`` until step ``crash_at`` fails (a crash after the checkpoints before it)."""

    def crash(step: int, model: torch.nn.Module) -> None:
        if step == crash_at:
            raise Interrupt

    with contextlib.suppress(Interrupt):
        train(from_dict(raw), crash)


def interrupted_then_resumed(rank: int, world: int, raw: dict, crash_at: int) -> dict[int, float]:
    """Train ``raw`` until step ``crash_at`` fails, then train it again (it resumes from the newest checkpoint);
    the second run's loss per step."""
    train_until(raw, crash_at)
    return train(from_dict(raw)).losses


@contextlib.contextmanager
def counting_draws() -> Iterator[dict[str, int]]:
    """Within: ``calls["normal_"]`` counts `torch.Tensor.normal_` on real tensors (meta_model's modules call it on
    meta tensors: no values) and ``calls["stream_seed"]`` the init's `stream_seed`, each row block's generator
    seed: both stay 0 in a build that draws no initial value."""
    import tessera.model.init as init

    calls = {"normal_": 0, "stream_seed": 0}
    normal, stream_seed = torch.Tensor.normal_, init.stream_seed

    def counted_normal(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls["normal_"] += not self.is_meta
        return normal(self, *args, **kwargs)

    def counted_seed(*args: object) -> int:
        calls["stream_seed"] += 1
        return stream_seed(*args)

    torch.Tensor.normal_, init.stream_seed = counted_normal, counted_seed
    try:
        yield calls
    finally:
        torch.Tensor.normal_, init.stream_seed = normal, stream_seed


def assert_layout_matches_reference(
    got: Record, reference: Record, tol: Tolerance, model: ModelConfig, nproc: int, steps: int
) -> set[str]:
    """A layout's record against the one-process reference: losses, norms, every gradient and the updated
    parameters within ``tol`` (`tessera.parity.compare_records`); every parameter of ``model`` was gathered and
    compared at every step, not a subset; and the run really was the layout (``nproc`` ranks, another layout).
    Returns the parameter names, for a test to check the family's own (e.g. a post-norm)."""
    report = compare_records(got, reference, tol)
    assert report.ok, report.table(20)
    names = {n for n, _ in meta_model(model).named_parameters(remove_duplicate=False)}
    for k in range(steps):
        assert set(got.grads[k]) == set(reference.grads[k]) == names
        assert set(got.params[k]) == names
    assert got.world == nproc and got.layout != reference.layout
    return names
