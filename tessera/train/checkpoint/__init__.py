"""Atomic, resumable checkpoints on torch.distributed.checkpoint (DCP), loaded without unpickling code.

Layout of a checkpoint directory::

    ckpt_dir/
      latest                  text: the name of the newest complete checkpoint ("step_00000100")
      step_00000100/
        .metadata             DCP index (a pickle; read through an allow-list unpickler, see safe_read.py)
        __0_0.distcp ...      DCP tensor data, written by every rank
        rng_rank0.pt ...      each rank's RNG streams (tensors and numbers only; torch.load(weights_only=True))
        meta.json             step, world size, layout, JSON part of `extra`, checksums, "complete": true
      step_00000200.tmp/      a save in progress or one that crashed; ignored and deleted by the next save

The package, by seam: this module saves and loads (the one save path, `save_checkpoint`, which
tessera/train/async_save.py continues in the background); tessera/train/checkpoint_files.py is the commit
protocol (atomic files, the rename, ``latest``, pruning, finding checkpoints and reading their meta.json; outside
this package, whose import is torch's, so a run folder is looked up without torch); safe_read.py reads without
unpickling code; rng.py captures and restores the RNG streams; tessera/train/integrity.py checksums the files.
See docs/checkpoints.md for the safety argument.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from tessera.errors import CheckpointError, CheckpointWriteError
from tessera.train.checkpoint.rng import capture_rng, read_rng, reseed_rng, restore_rng, write_rank_files
from tessera.train.checkpoint.safe_read import SafeLoadPlanner, SafeReader, read_metadata_safely
from tessera.train.checkpoint.state import (
    GlobalLoadPlanner,
    GlobalSavePlanner,
    RankState,
    check_shapes,
    extra_pieces,
    group_settings,
    has_optimizer_state,
    restore_group_settings,
    state_dict_of,
)
from tessera.train.checkpoint_files import (
    LAYOUT_FREE_FORMAT,
    RANK_LOCAL_FORMAT,
    checkpoint_meta,
    commit,
    is_sharded,
    latest_checkpoint,
    list_checkpoints,
    prune,
    read_meta,
    remove_stale_tmp,
    resolve,
    step_dir_name,
    step_dirs,
)
from tessera.train.integrity import files_written_by, hash_files, verify_files

if TYPE_CHECKING:
    from tessera.train.async_save import AsyncSaves

__all__ = [
    "capture_rng",
    "checkpoint_meta",
    "is_sharded",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_weights",
    "loadable_format",
    "missing_model_state",
    "read_metadata_safely",
    "read_tensor",
    "require_model_state",
    "reseed_rng",
    "restore_rng",
    "save_checkpoint",
    "save_model_weights",
    "step_dir_name",
    "verify_checkpoint",
]

_NO_PG_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
# the two steps of a save after DCP's write, looked up here at each save (the crash tests replace them)
_write_rank_files = write_rank_files
_commit = commit


# --- saving ----------------------------------------------------------------------------------------------------


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    keep: int = 2,
    *,
    shard_id: str | None = None,
    layout: str | None = None,
    background: AsyncSaves | None = None,
    state: RankState | None = None,
) -> Path:
    """Save model, optimizer, ``extra`` and every rank's RNG state as ``ckpt_dir/step_{step:08d}``; collective.

    ``extra`` (scheduler state, data position, ...) must be the same on every rank: its JSON values go to
    meta.json (rank 0's copy) and its tensors into the checkpoint. The format is layout-free (state.py): every
    parameter and optimizer moment under its global name, each rank writing its blocks of it, so any layout
    resumes it. ``state`` says which blocks this rank holds (the trainer's steppers); without it ``model`` is
    held whole by every rank. Only a caller that passes ``shard_id`` and no ``state`` (a module whose ranks hold
    different, undescribed slices: ranks with equal ids hold identical state) gets the rank-local format 1,
    which resumes only at its own layout. ``layout`` describes the layout (the RNG streams are restored only at
    the same one). Keeps the newest
    ``keep`` complete checkpoints and returns the new folder. With ``background`` (`checkpoint.async`) it
    returns once the state is copied: the files are written and committed, in the same way, in a thread
    (tessera/train/async_save.py), and the folder exists only once ``background.wait()`` has returned.
    """
    if keep < 1:
        raise ValueError(f"keep = {keep} must be at least 1 (the checkpoint just written)")
    ckpt_dir = Path(ckpt_dir)
    rank, world = _rank_world()
    final, tmp = step_dirs(ckpt_dir, step)
    json_extra, tensor_paths, tensors = _split_extra(extra)
    if background is not None:
        background.wait()  # at most one save in flight, and its .tmp folder is not stale
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(ckpt_dir)
    _barrier()  # nobody writes into tmp before rank 0 has cleared it
    fmt, to_write, planner = _to_write(model, optimizer, tensors, shard_id, state)
    groups = group_settings(optimizer) if fmt == LAYOUT_FREE_FORMAT else None
    rng = capture_rng()  # the RNG streams as of this step, wherever the files are written

    def publish(group: dist.ProcessGroup | None = None) -> Path:
        with _write_errors(step, tmp):
            _write_rank_files(tmp, rank, rng)
        sums = hash_files(
            tmp, files_written_by(tmp, rank)
        )  # re-read from the page cache, by the rank that wrote
        gathered = _gather((shard_id, sums), world, group)  # also the barrier: every rank's files are on disk
        if rank == 0:
            meta = {
                "format": fmt,
                "step": step,
                "world_size": world,
                "layout": layout,
                "shard_ids": [sid for sid, _ in gathered],
                "extra": json_extra,
                "extra_tensors": tensor_paths,
                "param_groups": groups,
                "files": {name: entry for _, files in gathered for name, entry in files.items()},
                "complete": True,
            }
            _commit(tmp, final, meta)
            prune(ckpt_dir, keep)
        _barrier(group)  # no rank returns before the checkpoint is published
        return final

    if background is not None:
        background.start(to_write, tmp, publish, functools.partial(_write_errors, step, tmp), planner)
        return final
    with _write_errors(step, tmp), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
        dcp.save(to_write, storage_writer=FileSystemWriter(tmp), planner=planner)
    return publish()


def _to_write(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: list[torch.Tensor],
    shard_id: str | None,
    state: RankState | None,
) -> tuple[int, dict[str, Any], SavePlanner | None]:
    """(format, the state dict DCP writes, its planner): the layout-free pieces, or format 1's rank-local
    state dicts for a caller that names undescribed shards."""
    extra = {str(i): t for i, t in enumerate(tensors)}
    if state is None and shard_id is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return (
            RANK_LOCAL_FORMAT,
            {**_wrap({"model": model_sd, "optim": optim_sd}, shard_id), "extra": extra},
            None,
        )
    state = state or RankState.of_module(model, optimizer)
    parts = state.to_save() + extra_pieces(extra)
    return LAYOUT_FREE_FORMAT, state_dict_of(parts), GlobalSavePlanner(parts)


@contextlib.contextmanager
def _write_errors(step: int, tmp: Path) -> Iterator[None]:
    """Disk full, quota, permissions (DCP raises on every rank) become a CheckpointWriteError."""
    try:
        yield
    except (OSError, CheckpointException) as e:
        raise CheckpointWriteError(
            f"could not write the checkpoint of step {step} into {tmp}: {_last_line(e)}; the previous "
            "checkpoint is intact\n    fix: free space in (or grant access to) checkpoint.dir, then resume"
        ) from None


def save_model_weights(
    ckpt_dir: Path,
    step: int,
    model: nn.Module,
    source: dict[str, Any],
    planner: SavePlanner | None = None,
) -> Path:
    """Save only ``model``'s weights as ``ckpt_dir/step_{step:08d}``, from this process alone (no collectives).

    For `tessera export`: the result holds one unsharded copy of the plain model, which `load_model_weights`
    (and so `tessera generate`) reads in any world size. ``source`` (JSON) records what it was exported from.
    Written atomically like `save_checkpoint`; it has no optimizer state, RNG streams or data position, so
    `load_checkpoint` refuses to resume from it. ``planner`` may supply the tensors as DCP writes them (a meta
    ``model`` then only names and shapes them): `tessera export` streams a sharded run's weights this way.
    """
    ckpt_dir = Path(ckpt_dir)
    final, tmp = step_dirs(ckpt_dir, step)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(ckpt_dir)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
        state = {"model": get_model_state_dict(model)}
        dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=planner, no_dist=True)
    meta = {
        "files": hash_files(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file())),
        "format": LAYOUT_FREE_FORMAT,
        "step": step,
        "world_size": 1,
        "layout": None,
        "shard_ids": [None],
        "weights_only": True,
        "exported_from": source,
        "complete": True,
    }
    commit(tmp, final, meta)
    return final


def _wrap(state: dict[str, Any], shard_id: str | None) -> dict[str, Any]:
    return state if shard_id is None else {"shards": {shard_id: state}}


def _gather(value: Any, world: int, group: dist.ProcessGroup | None = None) -> list[Any]:
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def _split_extra(extra: dict[str, Any]) -> tuple[Any, list[list[str]], list[torch.Tensor]]:
    """Split ``extra`` into a JSON tree and a list of tensors with their key paths (tensors become null)."""
    paths: list[list[str]] = []
    tensors: list[torch.Tensor] = []

    def walk(obj: Any, path: list[str]) -> Any:
        if isinstance(obj, torch.Tensor):
            paths.append(path)
            tensors.append(obj.detach())
            return None
        if isinstance(obj, dict):
            for k in obj:
                if not isinstance(k, str):
                    raise ValueError(f"extra key {k!r} at {'.'.join(path) or 'top level'} must be a string")
            return {k: walk(v, [*path, k]) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [walk(v, [*path, str(i)]) for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise ValueError(
            f"extra[{'.'.join(path)}] is a {type(obj).__name__}; checkpoints store only tensors and JSON values "
            "(numbers, strings, lists, dicts, None), never pickled objects: convert it first"
        )

    return walk(dict(extra), []), paths, tensors


def verify_checkpoint(path: Path, *, collective: bool = True) -> list[str]:
    """What is wrong with a complete checkpoint's files against the checksums in its meta.json (empty when
    intact, or when it predates checksums); collective by default, so every rank gets the same answer."""
    meta = read_meta(Path(path))
    files = meta.get("files")
    if files is None:
        return []
    if not isinstance(files, dict):
        return ["meta.json's file list is damaged"]
    return verify_files(Path(path), files, collective=collective)


# --- loading ---------------------------------------------------------------------------------------------------


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    shard_id: str | None = None,
    layout: str | None = None,
    verify: bool = True,
    state: RankState | None = None,
) -> dict[str, Any]:
    """Restore ``model`` and ``optimizer`` in place from a checkpoint folder (or the newest one in a checkpoint
    directory); collective. Returns ``extra`` as saved, plus ``"step"`` and this rank's ``"rng"`` states
    (pass the result to `restore_rng`). The files are first checked against their checksums (`verify=False`
    when the caller just did, with `verify_checkpoint`); a damaged checkpoint is a CheckpointError.

    A layout-free checkpoint loads at any layout: ``state`` (as for `save_checkpoint`) says which blocks this
    rank reads, each straight into its live tensor. ``"rng"`` is None when the world size or ``layout`` differs
    from the saved one: the saved ranks' streams belong to other coordinates (docs/checkpoints.md). A format 1
    (rank-local) checkpoint loads only at its own layout, with ``shard_id`` naming this rank's slice.
    """
    path = resolve(Path(path))
    meta = read_meta(path)
    rank, world = _rank_world()
    fmt = loadable_format(path, meta, world, layout)
    metadata = read_metadata_safely(path)
    if fmt == LAYOUT_FREE_FORMAT:
        _refuse_pickled(path, metadata)
    # pieces are read into the live tensors: refuse damage before touching them
    if verify and fmt == LAYOUT_FREE_FORMAT:
        _refuse_damaged(path, verify_checkpoint(path))
    extra_tensors = _empty_extra(metadata, len(meta.get("extra_tensors", [])))
    with _read_errors(path, verify and fmt == RANK_LOCAL_FORMAT):
        if fmt == RANK_LOCAL_FORMAT:
            _load_rank_local(path, metadata, model, optimizer, shard_id, extra_tensors, verify)
        else:
            state = state or RankState.of_module(model, optimizer)
            parts = state.to_load(has_optimizer_state(metadata)) + extra_pieces(extra_tensors)
            check_shapes(path, {p.fqn: tuple(p.size) for p in parts}, metadata)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
                reader = SafeReader(path, metadata)
                dcp.load(state_dict_of(parts), storage_reader=reader, planner=GlobalLoadPlanner(parts))
            if state.after_load is not None:
                state.after_load()
            restore_group_settings(state.optimizer, meta.get("param_groups"))
    extra = _join_extra(meta.get("extra") or {}, meta.get("extra_tensors", []), extra_tensors)
    same = meta.get("world_size") == world and (layout is None or meta.get("layout") in (None, layout))
    return {"step": meta["step"], **extra, "rng": read_rng(path, rank) if same else None}


def _refuse_pickled(path: Path, metadata: Metadata) -> None:
    """A layout-free checkpoint holds tensors only; a pickled value in one was put there by someone else."""
    pickled = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    if pickled:
        raise CheckpointError(
            f"checkpoint {path} could not be read: it holds pickled values ({', '.join(sorted(pickled)[:3])}), "
            "which a layout-free checkpoint never contains; refusing to unpickle them\n    fix: only load "
            "checkpoints you or tessera wrote, or resume from an earlier checkpoint (checkpoint.load_step)"
        )


@contextlib.contextmanager
def _read_errors(path: Path, verify: bool, *, collective: bool = True) -> Iterator[None]:
    """DCP's read failures (on every rank, or in this process alone when not ``collective``) as a
    CheckpointError, naming damaged files when ``verify``."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        # collective where the load was: DCP then fails on every rank alike
        problems = verify_checkpoint(path, collective=collective) if verify else []
        damaged = f"; the files are damaged: {'; '.join(problems[:5])}" if problems else ""
        raise CheckpointError(
            f"checkpoint {path} could not be read: {_last_line(e)}{damaged}\n    fix: check that the folder is "
            "intact (compare with another copy) or resume from an earlier checkpoint (checkpoint.load_step)"
        ) from e


def _load_rank_local(
    path: Path,
    metadata: Metadata,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    shard_id: str | None,
    extra_tensors: dict[str, torch.Tensor],
    verify: bool,
) -> None:
    """Format 1: this rank's own state dicts (``shard_id``'s), checked after the read, applied after that."""
    state = _wrap(dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True)), shard_id)
    _check_shapes(path, state, metadata)
    state["extra"] = extra_tensors
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
        dcp.load(state, storage_reader=SafeReader(path, metadata), planner=SafeLoadPlanner())
    if verify:  # checked after the read (the OS cache serves one of the two), before anything is applied
        _refuse_damaged(path, verify_checkpoint(path))
    inner = state if shard_id is None else state["shards"][shard_id]
    set_state_dict(model, optimizer, model_state_dict=inner["model"], optim_state_dict=inner["optim"])


