"""Software stacks (tessera.planner.stacks): the megatron-te share applies where named and nowhere else, the
default stack leaves every hardware file (and `tessera plan`) as shipped, and the calibration table says where
each of its numbers is published."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import pytest

from tessera.errors import ConfigError
from tessera.planner.cli import _hardware, add_plan_parsers
from tessera.planner.cost import ModelShape, Plan
from tessera.planner.cost.collectives import group_placement
from tessera.planner.cost.compute import attention_core_time
from tessera.planner.gemm import shape_fraction
from tessera.planner.hardware import list_hardware, load_hardware
from tessera.planner.network import TESSERA_ORDER
from tessera.planner.stacks import (
    DEFAULT_STACK,
    MEGATRON_CP_ORDER,
    MEGATRON_TE_CALIBRATION,
    STACK_SHARES,
    STACKS,
    calibration_errors,
    fit_stack_share,
    stack_plan,
    with_stack,
)

ROOT = Path(__file__).resolve().parents[2]


def _plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_parsers(parser.add_subparsers())
    return parser.parse_args(["plan", "--model", "llama-8b", "--gpus", "8", *argv])


# --- where the factor applies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list_hardware())
def test_default_stack_is_the_shipped_file_itself(name: str) -> None:
    hw = load_hardware(name)
    assert with_stack(hw) is hw
    assert with_stack(hw, DEFAULT_STACK) is hw


def test_megatron_te_changes_the_framework_share_and_nothing_else() -> None:
    hw = load_hardware("h100")
    te = with_stack(hw, "megatron-te")
    assert te.gemm_framework_share == STACK_SHARES["megatron-te"]["h100"] == 0.86
    assert dataclasses.replace(te, gemm_framework_share=hw.gemm_framework_share) == hw


def test_a_gemm_by_hand_on_each_stack() -> None:
    """The h100 file's measured GEMM (6144 × 17920 × 2816 at 792.1 TFLOP/s of 989) on 128 × 128 tiles is
    48 · 140 = 6720 tiles, 50.9 waves of 132 SMs rounded up to 51: kernel fraction 792.1 / 989 / (6720/132/51),
    then × the stack's share (0.65 default, 0.86 megatron-te)."""
    kernel = 792.1 / 989 / (6720 / 132 / 51)
    hw = load_hardware("h100")
    assert shape_fraction(hw) == pytest.approx(kernel * 0.65, rel=1e-12)
    assert shape_fraction(with_stack(hw, "megatron-te")) == pytest.approx(kernel * 0.86, rel=1e-12)


def test_fused_attention_by_hand_on_each_stack() -> None:
    """Llama 3.1 8B's attention at s = 8192, c = 2: forward 4·s²·d·heads / 2 (causal) / c FLOPs per block and
    micro-batch = 8192² · 128 · 32 = 2.749e11, at FlashAttention-2's 265 TFLOP/s × the stack's share."""
    shape = MEGATRON_TE_CALIBRATION[0].shape
    plan = Plan(cp=2, dp=4, flash_attention=True)
    flops = 8192**2 * 128 * 32
    hw = load_hardware("h100")
    default_fwd, _ = attention_core_time(shape, hw, plan)
    te_fwd, _ = attention_core_time(shape, with_stack(hw, "megatron-te"), plan)
    assert default_fwd == pytest.approx(flops / (265e12 * 0.65), rel=1e-12)
    assert te_fwd == pytest.approx(flops / (265e12 * 0.86), rel=1e-12)


def test_stack_errors_name_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of default, megatron-te"):
        with_stack(load_hardware("h100"), "nemo")
    with pytest.raises(ValueError, match=r"calibrated only for h100 .*--stack default"):
        with_stack(load_hardware("a100-80gb"), "megatron-te")
    assert set(STACKS) == {DEFAULT_STACK, *STACK_SHARES}


# --- tessera plan: the default unchanged, the stack where named -----------------------------------------------


def test_plan_default_stack_prices_the_shipped_file() -> None:
    args = _plan_args("--hardware", "h100")
    assert args.stack == DEFAULT_STACK
    assert _hardware(args) == load_hardware("h100")


def test_plan_stack_flag_prices_the_stack() -> None:
    hw = _hardware(_plan_args("--hardware", "h100", "--stack", "megatron-te"))
    assert hw == with_stack(load_hardware("h100"), "megatron-te")


def test_plan_stack_without_calibration_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="calibrated only for h100"):
        _hardware(_plan_args("--hardware", "a100-80gb", "--stack", "megatron-te"))


def test_plan_refuses_out_on_another_stack(tmp_path: Path) -> None:
    from tessera.planner.cli import cmd_plan

    args = _plan_args("--hardware", "h100", "--stack", "megatron-te", "--out", str(tmp_path / "p.toml"))
    with pytest.raises(ConfigError, match="tessera runs the default stack"):
        cmd_plan(args)
    assert not (tmp_path / "p.toml").exists()


# --- the Megatron-Core validation rows (and only they) on the stack --------------------------------------------


