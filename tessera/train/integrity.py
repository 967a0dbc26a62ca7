"""Checksums of a checkpoint's files: each rank hashes what it wrote at save; loads verify before reading.

meta.json (written last, by rank 0) lists every other file of the checkpoint with its size and sha256. At load
the files are split over the ranks (file i is hashed by rank i mod world), so verifying reads the checkpoint
once in total, in parallel; the ranks then share what they found, so all of them take the same decision.
Checkpoints written before checksums existed (no ``"files"`` in meta.json) are not verified.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["files_written_by", "hash_files", "verify_files"]

_CHUNK = 1 << 24


def files_written_by(folder: Path, rank: int) -> list[str]:
    """The files of a checkpoint folder that ``rank`` wrote: DCP's ``__{rank}_*.distcp``, its RNG file, and on
    rank 0 DCP's ``.metadata`` (DCP's coordinator is rank 0)."""
    names = [p.name for p in Path(folder).glob(f"__{rank}_*.distcp")] + [f"rng_rank{rank}.pt"]
    if rank == 0:
        names.append(".metadata")
    return sorted(n for n in names if (Path(folder) / n).is_file())


def hash_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {"bytes": size, "sha256": hex}} of the named files in ``folder``."""
    return {name: _digest(Path(folder) / name) for name in names}


def _digest(path: Path) -> dict[str, Any]:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def verify_files(folder: Path, expected: dict[str, dict[str, Any]], *, collective: bool = True) -> list[str]:
    """Problems found checking ``folder`` against ``expected`` (empty when intact); collective when asked and a
    process group exists: this rank checks its share and every rank returns everyone's findings."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if collective and dist.is_initialized() else (0, 1)
    mine = [name for i, name in enumerate(sorted(expected)) if i % world == rank]
    problems = [p for name in mine if (p := _check(Path(folder), name, expected[name]))]
    if world == 1:
        return problems
    everyone: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(everyone, problems)
    return sorted(p for found in everyone for p in found)


def _check(folder: Path, name: str, want: dict[str, Any]) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"{name} is missing"
    try:
        got = _digest(path)
    except OSError as e:
        return f"{name} cannot be read ({e})"
    if got["bytes"] != want.get("bytes"):
        return f"{name} has {got['bytes']} bytes, {want.get('bytes')} were written"
    if got["sha256"] != want.get("sha256"):
        return f"{name} does not match its checksum (its contents changed after the save)"
    return None