def loadable_format(path: Path, meta: dict[str, Any], world: int, layout: str | None) -> int:
    """The format of the training checkpoint ``path`` (its ``meta``), which `load_checkpoint` can load into
    ``world`` ranks of ``layout``; a CheckpointError naming the fix if it cannot: exported weights only, a
    format this version does not know, or a format 1 checkpoint of another layout."""
    if meta.get("weights_only"):
        raise CheckpointError(
            f"checkpoint {path} holds exported weights only (no optimizer state, RNG streams or data position), "
            "so training cannot resume from it\n    fix: resume from the training checkpoint it was exported "
            "from (RUN_DIR/checkpoints)"
        )
    fmt = meta.get("format", RANK_LOCAL_FORMAT)
    if fmt not in (RANK_LOCAL_FORMAT, LAYOUT_FREE_FORMAT):
        raise CheckpointError(
            f"checkpoint {path} has format {fmt!r}, which this version of tessera does not know (it reads "
            f"{RANK_LOCAL_FORMAT} and {LAYOUT_FREE_FORMAT})\n    fix: resume it with the tessera version that wrote it"
        )
    if fmt == RANK_LOCAL_FORMAT:
        _check_layout(path, meta, world, layout)
    return fmt


def missing_model_state(path: Path, model: nn.Module, shard_id: str | None = None) -> list[str]:
    """The names in ``model``'s state dict (its parameters and persistent buffers) that checkpoint ``path`` holds
    no tensor for; empty when it covers them all. ``shard_id``: the slice of a rank-local (format 1) checkpoint
    that ``model`` is; None reads ``model.NAME``, a layout-free checkpoint's global names (``model`` then being
    the plain model, e.g. on meta) or a format 1 checkpoint without shards. Reads only the checkpoint's index,
    and is this process's answer alone: a collective caller gathers every rank's."""
    path = resolve(Path(path))
    saved = read_metadata_safely(path).state_dict_metadata
    wanted = _wrap({"model": get_model_state_dict(model)}, shard_id)
    prefix = "model." if shard_id is None else f"shards.{shard_id}.model."
    return [
        name.removeprefix(prefix)
        for name in _tensor_leaves(wanted)
        if not isinstance(saved.get(name), TensorStorageMetadata)
    ]


