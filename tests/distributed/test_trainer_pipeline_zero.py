"""The trainer with pipelines, layered accumulation and ZeRO, as a user configures them, against the reference.

Each layout trains 3 steps through the trainer's `TrainingRun`, each step from the reference's state after the one
before (`record_layouts`' ``follow``, as `tessera compare` runs: docs/parity.md), and every step's loss, clipping
norm, every gradient (gathered from pipeline stages, tensor blocks and ZeRO shards alike) and every updated
parameter must match the single-device run. A layout with parallel.overlap_param_gather must also equal its twin
without it exactly, both trained freely by `train` (`OVERLAP_TWINS`). The component tests
(test_pipeline_runtime.py, test_zero.py, test_zero_tp2d.py) check the sharded cases piece by piece; this file checks
the whole step: data, schedule, synchronisation, clipping, optimizer.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tessera.config import from_dict
from tessera.parity import FP32, Record
from tessera.pipeline.csvio import to_csv
from tessera.pipeline.schedules import build_schedule
from tessera.train import checkpoint as ckpt
from tessera.train.trainer import train
from tests.distributed.conftest import (
    Recorded,
    assert_layout_matches_reference,
    follow_file,
    record_layouts,
    trainer_config,
)
from tests.harness import run_distributed

LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
# docs/parity.md's fp32 tolerances (`tessera.parity.FP32`: the losses' and GRAD_RTOL are these) with this file's
# tighter gradient atol
TOLERANCE = replace(FP32, grad_atol=GRAD_ATOL)
STEPS = 3
TWIN_STEPS = 2  # the overlap twins: step 1 is the first to wait for the all-gathers deferred by an update

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

OVERLAP_TWINS = {
    "dp2_z1_overlap": "dp2_z1",
    "dp2_z2_overlap": "dp2_z2",
    "dp2_pp2_z1_overlap": (4, {"data": 2, "pipeline": 2, "zero": 1}),  # not a layout of its own above
}
"""parallel.overlap_param_gather only waits for the same all-gathers later: a run with it equals its twin (a layout
above, or its world size and parallel section) without it bit for bit, in its losses and in the checkpoint the
trainer writes right after the last update. Both train freely (`train`): a run that follows another's state
loads it before each step, which waits for the all-gathers an update deferred, so only a free run's next step
waits for them in its forward as training does. The overlap layouts whose twin is a layout above are not also
recorded following the reference: until the deferred wait, their steps are their twins' computation."""


def _config(token_file: Path, run_dir: Path, parallel: dict, **train: object) -> dict:
    model = {"size": "gpt2-tiny", "n_layers": 4}
    return trainer_config(token_file, run_dir, model, parallel, **{"steps": STEPS, "grad_clip": 0.5, **train})


def _run_all(rank: int, world: int, configs: list[dict]) -> list[tuple[dict[int, float], list[dict]]]:
    """Train every config in turn in this process group (`train`, freely); per config: losses and this rank's
    gradients."""
    out = []
    for raw in configs:
        grads: list[dict[str, torch.Tensor]] = []

        def hook(step: int, model: torch.nn.Module, grads: list = grads) -> None:
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

        out.append((train(from_dict(raw), hook).losses, grads))
    return out


@pytest.fixture(scope="module")
def reference(token_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Record:
    """The single-device run with its states to follow, recorded once for the module (each world size's test
    follows the same one)."""
    ref = _config(token_file, tmp_path_factory.mktemp("pp_zero_ref") / "ref", {"accumulation": "depth_first"})
    return record_layouts(0, 1, [ref], keep_states=True)[0].record


def _run_world(
    rank: int, world: int, configs: list[dict], follow: Path, twins: list[dict]
) -> tuple[list[Recorded], list[tuple[dict[int, float], list[dict]]]]:
    """One spawn per world size: the layouts recorded following the reference, then the overlap twins trained."""
    return record_layouts(rank, world, configs, follow), _run_all(rank, world, twins)


def _twin(name: str) -> tuple[int, dict]:
    twin = OVERLAP_TWINS[name]
    return LAYOUTS[twin] if isinstance(twin, str) else twin


@pytest.mark.parametrize("world", sorted({w for w, _ in LAYOUTS.values()}))
def test_layouts_match_single_device(token_file: Path, tmp_path: Path, world: int, reference: Record) -> None:
    names = [n for n, (w, _) in LAYOUTS.items() if w == world and not isinstance(OVERLAP_TWINS.get(n), str)]
    configs = [_config(token_file, tmp_path / n, LAYOUTS[n][1]) for n in names]
    overlapped = [n for n in OVERLAP_TWINS if LAYOUTS[n][0] == world]
    twins = []
    for n in overlapped:
        twins += [_config(token_file, tmp_path / n, LAYOUTS[n][1], steps=TWIN_STEPS)]
        twins += [_config(token_file, tmp_path / f"{n}_twin", _twin(n)[1], steps=TWIN_STEPS)]
    follow = follow_file(tmp_path / "follow.pt", [reference] * len(names))
    recorded, trained = run_distributed(_run_world, world, configs, follow, twins, timeout=600)[0]
    for raw, got in zip(configs, recorded, strict=True):
        assert_layout_matches_reference(got.record, reference, TOLERANCE, from_dict(raw).model, world, STEPS)
    for k, name in enumerate(overlapped):
        (losses, _), (twin_losses, _) = trained[2 * k], trained[2 * k + 1]
        assert sorted(losses) == list(range(TWIN_STEPS)), name
        assert losses == twin_losses, f"{name}: losses differ from its twin's without the overlap"
        _same_final_checkpoint(tmp_path / name, tmp_path / f"{name}_twin")


def _same_final_checkpoint(run_dir: Path, twin_dir: Path) -> None:
    """Every tensor (weights, Adam moments) of the two runs' last checkpoints is equal."""
    path, twin = (ckpt.latest_checkpoint(d / "checkpoints") for d in (run_dir, twin_dir))
    assert path is not None and twin is not None and path.name == twin.name == ckpt.step_dir_name(TWIN_STEPS)
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
