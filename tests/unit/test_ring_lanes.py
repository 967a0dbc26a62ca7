"""The ring's lanes (`tessera.parallel.ring_1d._Lanes`) on CPU: CPU tensors take the pass-through (one lane, the
plain loop's arithmetic bit for bit); with lanes forced onto synchronous streams, chunk k runs on lane k mod S
after the lane waited for the current stream, results reach the current stream through a wait, and the per-lane
partial sums add up, lane 0 first, after the join. The rings with forced lanes are checked against the
single-device model in tests/distributed/test_tensor_1d.py."""

from __future__ import annotations

import functools

import pytest
import torch

from tessera.parallel import ring_1d
from tessera.traffic import RING_GEMM_LANES
from tests.sync_streams import forced_lanes

SUM_RTOL = 1e-6
"""Per-lane partial sums against the sequential sum: fp32 rounding of a few reordered adds."""


def _values(count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 8, generator=g) for _ in range(count)]


def _sequential(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def test_cpu_tensors_take_the_pass_through() -> None:
    lanes = ring_1d._open_lanes(torch.zeros(2), 4)
    assert lanes.count == 1
    x = torch.randn(3)
    assert torch.equal(lanes.run(5, torch.neg, x), -x)
    assert lanes.hand_over(5, x) is x
    values = _values(5)
    for k, v in enumerate(values):
        lanes.run(k, functools.partial(lanes.accumulate, k, "w"), v)
    lanes.join()
    assert torch.equal(lanes.total("w"), _sequential(values))  # the plain loop's order, bit for bit
    assert lanes.total("absent") is None


@pytest.mark.parametrize("count, t", [(2, 4), (3, 4), (3, 5), (3, 2), (2, 2)])
def test_forced_lanes_round_robin_wait_keep_and_join(count: int, t: int) -> None:
    with forced_lanes(count) as log:
        lanes = ring_1d._open_lanes(torch.zeros(1), t)
    s = min(count, t)
    assert lanes.count == s
    for k in range(t):
        held = torch.randn(2)
        log.clear()

        def on_lane(h: torch.Tensor, k: int = k) -> torch.Tensor:
            log.append(("fn", f"chunk{k}", None))
            return h * 2

        out = lanes.run(k, on_lane, held)
        lane = f"lane{k % s}"
        assert log == [
            ("wait", lane, "current"),  # what the current stream queued (received chunks) comes first
            ("keep", lane, id(held)),  # a received buffer freed on the current stream outlives the lane's use
            ("enter", lane, None),
            ("fn", f"chunk{k}", None),
            ("exit", lane, None),
        ]
        log.clear()
        assert lanes.hand_over(k, out) is out
        assert log == [("wait", "current", lane), ("keep", "current", id(out))]
    log.clear()
    lanes.join()
    assert log == [("wait", "current", f"lane{j}") for j in range(s)]


@pytest.mark.parametrize("count, t", [(2, 4), (3, 5)])
def test_a_reduce_rings_chunks_wait_only_for_the_fork(count: int, t: int) -> None:
    """A reduce ring's partials (`run(..., follow=False)`) read inputs ready before the loop: each lane waits for
    the current stream once, at `fork`, so chunk k + 1 does not queue behind chunk k's hand-over."""
    with forced_lanes(count) as log:
        lanes = ring_1d._open_lanes(torch.zeros(1), t)
    s = min(count, t)
    lanes.fork()
    assert log == [("wait", f"lane{j}", "current") for j in range(s)]
    for k in range(t):
        log.clear()
        out = lanes.hand_over(k, lanes.run(k, functools.partial(torch.ones, 2), follow=False))
        lane = f"lane{k % s}"
        assert log == [
            ("enter", lane, None),
            ("exit", lane, None),
            ("wait", "current", lane),
            ("keep", "current", id(out)),
        ]


@pytest.mark.parametrize("count, t", [(2, 4), (3, 4), (3, 5), (3, 2), (3, 3)])
def test_per_lane_partial_sums_add_up_lane_0_first(count: int, t: int) -> None:
    values = _values(t)
    with forced_lanes(count) as log:
        lanes = ring_1d._open_lanes(torch.zeros(1), t)
    s = lanes.count
    for k, v in enumerate(values):
        lanes.run(k, functools.partial(lanes.accumulate, k, "w"), v)
    with pytest.raises(RuntimeError, match="before join"):
        lanes.total("w")
    lanes.join()
    log.clear()
    total = lanes.total("w")
    per_lane = [_sequential(values[j::s]) for j in range(s)]
    assert torch.equal(total, _sequential(per_lane))
    assert [op for op, name, _ in log] == ["keep"] * s and {name for _, name, _ in log} == {"current"}
    torch.testing.assert_close(total, _sequential(values), rtol=SUM_RTOL, atol=SUM_RTOL)
    if t <= s:  # one chunk per lane: the sequential order exactly
        assert torch.equal(total, _sequential(values))


def test_side_streams_need_the_current_stream() -> None:
    with pytest.raises(ValueError, match="current stream"):
        ring_1d._Lanes([object()])


def test_lanes_are_min_of_traffic_default_and_chunks() -> None:
    with forced_lanes():  # side streams, RING_GEMM_LANES kept
        assert [ring_1d._open_lanes(torch.zeros(1), t).count for t in (2, 8)] == [
            min(2, RING_GEMM_LANES),
            RING_GEMM_LANES,
        ]


@pytest.mark.parametrize("autocast", [False, True])
def test_gathered_outputs_have_the_linears_shape_and_dtype(autocast: bool) -> None:
    x = torch.randn(2, 3, 8)  # [b, n, h]
    params = [torch.randn(5, 8), torch.randn(5), torch.randn(7, 8), None]  # w0, b0, w1 (no bias)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = ring_1d._gathered_outputs(x, 1, 4, params)
        ys = [torch.nn.functional.linear(x, params[i], params[i + 1]) for i in (0, 2)]
    assert [o.shape for o in outs] == [(2, 12, 5), (2, 12, 7)]
    assert (
        [o.dtype for o in outs]
        == [y.dtype for y in ys]
        == [torch.bfloat16 if autocast else torch.float32] * 2
    )
