"""Write a tessera model as a Hugging Face folder: config.json, safetensors shards (+ index), tokenizer files.

Streaming: the shard plan (names, shapes, byte offsets) comes from the model's shapes alone, so each shard's
safetensors header is written first and then one tensor at a time is built, written and dropped; the writer
holds at most one HF tensor beyond what ``get`` holds. The safetensors layout (8-byte little-endian header
length, JSON header with dtype/shape/data_offsets, then the raw little-endian bytes) is the published format
of the `safetensors` project. Files go to a temporary sibling folder renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from tessera.config import Config
from tessera.errors import CheckpointError, why_unwritable
from tessera.hf.config import hf_config, init_folder, read_hf_config
from tessera.hf.weights import INDEX, SINGLE, HFPlanned, hf_tensors
from tessera.model.build import meta_model

__all__ = ["MAX_SHARD_BYTES", "TOKENIZER_FILES", "save_hf"]

MAX_SHARD_BYTES = 5 * 10**9
"""Largest safetensors file written (5 GB, as `save_pretrained`'s default), unless one tensor is larger."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""Files of a tokenizer folder copied into an export."""

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def save_hf(
    out: Path,
    cfg: Config,
    get: Callable[[str], torch.Tensor],
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write ``cfg``'s model as an HF folder ``out``; ``get(name)`` returns the full tessera parameter ``name``.

    The tokenizer files are copied when the run used a tokenizer (``data.tokenizer`` a folder or a
    tokenizer.json), and config.json starts from the imported folder's when ``model.init`` names one."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "exists and is not empty"
        raise CheckpointError(f"{out} {what}; pass a new folder to --out or remove it")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:  # a path component is a file, or no permission
        raise CheckpointError(
            f"cannot write --out {out}: {why_unwritable(tmp, e)}; pass --out in a writable folder"
        ) from None
    try:
        _write_folder(tmp, cfg, get, dtype, max_shard_bytes)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:  # no half-written folder is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_folder(
    tmp: Path, cfg: Config, get: Callable[[str], torch.Tensor], dtype: torch.dtype, max_shard_bytes: int
) -> None:
    """The files of `save_hf`'s folder, written into ``tmp``."""
    tensors = list(hf_tensors(meta_model(cfg.model), get))
    shards = _plan_shards([p for p, _ in tensors], _DTYPES[dtype], dtype.itemsize, max_shard_bytes)
    builders = {p.name: build for p, build in tensors}
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        file = SINGLE if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(tmp / file, shard, lambda n: builders[n]().to(dtype))
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
    base = _init_config(cfg)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    config = hf_config(cfg.model, base, name)
    eot = _data_eot(cfg) if base is None else None  # an imported folder's config keeps its own token ids
    if eot is not None:
        config["eos_token_id"] = config["bos_token_id"] = eot
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(cfg, tmp)


def _data_eot(cfg: Config) -> int | None:
    """The end-of-text id the run's documents end with: the first token file's metadata (``tessera prepare``
    records it, --eot-token included), else the tokenizer's own (the byte tokenizer's is 0). Without it the
    transformers config classes default to GPT-2's 50256 or Llama's 2 — an id past a small vocabulary, or an
    ordinary token — and ``generate`` never stops or stops at the wrong token. It is also the BOS: in the
    training stream every document but the first follows it. None when neither can be read."""
    from tessera.errors import DataError
    from tessera.train.data import read_token_meta
    from tessera.train.tokenizer import load_tokenizer

    for path, _ in cfg.data.sources():
        try:
            eot = read_token_meta(path).get("eot")
        except DataError:  # the data need not travel with the run folder
            continue
        if eot is not None:
            return int(eot)
    try:
        return load_tokenizer(cfg.data.tokenizer).eot
    except DataError:
        return None


def _plan_shards(planned: list[HFPlanned], code: str, itemsize: int, max_bytes: int) -> list[dict[str, dict]]:
    """Shards in table order: name -> safetensors header entry; a new shard when the next tensor would overflow."""
    shards: list[dict[str, dict]] = [{}]
    offset = 0
    for p in planned:
        nbytes = itemsize * _numel(p.shape)
        if shards[-1] and offset + nbytes > max_bytes:
            shards.append({})
            offset = 0
        shards[-1][p.name] = {
            "dtype": code,
            "shape": list(p.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_shard(path: Path, header: dict[str, dict], build: Callable[[str], torch.Tensor]) -> int:
    """Write one safetensors file, building its tensors one at a time; returns its data bytes."""
    blob = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, entry in header.items():
            t = build(name).detach().to("cpu").contiguous()
            if list(t.shape) != entry["shape"]:
                raise CheckpointError(f"export: {name} has shape {tuple(t.shape)}, expected {entry['shape']}")
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return max((e["data_offsets"][1] for e in header.values()), default=0)


def _init_config(cfg: Config) -> dict | None:
    """The imported folder's config.json (to keep the keys tessera does not own), if it is still there."""
    if not cfg.model.init:
        return None
    folder = init_folder(cfg.model.init)
    return read_hf_config(folder) if (folder / "config.json").is_file() else None


def _copy_side_files(cfg: Config, tmp: Path) -> None:
    """Tokenizer files of the run's tokenizer, and the imported folder's generation_config.json."""
    spec = cfg.data.tokenizer
    if spec != "byte":
        src = Path(spec)
        if src.is_dir():
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp / name)
        elif src.is_file():
            shutil.copy2(src, tmp / "tokenizer.json")
    if cfg.model.init:
        gen = init_folder(cfg.model.init) / "generation_config.json"
        if gen.is_file():
            shutil.copy2(gen, tmp / gen.name)