def require_model_state(
    path: Path,
    model: nn.Module,
    shard_id: str | None,
    described: str,
    action: str,
    done: str,
    *,
    collective: bool = True,
) -> None:
    """Refuse checkpoint ``path`` (a CheckpointError naming every missing tensor, by shard) unless it holds every
    tensor of ``model``'s state (`missing_model_state`; ``model``/``shard_id`` as there). Whoever loads it into a
    model built without initial values (export, resume) calls this first: a missing tensor would otherwise keep
    the undrawn storage. ``described``: what the model comes from, for the message (e.g. the config file);
    ``action``: what the caller does with the checkpoint ("export"), ``done``: what did not happen ("nothing was
    exported"). ``collective`` (with a process group): every rank's missing names are gathered, so every rank
    stops alike, before any load collective."""
    table = [(shard_id, missing_model_state(path, model, shard_id))]
    if collective and dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, table[0])
        table = gathered
    missing = {sid: names for sid, names in table if names}  # equal shard ids: equal state, equal names
    if not missing:
        return
    count = sum(len(names) for names in missing.values())
    listed = "; ".join(
        ("" if sid is None else f"shard {sid}: ")
        + ", ".join(names[:8])
        + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        for sid, names in sorted(missing.items(), key=lambda kv: str(kv[0]))
    )
    raise CheckpointError(
        f"checkpoint {resolve(Path(path))} holds no saved value for {count} tensor(s) of the model that "
        f"{described} describes ({listed}); {done}\n    fix: this checkpoint was written by a "
        f"different model config; {action} it with the config of the run that wrote it (that run folder's "
        "config.json)"
    )


