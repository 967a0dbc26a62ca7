"""The engine's pending sends: completed ones are dropped, and the sweeps cost time linear in the sends (gloo
reports a send complete only once waited for, so a step's sends can all stay pending)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tessera.config import from_dict
from tessera.layout import Layout
from tessera.model.build import build_model
from tessera.pipeline import runtime
from tessera.pipeline.runtime import _StepState, build_pipeline


class _Work:
    """A send's work handle that counts how often it is asked whether it is complete."""

    asked = 0

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def is_completed(self) -> bool:
        _Work.asked += 1
        return self.done

    def wait(self) -> None:
        self.done = True


def _issue(state: _StepState, work: _Work) -> None:
    """What the engine does per SEND: issue it, then (after the action) drop what has completed."""
    state.sends.append((torch.zeros(1), [work]))  # type: ignore[list-item]
    state.drop_completed_sends()


def _rank_0(monkeypatch: pytest.MonkeyPatch, m: int, sends: list[int], done: bool) -> runtime.PipelineEngine:
    """Rank 0 of a 1F1B pipeline over 2 ranks, its messages faked: sends recorded (their works complete at once
    when ``done``, else only when waited for, as gloo's) and receives of zeros."""

    def send(tensor: torch.Tensor, peer: int, group: Any, tag: int) -> tuple:
        sends.append(tag)
        return ("send", tensor)

    def recv(tensor: torch.Tensor, peer: int, group: Any, tag: int) -> tuple:
        return ("recv", tensor.zero_())

    monkeypatch.setattr(runtime.comm, "send", send)
    monkeypatch.setattr(runtime.comm, "recv", recv)
    monkeypatch.setattr(runtime.comm, "batch_p2p", lambda ops: [_Work(done) for _ in ops])
    cfg = from_dict(
        {
            "model": {"size": "gpt2-tiny", "n_layers": 2, "tie_embeddings": False},
            "parallel": {"pipeline": 2, "schedule": "1f1b"},
            "train": {"global_batch": m, "micro_batch": 1},
        }
    )
    return build_pipeline(build_model(cfg.model), Layout(pp=2), None, cfg)


def test_a_step_checks_its_pending_sends_a_linear_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sends that never complete before a wait: a sweep after every action asked ~m²/2 times, the doubling
    sweep < 2m."""
    m, sends = 64, []
    engine = _rank_0(monkeypatch, m, sends, done=False)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    _Work.asked = 0
    engine.step([(tokens, tokens)] * m)
    assert len(sends) == m  # one activation per micro-batch
    assert _Work.asked < 2 * m


def test_evaluation_frees_completed_sends_during_its_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sends that complete at once are dropped as the forward-only pass goes, as in a step, not held (and
    waited for) until its end: each is swept after its own action, so none is left to wait for."""
    m, sends = 16, []
    engine = _rank_0(monkeypatch, m, sends, done=True)
    waited = []
    monkeypatch.setattr(_Work, "wait", lambda self: waited.append(self))
    tokens = torch.zeros(1, 8, dtype=torch.long)
    engine.evaluate([(tokens, tokens)] * m)
    assert len(sends) == m  # one activation per micro-batch
    assert waited == []


def test_completed_sends_are_dropped() -> None:
    """A completed send is dropped at the latest once as many sends again as were pending have been issued."""
    state = _StepState(batches=[])
    stuck = [_Work() for _ in range(5)]
    finished = [_Work(done=True) for _ in range(5)]
    for work in stuck + finished:
        _issue(state, work)
    later = [_Work() for _ in range(len(state.sends))]
    for work in later:
        _issue(state, work)
    assert [w for _, (w,) in state.sends] == stuck + later
