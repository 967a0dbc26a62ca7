"""Transcription checks of benchmarks/published_mtnlg.py (MT-NLG 530B, arXiv 2201.11990 §2.4): the shape, the
published figures and the FLOP convention agree with each other and with the paper's other stated numbers. The
planner's errors on these rows are the report's business, not a test's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import published_mtnlg as mtnlg


def test_shape_has_the_530b_parameter_count() -> None:
    """Our GPT shape (105 × 20,480, vocabulary 51,200, tied) has the 529.6B parameters Narayanan 2021 Table 1
    gives for this model, i.e. the paper's "530B"."""
    assert mtnlg.SHAPE.n_params() == pytest.approx(529.6e9, abs=0.05e9)


def test_layout_is_tp8_pp35_with_the_stated_data_parallel_degrees() -> None:
    """280 / 350 / 420 DGX A100 servers of 8 GPUs, replicas of 8 × 35 GPUs: data-parallel 8 / 10 / 12, and the
    global batch 1,920 splits into whole micro-batches."""
    assert [r.dp for r in mtnlg.ROWS] == [8, 10, 12]
    assert [r.microbatches for r in mtnlg.ROWS] == [240, 192, 160]
    for r in mtnlg.ROWS:
        assert r.dp * mtnlg.TP * mtnlg.PP == r.gpus
        assert r.microbatches * mtnlg.MICRO_BATCH * r.dp == mtnlg.GLOBAL_BATCH


@pytest.mark.parametrize("row", mtnlg.ROWS, ids=lambda r: f"{r.nodes}-nodes")
def test_convention_reproduces_published_tflops_from_iteration_time(row: mtnlg.MtnlgRow) -> None:
    """Narayanan's eq. 3 (with recompute) turns each published iteration time into the published TFLOP/s per GPU
    within the rounding of both figures: ±0.5 TFLOP/s on the result, ±0.05 s on the time."""
    tolerance = 0.5 + row.tflops_per_gpu * 0.05 / row.iteration_s
    assert abs(mtnlg.tflops_from_iteration_time(row) - row.tflops_per_gpu) <= tolerance


def test_palm_mfu_of_the_280_node_run() -> None:
    """PaLM (arXiv 2204.02311, App. B): MT-NLG's MFU is 29.7 % (30.2 % counting attention), from 65.43K tokens/s
    on 2,240 A100s; the same from our shape and the 280-node iteration time, to the published digit."""
    row = mtnlg.ROWS[0]
    assert mtnlg.GLOBAL_BATCH * mtnlg.SHAPE.seq_len / row.iteration_s == pytest.approx(65.43e3, abs=5)
    assert mtnlg.palm_mfu(row) == pytest.approx(0.297, abs=0.0005)
    assert mtnlg.palm_mfu(row, attention=True) == pytest.approx(0.302, abs=0.0005)
