"""The trainer with pipelines, layered accumulation and ZeRO, as a user configures them, against the reference.

Each layout trains 3 steps; the loss of every step (which after step 0 depends on every earlier update) and, where
gradients live in parameters (no ZeRO), every gradient of every step must match the single-device
run. A layout with parallel.overlap_param_gather must also equal its twin without it exactly (`OVERLAP_TWINS`). The component tests (test_pipeline_runtime.py, test_zero.py, test_zero_tp2d.py) check gradients of the
sharded cases; this file checks the whole step: data, schedule, synchronisation, clipping, optimizer, metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessera.config import from_dict
from tessera.pipeline.csvio import to_csv
from tessera.pipeline.schedules import build_schedule
from tessera.train import checkpoint as ckpt
from tessera.train.trainer import train
from tests.distributed.conftest import assert_rank_grads_match, trainer_config
from tests.harness import run_distributed

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
STEPS = 3

LAYOUTS = {  # name: (world size, parallel section)
    "pp2_1f1b": (2, {"pipeline": 2, "schedule": "1f1b"}),
    "pp2_gpipe": (2, {"pipeline": 2, "schedule": "gpipe"}),
    "pp2_bf_v2": (2, {"pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2}),
    "pp2_interleaved_v2": (2, {"pipeline": 2, "schedule": "interleaved", "stages_per_rank": 2}),
    "pp2_uneven": (2, {"pipeline": 2, "schedule": "1f1b", "stage_layers": [1, 3]}),
    "pp2_z1_dp1": (2, {"data": 1, "pipeline": 2, "zero": 1}),  # regression: gloo "data size doesn't match"
    "dp2_z1": (2, {"data": 2, "zero": 1}),
    "dp2_z2": (2, {"data": 2, "zero": 2}),
    "dp2_z3": (2, {"data": 2, "zero": 3}),
    "dp2_z3_depth_first": (2, {"data": 2, "zero": 3, "accumulation": "depth_first"}),
    "dp2_z3_full_ckpt": (2, {"data": 2, "zero": 3, "checkpointing": "full"}),
    "dp2_z1_overlap": (2, {"data": 2, "zero": 1, "overlap_param_gather": True}),
    "dp2_z2_overlap": (2, {"data": 2, "zero": 2, "overlap_param_gather": True}),
    "pp2_tp2_z1_dp1": (4, {"data": 1, "pipeline": 2, "tensor": 2, "zero": 1}),
    # sequence parallelism's collectives as rings under the GEMMs (tp_comm_overlap) inside pipeline stages:
    # losses only here (every step's depends on the earlier gradients)
    "pp2_tp2_sp_overlap": (
        4,
        {"pipeline": 2, "tensor": 2, "sequence_parallel": True, "tp_comm_overlap": True},
    ),
    "dp2_pp2_bf": (4, {"data": 2, "pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2}),
    "dp2_pp2_z1_overlap": (4, {"data": 2, "pipeline": 2, "zero": 1, "overlap_param_gather": True}),
    "dp2_pp2_z3": (
        4,
        {"data": 2, "pipeline": 2, "schedule": "breadth_first", "stages_per_rank": 2, "zero": 3},
    ),
}

OVERLAP_TWINS = {"dp2_z1_overlap": "dp2_z1", "dp2_z2_overlap": "dp2_z2"}
"""parallel.overlap_param_gather only waits for the same all-gathers later: a run with it equals its twin
without it bit for bit, in its losses and in the checkpoint the trainer writes right after the last update."""


def _config(token_file: Path, run_dir: Path, parallel: dict, **train: object) -> dict:
    model = {"size": "gpt2-tiny", "n_layers": 4}
    return trainer_config(token_file, run_dir, model, parallel, **{"steps": STEPS, "grad_clip": 0.5, **train})


def _run_all(rank: int, world: int, configs: list[dict]) -> list[tuple[dict[int, float], list[dict]]]:
    """Train every config in turn in this process group; per config: losses and this rank's gradients."""
    out = []
    for raw in configs:
        grads: list[dict[str, torch.Tensor]] = []

        def hook(step: int, model: torch.nn.Module, grads: list = grads) -> None:
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

        out.append((train(from_dict(raw), hook).losses, grads))
    return out


@pytest.fixture(scope="module")
def reference(
    token_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[int, float], list[dict]]:
    """The single-device run's losses and gradients, trained once for the module (each world size's test trained
    the same one)."""
    ref = _config(token_file, tmp_path_factory.mktemp("pp_zero_ref") / "ref", {"accumulation": "depth_first"})
    return _run_all(0, 1, [ref])[0]