def load_model_weights(path: Path, model: nn.Module) -> int:
    """Load only the model weights of a checkpoint into a plain ``model`` in this process; returns its step.

    For inference (``tessera generate``): optimizer state, RNG streams and data position are skipped. Any
    layout-free checkpoint loads, whatever its layout; of the rank-local format 1 only replicated (data-parallel)
    ones do, since the others' weights exist only split over the ranks that saved them.
    """
    path = resolve(Path(path))
    meta = read_meta(path)
    if is_sharded(meta):
        raise CheckpointError(
            f"checkpoint {path} holds model-parallel shards ({sorted(set(meta['shard_ids']))}); its weights "
            "exist only split over the ranks that saved it\n    fix: merge them first with `tessera export "
            f"RUN_DIR` (it starts the {meta.get('world_size')} ranks it needs), then load the export"
        )
    metadata = read_metadata_safely(path)
    state = {"model": get_model_state_dict(model)}
    _check_shapes(path, state, metadata)
    # this process alone, even where a process group exists (export, generate)
    with warnings.catch_warnings(), _read_errors(path, verify=True, collective=False):
        warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
        reader = SafeReader(path, metadata)
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    _refuse_damaged(path, verify_checkpoint(path, collective=False))
    set_model_state_dict(model, state["model"])
    return int(meta["step"])


