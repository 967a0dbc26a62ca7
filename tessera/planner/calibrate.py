"""`tessera calibrate`: measure this machine into a `Hardware` profile (the same TOML format as the shipped ones).

Measured, each on one process with one thread (one CPU core plays the part of one device; `gpus_per_node` is the
number of cores). Compute and memory timings use the thread's CPU time (best of several), so a busy shared
machine does not inflate them; collectives use wall time (best of several), since waiting is their cost.

- GEMM efficiency curve: fp32 `torch.matmul` of square sizes; peak = the third-best rate seen (robust to one lucky
  timing), each size's point is (FLOPs of the call, rate / peak, at most 1). The same measurements are written as
  the file's `gemm_table` rows (m, n, k, dtype, FLOP/s). A CPU has no SMs, so the profile keeps `sm_count = 0`
  and the planner prices its GEMMs with the size curve (`tessera.planner.gemm`); `gpu_gemm_profile` is the same
  measurement on a CUDA device, which also reads the SM count, so the planner prices GEMMs by shape there.
- Memory bandwidth: a large tensor copy (read + write bytes / time) → `hbm_bandwidth`.
- Collectives: `world` gloo processes on localhost run all-reduce and all-gather over a size sweep; a least-squares
  fit of t = c_bytes·bytes/bw + c_lat·latency, with the ring coefficients of `cost.all_reduce_time` /
  `all_gather_time`, gives (bandwidth, latency). Inside and across "nodes" are the same on one machine.
- Memory capacity: physical RAM divided by the cores.

Takes a few seconds (`quick`) to about half a minute.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tessera.planner.hardware import GemmRow, Hardware

__all__ = [
    "MeasuredSteps",
    "calibrate",
    "fit_collectives",
    "gpu_gemm_profile",
    "measure_collectives",
    "measure_gemm",
    "measure_memory_bandwidth",
    "measure_trainer_step",
    "predict_trainer_step",
    "run_queue_wait",
    "trainer_plan",
]

GEMM_SIZES = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
GEMM_SIZES_QUICK = (16, 32, 64, 128, 256, 512)
COLLECTIVE_BYTES = tuple(2**k for k in range(10, 25, 2))  # 1 KiB .. 16 MiB
COLLECTIVE_BYTES_QUICK = tuple(2**k for k in range(10, 23, 3))  # 1 KiB .. 4 MiB


def _best_time(fn: Any, min_seconds: float, max_repeats: int = 200) -> float:
    """Best of repeated timings (at least two runs, until `min_seconds` spent), in CPU time of the calling
    thread: on a shared machine wall time would include waiting for a core."""
    fn()  # warm-up
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or (spent < min_seconds and runs < max_repeats):
        t0 = time.thread_time()
        fn()
        dt = time.thread_time() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return best


def measure_gemm(sizes: tuple[int, ...] = GEMM_SIZES, min_seconds: float = 0.15) -> list[tuple[float, float]]:
    """(FLOPs per call, achieved FLOP/s) of fp32 square matmuls on one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = []
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            t = _best_time(lambda a=a, b=b: torch.matmul(a, b), min_seconds)
            out.append((2.0 * n**3, 2.0 * n**3 / t))
        return out
    finally:
        torch.set_num_threads(threads)


GPU_GEMM_SHAPES = ((8192, 8192, 8192), (4096, 4096, 4096), (2048, 12288, 4096), (2048, 4096, 12288))
"""Square and transformer-like (tokens × hidden) shapes `gpu_gemm_profile` measures."""


