"""Simulator against hand-computed bubbles, costs and memory; text and image rendering; show_schedule."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from tessera.pipeline import Action, ActionKind, ScheduleError, build_schedule, lower
from tessera.sim import CostTable, render_image, render_text, show_schedule, simulate

EXACT = 1e-12  # unit durations are small integers: results are exact up to float summation


def _bubble(name: str, p: int, m: int, v: int = 1, **options: object) -> float:
    return simulate(lower(build_schedule(name, p, m, v, **options), p), p).bubble_fraction


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(1, 4), (2, 1), (2, 4), (4, 4), (4, 8)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name: str, p: int, m: int) -> None:
    assert _bubble(name, p, m) == pytest.approx(float(Fraction(p - 1, m + p - 1)), abs=EXACT)


@pytest.mark.parametrize("name", ["interleaved_1f1b", "breadth_first"])
@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3)])
def test_looped_bubble_is_p_minus_1_over_vm_plus_p_minus_1(name: str, p: int, m: int, v: int) -> None:
    assert _bubble(name, p, m, v) == pytest.approx(float(Fraction(p - 1, v * m + p - 1)), abs=EXACT)


def test_breadth_first_stalls_when_m_below_p() -> None:
    # p=4, m=2, v=2: each of the v-1 wrap-arounds waits (p - m)·t_f forward and (p - m)·t_b backward.
    result = simulate(lower(build_schedule("breadth_first", 4, 2, 2), 4), 4)
    assert result.step_time == 3 * (2 * 2 + 4 - 1) + 3 * (4 - 2)


def test_breadth_first_beats_1f1b_at_p4_m4_v2() -> None:
    bf, one = _bubble("breadth_first", 4, 4, 2), _bubble("1f1b", 4, 4)
    assert bf == pytest.approx(3 / 11, abs=EXACT) and one == pytest.approx(3 / 7, abs=EXACT)
    assert bf < one


def test_gpipe_step_time_and_per_rank_numbers() -> None:
    result = simulate(lower(build_schedule("gpipe", 2, 2), 2), 2)
    assert result.step_time == 9  # (m + p - 1)·(t_f + t_b) = 3·3
    assert result.compute == [6, 6] and result.idle == [3, 3]
    assert result.bubble == pytest.approx([1 / 3, 1 / 3], abs=EXACT)
    assert result.peak_activations == [2, 2]
    first = [
        (str(e.action), e.start, e.end) for e in result.timeline if e.rank == 0 and e.action.kind.is_compute
    ]
    assert first == [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 5, 7), ("0B1", 7, 9)]


def test_peak_activations_by_schedule_and_weighted_by_bytes() -> None:
    assert simulate(lower(build_schedule("1f1b", 4, 8), 4), 4).peak_activations == [4, 3, 2, 1]
    assert simulate(lower(build_schedule("breadth_first", 2, 4, 2), 2), 2).peak_activations == [8, 8]
    weighted = simulate(lower(build_schedule("gpipe", 2, 2), 2), 2, activation_bytes={0: 10.0, 1: 3.0})
    assert weighted.peak_activations == [20, 6]


def test_comm_latency_and_costs() -> None:
    lowered = lower(build_schedule("gpipe", 2, 1), 2)
    # F0 on r0 [0,1], arrives at 1.5, F on r1 [1.5, 2.5], B [2.5, 4.5], arrives 5, B on r0 [5, 7].
    assert simulate(lowered, 2, comm_latency=0.5).step_time == 7
    slow = CostTable(forward=2.0, send=0.25, reduce=1.0)
    # r0: F [0,2] send [2,2.25]; r1: F [2.25,4.25] B [4.25,8.25] send ->8.5, reduce; r0: B [8.5,12.5] reduce 13.5
    result = simulate(lowered, 2, slow)
    assert result.step_time == 13.5
    assert result.busy[0] == 2 + 0.25 + 4 + 1 and result.compute[0] == 6


def test_measured_timings_by_stage_and_kind() -> None:
    lowered = lower(build_schedule("gpipe", 2, 1), 2)
    measured = {(0, "F"): 1.0, (0, "B"): 3.0, (1, ActionKind.FORWARD): 2.0, (1, "B"): 2.0}
    assert simulate(lowered, 2, measured).step_time == 1 + 2 + 2 + 3
    with pytest.raises(ScheduleError, match="no measured duration for stage 1"):
        simulate(lowered, 2, {(0, "F"): 1.0, (0, "B"): 3.0})


def test_callable_durations_and_split_backward() -> None:
    k = ActionKind
    schedule = [[Action(0, k.FORWARD, 0), Action(0, k.BACKWARD_INPUT, 0), Action(0, k.BACKWARD_WEIGHT, 0)]]
    result = simulate(lower(schedule, 1), 1, lambda action, rank: 1.0 if action.kind.is_compute else 0.0)
    assert result.step_time == 3 and result.peak_activations == [1]


def test_simulator_refuses_an_invalid_schedule() -> None:
    with pytest.raises(ScheduleError, match="missing"):
        simulate([[Action(0, ActionKind.FORWARD, 0)]], 1)


def test_render_text_rows_and_columns() -> None:
    result = simulate(lower(build_schedule("gpipe", 2, 2), 2), 2)
    lines = render_text(result.timeline, 2).splitlines()
    assert lines[0].split() == ["r0", "0F0", "0F1", ".", ".", ".", "0B0", "---", "0B1", "---"]
    assert lines[1].split() == ["r1", ".", "1F0", "1F1", "1B0", "---", "1B1", "---", ".", "."]


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_show_schedule_writes_a_picture(tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"bf{suffix}"
    text = show_schedule("breadth_first", 4, 4, 2, out=str(out))
    assert text.splitlines()[0].startswith("breadth_first p=4 m=4 v=2: 8 stages, step time 33")
    assert "bubble 27.3%" in text.splitlines()[0]
    assert len(text.splitlines()) == 1 + 4
    assert out.stat().st_size > 1000
    head = out.read_bytes()[:8]
    assert head.startswith(b"\x89PNG") if suffix == ".png" else b"<?xml" in out.read_bytes()[:100]


def test_render_image_rejects_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match=r"\.png or \.svg"):
        render_image([], 1, tmp_path / "x.jpg")


@pytest.mark.parametrize("every", [False, True])
def test_tied_ends_exchange_then_reduce_once_at_the_end(every: bool) -> None:
    """1F1B, p = 2, m = 2, stages 0 and 1 tied (an embedding and its head), t_f = 1, t_b = 2, EXCHANGE 0.5,
    REDUCE 0.25. Rank 0: F0 0-1, F1 1-2, B0 4-6 (after rank 1's B0 2-4), B1 7-9 (after rank 1's F1 4-5, B1
    5-7). Rank 1 reaches its EXCHANGE at 7 and waits for rank 0 (9): both exchange 9-9.5, then reduce each
    stage once, 9.5-9.75 (per-micro-batch reduction or not: the tied stages' REDUCE_MBs are gone)."""
    lowered = lower(build_schedule("1f1b", 2, 2), 2, reduce_every_microbatch=every, tied=((0, 1),))
    result = simulate(lowered, 2, CostTable(forward=1.0, exchange=0.5, reduce=0.25))
    assert result.step_time == pytest.approx(9.75, abs=EXACT)
    ends = [(e.rank, str(e.action), e.start, e.end) for e in result.timeline if not e.action.kind.is_compute]
    exchanges = [x for x in ends if "EXCHANGE" in x[1]]
    reduces = [x for x in ends if "REDUCE" in x[1]]
    assert sorted(exchanges) == [(0, "0EXCHANGE<>r1", 9.0, 9.5), (1, "1EXCHANGE<>r0", 9.0, 9.5)]
    assert sorted(reduces) == [(0, "0REDUCE", 9.5, 9.75), (1, "1REDUCE", 9.5, 9.75)]


def test_an_exchange_without_its_peer_deadlocks() -> None:
    lowered = lower(build_schedule("1f1b", 2, 1), 2, tied=((0, 1),))
    lowered[1] = [a for a in lowered[1] if not a.kind.is_exchange]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(lowered, 2, check=False)


def _diagonal(p: int, m: int) -> list:
    """A GPipe-shaped timeline without simulating it: rank r runs m unit forwards from time r."""
    from tessera.sim.simulator import TimelineEntry

    return [
        TimelineEntry(r, Action(r, ActionKind.FORWARD, i), r + i, r + i + 1.0)
        for r in range(p)
        for i in range(m)
    ]


def _captured_figure(monkeypatch: pytest.MonkeyPatch) -> list:
    """Figures render_image saves, kept (their artists are counted) instead of written."""
    import tessera.sim.render as render_module

    saved: list = []
    real = render_module.save_figure

    def keep(fig: Any, out: Path, fmt: str, **kw: Any) -> Path:
        saved.append((fig.get_size_inches().tolist(), fig.axes[0]))
        return real(fig, out, fmt, **kw)

    monkeypatch.setattr(render_module, "save_figure", keep)
    return saved


def test_a_picture_of_thousands_of_ranks_fits_and_is_drawn_in_few_artists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--pp 2000 drew one 0.5 in row per rank (1,001 in: 100,120 px, which matplotlib refuses) with a bar and a
    number per action (16,000 artists each, minutes). Counted, not timed: the picture is at most IMAGE_HEIGHT_IN
    high and its bars are a few collections; small pipelines keep their 0.5 in rows and numbers."""
    from PIL import Image

    from tessera.sim.render import IMAGE_HEIGHT_IN, image_note

    saved = _captured_figure(monkeypatch)
    out = render_image(_diagonal(2000, 8), 2000, tmp_path / "big.png", title="big")
    (width, height), ax = saved[-1]
    assert height <= IMAGE_HEIGHT_IN and width <= IMAGE_HEIGHT_IN, (width, height)
    assert Image.open(out).size[1] <= IMAGE_HEIGHT_IN * 100  # savefig's default 100 dpi
    assert len(ax.patches) + len(ax.collections) + len(ax.texts) <= 20, (ax.patches, ax.collections, ax.texts)
    assert len(ax.get_yticks()) <= 64  # rank names: every 32nd
    assert "2000 rank rows" in ax.get_title() and "micro-batch numbers left out" in ax.get_title()
    assert image_note(2000) == "2000 rank rows of 0.0194 in, to fit 40 in"

    render_image(_diagonal(4, 4), 4, tmp_path / "small.png", title="small")
    (_, height), ax = saved[-1]
    assert height == pytest.approx(1.2 + 0.5 * 4) and ax.get_title() == "small" and image_note(4) is None
    assert sorted(t.get_text() for t in ax.texts) == sorted(str(i) for _ in range(4) for i in range(4))


def test_a_picture_over_the_bar_limit_is_refused_before_drawing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tessera.sim.render as render_module

    monkeypatch.setattr(render_module, "IMAGE_BAR_LIMIT", 15)
    saved = _captured_figure(monkeypatch)
    with pytest.raises(ScheduleError, match=r"16 bars \(4 ranks\), over the 15 .*leave out --out"):
        render_image(_diagonal(4, 4), 4, tmp_path / "x.png")
    assert saved == [] and not (tmp_path / "x.png").exists()


def test_schedule_show_says_how_a_large_picture_was_fitted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tessera.cli import main

    out = tmp_path / "p200.png"
    assert main(["schedule", "show", "1f1b", "--pp", "200", "--microbatches", "2", "--out", str(out)]) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1] == f"wrote {out} (200 rank rows of 0.194 in, to fit 40 in)"
    )
    assert out.stat().st_size > 1000