@pytest.mark.parametrize("world", sorted({w for w, _ in LAYOUTS.values()}))
def test_layouts_match_single_device(
    token_file: Path, tmp_path: Path, world: int, reference: tuple[dict[int, float], list[dict]]
) -> None:
    names = [n for n, (w, _) in LAYOUTS.items() if w == world]
    ref_losses, ref_grads = reference
    configs = [_config(token_file, tmp_path / n, LAYOUTS[n][1]) for n in names]
    results = run_distributed(_run_all, world, configs, timeout=600)
    for i, name in enumerate(names):
        losses = results[0][i][0]
        for step in range(STEPS):
            torch.testing.assert_close(
                losses[step], ref_losses[step], rtol=LOSS_RTOL, atol=LOSS_ATOL, msg=name
            )
        if name in OVERLAP_TWINS:
            twin = names.index(OVERLAP_TWINS[name])
            assert losses == results[0][twin][0], f"{name}: losses differ from {OVERLAP_TWINS[name]}'s"
            _same_final_checkpoint(tmp_path / name, tmp_path / OVERLAP_TWINS[name])
        if LAYOUTS[name][1].get("zero", 0) >= 1:
            continue  # reduced gradients live in ZeRO shards; checked in test_zero.py and test_zero_tp2d.py
        if LAYOUTS[name][1].get("tensor", 1) != 1:
            continue  # tensor shards: their full gradients are compared in test_trainer_tp.py
        for step in range(STEPS):
            rank_grads = [rank_result[i][1][step] for rank_result in results]
            assert_rank_grads_match(rank_grads, ref_grads[step], GRAD_RTOL, GRAD_ATOL, f"{name} step {step}")


def _same_final_checkpoint(run_dir: Path, twin_dir: Path) -> None:
    """Every tensor (weights, Adam moments) of the two runs' last checkpoints is equal."""
    path, twin = (ckpt.latest_checkpoint(d / "checkpoints") for d in (run_dir, twin_dir))
    assert path is not None and twin is not None and path.name == twin.name == ckpt.step_dir_name(STEPS)
    meta, twin_meta = ckpt.read_metadata_safely(path), ckpt.read_metadata_safely(twin)
    fqns = sorted(k for k in meta.state_dict_metadata if k.startswith(("model.", "optim.")))
    assert fqns and fqns == sorted(
        k for k in twin_meta.state_dict_metadata if k.startswith(("model.", "optim."))
    )
    for fqn in fqns:
        a, b = ckpt.read_tensor(path, fqn, meta), ckpt.read_tensor(twin, fqn, twin_meta)
        assert torch.equal(a, b), f"{run_dir.name}: {fqn} differs from {twin_dir.name}'s checkpoint"


def test_users_csv_schedule_trains_like_the_builtin(token_file: Path, tmp_path: Path) -> None:
    """A schedule written to CSV (here 1F1B, p=2, m=4) and passed as parallel.schedule runs like the named one."""
    csv = tmp_path / "my_1f1b.csv"
    csv.write_text(to_csv(build_schedule("1f1b", 2, 4)))
    named = _config(token_file, tmp_path / "named", {"pipeline": 2, "schedule": "1f1b"})
    custom = _config(token_file, tmp_path / "custom", {"pipeline": 2, "schedule": str(csv)})
    (named_losses, _), (custom_losses, _) = run_distributed(_run_all, 2, [named, custom], timeout=300)[0]
    assert custom_losses == named_losses


def _comm_bytes(run_dir: Path) -> dict[str, int]:
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {k: v for k, v in first.items() if k.startswith("comm/")}


def test_layered_comm_is_constant_in_m_depth_first_grows(token_file: Path, tmp_path: Path) -> None:
    """ZeRO-3 over dp2: per-step gather and reduce-scatter bytes, from the trainer's metrics, for m = 1, 2, 4."""
    configs, names = [], []
    for acc in ("layered", "depth_first"):
        for m in (1, 2, 4):
            names.append((acc, m))
            run = tmp_path / f"{acc}_{m}"
            configs.append(_config(token_file, run, {"data": 2, "zero": 3, "accumulation": acc},
                                   steps=1, global_batch=2 * 2 * m))  # fmt: skip
    run_distributed(_run_all, 2, configs, timeout=600)
    volume = {key: _comm_bytes(tmp_path / f"{key[0]}_{key[1]}") for key in names}
    for kind in ("comm/all_gather/data_bytes", "comm/reduce_scatter/data_bytes"):
        layered = [volume[("layered", m)][kind] for m in (1, 2, 4)]
        depth_first = [volume[("depth_first", m)][kind] for m in (1, 2, 4)]
        assert layered[0] > 0 and layered == [layered[0]] * 3, (kind, layered)
        # linear in m: each micro-batch group gathers every stage again (the turn-around stage's forward and
        # backward share one gather, so the gathers are a + (m-1)·b rather than m·a) and reduce-scatters again
        step = depth_first[1] - depth_first[0]
        assert step > 0 and depth_first[2] == depth_first[0] + 3 * step, (kind, depth_first)
        assert depth_first[0] == layered[0], (kind, depth_first, layered)