def gpu_gemm_profile(
    shapes: tuple[tuple[int, int, int], ...] = GPU_GEMM_SHAPES, dtype: str = "bf16", repeats: int = 20
) -> tuple[int, list[GemmRow]]:
    """(SM count, measured rows) of `torch.matmul` on the current CUDA device, timed with CUDA events (best of
    `repeats`): the `sm_count` and `gemm_table` of a GPU hardware file."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("gpu_gemm_profile needs a CUDA device; on a CPU use calibrate() (size curve)")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch_dtype)
        b = torch.randn(k, n, device="cuda", dtype=torch_dtype)
        torch.matmul(a, b)  # warm-up: cuBLAS picks and loads its kernel
        best = float("inf")
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            stop.record()
            stop.synchronize()
            best = min(best, start.elapsed_time(stop) / 1e3)
        rows.append(GemmRow(m, n, k, dtype, 2.0 * m * n * k / best, "tessera calibrate"))
    return torch.cuda.get_device_properties(0).multi_processor_count, rows


def measure_memory_bandwidth(nbytes: int = 64 * 2**20, min_seconds: float = 0.2) -> float:
    """Bytes/s of a large fp32 copy on one thread (read + write)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.randn(nbytes // 4)
        dst = torch.empty_like(src)
        return 2 * nbytes / _best_time(lambda: dst.copy_(src), min_seconds)
    finally:
        torch.set_num_threads(threads)


def _collective_worker() -> None:
    """Entry point of one collective-sweep process (env: RANK, WORLD_SIZE, MASTER_PORT, SIZES, REPEATS); rank 0
    prints one JSON list of [collective, bytes, best seconds] rows."""
    import json

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sizes = [int(x) for x in os.environ["TESSERA_CAL_SIZES"].split(",")]
    repeats = int(os.environ["TESSERA_CAL_REPEATS"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = []
        for nbytes in sizes:
            x = torch.ones(nbytes // 4)
            parts = [torch.empty(nbytes // 4 // world) for _ in range(world)]
            for name in ("all_reduce", "all_gather"):
                best = float("inf")
                for _ in range(repeats + 1):  # the first call warms up the connection
                    dist.barrier()
                    t0 = time.perf_counter()
                    if name == "all_reduce":
                        dist.all_reduce(x)
                    else:
                        dist.all_gather(parts, parts[rank].clone())
                    best = min(best, time.perf_counter() - t0)
                rows.append([name, nbytes, best])
        if rank == 0:
            print(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def measure_collectives(
    world: int = 2, sizes: tuple[int, ...] = COLLECTIVE_BYTES, repeats: int = 5, timeout: float = 60.0
) -> list[tuple[str, int, float]]:
    """(collective, full buffer bytes, best seconds) over `world` gloo processes on localhost (subprocesses, so
    no main-module import guard is needed in the caller)."""
    import json

    env = {"TESSERA_CAL_SIZES": ",".join(map(str, sizes)), "TESSERA_CAL_REPEATS": str(repeats)}
    code = "from tessera.planner.calibrate import _collective_worker; _collective_worker()"
    outputs = _run_ranks(code, world, env, timeout, "collective calibration", keep_stdout=True)
    return [(str(n), int(b), float(t)) for n, b, t in json.loads(outputs[0].strip().splitlines()[-1])]


def _run_ranks(
    code: str, world: int, env: dict[str, str], timeout: float, what: str, *, keep_stdout: bool = False
) -> list[str]:
    """Run ``python -c code`` as `world` local gloo ranks (one thread each); each rank's stdout ("" unless
    ``keep_stdout``). A failing rank raises RuntimeError with the end of its stderr; stragglers are killed."""
    import subprocess
    import sys

    from tessera.train.launch import free_port

    base = {**os.environ, **env, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    base |= {"MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=base | {"RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE if keep_stdout else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failed = [(r, err) for r, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)) if p.returncode]
    if failed:
        rank, err = failed[0]
        raise RuntimeError(f"{what} failed on rank {rank}:\n{err[-3000:]}")
    return [out or "" for out, _ in outputs]


def fit_collectives(rows: list[tuple[str, int, float]], world: int) -> tuple[float, float]:
    """Least-squares (bandwidth bytes/s, latency s per ring step) with the ring formulas: all-reduce
    2(n−1)/n·B/bw + 2(n−1)·lat, all-gather (n−1)/n·B/bw + (n−1)·lat. Rows are weighted by 1/t so small and
    large messages count alike."""
    n = world
    a, y = [], []
    for name, nbytes, t in rows:
        k = 2.0 if name == "all_reduce" else 1.0
        a.append([k * (n - 1) / n * nbytes / t, k * (n - 1) / t])
        y.append(1.0)
    (inv_bw, lat), *_ = np.linalg.lstsq(np.array(a), np.array(y), rcond=None)
    bandwidth = 1.0 / inv_bw if inv_bw > 0 else float("inf")
    return float(bandwidth), float(max(lat, 1e-7))


REFERENCE_MODEL = dict(family="gpt", n_layers=4, d_model=384, n_heads=6, vocab_size=256, seq_len=128)
"""The one training step the end-to-end factor is fitted on (not part of the validation layouts)."""
REFERENCE_BATCH = 8


def measure_reference_step(min_seconds: float = 0.5) -> float:
    """CPU seconds (one thread, best of several) of one training step of `REFERENCE_MODEL`: forward, backward,
    gradient clipping and an AdamW update, the same operations as the trainer's step."""
    import torch

    from tessera.config import ModelConfig
    from tessera.model.build import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build_model(ModelConfig(**REFERENCE_MODEL))
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        x = torch.randint(0, 256, (REFERENCE_BATCH, REFERENCE_MODEL["seq_len"]))

        def step() -> None:
            model(x, x).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return _best_time(step, min_seconds, max_repeats=10)
    finally:
        torch.set_num_threads(threads)


def _reference_prediction(hw: Hardware) -> float:
    from tessera.config import ModelConfig
    from tessera.planner.cost import ModelShape, Plan
    from tessera.planner.steptime import fast_step

    plan = Plan(micro_batch=REFERENCE_BATCH, dtype="fp32", flash_attention=True)
    return fast_step(ModelShape.from_config(ModelConfig(**REFERENCE_MODEL)), hw, plan, "1f1b").step_time


def calibrate(
    name: str = "this-cpu", *, quick: bool = False, world: int = 2, end_to_end: bool = True
) -> tuple[Hardware, str]:
    """Measure this machine; returns the profile and a short text report of what was measured.

    With `end_to_end` the GEMM curve is finally scaled so that one single-process training step of
    `REFERENCE_MODEL` is predicted exactly: the same one-point calibration the shipped GPU files use (their
    plateau reproduces one published single-GPU row). It absorbs what the cost model does not itemise on this
    machine (eager-mode kernels, autograd and optimizer overheads); multi-process layouts, other sizes and
    micro-batch counts are then predictions."""
    gemm = measure_gemm(GEMM_SIZES_QUICK if quick else GEMM_SIZES, 0.05 if quick else 0.15)
    peak = sorted(rate for _, rate in gemm)[-3:][0]  # third best: robust to one lucky timing
    hbm = measure_memory_bandwidth(min_seconds=0.05 if quick else 0.2)
    rows = measure_collectives(
        world, COLLECTIVE_BYTES_QUICK if quick else COLLECTIVE_BYTES, 3 if quick else 5
    )
    bandwidth, latency = fit_collectives(rows, world)
    cores = os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    hw = Hardware(
        name=name,
        peak_flops={"fp32": peak},
        memory_bytes=float(ram / cores),
        hbm_bandwidth=hbm,
        gpus_per_node=cores,
        intra_node_bandwidth=bandwidth,
        intra_node_latency=latency,
        inter_node_bandwidth=bandwidth,
        inter_node_latency=latency,
        gemm_efficiency=[(f, min(1.0, max(rate / peak, 1e-3))) for f, rate in gemm],
        gemm_table=[_square_row(f, rate) for f, rate in gemm],
    )
    factor = 1.0
    if end_to_end:
        factor = _reference_prediction(hw) / measure_reference_step(0.3 if quick else 1.0)
        hw.gemm_efficiency = [(f, min(1.0, max(e * factor, 1e-3))) for f, e in hw.gemm_efficiency]
    lines = [
        f"GEMM fp32, one thread: peak {peak / 1e9:.1f} GFLOP/s; efficiency "
        + ", ".join(f"{f:.0e}: {min(1.0, r / peak):.2f}" for f, r in gemm),
        f"memory copy bandwidth {hbm / 1e9:.2f} GB/s",
        f"gloo over {world} processes: bandwidth {bandwidth / 1e9:.3f} GB/s, latency {latency * 1e6:.0f} µs per step",
        f"end-to-end factor on the reference step (GEMM curve scaled by it): {factor:.3f}",
    ]
    return hw, "\n".join(lines)


def _square_row(flops: float, rate: float) -> GemmRow:
    """The fp32 square matmul of `flops` = 2n³ FLOPs measured at `rate`, as a `gemm_table` row."""
    n = round((flops / 2) ** (1 / 3))
    return GemmRow(n, n, n, "fp32", rate, "tessera calibrate")


def trainer_plan(cfg: Any, world: int, *, flash_attention: bool = True) -> tuple[Any, str]:
    """The cost model's (`Plan`, schedule name) for what `tessera.train.trainer.train(cfg)` runs on `world` ranks.

    Read from the execution plan (`tessera.execution.resolve`): the schedule runtime's schedule and stages (one
    pipeline rank: breadth-first, one stage per block), or for the direct loop depth-first accumulation timed as
    a one-rank 1F1B (bucketed all-reduce overlapped with the last micro-batch's backward)."""
    from tessera.execution import resolve
    from tessera.memory import cost_plan
    from tessera.planner.steptime import CONFIG_TO_IR

    execution = resolve(cfg, world)
    schedule = execution.schedule or "1f1b"
    if schedule not in CONFIG_TO_IR:
        raise ValueError(
            f"parallel.schedule = {schedule!r} has no closed-form prediction; use one of "
            f"{', '.join(CONFIG_TO_IR)} to predict the step time"
        )
    # ZeRO over one data-parallel rank moves no bytes: time it as plain training
    zero = execution.zero if execution.dp > 1 else 0
    plan = replace(cost_plan(execution), zero_stage=zero, flash_attention=flash_attention)
    return plan, schedule


def predict_trainer_step(cfg: Any, world: int, hw: Hardware, *, flash_attention: bool = True) -> Any:
    """Predicted `StepBreakdown` of `tessera.train.trainer.train(cfg)` on `world` ranks: data × pipeline ×
    tensor (1D with or without sequence parallelism, or 2D), any ZeRO stage, the schedule and accumulation order
    the trainer runs (`trainer_plan`), the config's dtype and checkpointing."""
    from tessera.planner.cost import ModelShape
    from tessera.planner.steptime import fast_step

    plan, schedule = trainer_plan(cfg, world, flash_attention=flash_attention)
    return fast_step(ModelShape.from_config(cfg.model), hw, plan, schedule)


def run_queue_wait() -> float:
    """Seconds the calling thread has spent runnable but waiting for a core (Linux schedstat; 0 elsewhere)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _trainer_worker() -> None:
    """One rank of `measure_trainer_step` (config JSON in TESSERA_CAL_CONFIG): trains and writes, at every step's
    hook, [process CPU time, wall time, run-queue wait] of this process to TESSERA_CAL_OUT.<rank>.json."""
    import json

    import torch

    from tessera.config import from_dict
    from tessera.train.trainer import train

    torch.set_num_threads(1)
    marks: list[tuple[float, float, float]] = []
    train(
        from_dict(json.loads(os.environ["TESSERA_CAL_CONFIG"])),
        lambda step, model: marks.append((time.process_time(), time.perf_counter(), run_queue_wait())),
    )
    Path(f"{os.environ['TESSERA_CAL_OUT']}.{os.environ['RANK']}.json").write_text(json.dumps(marks))


@dataclass(frozen=True)
class MeasuredSteps:
    """Per-step seconds of rank 0 after the warm-up steps, three ways."""

    wall: list[float]
    """Wall-clock step time from metrics.jsonl (includes waiting for a core on a shared machine)."""
    cpu: list[float]
    """CPU time of the process between consecutive step hooks: its own work, without any time blocked (waiting
    for a pipeline neighbour or a collective) or waiting for a core."""
    on_core: list[float]
    """Wall time between step hooks minus the main thread's run-queue wait: running or blocked, not waiting for
    a core. The step as it would take with a dedicated core, *if* the other ranks were not delayed either."""


def measure_trainer_step(cfg: Any, world: int, *, warmup: int = 2, timeout: float = 300.0) -> MeasuredSteps:
    """Run `train(cfg)` on `world` gloo processes (one thread each) and time rank 0's steps after `warmup` steps
    (`MeasuredSteps`). On a shared machine wall time includes waiting for a core; CPU and on-core time do not."""
    import json

    code = "from tessera.planner.calibrate import _trainer_worker; _trainer_worker()"
    marks = Path(cfg.log.run_dir) / "cpu_marks"
    Path(cfg.log.run_dir).mkdir(parents=True, exist_ok=True)
    env = {"TESSERA_CAL_CONFIG": json.dumps(cfg.to_dict()), "TESSERA_CAL_OUT": str(marks)}
    _run_ranks(code, world, env, timeout, "training run")
    rows = [json.loads(line) for line in (Path(cfg.log.run_dir) / "metrics.jsonl").read_text().splitlines()]
    hooks = json.loads(Path(f"{marks}.0.json").read_text())
    steps = list(itertools.pairwise(hooks))[max(0, warmup - 1) :]
    return MeasuredSteps(
        wall=[r["step_time"] for r in rows if r["step"] >= warmup],
        cpu=[b[0] - a[0] for a, b in steps],
        on_core=[(b[1] - a[1]) - (b[2] - a[2]) for a, b in steps],
    )
