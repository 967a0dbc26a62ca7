"""Each rank's random number generators in a checkpoint: ``rng_rank{r}.pt``, tensors and numbers only
(loaded with ``torch.load(weights_only=True)``), restored exactly by the rank that saved them."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from tessera.errors import CheckpointError

__all__ = ["capture_rng", "read_rng", "reseed_rng", "restore_rng", "write_rank_files"]


def write_rank_files(tmp: Path, rank: int, rng: dict[str, Any]) -> None:
    """This rank's RNG streams (`capture_rng`), as tensors and numbers only (no pickled objects)."""
    path = tmp / f"rng_rank{rank}.pt"
    with open(path, "wb") as f:
        torch.save(rng, f)
        f.flush()
        os.fsync(f.fileno())


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as tensors and numbers: torch CPU, every CUDA device, numpy, Python."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    version, internal, gauss = random.getstate()
    state["python"] = {
        "version": version,
        "state": torch.tensor(internal, dtype=torch.int64),
        "gauss_next": gauss,
    }
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def reseed_rng(seed: int, step: int, rank: int) -> None:
    """Seed this process's RNGs (torch on every device, numpy, Python) from (``seed``, ``step``, ``rank``): what
    a rank does when it resumes a checkpoint saved at another layout, whose streams belong to other ranks. The
    result is deterministic, so two resumes at the same layout continue alike."""
    mixed = (seed * 1_000_003 + step) * 1_000_033 + rank  # distinct per rank and step, the same every time
    torch.manual_seed(mixed % 2**63)
    random.seed(mixed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(mixed % 2**32)


def restore_rng(extra: dict[str, Any]) -> None:
    """Set this process's RNGs from ``extra["rng"]`` (as returned by `load_checkpoint`) or a `capture_rng` dict."""
    try:
        _restore_rng(extra.get("rng", extra))
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise CheckpointError(
            f"the checkpoint's RNG state cannot be restored ({type(e).__name__}: {e}); the rng_rank*.pt file is "
            "damaged\n    fix: resume from an earlier checkpoint (checkpoint.load_step = N)"
        ) from None


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise CheckpointError(
                f"checkpoint holds RNG states of {len(cuda)} CUDA device(s) but {torch.cuda.device_count()} are "
                "visible\n    fix: resume with the same CUDA_VISIBLE_DEVICES as the saved run"
            )
        torch.cuda.set_rng_state_all(cuda)
    py = state.get("python")
    if py is not None:
        random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    np_state = state.get("numpy")
    if np_state is not None:
        import numpy as np

        keys = np_state["keys"].numpy().astype(np.uint32)
        np.random.set_state(
            (np_state["kind"], keys, np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"])
        )


def read_rng(path: Path, rank: int) -> dict[str, Any]:
    file = path / f"rng_rank{rank}.pt"
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {file.name}; it is incomplete or from another layout"
        )
    try:
        return torch.load(file, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: {file.name} is not a plain tensor file ({e})") from e
