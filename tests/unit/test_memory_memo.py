"""tessera.memory's memo tables (`_memo`, keyed on the fields each function reads, so that the planner's search
prices layouts differing only in other fields once): a value stored for one plan is never returned for a plan
that differs in a field the function reads."""

from __future__ import annotations

import itertools

import pytest

from tessera import memory
from tessera.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainConfig
from tessera.execution import ExecutionPlan, Layout, resolve
from tessera.planner.cost import ModelShape
from tests.plan_grid import valid_plan

MODEL = ModelConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=128, seq_len=32, tie_embeddings=True)
SHAPE = ModelShape.from_config(MODEL)
TABLES = (
    memory._STAGE_PARAMS,
    memory._INFLIGHT,
    memory._STATE_FLOORS,
    memory._RANK_STATES,
    memory._MICRO_BATCH_BYTES,
    memory._BLOCK_AND_P2P,
)


def _clear() -> None:
    for table in TABLES:
        table.clear()


def _plan(
    world: int,
    micro_batch: int = 1,
    global_batch: int = 8,
    documents: bool = False,
    dtype: str = "fp32",
    **parallel: object,
) -> ExecutionPlan:
    cfg = Config(
        model=MODEL,
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(global_batch=global_batch, micro_batch=micro_batch, dtype=dtype),
        data=DataConfig(document_mask=documents),
    )
    return resolve(cfg, world, training=False)


def _grid() -> list[ExecutionPlan]:
    """Valid plans over every field the memoized functions read, each varied alone somewhere in the grid."""
    plans = []
    for tensor, pipeline, data, schedule, v, zero, ckpt, mb, split in itertools.product(
        (1, 2),
        (1, 2),
        (1, 2),
        ("1f1b", "gpipe", "interleaved", "breadth_first"),
        (1, 2),
        (0, 1, 2, 3),
        ("none", "full"),
        (1, 2),
        (None, [1, 3]),
    ):
        if split is not None and (pipeline, v) != (2, 1):
            continue
        parallel = dict(
            tensor=tensor,
            sequence_parallel=tensor > 1,
            pipeline=pipeline,
            data=data,
            schedule=schedule,
            stages_per_rank=v,
            zero=zero,
            checkpointing=ckpt,
            stage_layers=split,
        )
        plan = valid_plan(MODEL, parallel, global_batch=8, micro_batch=mb)
        if plan is not None:
            plans.append(plan)
    return plans


def _values(plan: ExecutionPlan) -> tuple:
    """Everything the memo tables feed, for one plan: the memoized functions and the estimates built on them."""
    return (
        memory._plan_stage_params(SHAPE, plan),
        memory._inflight(plan),
        memory.model_state_floor(SHAPE, plan),
        [memory._rank_state(SHAPE, plan, r) for r in range(plan.pp)],
        memory._micro_batch_bytes(SHAPE, memory.cost_plan(plan)),
        memory.memory_floor(SHAPE, plan),
        memory._block_and_p2p(SHAPE, plan),
        [memory._rank_state_floor(SHAPE, plan, r) for r in range(plan.pp)],
        [memory.estimate_plan(SHAPE, plan, stage=r).total for r in range(plan.pp)],
    )


def test_memoized_values_equal_fresh_ones_over_a_grid() -> None:
    """Filled in grid order (neighbours differ in one field), every plan's values equal those computed with empty
    tables; the tables shared entries (fewer than the plans), so the memos were exercised."""
    plans = _grid()
    assert len(plans) > 200
    _clear()
    warm = [_values(plan) for plan in plans]
    assert len(memory._STATE_FLOORS) < len(plans) / 4
    assert len(memory._INFLIGHT) < len(plans) / 4
    for plan, values in zip(plans, warm, strict=True):
        _clear()
        assert _values(plan) == values, plan


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # model state: ZeRO stage, the split, the tensor degree
        (dict(world=4, data=2, pipeline=2, zero=1), dict(world=4, data=2, pipeline=2, zero=2)),
        (dict(world=2, pipeline=2), dict(world=2, pipeline=2, stage_layers=[1, 3])),
        (dict(world=2, pipeline=2, tensor=1, data=1), dict(world=2, pipeline=1, tensor=2, data=1)),
        # in-flight counts: the schedule, the micro-batch count
        (dict(world=2, pipeline=2, schedule="1f1b"), dict(world=2, pipeline=2, schedule="gpipe")),
        (
            dict(world=2, pipeline=2, schedule="gpipe"),
            dict(world=2, pipeline=2, schedule="gpipe", global_batch=4),
        ),
        # one micro-batch's bytes: checkpointing, the micro-batch size, sequence parallelism
        (dict(world=2, pipeline=2), dict(world=2, pipeline=2, checkpointing="full")),
        (dict(world=2, pipeline=2), dict(world=2, pipeline=2, micro_batch=2)),
        (dict(world=2, tensor=2), dict(world=2, tensor=2, sequence_parallel=True)),
        # full recomputation in bf16: ZeRO-3's replay makes its block's weight copies again (ZeRO-1's cache has them)
        (
            dict(world=2, data=2, zero=1, checkpointing="full", dtype="bf16"),
            dict(world=2, data=2, zero=3, checkpointing="full", dtype="bf16"),
        ),
        # document masking: every layer's mask (none), the stage's shared mask (selective)
        (dict(world=2, pipeline=2), dict(world=2, pipeline=2, documents=True)),
        (
            dict(world=2, pipeline=2, checkpointing="selective"),
            dict(world=2, pipeline=2, checkpointing="selective", documents=True),
        ),
    ],
)
def test_a_plan_differing_in_a_read_field_gets_its_own_value(first: dict, second: dict) -> None:
    """The second plan's values, asked for right after the first's, are its own (equal to a fresh computation)
    and differ from the first's (the field matters: a stale entry would be caught)."""
    a, b = _plan(**first), _plan(**second)
    _clear()
    fresh_b = _values(b)
    _clear()
    values_a, values_b = _values(a), _values(b)
    assert values_b == fresh_b
    assert values_a != values_b


def test_decide_shares_layouts_equal_to_from_config() -> None:
    """`execution.decide` builds each distinct Layout once: the same sizes as `Layout.from_config`."""
    plan = _plan(world=8, data=2, pipeline=2, tensor=2)
    assert plan.layout == Layout.from_config(ParallelConfig(data=2, pipeline=2, tensor=2), 8)
    assert plan.layout is _plan(world=8, data=2, pipeline=2, tensor=2, zero=1).layout
