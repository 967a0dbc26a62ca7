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

On a GPU node (`calibrate_gpu`, `tessera calibrate --device cuda`) the profile is a shipped *base* file with the
fields one node can measure replaced (`gpu_profile`, a pure function: base + `GpuMeasurements` → `Hardware` and
a report): `sm_count` and bf16 `gemm_table` rows, `hbm_bandwidth` (device-to-device copy),
`flash_attention_flops` (causal bf16 SDPA forward + backward, FLOPs as `cost.compute.attention_core_time` counts
them) and, over more than one GPU, the intra-node bandwidth and latency (the same sweep and fit with NCCL). The
published peak, the network between nodes and the fitted shares stay the base's (docs/planner.md §5). The CUDA
functions here have not yet been run on a GPU.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tessera.errors import ConfigError, TesseraError
from tessera.planner.hardware import GemmRow, Hardware, list_hardware, load_hardware

__all__ = [
    "ATTENTION_SHAPE",
    "AttentionShape",
    "CollectiveFit",
    "GpuMeasurements",
    "MeasuredSteps",
    "attention_flops",
    "base_for_device",
    "calibrate",
    "calibrate_gpu",
    "fit_collectives",
    "gpu_attention_seconds",
    "gpu_copy_bandwidth",
    "gpu_gemm_profile",
    "gpu_profile",
    "measure_collectives",
    "measure_gemm",
    "measure_gpu",
    "measure_memory_bandwidth",
    "measure_trainer_step",
    "predict_trainer_step",
    "resolve_device",
    "run_queue_wait",
    "trainer_plan",
]

GEMM_SIZES = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
GEMM_SIZES_QUICK = (16, 32, 64, 128, 256, 512)
COLLECTIVE_BYTES = tuple(2**k for k in range(10, 25, 2))  # 1 KiB .. 16 MiB
COLLECTIVE_BYTES_QUICK = tuple(2**k for k in range(10, 23, 3))  # 1 KiB .. 4 MiB
NCCL_BYTES = tuple(2**k for k in range(10, 29, 2))  # 1 KiB .. 256 MiB: NVLink reaches its bandwidth late
NCCL_BYTES_QUICK = tuple(2**k for k in range(10, 29, 3))  # 1 KiB .. 256 MiB


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


def _cuda_seconds(fn: Any, repeats: int) -> float:
    """Best of `repeats` timings of ``fn()`` on the current CUDA stream with CUDA events, after one warm-up call
    (cuBLAS / the attention backend pick and load their kernels on the first call)."""
    import torch

    fn()
    best = float("inf")
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / 1e3)
    return best


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
        best = _cuda_seconds(lambda a=a, b=b: torch.matmul(a, b), repeats)
        rows.append(GemmRow(m, n, k, dtype, 2.0 * m * n * k / best, "tessera calibrate"))
    return torch.cuda.get_device_properties(0).multi_processor_count, rows


