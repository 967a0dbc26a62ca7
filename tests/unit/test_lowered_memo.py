"""`tessera.pipeline.build.lowered_schedule` memoises its lowered lists: one build per key, fresh lists per call,
an edited schedule file read again, a failed build not remembered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera.config import load_config
from tessera.errors import ConfigError
from tessera.execution import resolve
from tessera.pipeline import build
from tessera.pipeline.build import lowered_schedule
from tessera.pipeline.csvio import to_csv
from tessera.pipeline.ir import ScheduleError
from tessera.pipeline.passes import lower
from tessera.pipeline.schedules import build_schedule
from tessera.pipeline.validate import validate


@pytest.fixture(autouse=True)
def empty_memo() -> Iterator[None]:
    build._build.cache_clear()  # another test's entry would hide a build
    yield
    build._build.cache_clear()


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times `lowered_schedule` has lowered and validated a schedule."""
    count = {"lower": 0, "validate": 0}

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            count[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(build, "lower", counted("lower", lower))
    monkeypatch.setattr(build, "validate", counted("validate", validate))
    return count


def test_second_identical_call_does_not_rebuild(builds: dict[str, int]) -> None:
    first = lowered_schedule("interleaved", 2, 4, 2, zero3=True, tied=[(0, 3)])
    again = lowered_schedule("interleaved", 2, 4, 2, zero3=True, tied=((0, 3),))  # a list or a tuple of pairs
    assert builds == {"lower": 1, "validate": 1}
    assert again == first
    expected = lower(build_schedule("interleaved", 2, 4, 2), 2, zero3=True, tied=[(0, 3)])
    assert first == (expected, "loop")


@pytest.mark.parametrize(
    "changed",
    [
        {"m": 6},
        {"v": 1},
        {"zero3": True},
        {"accumulation": "depth_first"},
        {"reduce_every_microbatch": True},
        {"tied": [(0, 3)]},
        {"placement": "vshape"},
    ],
    ids=lambda changed: next(iter(changed)),
)
def test_a_different_argument_rebuilds(builds: dict[str, int], changed: dict[str, Any]) -> None:
    base: dict[str, Any] = {"schedule_name": "breadth_first", "p": 2, "m": 4, "v": 2}
    first, _ = lowered_schedule(**base)
    other, _ = lowered_schedule(**{**base, **changed})
    assert builds["lower"] == 2
    assert other != first
    lowered_schedule(**base)  # both stay in the memo
    lowered_schedule(**{**base, **changed})
    assert builds["lower"] == 2


def test_the_memo_is_bounded(builds: dict[str, int]) -> None:
    last = 2 + build.MEMO_SIZE
    for m in range(2, last + 1):  # one more key than it holds: the first is dropped
        lowered_schedule("1f1b", 2, m)
    lowered_schedule("1f1b", 2, last)
    assert builds["lower"] == build.MEMO_SIZE + 1  # the newest is kept
    lowered_schedule("1f1b", 2, 2)
    assert builds["lower"] == build.MEMO_SIZE + 2  # the oldest is not


def test_callers_get_their_own_lists(builds: dict[str, int]) -> None:
    mine, _ = lowered_schedule("1f1b", 2, 4)
    expected = [list(actions) for actions in mine]
    mine[0].clear()
    mine[1].reverse()
    mine.append([])
    theirs, _ = lowered_schedule("1f1b", 2, 4)
    assert builds["lower"] == 1  # from the memo, untouched by the first caller's edits
    assert theirs == expected and isinstance(theirs, list) and all(type(a) is list for a in theirs)


def test_an_edited_schedule_file_is_read_again(tmp_path: Path, builds: dict[str, int]) -> None:
    file = tmp_path / "mine.csv"
    file.write_text(to_csv(build_schedule("1f1b", 2, 4)))
    one_f_one_b, _ = lowered_schedule(str(file), 2, 4)
    assert lowered_schedule(str(file), 2, 4)[0] == one_f_one_b and builds["lower"] == 1

    file.write_text(to_csv(build_schedule("gpipe", 2, 4)))  # same path, new schedule
    gpipe, _ = lowered_schedule(str(file), 2, 4)
    assert gpipe == lowered_schedule("gpipe", 2, 4)[0] != one_f_one_b

    file.write_text(to_csv(build_schedule("gpipe", 2, 6)))  # now the wrong micro-batch count
    with pytest.raises(ConfigError, match="micro-batches"):
        lowered_schedule(str(file), 2, 4)

    file.unlink()
    with pytest.raises(ConfigError, match="no such file"):
        lowered_schedule(str(file), 2, 4)


def test_a_failed_build_is_not_memoised(monkeypatch: pytest.MonkeyPatch, builds: dict[str, int]) -> None:
    calls = {"n": 0}
    checked = build.validate

    def fails_once(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ScheduleError("deadlock (injected)")
        checked(*args, **kwargs)

    monkeypatch.setattr(build, "validate", fails_once)
    with pytest.raises(ScheduleError, match="injected"):
        lowered_schedule("1f1b", 2, 4)
    lowered, _ = lowered_schedule("1f1b", 2, 4)  # built again, and this time it passes
    assert lowered == lower(build_schedule("1f1b", 2, 4), 2)
    lowered_schedule("1f1b", 2, 4)
    assert (calls["n"], builds["lower"]) == (2, 2)  # the success is memoised


def test_resolve_then_the_runtimes_lists_build_once(builds: dict[str, int]) -> None:
    cfg = load_config(
        "configs/demo.toml", ["parallel.data=1", "parallel.pipeline=2", "train.global_batch=64"]
    )
    cfg.validate(2)  # the CLI's early check
    plan = resolve(cfg, 2)  # the trainer's
    assert plan.schedule_checked
    lowered = plan.lowered()  # the runtime's
    assert builds["lower"] == 1
    assert sum(map(len, lowered)) > 0
