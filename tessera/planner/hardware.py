"""Hardware descriptions for the cost model: peak FLOP/s, memory, bandwidths, latencies, GEMM efficiency.

Shipped descriptions live in `tessera/hardware/<name>.toml` (package data); any other TOML file with the same
keys can be loaded by path. Values and their sources: docs/cost-model.md and the comments in each file.
No torch import: the planner runs on machines without PyTorch.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from tessera.errors import ConfigError

__all__ = [
    "DEFAULT_GEMM_EFFICIENCY",
    "DEFAULT_GPU_MTBF_HOURS",
    "DEFAULT_STORAGE_WRITE_BANDWIDTH",
    "DTYPE_BYTES",
    "GemmRow",
    "Hardware",
    "list_hardware",
    "load_hardware",
    "save_hardware",
]

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each compute dtype (tf32 is stored as fp32)."""

# Achieved fraction of peak for one GEMM (or batched GEMM) call as a function of its FLOPs, interpolated in
# log10(FLOPs). ASSUMPTION, not a measurement of ours: the shape follows public cuBLAS/A100 GEMM benchmarks
# (tiny calls are launch/latency bound, efficiency saturates for calls above ~1e11 FLOPs) and the plateau (0.65)
# is the end-to-end achieved GEMM efficiency inside a training framework, calibrated on ONE published point:
# the single-GPU A100 row of the Megatron-LM Sept 2020 README table (docs/cost-model.md §1; 149.8 TFLOP/s,
# no communication). See docs/cost-model.md "GEMM efficiency".
DEFAULT_GEMM_EFFICIENCY: tuple[tuple[float, float], ...] = (
    (1e6, 0.02),
    (1e7, 0.075),
    (1e8, 0.23),
    (1e9, 0.42),
    (1e10, 0.56),
    (1e11, 0.63),
    (1e12, 0.65),
)

DEFAULT_STORAGE_WRITE_BANDWIDTH = 2e12 / 16_384
"""Bytes/s per GPU at which every rank writes its checkpoint shard at once: Llama 3's checkpoint storage (Meta's
Tectonic, "a sustainable throughput of 2 TB/s") shared by the 16,384 H100s of its pre-training (Llama 3 paper,
arXiv 2407.21783, §3.3.1), ≈ 122 MB/s per GPU. A published cluster's figure, not a measurement of ours."""

DEFAULT_GPU_MTBF_HOURS = 54 * 24 * 16_384 / 419
"""Mean time between unexpected job interruptions per GPU, hours: Llama 3's 419 unexpected interruptions in a
54-day snapshot of pre-training on 16,384 H100s (arXiv 2407.21783, §3.3.4), ≈ 50,700 GPU-hours; a job on N GPUs is
interrupted every DEFAULT_GPU_MTBF_HOURS / N hours on average (3.1 h on 16,384). It counts every cause of an
unexpected interruption (GPUs and their memory, hosts, network, software), not GPU failures only."""


class GemmRow(NamedTuple):
    """One measured GEMM: [m×k]·[k×n] in `dtype` at `flops_per_s` (2mnk / seconds), and where it comes from."""

    m: int
    n: int
    k: int
    dtype: str
    flops_per_s: float
    source: str = ""


