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


# DeepSpeed's blocking, partitioned p2p (the report's engine table), by hand on the shipped a100-80gb file:
# NVLink 300 GB/s and 5 us per hop in the node, 25 GB/s and 10 us per GPU across nodes. Pipeline neighbours are
# t·d ranks apart (Megatron's order), on two nodes; the tensor group is the node's 8 GPUs.
_FULL = 2048 * 20480 * 2  # one micro-batch's b·s·h boundary tensor in bf16: 83,886,080 bytes
_PART = _FULL / 8 / 25e9 + 10e-6  # 1/t of it to the neighbour: 429.43 us
_WHOLE = _FULL / 25e9 + 10e-6  # all of it: 3,365.44 us
_GATHER = 7 / 8 * _FULL / 300e9 + 7 * 5e-6  # ring all-gather over 8 GPUs on NVLink: 279.67 us


@pytest.mark.parametrize(
    ("partitioned", "expected"),
    [(True, 4 * _PART + 3 * _GATHER), (False, 2 * _PART + 2 * _WHOLE + 2 * _GATHER)],
    ids=["grads-partitioned", "grads-whole"],
)
def test_deepspeed_p2p_per_micro_batch_by_hand(partitioned: bool, expected: float) -> None:
    """Four blocking transfers per micro-batch (activation and gradient, in and out) and the all-gathers that
    re-assemble the partitioned tensors: 2.557 ms with partitioned gradients (v0.5.4 on), 8.149 ms with whole
    ones (to v0.5.3)."""
    hw = mtnlg.load_hardware("a100-80gb")
    got = mtnlg.deepspeed_p2p(mtnlg.SHAPE, hw, mtnlg.plan(mtnlg.ROWS[-1]), partitioned)
    assert got == pytest.approx(expected, rel=1e-9)
    assert got == pytest.approx(2.5567e-3 if partitioned else 8.1491e-3, abs=1e-7)


def test_deepspeed_p2p_bound_counts_every_micro_batch_period() -> None:
    """The 420-node row: m + p − 1 = 160 + 34 periods of 2.557 ms = 0.496 s."""
    hw = mtnlg.load_hardware("a100-80gb")
    row = mtnlg.ROWS[-1]
    assert mtnlg.deepspeed_p2p_bound(row, hw, True) == pytest.approx(
        194 * (4 * _PART + 3 * _GATHER), rel=1e-9
    )
    assert mtnlg.deepspeed_p2p_bound(row, hw, True) == pytest.approx(0.4960, abs=1e-4)
