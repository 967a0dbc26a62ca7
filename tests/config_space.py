"""The space of tiny training configs that the property tests and the layout search draw from.

`draw_run_config` draws (world size, raw config sections) through a `Pick`: `HypothesisPick` makes it a hypothesis
strategy (tests/distributed/test_validate_accepts_train_runs.py: derandomized, shrinkable) and `RandomPick` a
seeded one (benchmarks/layout_search.py). Both make the same sequence of choices, so a hypothesis example and a
seeded draw are the same function of their choices.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

__all__ = ["HypothesisPick", "Pick", "RandomPick", "draw_op_checkpointing", "draw_run_config", "op_runs"]


class Pick(Protocol):
    """The choices a draw makes."""

    def integers(self, lo: int, hi: int) -> int: ...

    def sampled_from(self, options: Sequence[T]) -> T: ...

    def booleans(self) -> bool: ...

    def int_list(self, lo: int, hi: int, n: int) -> list[int]: ...


class RandomPick:
    """Choices from a seeded ``random.Random``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integers(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def sampled_from(self, options: Sequence[T]) -> T:
        return self.rng.choice(list(options))

    def booleans(self) -> bool:
        return self.rng.random() < 0.5

    def int_list(self, lo: int, hi: int, n: int) -> list[int]:
        return [self.rng.randint(lo, hi) for _ in range(n)]


class HypothesisPick:
    """Choices drawn by hypothesis (inside an ``st.composite``)."""

    def __init__(self, draw: Any) -> None:
        from hypothesis import strategies as st

        self.draw, self.st = draw, st

    def integers(self, lo: int, hi: int) -> int:
        return self.draw(self.st.integers(lo, hi))

    def sampled_from(self, options: Sequence[T]) -> T:
        return self.draw(self.st.sampled_from(options))

    def booleans(self) -> bool:
        return self.draw(self.st.booleans())

    def int_list(self, lo: int, hi: int, n: int) -> list[int]:
        return self.draw(self.st.lists(self.st.integers(lo, hi), min_size=n, max_size=n))


def draw_run_config(pick: Pick, head_dim: bool = True, op: Pick | None = None) -> tuple[int, dict]:
    """(world size, raw config sections) of a tiny model: mostly consistent with the world size.

    ``head_dim=False`` leaves out the ``model.head_dim`` draw (added after the layout search's seeds 0-6 were
    recorded), so a seeded draw makes those seeds' choices again (benchmarks/layout_search.py's plain draw).
    ``op``: a second source of choices for ``checkpointing = "op"`` (`draw_op_checkpointing`), consulted after
    every draw from ``pick``; None draws no op."""
    world = pick.integers(1, 4)
    family = pick.sampled_from(["gpt", "llama", "qwen2", "qwen3"])
    n_heads = pick.sampled_from([1, 2, 4])
    model = {
        "family": family,
        "n_layers": pick.integers(1, 4),
        "d_model": pick.sampled_from([16, 32, 48]),
        "n_heads": n_heads,
        "vocab_size": 256,  # the byte tokenizer of the test corpus
        "seq_len": pick.sampled_from([8, 12, 16]),
        "tie_embeddings": pick.booleans(),
    }
    if family != "gpt":  # Llama, Qwen2 and Qwen3 have grouped-query attention
        model["n_kv_heads"] = pick.sampled_from([None, 1, 2])
    # a head width other than d_model / n_heads (Qwen3-0.6B's kind); 3: odd, RoPE refuses it, and so does GPT
    # unless it is d / a
    if head_dim and not pick.integers(0, 3):
        model["head_dim"] = pick.sampled_from([3, 4, 6, 12])
    tensor_options = [t for t in (1, 2, 3, 4) if world % t == 0] + (["2x2"] if world == 4 else [])
    tensor = pick.sampled_from(tensor_options) if pick.integers(0, 4) else pick.sampled_from([1, 2, 3, "2x2"])
    ranks = 4 if tensor == "2x2" else int(tensor)
    rest = world // ranks if world % ranks == 0 else 1
    pipeline = (
        pick.sampled_from([p for p in (1, 2, 3) if rest % p == 0])
        if pick.integers(0, 4)
        else pick.integers(1, 3)
    )
    schedule = pick.sampled_from(["1f1b", "gpipe", "interleaved", "breadth_first"])
    v = pick.integers(1, 3) if schedule in ("interleaved", "breadth_first") or not pick.integers(0, 3) else 1
    parallel = {
        "tensor": tensor,
        "sequence_parallel": tensor not in (1, "2x2") and pick.booleans(),
        "pipeline": pipeline,
        "schedule": schedule,
        "stages_per_rank": v,
        "zero": pick.integers(0, 3),
        "accumulation": pick.sampled_from(["layered", "depth_first"]),
        "checkpointing": pick.sampled_from(["none", "full", "selective"]),
    }
    if not pick.integers(0, 5):
        parallel["data"] = pick.integers(1, 4)
    if pipeline * v > 1 and not pick.integers(0, 4):
        n = pipeline * v
        parallel["stage_layers"] = pick.int_list(0, 2, n)
    micro = pick.sampled_from([1, 2, 4])
    dp = max(1, world // (pipeline * ranks))
    batch = micro * dp * pick.integers(1, 6) if pick.integers(0, 4) else pick.integers(1, 16)
    train = {
        "micro_batch": micro,
        "global_batch": batch,
        "dtype": pick.sampled_from(["fp32", "fp32", "bf16"]),
    }
    # drawn last, so the draws above stay as they were; mostly with SP (accepted), sometimes without (rejected)
    if parallel["sequence_parallel"] or not pick.integers(0, 9):
        parallel["tp_comm_overlap"] = pick.booleans()
    # likewise: mostly with ZeRO-1/2 (accepted), sometimes with ZeRO-0/3 (rejected)
    if parallel["zero"] in (1, 2) or not pick.integers(0, 9):
        parallel["overlap_param_gather"] = pick.booleans()
    # likewise: a stage split of the one stage of pipeline 1 (validated as any other; it once passed unchecked)
    if pipeline * v == 1 and not pick.integers(0, 9):
        parallel["stage_layers"] = [pick.sampled_from([model["n_layers"], model["n_layers"] + 1])]
    # likewise: hybrid sharding's shard size, mostly where ZeRO has data ranks to shard over (dp 4 = 2 × 2 is
    # accepted; 1, 3 and sizes without ZeRO are refused)
    if (parallel["zero"] and dp > 1 and pick.integers(0, 1)) or not pick.integers(0, 19):
        parallel["zero_shard_size"] = pick.sampled_from([1, 2, 2, 3, 4])
    if op is not None:
        draw_op_checkpointing(op, parallel)
    return world, {"model": model, "parallel": parallel, "train": train}


def op_runs(parallel: dict) -> bool:
    """Whether ``checkpointing = "op"`` runs on a drawn parallel section: not on the 2D grid nor with the tensor
    rings, where a Linear is several matmuls (`tessera.execution.op_checkpointing_violations`)."""
    return parallel["tensor"] != "2x2" and not parallel.get("tp_comm_overlap", False)


def draw_op_checkpointing(op: Pick, parallel: dict) -> None:
    """Make a third of the draws that checkpoint ("full" or "selective") and where op runs (`op_runs`) op instead.

    Why only those, from a Pick of its own: a draw from ``pick`` shifted every later choice of the layout search's
    recorded seeds (83b8452 drew op from it; 0d8f8f7 removed that), and turning a "none" into op would change which
    draws the ckpt_pp focus keeps. So every other choice, and which draws checkpoint, stay as recorded."""
    if parallel["checkpointing"] != "none" and op_runs(parallel) and not op.integers(0, 2):
        parallel["checkpointing"] = "op"
