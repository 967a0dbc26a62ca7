"""Context parallelism in one process: the chunking, the execution plan's rules and refusals, `tessera validate`.

The parity of the runs themselves (loss and every gradient against one process) is
tests/distributed/test_context_parallel.py; the CLI run and the resume at context 1, test_context_cli.py.
"""

from __future__ import annotations

import pytest
import torch

from tessera.cli import main
from tessera.config import from_dict
from tessera.execution import resolve, violations
from tessera.memory import estimate
from tessera.parallel.context import context_batch, context_indices, key_indices


@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_ranks_hold_chunks_i_and_2c_minus_1_minus_i_and_equal_causal_work(c: int) -> None:
    s, n = 8 * c, 4  # chunks of 4
    held = [context_indices(s, c, r) for r in range(c)]
    for r, idx in enumerate(held):
        chunks = sorted({int(i) // n for i in idx})
        assert chunks == sorted({r, 2 * c - 1 - r}) and idx.tolist() == sorted(idx.tolist())
    assert torch.equal(torch.cat(held).sort().values, torch.arange(s))  # every token once
    # causal work of a query = the keys it sees (its global index + 1): the same on every rank
    assert len({int((idx + 1).sum()) for idx in held}) == 1
    assert torch.equal(key_indices(s, c), torch.cat(held))  # the gathered K/V's order: group-rank order


def test_context_batch_cuts_tokens_targets_and_positions_alike() -> None:
    tokens = torch.arange(32).view(2, 16)
    targets, documents = tokens + 100, (torch.arange(16) % 5).expand(2, 16)
    x, y, p = context_batch((tokens, targets), 2, 1)  # rank 1 of 2: chunks 1 and 2 of 4
    idx = [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(x, tokens[:, idx]) and torch.equal(y, targets[:, idx])
    assert torch.equal(p, torch.tensor(idx).expand(2, 8))  # global positions: RoPE, learned tables
    _, _, p = context_batch((tokens, targets, documents), 2, 1)
    assert torch.equal(p, documents[:, idx])  # positions within documents, taken from the whole window


def test_seq_len_not_dividing_into_2c_chunks_is_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 4"):
        context_indices(18, 2, 0)


def _raw(parallel: dict, **model: object) -> dict:
    return {"model": {"size": "llama-tiny", **model}, "parallel": parallel, "train": {"global_batch": 4}}


REFUSED = {  # what parallel.context does not run with in this version, each named with its fix
    "pipeline": ({"context": 2, "pipeline": 2}, 4, "parallel.pipeline = 2", "set parallel.pipeline = 1"),
    "2d": ({"context": 2, "tensor": "2x2"}, 8, '"2x2" (2D)', "use 1D tensor parallelism"),
    "hybrid": (
        {"context": 2, "data": 4, "zero": 1, "zero_shard_size": 2},
        8,
        "zero_shard_size = 2",
        "remove parallel.zero_shard_size",
    ),
    "tp_comm_overlap": (
        {"context": 2, "tensor": 2, "sequence_parallel": True, "tp_comm_overlap": True},
        4,
        "parallel.tp_comm_overlap",
        "set parallel.tp_comm_overlap = false",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_combinations_are_refused_by_name(name: str) -> None:
    parallel, world, what, fix = REFUSED[name]
    found = [v for v in violations(from_dict(_raw(parallel)), world) if v.rule == "context.refused"]
    assert len(found) == 1 and what in found[0].problem and found[0].fix.startswith(fix), found


@pytest.mark.parametrize(
    ("parallel", "seq_len", "unit"),
    [({"context": 2}, 34, 4), ({"context": 2, "tensor": 2, "sequence_parallel": True}, 36, 8)],
)
def test_seq_len_must_divide_by_2c_times_t_with_sp(parallel: dict, seq_len: int, unit: int) -> None:
    world = parallel["context"] * parallel.get("tensor", 1)
    found = [
        v
        for v in violations(from_dict(_raw(parallel, seq_len=seq_len)), world)
        if v.rule == "context.seq_len"
    ]
    assert len(found) == 1 and f"= {unit}" in found[0].problem, found
    assert found[0].fix.startswith("set model.seq_len = ") and int(found[0].fix.split("= ")[1]) % unit == 0


def test_plan_shards_zero_over_data_times_context() -> None:
    plan = resolve(from_dict(_raw({"context": 2, "data": 2, "zero": 3})), 4)
    assert (plan.cp, plan.dp, plan.batch_ranks, plan.zero_shard, plan.zero_replicas) == (2, 2, 4, 4, 1)
    assert (
        "context: 2 ranks" in plan.describe()
        and "ZeRO state sharded over data × context = 4" in plan.describe()
    )


def test_compare_starts_a_context_parallel_side_on_its_world_size() -> None:
    from tessera.parity import default_nproc

    assert default_nproc(from_dict(_raw({"context": 2, "tensor": 2, "data": 2}))) == 8


def test_validate_names_the_refusal_and_exits_1(capsys: pytest.CaptureFixture) -> None:
    code = main(
        [
            "validate",
            "configs/demo.toml",
            "--world-size",
            "4",
            "--parallel.context=2",
            "--parallel.pipeline=2",
        ]
    )
    out = capsys.readouterr()
    assert code == 1
    assert (
        "[context.refused] parallel.context = 2 does not run with parallel.pipeline = 2" in out.out + out.err
    )


def test_memory_estimate_counts_a_context_ranks_tokens_and_gathered_kv() -> None:
    """At c = 2 a rank's per-token activations are those of s/2 tokens with a mask per layer (a document-masked
    run of s/2), and it also keeps K and V of the other s/2 tokens and the mask's other half: more than that run,
    less than it plus the whole-sequence run. The bytes against the measured: tests/distributed/
    test_context_parallel.py."""
    seq = {"seq_len": 256}
    one = estimate(from_dict(_raw({"context": 1}, **seq)), 1).at_peak.activations
    two = estimate(from_dict(_raw({"context": 2}, **seq)), 2).at_peak.activations
    half = estimate(
        from_dict({**_raw({}, seq_len=128), "data": {"document_mask": True}}), 1
    ).at_peak.activations
    assert half < two < one + half
