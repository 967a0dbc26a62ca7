"""The commit protocol of a checkpoint folder: atomic files, the ``step_N.tmp`` → ``step_N`` rename, ``latest``,
pruning, and finding the complete checkpoints again.

A save writes into ``step_N.tmp/``; rank 0 then writes ``meta.json`` (marked complete), renames the folder to
``step_N/`` and atomically replaces ``latest``, so a crash at any point leaves the previous checkpoint intact.
Pruning renames a folder to ``*.old.tmp`` before deleting it, so a half-deleted one is never taken for complete.

Part of the checkpoint package's design (tessera/train/checkpoint/__init__.py) but outside the package, whose
``__init__`` imports torch: finding a run's checkpoints and reading their meta.json needs none, so `tessera
generate` and `tessera export` reject a run without one in milliseconds instead of the seconds torch takes.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any

from tessera.errors import CheckpointError

__all__ = [
    "LAYOUT_FREE_FORMAT",
    "META",
    "RANK_LOCAL_FORMAT",
    "checkpoint_meta",
    "commit",
    "complete_checkpoints",
    "is_sharded",
    "latest_checkpoint",
    "list_checkpoints",
    "prune",
    "read_meta",
    "remove_stale_tmp",
    "resolve",
    "set_aside_later",
    "step_dir_name",
    "step_dirs",
]

META = "meta.json"
_LATEST = "latest"
_PREFIX = "step_"
_TMP = ".tmp"
LAYOUT_FREE_FORMAT = 2  # layout-free: global names and blocks (checkpoint/state.py)
RANK_LOCAL_FORMAT = 1  # each rank's own state dict; resumes only at the layout that wrote it


def step_dir_name(step: int) -> str:
    """The folder name of step ``step``'s checkpoint: ``step_00000100``."""
    return f"{_PREFIX}{step:08d}"


def step_dirs(ckpt_dir: Path, step: int) -> tuple[Path, Path]:
    """(the published folder ``step_N``, the folder a save writes into before its atomic rename)."""
    final = ckpt_dir / step_dir_name(step)
    return final, ckpt_dir / f"{final.name}{_TMP}"


def commit(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Mark complete, rename into place and point `latest` at it; each step is atomic on POSIX."""
    write_atomic(tmp / META, json.dumps(meta, indent=1))
    if final.exists():  # re-saving the same step: move the old one aside rather than merge into it
        old = final.with_name(final.name + ".old" + _TMP)
        os.replace(final, old)
        shutil.rmtree(old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    write_atomic(final.parent / _LATEST, final.name + "\n")


def write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_tmp(ckpt_dir: Path) -> None:
    for p in ckpt_dir.glob(f"{_PREFIX}*{_TMP}"):
        shutil.rmtree(p, ignore_errors=True)


def prune(ckpt_dir: Path, keep: int) -> None:
    for p in complete_checkpoints(ckpt_dir)[:-keep]:
        # rename first: a crash mid-delete then leaves a .tmp folder, which no load considers and the next
        # save removes, never a step folder that looks complete but lacks files
        doomed = p.with_name(p.name + ".old" + _TMP)
        os.replace(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def set_aside_later(ckpt_dir: Path, start: int, stamp: str) -> Path | None:
    """Move every step folder of a step after ``start`` into ``ckpt_dir/superseded_<stamp>_from_step_N/``, and
    point ``latest`` at ``start``'s checkpoint (or remove it); the folder, or None when there was none to move.

    A run that starts at ``start`` (from scratch, from an older checkpoint by ``checkpoint.load_step``, or past
    damaged newer ones) replaces the history after it. Left in place, those checkpoints outnumbered its own when
    pruning kept the newest, and the next resume took the replaced run's newest checkpoint: the two runs mixed
    without a word. Moved, not deleted: they are the user's to inspect or remove."""
    later = [p for p in _step_folders(ckpt_dir) if int(p.name[len(_PREFIX) :]) > start]
    if not later:
        return None
    aside = ckpt_dir / f"superseded_{stamp}_from_{step_dir_name(start)}"
    for n in itertools.count(2):  # two restarts in one second at the same step: a folder each
        try:
            aside.mkdir()
            break
        except FileExistsError:
            aside = aside.with_name(f"superseded_{stamp}_{n}_from_{step_dir_name(start)}")
    for p in later:
        os.replace(p, aside / p.name)
    latest, kept = ckpt_dir / _LATEST, ckpt_dir / step_dir_name(start)
    if kept.is_dir():
        write_atomic(latest, kept.name + "\n")
    else:
        latest.unlink(missing_ok=True)
        _fsync_dir(ckpt_dir)
    return aside


def _step_folders(ckpt_dir: Path) -> list[Path]:
    """Every ``step_N`` folder, complete or not (``.tmp`` leftovers excluded), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.glob(f"{_PREFIX}*") if p.is_dir() and not p.name.endswith(_TMP))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint under ``ckpt_dir`` (``.tmp`` leftovers ignored), or None if there is none.

    Complete folders are authoritative; the ``latest`` file is what tools read and agrees with this except
    in the instant between a rename and its update.
    """
    found = complete_checkpoints(Path(ckpt_dir))
    return found[-1] if found else None


def list_checkpoints(ckpt_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete checkpoints, oldest first; step folders that are not complete, e.g. damaged meta.json)."""
    steps = _step_folders(Path(ckpt_dir))
    return [p for p in steps if _is_complete(p)], [p for p in steps if not _is_complete(p)]


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    done = [p for p in ckpt_dir.glob(f"{_PREFIX}*") if not p.name.endswith(_TMP) and _is_complete(p)]
    return sorted(done, key=lambda p: p.name)


def _is_complete(path: Path) -> bool:
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("complete") is True and (path / ".metadata").is_file()


def resolve(path: Path) -> Path:
    if not path.exists():
        raise CheckpointError(
            f"checkpoint directory {path} does not exist\n    fix: pass a folder written by save_checkpoint "
            "(e.g. RUN_DIR/checkpoints/step_00000100) or the checkpoint directory to take its newest"
        )
    if (path / META).exists() or path.name.endswith(_TMP):
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        raise CheckpointError(
            f"{path} holds no complete checkpoint (no step_* folder with meta.json marked complete)\n"
            "    fix: start without resuming, or point at a directory a finished save wrote"
        )
    return newest


def read_meta(path: Path) -> dict[str, Any]:
    if path.name.endswith(_TMP) or not _is_complete(path):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (the save was interrupted before it was marked complete)\n"
            f"    fix: resume from latest_checkpoint({path.parent}), which skips unfinished saves"
        )
    return json.loads((path / META).read_text())


def checkpoint_meta(path: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint folder (or of the newest one in a checkpoint directory), with its
    resolved ``"path"``: step, world size, layout, shard ids, ``weights_only`` for exports."""
    path = resolve(Path(path))
    return {**read_meta(path), "path": str(path)}


def is_sharded(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint's ranks saved different slices of the model in the rank-local format 1, so only its
    own layout can load it; False for a layout-free checkpoint (any layout, one process included, reads it)."""
    if meta.get("format", RANK_LOCAL_FORMAT) != RANK_LOCAL_FORMAT:
        return False
    return any(s is not None for s in meta.get("shard_ids") or [])
