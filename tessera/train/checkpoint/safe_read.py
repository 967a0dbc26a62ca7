"""Reading a checkpoint without unpickling code: DCP's ``.metadata`` through an allow-list unpickler, and every
non-tensor value with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from tessera.errors import CheckpointError

__all__ = ["SafeLoadPlanner", "SafeReader", "read_metadata_safely"]

_DCP = "torch.distributed.checkpoint"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {(f"{_DCP}.metadata", n) for n in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )}
    | {
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata dataclasses, torch.Size/dtypes/layouts and a few containers."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP index never contains; refusing to "
            "load it (it could run code)\n    fix: only load checkpoints you or tessera wrote"
        )


def read_metadata_safely(path: Path) -> Metadata:
    """Read a DCP ``.metadata`` file through the allow-list unpickler (DCP itself uses plain pickle.load)."""
    try:
        with open(Path(path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path}: .metadata is unreadable ({type(e).__name__}: {e})\n    fix: resume from "
            "another checkpoint; this one is damaged"
        ) from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint {path}: .metadata holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader that hands DCP the metadata already read by `read_metadata_safely`."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("tessera checkpoints have one global .metadata, not per-rank ones")
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor values (optimizer hyper-parameters) load with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