def read_tensor(path: Path, fqn: str, metadata: Metadata | None = None) -> torch.Tensor:
    """One whole tensor of a layout-free checkpoint (``"model.blocks.0.attn.wq.weight"``), assembled from every
    rank's blocks in this process alone: a streaming export holds one tensor at a time. ``metadata``: the
    checkpoint's, when the caller reads many (`read_metadata_safely`); the caller verifies the checksums."""
    path = resolve(Path(path))
    metadata = metadata or read_metadata_safely(path)
    entry = metadata.state_dict_metadata.get(fqn)
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint {path} has no tensor {fqn!r}\n    fix: check the model settings")
    out = {fqn: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
    with warnings.catch_warnings(), _read_errors(path, verify=False):  # the caller verified the checksums
        warnings.filterwarnings("ignore", message=_NO_PG_WARNING)
        reader = SafeReader(path, metadata)
        dcp.load(out, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return out[fqn]


def _refuse_damaged(path: Path, problems: list[str]) -> None:
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {'; '.join(problems[:5])}"
            + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
            + "\n    fix: resume from an earlier checkpoint (checkpoint.load_step = N), or restore this one from a copy"
        )


def _last_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]  # DCP appends each rank's traceback
    causes = [x for x in lines if "Error:" in x or "Exception:" in x]
    return (causes or lines or [type(e).__name__])[-1]


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


