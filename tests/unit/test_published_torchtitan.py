"""Transcription checks of torchtitan's published rows (benchmarks/published_torchtitan.py): each published MFU is
reproduced from the same row's published tokens/s/GPU by our shapes and torchtitan's FLOP convention of the time.
The planner's errors are the report's business, not pinned here."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import published_torchtitan as titan

WITH_MFU = [r for r in titan.ROWS if r.mfu is not None]


def _tolerance(row: titan.TitanRow) -> float:
    """Rounding of both printed figures: the MFU to 0.1 point, the tokens/s/GPU to an integer."""
    return 0.05 + row.mfu * 0.5 / row.tokens_per_gpu


@pytest.mark.parametrize("row", WITH_MFU, ids=[titan.label(r) for r in WITH_MFU])
def test_published_mfu_follows_from_published_tps(row: titan.TitanRow) -> None:
    assert abs(titan.mfu(row, row.tokens_per_gpu) - row.mfu) <= _tolerance(row)


def test_the_april_convention_is_forced_by_the_data() -> None:
    # April 2024 counts the input embedding in N; without it every April row misses its published MFU (the 405B
    # row's embedding is too small a share to decide: its convention is read from train.py at its commit)
    april = [r for r in WITH_MFU if r.convention == titan.APRIL_2024]
    assert len(april) == 3
    for row in april:
        without = titan.mfu(replace(row, convention=titan.AUGUST_2024), row.tokens_per_gpu)
        assert abs(without - row.mfu) > _tolerance(row)


def test_h100_8b_rows_fall_in_the_stated_mfu_range() -> None:
    low, high = titan.STATED_MFU_RANGE
    rows = [r for r in titan.ROWS if r.model == "llama3-8b" and r.gpu == "h100"]
    assert len(rows) == 4
    for r in rows:
        assert low - 0.5 <= titan.mfu(r, r.tokens_per_gpu) < high + 0.5


def test_shapes_are_torchtitans_llama_args() -> None:
    # SwiGLU width: multiple_of rounding of ffn_dim_multiplier · int(8h/3) (torchtitan's FeedForward)
    def ffn(h: int, multiplier: float | None, multiple_of: int) -> int:
        hidden = int(2 * 4 * h / 3)
        hidden = int(multiplier * hidden) if multiplier else hidden
        return multiple_of * math.ceil(hidden / multiple_of)

    expected = {
        "llama3-8b": ffn(4096, 1.3, 1024),
        "llama3.1-405b": ffn(16384, 1.2, 4096),
        "llama2-13b": ffn(5120, None, 256),
        "llama2-70b": ffn(8192, 1.3, 4096),
    }
    assert {k: s.ffn_hidden for k, s in titan.SHAPES.items()} == expected


def test_cases_one_per_row_in_tokens_per_gpu() -> None:
    cases = titan.cases()
    assert [c.published for c in cases] == [r.tokens_per_gpu for r in titan.ROWS]
    assert all(c.unit == "tokens/s/GPU" and math.isfinite(c.predicted) and c.predicted > 0 for c in cases)
    assert len({c.label for c in cases}) == len(cases)