@dataclass(kw_only=True, slots=True)
class Hardware:
    """One accelerator type inside its node and cluster. All rates in SI units (bytes/s, FLOP/s, seconds)."""

    name: str
    """Short name, e.g. "a100-80gb"."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by dtype: "bf16", "fp16", "tf32", "fp32"."""
    memory_bytes: float
    """Device memory capacity in bytes."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    gpus_per_node: int
    """Devices sharing the fast intra-node fabric (NVLink/NVSwitch)."""
    intra_node_bandwidth: float
    """Per GPU, per direction, bytes/s, between devices of one node."""
    intra_node_latency: float
    """Per collective step (one ring hop), seconds, inside a node."""
    inter_node_bandwidth: float
    """Per GPU, per direction, bytes/s, to devices of other nodes (NIC bandwidth per GPU)."""
    inter_node_latency: float
    """Per collective step (one ring hop), seconds, across nodes."""
    topology: str = "rail-optimized fat tree"
    """How nodes connect (descriptive; the pricing uses `pod_gpus` and `oversubscription`)."""
    pod_gpus: int = 0
    """GPUs reachable at full bisection bandwidth (one pod); 0: the whole cluster is non-blocking."""
    oversubscription: float = 1.0
    """Bandwidth reduction for traffic between pods (e.g. 7 for a 1:7 aggregation layer)."""
    best_published_mfu: float = 0.0
    """Highest model-FLOPs utilisation published for large-model training on this device (0: unknown); the
    planner flags predictions above it (sources in docs/cost-model.md §1)."""
    gemm_efficiency: list[tuple[float, float]] = field(default_factory=lambda: list(DEFAULT_GEMM_EFFICIENCY))
    """(FLOPs of one GEMM call, achieved fraction of peak) points, interpolated in log10(FLOPs), clamped. Used
    only without an SM count (`tessera.planner.gemm.plateau_time`)."""
    sm_count: int = 0
    """Streaming multiprocessors: with > 0 GEMMs are priced by shape (`tessera.planner.gemm.shape_time`: tile and
    wave quantization); 0 keeps the size curve `gemm_efficiency` (e.g. a CPU profile)."""
    gemm_tile: tuple[int, int] = (128, 256)
    """Output tile (rows, columns) of one thread block of the GEMM kernels, for the quantization."""
    gemm_framework_share: float = 1.0
    """Share of the best kernel's rate a training framework keeps end to end (launch gaps, synchronisation,
    what the cost model does not itemise)."""
    gemm_table: list[GemmRow] = field(default_factory=list)
    """Measured GEMMs (published or from `tessera calibrate`); the kernel fraction is fitted on them."""
    flash_attention_flops: float = 0.0
    """Measured forward + backward FLOP/s of the fused causal attention kernel in bf16/fp16, FLOPs counted as
    FlashAttention's benchmark counts them (4·s²·d per head forward, halved for causal, backward 2.5×); what
    `cost.compute.attention_core_time` prices flash attention at. 0: not measured (two batched GEMMs)."""
    overlap_slowdown: float = 0.0
    """Fraction by which compute slows while a data-parallel collective runs under it (the collective's kernels
    take SMs and memory bandwidth): each hidden second of such a collective adds this many seconds to the step
    (`steptime.dp_cost`). 0: overlap is free."""
    storage_write_bandwidth: float = DEFAULT_STORAGE_WRITE_BANDWIDTH
    """Bytes/s at which each GPU writes its checkpoint shard while every rank writes at once (the file system's
    sustained write throughput / the GPUs sharing it); `tessera plan --out` prices a checkpoint's write with it.
    Default: Llama 3's cluster, `DEFAULT_STORAGE_WRITE_BANDWIDTH`."""
    gpu_mtbf_hours: float = DEFAULT_GPU_MTBF_HOURS
    """Mean time between unexpected job interruptions per GPU, hours (a job on N GPUs: this / N); `tessera plan
    --out` sets the checkpoint interval from it. Default: Llama 3's interruption count, `DEFAULT_GPU_MTBF_HOURS`."""

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for `dtype`; clear error for a dtype the file does not list."""
        if dtype not in self.peak_flops:
            raise ConfigError(
                f"hardware {self.name!r} has no peak FLOP/s for dtype {dtype!r}; "
                f"listed: {sorted(self.peak_flops)}. Add it under [peak_flops] in the hardware file."
            )
        return self.peak_flops[dtype]

    def efficiency(self, flops: float) -> float:
        """Achieved fraction of peak for one GEMM call of `flops` FLOPs (log-space linear interpolation)."""
        import numpy as np  # here, not at the top: numpy's import is a third of `tessera plan`'s start-up

        xs, ys = zip(*sorted(self.gemm_efficiency), strict=True)
        # np.interp clamps to the end values outside the listed range.
        return float(np.interp(math.log10(max(flops, 1.0)), np.log10(xs), ys))

    def __post_init__(self) -> None:
        problems = [
            f"{key} must be > 0 (got {getattr(self, key)})"
            for key in (
                "memory_bytes",
                "hbm_bandwidth",
                "gpus_per_node",
                "intra_node_bandwidth",
                "inter_node_bandwidth",
                "storage_write_bandwidth",
                "gpu_mtbf_hours",
            )
            if not getattr(self, key) > 0
        ]
        problems += [f"peak_flops[{k!r}] must be > 0" for k, v in self.peak_flops.items() if not v > 0]
        if not 0 <= self.best_published_mfu <= 1:
            problems.append(f"best_published_mfu must be in [0, 1] (got {self.best_published_mfu})")
        if self.pod_gpus < 0 or not self.oversubscription >= 1:
            problems.append(
                f"pod_gpus must be >= 0 and oversubscription >= 1 (got {self.pod_gpus}, {self.oversubscription})"
            )
        if not self.gemm_efficiency:
            problems.append("gemm_efficiency needs at least one (flops, efficiency) point")
        problems += [
            f"gemm_efficiency point {p} must have flops > 0 and 0 < efficiency <= 1"
            for p in self.gemm_efficiency
            if not (p[0] > 0 and 0 < p[1] <= 1)
        ]
        problems += _gemm_problems(self)
        if problems:
            raise ConfigError(f"hardware {self.name!r} is invalid:\n  " + "\n  ".join(problems))


def _gemm_problems(hw: Hardware) -> list[str]:
    """What is wrong with the per-shape GEMM keys (empty list: nothing)."""
    problems = []
    if hw.sm_count < 0 or len(hw.gemm_tile) != 2 or min(hw.gemm_tile) < 1:
        problems.append(
            f"sm_count must be >= 0 and gemm_tile two sizes >= 1 (got {hw.sm_count}, {hw.gemm_tile})"
        )
    if not 0 < hw.gemm_framework_share <= 1:
        problems.append(f"gemm_framework_share must be in (0, 1] (got {hw.gemm_framework_share})")
    if not 0 <= hw.overlap_slowdown < 1:
        problems.append(f"overlap_slowdown must be in [0, 1) (got {hw.overlap_slowdown})")
    if hw.flash_attention_flops < 0:
        problems.append(f"flash_attention_flops must be >= 0 (got {hw.flash_attention_flops})")
    if hw.sm_count > 0 and not hw.gemm_table:
        problems.append(
            "sm_count > 0 needs gemm_table rows [m, n, k, dtype, FLOP/s, source] to fit the GEMM fraction"
        )
    problems += [
        f"gemm_table row {r} needs m, n, k, FLOP/s > 0 and a dtype listed under [peak_flops]"
        for r in hw.gemm_table
        if min(r.m, r.n, r.k, r.flops_per_s) <= 0 or r.dtype not in hw.peak_flops
    ]
    return problems


OPTIONAL_KEYS = frozenset(
    {
        "gemm_efficiency",
        "topology",
        "pod_gpus",
        "oversubscription",
        "best_published_mfu",
        "sm_count",
        "gemm_tile",
        "gemm_framework_share",
        "gemm_table",
        "flash_attention_flops",
        "overlap_slowdown",
        "storage_write_bandwidth",
        "gpu_mtbf_hours",
    }
)
"""Hardware keys a file may omit (they have defaults)."""


def _shipped_dir() -> Any:
    return resources.files("tessera") / "hardware"


def list_hardware() -> list[str]:
    """Names of the shipped hardware descriptions (usable with `load_hardware`)."""
    return sorted(p.name[: -len(".toml")] for p in _shipped_dir().iterdir() if p.name.endswith(".toml"))


def load_hardware(name_or_path: str | Path) -> Hardware:
    """Load a shipped description by name ("a100-80gb", "h100", ...) or any hardware TOML file by path."""
    text = str(name_or_path)
    path = Path(text)
    if text.endswith(".toml") or path.exists():
        if not path.is_file():
            raise ConfigError(
                f"hardware file {text!r} does not exist; pass a TOML path or one of {list_hardware()}"
            )
        return _from_dict(tomllib.loads(path.read_text()), default_name=path.stem)
    entry = _shipped_dir() / f"{text}.toml"
    if not entry.is_file():
        raise ConfigError(
            f"unknown hardware {text!r}; available: {', '.join(list_hardware())} (or pass a path to a .toml file)"
        )
    return _from_dict(tomllib.loads(entry.read_text()), default_name=text)


def _from_dict(raw: dict[str, Any], default_name: str) -> Hardware:
    raw = dict(raw)
    raw.setdefault("name", default_name)
    known = set(Hardware.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    missing = sorted(k for k in known - OPTIONAL_KEYS if k not in raw)
    if unknown or missing:
        raise ConfigError(
            f"hardware {raw['name']!r}: unknown keys {unknown}, missing keys {missing}; "
            f"expected keys: {sorted(known)}"
        )
    if "gemm_efficiency" in raw:
        raw["gemm_efficiency"] = [(float(f), float(e)) for f, e in raw["gemm_efficiency"]]
    if "gemm_tile" in raw:
        raw["gemm_tile"] = tuple(int(x) for x in raw["gemm_tile"])
    if "gemm_table" in raw:
        raw["gemm_table"] = [
            GemmRow(int(m), int(n), int(k), str(d), float(r), *map(str, rest))
            for m, n, k, d, r, *rest in raw["gemm_table"]
        ]
    raw["peak_flops"] = {k: float(v) for k, v in raw["peak_flops"].items()}
    return Hardware(**raw)


def save_hardware(hw: Hardware, path: str | Path) -> None:
    """Write `hw` as a TOML file that `load_hardware(path)` reads back unchanged."""
    lines = [f"name = {_toml_str(hw.name)}"]
    for key in (
        "memory_bytes",
        "hbm_bandwidth",
        "gpus_per_node",
        "intra_node_bandwidth",
        "intra_node_latency",
        "inter_node_bandwidth",
        "inter_node_latency",
        "pod_gpus",
        "oversubscription",
        "best_published_mfu",
        "sm_count",
        "gemm_framework_share",
        "flash_attention_flops",
        "overlap_slowdown",
        "storage_write_bandwidth",
        "gpu_mtbf_hours",
    ):
        lines.append(f"{key} = {getattr(hw, key)!r}")
    lines.append(f"gemm_tile = [{hw.gemm_tile[0]}, {hw.gemm_tile[1]}]")
    rows = ", ".join(
        f"[{r.m}, {r.n}, {r.k}, {_toml_str(r.dtype)}, {r.flops_per_s!r}, {_toml_str(r.source)}]"
        for r in hw.gemm_table
    )
    lines.append(f"gemm_table = [{rows}]")
    lines.append(f"topology = {_toml_str(hw.topology)}")
    points = ", ".join(f"[{f!r}, {e!r}]" for f, e in hw.gemm_efficiency)
    lines.append(f"gemm_efficiency = [{points}]")
    lines.append("")
    lines.append("[peak_flops]")
    lines += [f"{k} = {v!r}" for k, v in hw.peak_flops.items()]
    Path(path).write_text("\n".join(lines) + "\n")


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