def _check_layout(path: Path, meta: dict[str, Any], world: int, layout: str | None) -> None:
    """A format 1 checkpoint holds each saved rank's own slices: only the same ranks in the same layout."""
    saved_world, saved_layout = meta.get("world_size"), meta.get("layout")
    if saved_world != world or (layout is not None and saved_layout is not None and layout != saved_layout):
        raise CheckpointError(
            f"checkpoint {path} is in the rank-local format 1 (written before checkpoints became layout-free): "
            f"it holds the slices of the {saved_world} rank(s) of layout {saved_layout!r}, and this run has "
            f"{world} rank(s) in layout {layout!r}\n    fix: resume it once with {saved_world} rank(s) in the "
            "saved layout; its next checkpoint is layout-free and resumes at any layout"
        )


def _tensor_leaves(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensor leaves under DCP's flattened names ("model.0.weight", "optim.state.0.weight.exp_avg")."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_tensor_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _check_shapes(path: Path, state: dict[str, Any], metadata: Metadata) -> None:
    check_shapes(path, {name: tuple(t.shape) for name, t in _tensor_leaves(state).items()}, metadata)


def _empty_extra(metadata: Metadata, count: int) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(count):
        entry = metadata.state_dict_metadata.get(f"extra.{i}")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint lacks tensor extra.{i} listed in meta.json; it is damaged")
        out[str(i)] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return out


def _join_extra(tree: Any, paths: list[list[str]], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    for i, keys in enumerate(paths):
        node = tree
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if isinstance(node, list):
            node[int(last)] = tensors[str(i)]
        else:
            node[last] = tensors[str(i)]
    return tree
