"""tessera.peak_memory.walk on hand-written action lists: which sizes coexist at a rank's peak."""

from __future__ import annotations

import pytest

from tessera.peak_memory import StageBytes, walk
from tessera.pipeline.ir import Action, ActionKind

F, B, R, RM = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.REDUCE_GRAD, ActionKind.REDUCE_MICROBATCH
G, FREE = ActionKind.GATHER_PARAMS, ActionKind.FREE_PARAMS


def _sizes(zero: int, dp: int, **kw) -> StageBytes:
    # stage 0: 10 bytes of activations per micro-batch, 100 bytes of gradients; stage 1: 30 and 40
    return StageBytes(
        activations={0: 10.0, 1: 30.0},
        grads={0: 100.0, 1: 40.0},
        flat={0: 100.0, 1: 40.0},
        working={0: 5.0, 1: 5.0},
        zero=zero,
        dp=dp,
        **kw,
    )


def test_gradients_replace_a_micro_batchs_activations() -> None:
    # all forwards, then backwards: the peak follows the first backward (its gradients exceed what it frees)
    actions = [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1)]
    moment, held = walk(actions, _sizes(zero=0, dp=1))
    assert (moment.activations, moment.grads, moment.buffers) == (10.0, 100.0, 0.0)
    assert held == 100.0


def test_working_counts_at_the_start_of_a_backward() -> None:
    # stage 1 frees 30 of activations for 40 of gradients: before B0 60 + 5 of working, before B1 30 + 40 + 5
    actions = [Action(1, F, 0), Action(1, F, 1), Action(1, B, 0), Action(1, B, 1)]
    moment, _ = walk(actions, _sizes(zero=0, dp=1))
    assert (moment.activations, moment.grads, moment.working) == (30.0, 40.0, 5.0)


def test_zero3_holds_the_gathered_stage_and_one_flat_buffer() -> None:
    actions = [
        Action(0, G),
        Action(0, F, 0),
        Action(0, FREE),
        Action(0, G),
        Action(0, B, 0),
        Action(0, R),
        Action(0, FREE),
    ]
    moment, held = walk(actions, _sizes(zero=3, dp=4))
    # at REDUCE: gathered 100 + gradients 100 + their flat copy 100; the shard (25) comes after
    assert (moment.grads, moment.buffers) == (100.0, 200.0)
    assert held == 25.0


def test_zero1_keeps_full_gradients_and_the_shard() -> None:
    actions = [Action(0, F, 0), Action(0, B, 0), Action(0, R)]
    _, held = walk(actions, _sizes(zero=1, dp=4))
    assert held == 125.0


def test_plain_data_parallelism_keeps_each_micro_batchs_flat_buffer() -> None:
    actions = [Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, RM, 0), Action(0, B, 1)]
    actions.append(Action(0, RM, 1))
    moment, held = walk(actions, _sizes(zero=0, dp=2))
    # the end: two flat buffers and the gradients written back
    assert moment.total == pytest.approx(300.0)
    assert held == 100.0
