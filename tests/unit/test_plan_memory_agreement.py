"""One memory model: the planner's figure for a layout is `tessera memory` on the TOML `tessera plan --out` writes.

Both resolve the same execution plan (`tessera.execution`) and price it with the same estimator
(`tessera.memory.estimate_plan`); every recommended layout fits by `tessera memory` on the device it was planned
for.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.cli import main
from tessera.config import ModelConfig, load_config
from tessera.execution import resolve
from tessera.memory import estimate
from tessera.planner.hardware import load_hardware
from tessera.planner.report import write_config
from tessera.planner.search import PLANNER_SIZES, SearchSpace, search

REL = 1e-9
"""The same arithmetic on the same plan: equal up to float rounding."""
TOP = 3
"""Layouts checked per search: the best and the next ones (different ZeRO stages, schedules, tensor kinds)."""

MATRIX = [  # (model, GPUs, hardware, global batch or None for the critical batch)
    (
        "llama-1b",
        16,
        "h100",
        None,
    ),  # the critical batch: llama-8b here searched ~4× longer for the same check
    ("llama-8b", 8, "a100-80gb", 64),
    ("llama-8b", 32, "a100-40gb", 256),
    ("llama-1b", 8, "a100-40gb", 64),
    ("llama-1b", 4, "h100", 32),
    ("gpt2-1.5b", 8, "a100-40gb", 32),
    ("gpt2-774m", 2, "a100-40gb", 16),
    ("gpt2-350m", 1, "a100-40gb", 8),
    ("gpt2-124m", 4, "a100-40gb", 64),
    ("llama-70b", 64, "h100", 512),
    ("llama-70b", 32, "h200", 128),
]


@pytest.mark.parametrize(("model", "gpus", "hardware", "batch"), MATRIX)
def test_plan_memory_equals_tessera_memory_on_the_written_toml(
    model: str, gpus: int, hardware: str, batch: int | None, tmp_path: Path
) -> None:
    hw = load_hardware(hardware)
    space = SearchSpace(max_micro_batch=8)  # bounds the search's size, not what it checks
    result = search(model, gpus, hw, batch, space=space, keep=TOP)
    assert result.candidates, result.no_fit_message()
    for i, cand in enumerate(result.candidates):
        path = write_config(result, cand, tmp_path / f"plan{i}.toml")
        cfg = load_config(path)
        assert resolve(cfg, gpus) == cand.execution, cand.label
        est = estimate(cfg, gpus, hw.memory_bytes)
        assert est.total == pytest.approx(cand.memory.total, rel=REL), cand.label
        assert est.fits(), f"{cand.label}: {est.explain_overflow()}"


def test_cli_plan_out_then_memory_agree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The user's path: `tessera plan ... --out p.toml` then `tessera memory p.toml` prints the same figure.
    At the critical batch (no --global-batch) like MATRIX's first row, on a small search (llama-1b on 4 GPUs, ~3 s;
    llama-8b on 16 took ~20 s) since the library's agreement is checked on the whole MATRIX above."""
    out = tmp_path / "p.toml"
    args = ["--model", "llama-1b", "--gpus", "4", "--hardware", "h100", "--top", "1"]
    assert main(["plan", *args, "--json", "--out", str(out)]) == 0
    planned = json.loads(capsys.readouterr().out)["layouts"][0]["memory_per_gpu_bytes"]
    assert main(["memory", str(out), "--world-size", "4", "--hardware", "h100"]) == 0
    printed = capsys.readouterr().out
    assert f"total {planned / 2**30:.2f} GiB" in printed and "fits" in printed


CONTEXT_MATRIX = [(65536, 16, 16), (32768, 8, 8)]
"""(sequence length, GPUs, global batch) of Llama 3.1 8B on H100 where the search offers context parallelism."""


@pytest.mark.parametrize(("seq_len", "gpus", "batch"), CONTEXT_MATRIX)
def test_plan_out_with_context_validates_and_memory_agrees(
    seq_len: int, gpus: int, batch: int, tmp_path: Path
) -> None:
    """Every context-parallel layout among the top ones: the written TOML loads, validates for the world size,
    resolves to the execution plan the search priced, and `tessera memory`'s estimate is the search's figure."""
    result = search(
        ModelConfig(**{**PLANNER_SIZES["llama3.1-8b"], "seq_len": seq_len}),
        gpus,
        load_hardware("h100"),
        batch,
        space=SearchSpace(max_micro_batch=2),
        keep=200,
    )
    picked = [c for c in result.candidates if c.plan.cp > 1][:3]
    assert picked
    for i, cand in enumerate(picked):
        path = write_config(result, cand, tmp_path / f"plan{i}.toml")  # raises on a config validate refuses
        cfg = load_config(path)
        assert cfg.parallel.context == cand.plan.cp
        assert not cfg.check(gpus)
        assert resolve(cfg, gpus) == cand.execution, cand.label
        est = estimate(cfg, gpus, load_hardware("h100").memory_bytes)
        assert est.total == pytest.approx(cand.memory.total, rel=1e-9), cand.label


def test_cli_plan_out_with_context_then_validate_and_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The user's path at 64K tokens: `tessera plan MODEL.toml --out p.toml`, then `tessera validate` and
    `tessera memory` on it."""
    model = tmp_path / "model.toml"
    model.write_text('[model]\nsize = "llama3.1-8b"\nseq_len = 65536\n')
    out = tmp_path / "p.toml"
    args = ["--model", str(model), "--gpus", "16", "--hardware", "h100", "--global-batch", "16", "--top", "1"]
    assert main(["plan", *args, "--json", "--out", str(out)]) == 0
    layout = json.loads(capsys.readouterr().out)["layouts"][0]
    assert layout["context"] > 1 and "context = " in out.read_text()
    assert main(["validate", str(out), "--world-size", "16"]) == 0
    capsys.readouterr()
    assert main(["memory", str(out), "--world-size", "16", "--hardware", "h100"]) == 0
    printed = capsys.readouterr().out
    assert f"total {layout['memory_per_gpu_bytes'] / 2**30:.2f} GiB" in printed and "fits" in printed
