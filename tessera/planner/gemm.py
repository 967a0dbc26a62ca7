"""GEMM time by shape: a roofline with tile and wave quantization, its constants from a table per GPU.

A GEMM [m×k]·[k×n] (``batch`` independent ones in one call) is cut into output tiles of ``tm × tn`` (one thread
block each, NVIDIA "Matrix Multiplication Background" guide §2.3/§3); the tiles run in waves of ``sm_count``
(one tile per SM at a time), so the call lasts as long as ceil(tiles / SMs) full waves:

    tiles  = ceil(m/tm) · ceil(n/tn) · batch
    waves  = ceil(tiles / SMs)
    quant  = m·n·batch / (waves · SMs · tm · tn)          useful share of the launched tile slots (≤ 1)
    t      = max(F / (peak · fraction · quant), bytes / HBM bandwidth),   F = 2·m·n·k·batch

``fraction`` = ``kernel_fraction`` (what the best GEMM kernel reaches on a shape that fills its waves, fitted on
the hardware file's ``gemm_table`` of measured GEMMs) × ``gemm_framework_share`` (the share of that a training
framework keeps end to end: launch gaps, synchronisation, what the cost model does not itemise). The table rows
are public measurements (cited in the hardware files and docs/cost-model.md "GEMM efficiency") or what
`tessera calibrate` measured on the machine at hand.

A hardware description without an SM count (``sm_count = 0``, e.g. a CPU profile) keeps the size curve
(`plateau_time`): one efficiency per call size, the model used before shapes were priced.
Pure Python: no torch import.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from functools import lru_cache

from tessera.planner.hardware import DTYPE_BYTES, GemmRow, Hardware

__all__ = [
    "TILE_CHOICES",
    "gemm_call_time",
    "gemm_efficiency",
    "kernel_fraction",
    "lanes_call_time",
    "plateau_time",
    "quantization",
    "shape_fraction",
    "shape_time",
]

TILE_CHOICES: tuple[tuple[int, int], ...] = ((128, 128), (128, 256), (256, 128), (256, 256))
"""Output tiles the fit (`megatron_table.fit_gemm_constants`) chooses from: the large-GEMM tiles of cuBLAS
(NVIDIA "Matrix Multiplication Background" guide §2.3 lists 256×128 and 128×128 among the typical ones) and
their transposes and doubles."""


def quantization(m: float, n: float, batch: float, tile: tuple[int, int], sms: int) -> float:
    """Useful share of the tile slots a call occupies: m·n·batch / (ceil(tiles / SMs) · SMs · tm·tn), with
    tiles = ceil(m/tm)·ceil(n/tn)·batch. Tile quantization (partly filled edge tiles) times wave quantization
    (a partly filled last wave). 1 when the tiles divide the output and fill whole waves."""
    tm, tn = tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * math.ceil(batch)
    waves = math.ceil(tiles / sms)
    return m * n * batch / (waves * sms * tm * tn)


def kernel_fraction(
    rows: Iterable[GemmRow], peak_flops: dict[str, float], tile: tuple[int, int], sms: int
) -> float:
    """Fraction of peak the best kernel reaches on a wave-filling shape, from measured rows: the median over
    rows of rate / (peak(dtype) · quantization(row shape)), i.e. each measurement with its own shape's tile and
    wave losses taken out (capped at 1)."""
    ratios = []
    for r in rows:
        if r.dtype not in peak_flops:
            raise ValueError(f"gemm_table row {r} is in {r.dtype!r}, which has no peak_flops entry; add one")
        ratios.append(min(1.0, r.flops_per_s / (peak_flops[r.dtype] * quantization(r.m, r.n, 1, tile, sms))))
    if not ratios:
        raise ValueError("an SM count needs gemm_table rows (measured GEMMs) to fit the kernel fraction on")
    return statistics.median(ratios)


def shape_fraction(hw: Hardware) -> float:
    """`kernel_fraction` of the hardware's table × its `gemm_framework_share`: the achieved fraction of peak
    of a wave-filling GEMM inside training."""
    return (
        _fraction(
            tuple(hw.gemm_table), tuple(sorted(hw.peak_flops.items())), tuple(hw.gemm_tile), hw.sm_count
        )
        * hw.gemm_framework_share
    )


@lru_cache(maxsize=256)
def _fraction(
    table: tuple[GemmRow, ...], peaks: tuple[tuple[str, float], ...], tile: tuple[int, int], sms: int
) -> float:
    """`kernel_fraction`, cached: the search prices millions of GEMMs on one hardware file."""
    return kernel_fraction(table, dict(peaks), tile, sms)


def shape_time(hw: Hardware, m: float, n: float, k: float, *, batch: float = 1, dtype: str = "bf16") -> float:
    """Roofline with tile and wave quantization (module docstring):
    max(2mnk·batch / (peak · fraction · quantization), (mk + kn + mn)·batch·bytes / HBM bandwidth)."""
    flops = 2.0 * m * n * k * batch
    if flops <= 0:
        return 0.0
    nbytes = (m * k + k * n + m * n) * batch * DTYPE_BYTES[dtype]
    quant = quantization(m, n, batch, hw.gemm_tile, hw.sm_count)
    return max(flops / (hw.peak(dtype) * shape_fraction(hw) * quant), nbytes / hw.hbm_bandwidth)


def plateau_time(
    hw: Hardware, m: float, n: float, k: float, *, batch: float = 1, dtype: str = "bf16"
) -> float:
    """Size-curve roofline: max(F / (peak·η(F)), bytes / HBM bandwidth), F = 2·m·n·k·batch, bytes =
    (mk + kn + mn)·batch·bytes(dtype), η = `Hardware.efficiency(F)` of the whole call (no shape effects)."""
    flops = 2.0 * m * n * k * batch
    if flops <= 0:
        return 0.0
    nbytes = (m * k + k * n + m * n) * batch * DTYPE_BYTES[dtype]
    return max(flops / (hw.peak(dtype) * hw.efficiency(flops)), nbytes / hw.hbm_bandwidth)


def gemm_call_time(
    hw: Hardware, m: float, n: float, k: float, *, batch: float = 1, dtype: str = "bf16"
) -> float:
    """Seconds of one (batched) GEMM call: `shape_time` when the hardware gives an SM count, else
    `plateau_time`. The compute-time code of `cost` prices every GEMM through this."""
    if hw.sm_count > 0:
        return shape_time(hw, m, n, k, batch=batch, dtype=dtype)
    return plateau_time(hw, m, n, k, batch=batch, dtype=dtype)


def lanes_call_time(
    hw: Hardware, m: float, n: float, k: float, *, calls: int, lanes: int, dtype: str = "bf16"
) -> float:
    """Seconds of `calls` identical GEMMs issued round-robin on `lanes` streams (a tensor-parallel ring's chunks,
    `tessera.traffic.RING_GEMM_LANES`), their thread blocks sharing the SMs. When the calls in flight hold enough
    tiles to occupy every SM (lanes × tiles of one call ≥ `Hardware.sm_count`) the SMs never wait between calls
    and only the last wave of all of them is partly empty: one call batched over `calls`. Otherwise each round of
    `lanes` calls runs as one batched call: ceil(calls / lanes) of them. One lane (or no SM count): `calls` calls
    one after the other."""
    if lanes <= 1 or hw.sm_count <= 0:
        return calls * gemm_call_time(hw, m, n, k, dtype=dtype)
    tm, tn = hw.gemm_tile
    if lanes * math.ceil(m / tm) * math.ceil(n / tn) >= hw.sm_count:
        return gemm_call_time(hw, m, n, k, batch=calls, dtype=dtype)
    rounds, rest = divmod(calls, lanes)
    return rounds * gemm_call_time(hw, m, n, k, batch=lanes, dtype=dtype) + (
        gemm_call_time(hw, m, n, k, batch=rest, dtype=dtype) if rest else 0.0
    )


def gemm_efficiency(
    hw: Hardware, m: float, n: float, k: float, *, batch: float = 1, dtype: str = "bf16"
) -> float:
    """Achieved fraction of peak of one call under `gemm_call_time` (memory-bound calls included)."""
    t = gemm_call_time(hw, m, n, k, batch=batch, dtype=dtype)
    return 2.0 * m * n * k * batch / (hw.peak(dtype) * t) if t > 0 else 0.0