def gpu_copy_bandwidth(nbytes: int = 2**30, repeats: int = 20) -> float:
    """Bytes/s (read + write) of a device-to-device copy of `nbytes` on the current CUDA device, CUDA events."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * nbytes / _cuda_seconds(lambda: dst.copy_(src), repeats)


def gpu_attention_seconds(shape: AttentionShape | None = None, repeats: int = 10) -> float:
    """Seconds (CUDA events, best of `repeats`) of forward + backward of causal bf16
    `torch.nn.functional.scaled_dot_product_attention` (the call tessera's attention makes) on `shape`."""
    import torch
    import torch.nn.functional as F

    shape = shape or ATTENTION_SHAPE
    q, k, v = (
        torch.randn(
            shape.batch, shape.heads, shape.seq, shape.head_dim, device="cuda", dtype=torch.bfloat16
        ).requires_grad_()
        for _ in range(3)
    )  # [b, nh, s, hd]
    grad = torch.randn_like(q)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, nh, s, hd]
        torch.autograd.grad(out, (q, k, v), grad)  # returned, not accumulated into .grad: no extra adds

    return _cuda_seconds(step, repeats)


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
    """Entry point of one collective-sweep process (env: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT, SIZES,
    REPEATS, BACKEND); rank 0 prints one JSON list of [collective, bytes, best seconds] rows. With nccl each rank
    drives GPU LOCAL_RANK and a timing waits for the device (the collective is asynchronous on its stream)."""
    import json

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sizes = [int(x) for x in os.environ["TESSERA_CAL_SIZES"].split(",")]
    repeats = int(os.environ["TESSERA_CAL_REPEATS"])
    backend = os.environ.get("TESSERA_CAL_BACKEND", "gloo")
    torch.set_num_threads(1)
    device, sync = torch.device("cpu"), (lambda: None)
    if backend == "nccl":
        device, sync = torch.device("cuda", int(os.environ["LOCAL_RANK"])), torch.cuda.synchronize
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        rows = []
        for nbytes in sizes:
            x = torch.ones(nbytes // 4, device=device)
            parts = [torch.empty(nbytes // 4 // world, device=device) for _ in range(world)]
            for name in ("all_reduce", "all_gather"):
                best = float("inf")
                for _ in range(repeats + 1):  # the first call warms up the connection
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    if name == "all_reduce":
                        dist.all_reduce(x)
                    else:
                        dist.all_gather(parts, parts[rank].clone())
                    sync()
                    best = min(best, time.perf_counter() - t0)
                rows.append([name, nbytes, best])
        if rank == 0:
            print(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def measure_collectives(
    world: int = 2,
    sizes: tuple[int, ...] = COLLECTIVE_BYTES,
    repeats: int = 5,
    timeout: float = 60.0,
    backend: str = "gloo",
) -> list[tuple[str, int, float]]:
    """(collective, full buffer bytes, best seconds) over `world` local processes (subprocesses, so no
    main-module import guard is needed in the caller): gloo on CPU tensors, or nccl with one GPU per process."""
    import json

    env = {
        "TESSERA_CAL_SIZES": ",".join(map(str, sizes)),
        "TESSERA_CAL_REPEATS": str(repeats),
        "TESSERA_CAL_BACKEND": backend,
    }
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


# ---- GPU calibration: a shipped base file with the fields one node can measure replaced ----------------------


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """The fused-attention call `gpu_attention_seconds` times: [batch, heads, seq, head_dim] q, k and v."""

    batch: int
    heads: int
    seq: int
    head_dim: int


ATTENTION_SHAPE = AttentionShape(batch=4, heads=16, seq=4096, head_dim=128)
"""A training-sized causal attention (GPT-3 2.7B-like heads at a 4k sequence): long enough that the kernel's
rate, not its launch, is measured."""


def attention_flops(shape: AttentionShape) -> float:
    """Forward + backward FLOPs of causal fused attention on `shape`, counted as `cost.compute.attention_core_time`
    charges them (FlashAttention's benchmark convention): forward 4·s²·d per head, halved for causal; backward
    `FLASH_BACKWARD_FACTOR` × forward. Measured time × the rate this gives = the model's time by construction."""
    from tessera.planner.cost.compute import FLASH_BACKWARD_FACTOR

    forward = 4.0 * shape.seq**2 * shape.head_dim * shape.batch * shape.heads / 2
    return forward * (1 + FLASH_BACKWARD_FACTOR)


class CollectiveFit(NamedTuple):
    """An NCCL all-reduce/all-gather sweep over `world` GPUs of one node, fitted by `fit_collectives`."""

    world: int
    bandwidth: float
    latency: float


@dataclass(frozen=True, slots=True)
class GpuMeasurements:
    """What `measure_gpu` measured on one node (the inputs of the pure `gpu_profile`)."""

    device_name: str
    """`torch.cuda.get_device_name(0)`."""
    sm_count: int
    gemm_rows: tuple[GemmRow, ...]
    """bf16 `torch.matmul` rows (`gpu_gemm_profile`)."""
    hbm_bandwidth: float
    """Bytes/s (read + write) of a large device-to-device copy."""
    attention_seconds: float
    """Forward + backward of causal bf16 SDPA on `attention_shape`."""
    attention_shape: AttentionShape = ATTENTION_SHAPE
    collectives: CollectiveFit | None = None
    """None: one GPU visible, no intra-node sweep."""


GPU_KEPT_REASONS = {
    "peak_flops": "the published dense peak; the kernel fraction is a measured rate over it",
    "memory_bytes": "the datasheet capacity",
    "gpus_per_node": "the node's size as published (CUDA_VISIBLE_DEVICES may show fewer)",
    "intra_node_bandwidth": "one GPU visible: no NCCL sweep possible",
    "intra_node_latency": "one GPU visible: no NCCL sweep possible",
    "inter_node_bandwidth": "one node cannot measure the network between nodes",
    "inter_node_latency": "one node cannot measure the network between nodes",
    "topology": "the cluster's network, not visible from one node",
    "pod_gpus": "the cluster's network, not visible from one node",
    "oversubscription": "the cluster's network, not visible from one node",
    "best_published_mfu": "a published figure",
    "gemm_efficiency": "the size curve, unused with an SM count",
    "gemm_tile": "fitted on published runs with the quantization model",
    "gemm_framework_share": "fitted on published end-to-end runs; it scales the measured kernel rates",
    "overlap_slowdown": "a published average (compute slowed under overlapped collectives); not measured",
    "storage_write_bandwidth": "the cluster's shared file system, not visible from one node",
    "gpu_mtbf_hours": "a published failure rate (interruptions per GPU-hour at scale)",
}
"""Why each field a GPU calibration does not measure comes from the base file."""
PEAK_TOLERANCE = 1.05
"""A measured GEMM above 1.05 × the base's peak × its quantization means the base describes another GPU."""


def gpu_profile(base: Hardware, measured: GpuMeasurements, name: str) -> tuple[Hardware, list[str]]:
    """The GPU profile: `base` with the fields this node measured replaced (`sm_count`, `gemm_table`,
    `hbm_bandwidth`, `flash_attention_flops`, and the intra-node bandwidth and latency when an NCCL sweep ran),
    renamed `name`; and the report, one line per field, measured or kept (with why). Pure: no torch, no device.
    `peak_flops` stays the published peak, so the measured rows read as kernel fractions of it exactly as the
    base's published rows did (`gemm.kernel_fraction`); a row above that peak is an error (the base describes
    another GPU)."""
    rows = [r._replace(source=f"tessera calibrate, {measured.device_name}") for r in measured.gemm_rows]
    _check_rows_under_peak(base, rows, measured.sm_count)
    fields: dict[str, Any] = {
        "sm_count": measured.sm_count,
        "gemm_table": rows,
        "hbm_bandwidth": measured.hbm_bandwidth,
        "flash_attention_flops": attention_flops(measured.attention_shape) / measured.attention_seconds,
    }
    if measured.collectives is not None:
        fields |= {
            "intra_node_bandwidth": measured.collectives.bandwidth,
            "intra_node_latency": measured.collectives.latency,
        }
    hw = replace(base, name=name, **fields)
    return hw, _gpu_report(base, hw, measured, set(fields))


def _check_rows_under_peak(base: Hardware, rows: list[GemmRow], sms: int) -> None:
    from tessera.planner.gemm import quantization

    for r in rows:
        ceiling = base.peak(r.dtype) * quantization(r.m, r.n, 1, base.gemm_tile, sms)
        if r.flops_per_s > PEAK_TOLERANCE * ceiling:
            raise ConfigError(
                f"measured {r.dtype} GEMM {r.m}x{r.n}x{r.k} at {r.flops_per_s / 1e12:.0f} TFLOP/s exceeds base "
                f"{base.name!r}'s peak {base.peak(r.dtype) / 1e12:.0f} TFLOP/s (× quantization "
                f"{ceiling / base.peak(r.dtype):.2f}): the base file describes another GPU; pass --base with "
                f"the file of this one ({', '.join(list_hardware())} or a TOML path)"
            )


def _gpu_report(base: Hardware, hw: Hardware, measured: GpuMeasurements, replaced: set[str]) -> list[str]:
    """One line per `Hardware` field (measured: new value and the base's; kept: why), then the checks."""
    lines = [f"GPU calibration of {measured.device_name}, base file {base.name!r}:"]
    for key in Hardware.__dataclass_fields__:
        if key == "name":
            continue
        if key in replaced:
            lines.append(
                f"  measured {key}: {_show(key, getattr(hw, key))} (base {_show(key, getattr(base, key))})"
            )
        else:
            lines.append(f"  kept     {key}: {GPU_KEPT_REASONS[key]}")
    lines += _fraction_lines(base, hw)
    measured_rates = {(r.m, r.n, r.k, r.dtype): r.flops_per_s for r in hw.gemm_table}
    lines += [
        f"at the base's published shape {r.m}x{r.n}x{r.k} {r.dtype}: measured "
        f"{measured_rates[r.m, r.n, r.k, r.dtype] / 1e12:.0f} TFLOP/s, published {r.flops_per_s / 1e12:.0f}"
        for r in base.gemm_table
        if (r.m, r.n, r.k, r.dtype) in measured_rates
    ]
    a = measured.attention_shape
    lines.append(
        f"attention: causal bf16 SDPA, batch {a.batch} × heads {a.heads} × seq {a.seq} × head dim {a.head_dim}, "
        f"forward + backward {measured.attention_seconds * 1e3:.2f} ms = {attention_flops(a) / 1e12:.2f} TFLOP"
    )
    if measured.collectives is not None:
        lines.append(f"NCCL all-reduce/all-gather sweep over {measured.collectives.world} GPUs (ring fit)")
    if base.sm_count and hw.sm_count != base.sm_count:
        lines.append(
            f"WARNING: this device has {hw.sm_count} SMs, base {base.name!r} {base.sm_count}: check that --base "
            "describes this GPU (its peak and network are kept)"
        )
    return lines


def _fraction_lines(base: Hardware, hw: Hardware) -> list[str]:
    """The measured kernel fraction next to the base's, and what their ratio does to GEMM times."""
    from tessera.planner.gemm import kernel_fraction

    measured = kernel_fraction(hw.gemm_table, hw.peak_flops, hw.gemm_tile, hw.sm_count)
    line = f"kernel fraction of peak (gemm.kernel_fraction): measured {measured:.3f}"
    if not (base.gemm_table and base.sm_count > 0):  # the base priced GEMMs by the size curve
        return [
            line + f"; the base had no per-shape GEMM model (gemm_framework_share {hw.gemm_framework_share})"
        ]
    published = kernel_fraction(base.gemm_table, base.peak_flops, base.gemm_tile, base.sm_count)
    return [
        line + f", base {published:.3f}: wave-filling GEMMs take {published / measured:.2f}x the base file's "
        f"time (gemm_framework_share {hw.gemm_framework_share} kept)"
    ]


def _show(key: str, value: Any) -> str:
    """A measured field's value in the report's units."""
    if key == "gemm_table":
        return (
            "["
            + ", ".join(f"{r.m}x{r.n}x{r.k} {r.dtype} {r.flops_per_s / 1e12:.0f} TFLOP/s" for r in value)
            + "]"
        )
    if key.endswith("bandwidth"):
        return f"{value / 1e9:.0f} GB/s"
    if key.endswith("latency"):
        return f"{value * 1e6:.1f} µs"
    if key.endswith("flops"):
        return f"{value / 1e12:.0f} TFLOP/s"
    return str(value)


SHIPPED_GPU_NAMES: tuple[tuple[str, frozenset[str]], ...] = (
    ("h200", frozenset({"h200"})),
    ("h100", frozenset({"h100"})),
    ("a100-80gb", frozenset({"a100", "80gb"})),
    ("a100-40gb", frozenset({"a100", "40gb"})),
)
"""Shipped base file for a `torch.cuda.get_device_name` reading: the words it must contain (the shipped files are
SXM parts; "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H200")."""
OTHER_FORM_FACTORS = frozenset({"pcie", "nvl"})
"""Words that mark another part of the same chip (other clocks, peak, memory and links): no automatic base."""


def base_for_device(device_name: str) -> str:
    """The shipped hardware file describing `device_name`, matched by whole words (so "GH200" is not "H200");
    a clear error asking for --base when none or several match."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    matches = [] if words & OTHER_FORM_FACTORS else [n for n, need in SHIPPED_GPU_NAMES if need <= words]
    if len(matches) != 1:
        raise ConfigError(
            f"no shipped hardware file describes {device_name!r} (they describe SXM parts: "
            f"{', '.join(list_hardware())}); pass --base NAME or --base FILE.toml with this GPU's published peak, "
            "memory and network (the measured fields replace its own)"
        )
    return matches[0]


def resolve_device(requested: str, cuda_available: bool, detail: str = "") -> str:
    """The device to measure for --device `requested`, "cpu" or "cuda" ("auto": cuda when available); a clear
    error for cuda without a CUDA device (`detail` says what torch reports)."""
    if requested not in ("auto", "cpu", "cuda"):
        raise TesseraError(f"--device {requested!r}: use auto, cpu or cuda")
    if requested == "cuda" and not cuda_available:
        raise TesseraError(
            f"--device cuda, but torch.cuda.is_available() is False here{f' ({detail})' if detail else ''}; run "
            "on a GPU node with a CUDA build of PyTorch (and CUDA_VISIBLE_DEVICES not empty), or use --device cpu"
        )
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    return requested


def measure_gpu(
    *,
    quick: bool = False,
    world: int | None = None,
    shapes: tuple[tuple[int, int, int], ...] = GPU_GEMM_SHAPES,
) -> GpuMeasurements:
    """Run the CUDA measurements on this node: bf16 GEMMs of `shapes` and the SM count on GPU 0, copy
    bandwidth, attention, and an NCCL sweep over `world` GPUs (default: all visible; skipped with one)."""
    import torch

    world = torch.cuda.device_count() if world is None else world
    if not 1 <= world <= torch.cuda.device_count():
        raise ConfigError(
            f"--processes {world}: this node shows {torch.cuda.device_count()} GPUs; use 1 to that"
        )
    repeats = 5 if quick else 20
    sms, rows = gpu_gemm_profile(shapes, repeats=repeats)
    collectives = None
    if world > 1:
        sweep = measure_collectives(
            world, NCCL_BYTES_QUICK if quick else NCCL_BYTES, 3 if quick else 5, 300.0, "nccl"
        )
        collectives = CollectiveFit(world, *fit_collectives(sweep, world))
    return GpuMeasurements(
        device_name=torch.cuda.get_device_name(0),
        sm_count=sms,
        gemm_rows=tuple(rows),
        hbm_bandwidth=gpu_copy_bandwidth(repeats=repeats),
        attention_seconds=gpu_attention_seconds(repeats=max(3, repeats // 2)),
        collectives=collectives,
    )


def calibrate_gpu(
    name: str, base: str | None = None, *, quick: bool = False, world: int | None = None
) -> tuple[Hardware, str]:
    """Measure this GPU node into a profile: `base` (a shipped name or TOML path; default from the device name,
    `base_for_device`) with the measured fields replaced (`gpu_profile`); the profile and its report."""
    import torch

    base_hw = load_hardware(base or base_for_device(torch.cuda.get_device_name(0)))  # fail before measuring
    # the base's own published shapes too, so the report compares like with like
    published = tuple((r.m, r.n, r.k) for r in base_hw.gemm_table if r.dtype == "bf16")
    shapes = tuple(dict.fromkeys(GPU_GEMM_SHAPES + published))
    hw, lines = gpu_profile(base_hw, measure_gpu(quick=quick, world=world, shapes=shapes), name)
    return hw, "\n".join(lines)


def trainer_plan(cfg: Any, world: int, *, flash_attention: bool = True) -> tuple[Any, str]:
    """The cost model's (`Plan`, schedule name) for what `tessera.train.trainer.train(cfg)` runs on `world` ranks.

    Read from the execution plan (`tessera.execution.resolve`): the schedule runtime's schedule and stages (one
    pipeline rank: breadth-first, one stage per block), or for the direct loop depth-first accumulation timed as
    a one-rank 1F1B (bucketed all-reduce overlapped with the last micro-batch's backward)."""
    from tessera.execution import resolve
    from tessera.memory import cost_plan
    from tessera.planner.steptime import CONFIG_TO_IR

    execution = resolve(cfg, world, training=False)
    schedule = execution.schedule or "1f1b"
    if schedule not in CONFIG_TO_IR:
        raise ValueError(
            f"parallel.schedule = {schedule!r} has no closed-form prediction; use one of "
            f"{', '.join(CONFIG_TO_IR)} to predict the step time"
        )
    # ZeRO over one rank moves no bytes: time it as plain training (it shards over data × context)
    zero = execution.zero if execution.batch_ranks > 1 else 0
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
