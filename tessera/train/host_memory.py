"""A process's resident memory on Linux, read so that it counts live tensors: for start-up and training peaks
measured on CPU ranks (tests/distributed/test_startup_memory.py, benchmarks/scale_774m.py).

- `status_bytes("VmRSS")` / `status_bytes("VmHWM")`: the resident size now / its high-water mark (/proc).
- `reset_peak()`: lower the high-water mark to the current resident size (``/proc/self/clear_refs``), so the
  peak of one phase (building the model, training) is measured on its own.
- `fix_allocator()`: make glibc return freed large blocks at once. By default it raises its mmap and trim
  thresholds as big blocks are freed (up to 32 and 64 MiB) and keeps up to that much freed heap resident, so a
  measured peak would follow those heuristics rather than the tensors alive.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = ["fix_allocator", "reset_peak", "status_bytes"]

_MIB = 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status (e.g. VmRSS, VmHWM, RssAnon) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Reset VmHWM to the current resident size."""
    Path("/proc/self/clear_refs").write_text("5")


def fix_allocator() -> None:
    """glibc: blocks of 1 MiB and more are mapped on their own and returned when freed (see the module doc)."""
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, _MIB) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, _MIB) != 1:
        raise RuntimeError("glibc's mallopt refused the thresholds")
