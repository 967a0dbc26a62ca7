"""`PipelineEngine` validates every list it is handed, except `lowered_schedule`'s lists that `build_pipeline`
passes on untouched (validated once, where they were built); one process, no pipeline group (rank 0's engine)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tessera.config import Config, from_dict
from tessera.layout import Layout
from tessera.model.build import build_model
from tessera.pipeline import build, runtime
from tessera.pipeline.build import lowered_schedule
from tessera.pipeline.ir import Action, ActionKind, Schedule, ScheduleError
from tessera.pipeline.passes import lower
from tessera.pipeline.runtime import PipelineEngine, build_pipeline
from tessera.pipeline.schedules import build_schedule
from tessera.pipeline.stage import split_stages, tied_parameters
from tessera.pipeline.stage_comm import DataParallelStageComm
from tessera.pipeline.validate import validate

_K = ActionKind
P, M = 2, 4


def _config() -> Config:
    return from_dict(
        {
            "model": {"size": "gpt2-tiny", "n_layers": 2, "tie_embeddings": True},
            "parallel": {"pipeline": P, "schedule": "1f1b"},
            "train": {"global_batch": M * 2, "micro_batch": 2},
        }
    )


@pytest.fixture(autouse=True)
def empty_memo() -> Iterator[None]:
    build._build.cache_clear()  # a memoised build would not call validate
    yield
    build._build.cache_clear()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times `lowered_schedule` (``build``) and the engine (``engine``) have run `validate`."""
    count = {"build": 0, "engine": 0}

    def counted(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[name] += 1
            return validate(*args, **kwargs)

        return call

    monkeypatch.setattr(build, "validate", counted("build"))
    monkeypatch.setattr(runtime, "validate", counted("engine"))
    return count


def _engine(lowered: Schedule, **kwargs: Any) -> PipelineEngine:
    """Rank 0's engine of ``lowered`` over the two stages of a tied tiny GPT."""
    stages = split_stages(build_model(_config().model), P)
    mine = {s.index: s for s in stages if s.index == 0}
    comm = DataParallelStageComm(mine, None)
    return PipelineEngine(
        mine, lowered, 0, None, comm, microbatches=M, tied=tied_parameters(stages), **kwargs
    )


def _hand_made() -> Schedule:
    return lower(build_schedule("1f1b", P, M), P, tied=[(0, P - 1)])


def test_build_pipeline_validates_its_lists_once(calls: dict[str, int]) -> None:
    cfg = _config()
    engine = build_pipeline(build_model(cfg.model), Layout(pp=P), None, cfg)
    assert calls == {"build": 1, "engine": 0}
    assert engine.lowered == lowered_schedule("1f1b", P, M, tied=[(0, P - 1)])[0]


def test_hand_made_lists_are_validated(calls: dict[str, int]) -> None:
    _engine(_hand_made())
    assert calls["engine"] == 1


def test_lists_the_exchange_pass_changes_are_validated(calls: dict[str, int]) -> None:
    # validated without the tied pair: the engine adds its EXCHANGE
    lowered, _ = lowered_schedule("1f1b", P, M)
    engine = _engine(lowered, validated=True)
    assert calls == {"build": 1, "engine": 1}
    assert any(a.kind.is_exchange for a in engine.actions)


def _deadlocked() -> Schedule:
    """Rank 0 waits for micro-batch 0's gradient before sending its activation: neither rank can move."""
    lowered = _hand_made()
    rank0 = lowered[0]
    send = next(i for i, a in enumerate(rank0) if a.kind is _K.SEND_F and a.microbatch == 0)
    recv = next(i for i, a in enumerate(rank0) if a.kind is _K.RECV_B and a.microbatch == 0)
    rank0.insert(send, rank0.pop(recv))
    return lowered


def _missing_backward() -> Schedule:
    lowered = _hand_made()
    lowered[1] = [a for a in lowered[1] if a != Action(1, _K.BACKWARD, M - 1)]
    return lowered


@pytest.mark.parametrize(
    ("make", "why"),
    [(_deadlocked, "deadlock"), (_missing_backward, "1B3 has not run")],
    ids=["deadlock", "missing"],
)
def test_invalid_hand_made_lists_are_rejected(make: Callable[[], Schedule], why: str) -> None:
    with pytest.raises(ScheduleError, match=why):
        _engine(make())
