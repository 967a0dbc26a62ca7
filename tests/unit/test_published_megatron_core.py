"""Transcription checks of the Megatron-Core H100 rows (benchmarks/published_megatron_core.py): the table's
own derived columns and stated sizes are reproduced from its other columns. No planner prediction is checked
here."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import published_megatron_core as mc

from tessera.planner.cost import model_flops_per_token
from tessera.planner.megatron_table import MegatronRow

ROWS = mc.WEAK_SCALING


CASES = list(zip(ROWS, mc.DERIVED_COLUMNS, strict=True))
IDS = [f"{r.params_b:g}B" for r in ROWS]


@pytest.mark.parametrize(("row", "derived"), CASES, ids=IDS)
def test_layout_multiplies_out_to_the_gpu_count(row: MegatronRow, derived: tuple[int, int, float]) -> None:
    assert row.tp * row.pp * derived[0] == row.gpus
    assert row.dp == derived[0]
    assert row.layers % row.pp == 0
    assert row.batch % row.dp == 0


@pytest.mark.parametrize(("row", "derived"), CASES, ids=IDS)
def test_aggregate_column_is_per_gpu_times_gpus(row: MegatronRow, derived: tuple[int, int, float]) -> None:
    # the aggregate column is rounded to 0.1 PFLOP/s
    assert row.tflops_per_gpu * row.gpus / 1000 == pytest.approx(derived[2], abs=0.051)


@pytest.mark.parametrize(("row", "derived"), CASES, ids=IDS)
def test_mfu_column_is_per_gpu_over_the_bf16_peak(row: MegatronRow, derived: tuple[int, int, float]) -> None:
    # the MFU column is rounded to whole percent; 420.5 / 989 = 42.52 % is printed 43 %
    assert 100 * row.tflops_per_gpu * 1e12 / mc.PEAK_BF16 == pytest.approx(derived[1], abs=0.5)


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_untied_shape_reproduces_the_stated_size(row: MegatronRow) -> None:
    # sizes are printed to two significant digits below 10B (1.754B reads 1.7B) and to whole billions above
    params = mc.shape(row).n_params() / 1e9
    assert params == pytest.approx(row.params_b, abs=0.06 if row.params_b < 10 else 0.51)


def test_only_the_untied_shape_gives_the_gpt3_size_the_readme_describes() -> None:
    # "slightly more than 175 billion parameters due to larger vocabulary size", labelled 177B: untied 177.2B,
    # tied 175.6B
    untied = mc.shape(mc.GPT3)
    assert round(untied.n_params() / 1e9) == 177
    assert round(replace(untied, tied=True).n_params() / 1e9) == 176


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_megatron_flop_formula_equals_the_cost_models_model_flops(row: MegatronRow) -> None:
    # Megatron's num_floating_point_operations (transcribed) = 3 × forward matmul FLOPs over the full s×s,
    # i.e. the cost model's MFU convention for a dense GPT; the 12·B·s·L·h² closed form by hand below
    s = mc.shape(row)
    per_token = mc.megatron_flops_per_iteration(s, 1) / s.seq_len
    assert per_token == pytest.approx(model_flops_per_token(s), rel=1e-12)


def test_megatron_flop_formula_by_hand_for_gpt3() -> None:
    # 12·B·s·L·h²·(2 + s/h + 4 + V/(2Lh)) with a = g, f = 4h
    b, s, L, h, V = 1152, 4096, 96, 12288, 131072
    expected = 12 * b * s * L * h * h * (2 + s / h + 4 + V / (2 * L * h))
    assert mc.megatron_flops_per_iteration(mc.shape(mc.GPT3), b) == pytest.approx(expected, rel=1e-12)


def test_published_step_inverts_tflops() -> None:
    row = mc.GPT3
    t = mc.published_step(row, row.tflops_per_gpu)
    assert mc.tflops_per_gpu(row, t) == pytest.approx(row.tflops_per_gpu, rel=1e-12)


def test_strong_scaling_layout_keeps_the_177b_model_parallel_group() -> None:
    small, large = mc.strong_row(96), mc.strong_row(4608)
    assert (small.dp, large.dp) == (2, 96)
    assert small.tp * small.pp * small.dp == 96 and large.tp * large.pp * large.dp == 4608
    assert small.batch == large.batch == 1152


@pytest.mark.parametrize(("row", "v"), [(ROWS[0], 1), (ROWS[4], 2), (ROWS[5], 23), (ROWS[8], 7)])
def test_virtual_stage_rule(row: MegatronRow, v: int) -> None:
    assert mc.megatron_virtual_stages(row) == v


@pytest.mark.parametrize("row", ROWS)
def test_plan_runs_the_overlaps_the_readme_states(row: MegatronRow) -> None:
    """--tp-comm-overlap (with sequence parallelism, so only where TP > 1) and --overlap-param-gather (ZeRO-1)."""
    plan = mc.plan(row)
    assert plan.tp_comm_overlap == plan.sequence_parallel == (row.tp > 1)
    assert plan.overlap_param_gather and plan.zero_stage == 1
    off = mc.plan(row, overlaps=False)
    assert not (off.tp_comm_overlap or off.overlap_param_gather)
    # without PP, one stage per block: tessera's pipeline-free ZeRO, the deferred gather's unit
    assert plan.virtual_stages == (row.layers if row.pp == 1 else mc.megatron_virtual_stages(row))