def test_megatron_core_rows_are_priced_on_the_stack() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import published_megatron_core as mc

    assert mc.h100() == with_stack(load_hardware("h100"), "megatron-te")
    assert mc.h100("default") == load_hardware("h100")
    row = mc.WEAK_SCALING[0]
    assert mc.step(row).step_time == mc.step(row, mc.h100()).step_time
    assert mc.step(row).step_time < mc.step(row, load_hardware("h100")).step_time


def test_the_stack_moves_the_megatron_core_groups_and_no_other_published_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """planner_published's cases with megatron-te's share set back to the h100 file's: only the Megatron-Core
    groups (and the stack's calibration rows) may differ from the cases as shipped."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import planner_published as pp
    import published_megatron_core as mc

    shipped = {(c.group, c.label): c.predicted for c in pp.cases()}
    default_share = load_hardware("h100").gemm_framework_share
    monkeypatch.setitem(STACK_SHARES, "megatron-te", {"h100": default_share})
    as_default = {(c.group, c.label): c.predicted for c in pp.cases()}
    moved = {g for (g, label), v in shipped.items() if as_default[(g, label)] != v}
    assert moved == {mc.WEAK_GROUP, mc.STRONG_GROUP, mc.STACK_CALIBRATION_GROUP}


# --- the calibration table ------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", MEGATRON_TE_CALIBRATION, ids=lambda r: r.label)
def test_calibration_row_provenance(row) -> None:
    assert row.repo == "NVIDIA/dgxc-benchmarking"
    assert row.path.endswith(".md") and row.container
    assert re.fullmatch(r"[0-9a-f]{40}", row.commit)
    assert row.precision == "bf16"  # the validation rows are BF16; tessera has no FP8
    assert row.step_time > 0 and isinstance(row.shape, ModelShape)
    assert row.settings.startswith("NVIDIA/NeMo-Framework-Launcher launcher_scripts/conf/training/")
    assert re.search(r"\.yaml @ [0-9a-f]{12}$", row.settings) and row.recompute in ("none", "selective")
    assert row.dp * row.tp * row.pp * row.cp == row.gpus
    assert row.global_batch % (row.dp * row.micro_batch) == 0


@pytest.mark.parametrize("row", MEGATRON_TE_CALIBRATION, ids=lambda r: r.label)
def test_calibration_plan_runs_the_stated_layout(row) -> None:
    p = stack_plan(row)
    assert (p.dp, p.tp, p.pp, p.cp, p.micro_batch) == (row.dp, row.tp, row.pp, row.cp, row.micro_batch)
    assert p.n_microbatches * p.dp * p.micro_batch == row.global_batch
    assert p.virtual_stages == (row.vp if row.pp > 1 else row.shape.n_layers)
    assert p.rank_order == MEGATRON_CP_ORDER and p.zero_stage == 1 and p.recompute == row.recompute
    assert p.tp_comm_overlap == (row.tp > 1) and p.overlap_param_gather


def test_no_calibration_row_is_a_validation_row() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import published_megatron_core as mc

    validation = {(r.gpus, r.layers, r.hidden) for r in mc.WEAK_SCALING}
    validation |= {(g, mc.GPT3.layers, mc.GPT3.hidden) for g, _ in mc.STRONG_SCALING}
    for r in MEGATRON_TE_CALIBRATION:
        assert (r.gpus, r.shape.n_layers, r.shape.d_model) not in validation


def test_shipped_share_is_the_fit_and_the_fit_is_stated() -> None:
    """The shipped 0.86 is the grid fit on the calibration rows; its mean |error| is 5.6 % (rows -9.0 %,
    -0.3 %, +7.6 %, docs/cost-model.md), each within 10 %."""
    share, mean = fit_stack_share(load_hardware("h100"))
    assert share == STACK_SHARES["megatron-te"]["h100"]
    assert mean == pytest.approx(0.056, abs=0.001)
    errors = calibration_errors(with_stack(load_hardware("h100"), "megatron-te"))
    assert max(abs(e) for e in errors) < 0.10


# --- context parallelism with a pipeline in Megatron's rank order ---------------------------------------------


def test_data_context_group_with_a_pipeline_in_megatrons_order() -> None:
    """Megatron-Core's order tp-cp-ep-dp-pp: the d·c batch ranks are consecutive context coordinates, t apart;
    tessera's order puts the pipeline between data and context, which stays refused."""
    hw = load_hardware("h100")
    plan = Plan(dp=2, pp=4, cp=2, tp=4, rank_order=MEGATRON_CP_ORDER)
    pl = group_placement(hw, plan, "data_context")
    assert pl == group_placement(
        hw, Plan(dp=2, pp=1, cp=2, tp=4, rank_order=MEGATRON_CP_ORDER), "data_context"
    )
    with pytest.raises(ValueError, match="tessera's rank order"):
        group_placement(hw, dataclasses.replace(plan, rank_order=TESSERA_ORDER), "data_context")
