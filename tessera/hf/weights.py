"""Weights of a Hugging Face folder by tessera name and slice, and tessera weights by HF name.

`HFCheckpoint` is a value source ``(global_name, slices) -> tensor``: asked for any slice of any tessera
parameter (global shape, plain-model name), it reads exactly those bytes with safetensors'
``safe_open(...).get_slice`` (memory-mapped), so a rank that materializes only its shard reads only its shard.
`hf_tensors` runs the mapping the other way for the export. The trainer uses the source for
``model.init = "hf:DIR"`` (`TrainingRun._value_source`); `load_init` builds one plain model from it.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessera.errors import CheckpointError
from tessera.hf.config import INDEX, SINGLE, name_problems, text_weight_names
from tessera.hf.families import TIED_HEAD, HFFamily, HFTensor, family_for_model_type, family_for_tessera
from tessera.model.build import meta_model
from tessera.model.layers import TransformerLM
from tessera.model.materialize import declare, materialize, replicated_specs

if TYPE_CHECKING:
    from tessera.config import ModelConfig

__all__ = [
    "HFCheckpoint",
    "HFPlanned",
    "hf_tensors",
    "load_init",
    "plan_tensors",
]


Slices = tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class HFPlanned:
    """One HF tensor of a concrete model: its name, shape and the tessera parameters it holds."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[str, ...]
    part_sizes: tuple[int, ...]
    """Each part's size along the HF tensor's output dimension, in order."""
    conv1d: bool

    @property
    def out_dim(self) -> int:
        """The dimension the parts are concatenated along (Conv1D weights are stored [in, out])."""
        return 1 if self.conv1d and len(self.shape) == 2 else 0


def _family(model: TransformerLM) -> HFFamily:
    fam = family_for_tessera(model.cfg.family)
    if fam is None:
        raise CheckpointError(f"model family {model.cfg.family!r} has no Hugging Face mapping")
    return fam


def plan_tensors(model: TransformerLM) -> list[HFPlanned]:
    """The HF tensors of ``model`` (plain, any device incl. meta), in the family table's order per block."""
    fam = _family(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    planned = []
    for spec in _expand(fam.tensors, model.cfg.n_layers):
        if not all(p in shapes for p in spec.parts):
            continue  # e.g. lm_head when the output projection is the (tied) embedding
        first = shapes[spec.parts[0]]
        sizes = tuple(shapes[p][0] for p in spec.parts)
        shape = (sum(sizes), *first[1:])
        if spec.conv1d and len(shape) == 2:
            shape = shape[::-1]
        planned.append(HFPlanned(spec.hf, shape, spec.parts, sizes, spec.conv1d))
    return planned


def _expand(tensors: tuple[HFTensor, ...], n_layers: int) -> Iterator[HFTensor]:
    for spec in tensors:
        if "{i}" not in spec.hf:
            yield spec
            continue
        for i in range(n_layers):
            yield HFTensor(spec.hf.format(i=i), tuple(p.format(i=i) for p in spec.parts), spec.conv1d)


def _files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (sharded via the index, or one file)."""
    index, single = folder / INDEX, folder / SINGLE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
            return {str(name): folder / str(file) for name, file in weight_map.items()}
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{index} is not a safetensors index (a JSON object with a weight_map; {type(e).__name__}: {e})"
                "\n    fix: copy the folder again, or re-save it with `save_pretrained`"
            ) from None
    if single.is_file():
        from safetensors import safe_open

        with _opened(safe_open, single) as f:
            return dict.fromkeys(f.keys(), single)
    raise CheckpointError(
        f"{folder} has neither {SINGLE} nor {INDEX}; tessera reads safetensors weights only (re-save with "
        "`save_pretrained(DIR, safe_serialization=True)`)"
    )


class HFCheckpoint:
    """A `save_pretrained` folder as a value source for ``model``'s parameters (names and global shapes of the
    plain model; ``model`` may live on the meta device). Call it as ``source(name, slices)``; close it after.
    """

    def __init__(self, folder: Path, model: TransformerLM) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise CheckpointError(
                "model.init = hf:... needs the `safetensors` package; run `pip install 'tessera[hf]'`"
            ) from None
        self.folder, self._open = Path(folder), safe_open
        self._files, self._stored = self._text_files(_files(self.folder))
        self._where: dict[str, tuple[HFPlanned, int]] = {}
        for planned in plan_tensors(model):
            offset = 0
            for part, size in zip(planned.parts, planned.part_sizes, strict=True):
                self._where[part] = (planned, offset)
                offset += size
        self._handles: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()
        self._fam = _family(model)
        self._check_names(self._fam)
        # a tied model whose folder also holds an output projection: some versions save a copy of the embedding
        # there; transformers keeps one that differs untied, so it must equal the embedding (checked as read)
        wanted = {planned.name for planned, _ in self._where.values()}
        self._tied_head = TIED_HEAD if TIED_HEAD in self._files and TIED_HEAD not in wanted else None

    def _text_files(self, files: dict[str, Path]) -> tuple[dict[str, Path], dict[str, str]]:
        """({text-only HF name: file}, {text-only name: stored name}): a multimodal folder's language-model weights
        by the names of its text-only architecture (`text_weight_names`); its vision tower and projector are left
        unread, which one warning (rank 0's) says."""
        folder_fam = _folder_family(self.folder)
        if folder_fam is None or folder_fam.text_config is None:
            return files, {n: n for n in files}
        names, skipped, mixed = text_weight_names(folder_fam, files)
        if mixed:
            raise CheckpointError(f"{self.folder}: {mixed[0]}")
        if skipped and _rank() == 0:
            kinds = sorted({next(p for p in folder_fam.not_imported if n.startswith(p)) for n in skipped})
            warnings.warn(
                f"{self.folder} is a {folder_fam.architecture} folder: importing its language model only; its "
                f"{len(skipped)} vision tower and projector weights ({', '.join(p + '*' for p in kinds)}) are not "
                f"imported (nor read), and an export writes a text-only {folder_fam.text_model_type} folder",
                stacklevel=3,
            )
        return {text: files[stored] for text, stored in names.items()}, names

    def _slice(self, hf_name: str) -> Any:
        """The lazily read (memory-mapped) safetensors slice of text-only HF tensor ``hf_name``."""
        return self._handle(hf_name).get_slice(self._stored[hf_name])

    def _check_names(self, fam: HFFamily) -> None:
        """Every tessera tensor is in the folder with its shape, and every weight of the folder is used (the
        names are checked at validation too, from config.json; here again, against the built model)."""
        wanted = {planned.name: planned for planned, _ in self._where.values()}
        problems = name_problems(self.folder, fam, set(wanted), set(self._files))
        if problems:
            raise CheckpointError("\n".join(problems))
        for name, planned in wanted.items():
            shape = tuple(self._slice(name).get_shape())
            if shape != planned.shape:
                raise CheckpointError(
                    f"{self.folder}: {name} has shape {shape}, config.json implies {planned.shape}"
                )

    def _handle(self, hf_name: str):
        path = self._files[hf_name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(_opened(self._open, path))
        return self._handles[path]

    def __call__(self, name: str, slices: Slices | None = None) -> torch.Tensor:
        """The ``slices`` (one per dimension, global coordinates; None: all) of tessera parameter ``name``, as
        a CPU fp32 tensor (bf16/fp16 files are upcast exactly)."""
        if name not in self._where:
            raise CheckpointError(f"no Hugging Face tensor maps to tessera parameter {name!r}")
        planned, offset = self._where[name]
        size = planned.part_sizes[planned.parts.index(name)]
        ndim = len(planned.shape)
        slices = tuple(slices) if slices is not None else (slice(None),) * ndim
        dims = [_bounds(s, size if d == 0 else _tessera_dim(planned, d)) for d, s in enumerate(slices)]
        # tessera dim 0 is the HF output dim; shift it to this part's rows of a fused tensor
        hf_dims = [(dims[0][0] + offset, dims[0][1] + offset), *dims[1:]]
        if planned.out_dim == 1:
            hf_dims = hf_dims[::-1]
        window = self._read(planned.name, hf_dims)
        # loaded, a NaN or inf would make the first loss NaN and stop the run as diverged, blaming the lr
        if not bool(torch.isfinite(window).all()):
            raise CheckpointError(
                f"{self._files[planned.name]}: weight {self._stored[planned.name]} holds NaN or infinite values; the file is "
                "damaged or was saved from a diverged run: use another copy or checkpoint of the model"
            )
        if self._tied_head and planned.name == self._fam.embedding:
            self._check_tied_head(window, hf_dims)
        return window.t().contiguous() if planned.out_dim == 1 else window

    def _read(self, hf_name: str, hf_dims: list[tuple[int, int]]) -> torch.Tensor:
        """The rectangle ``hf_dims`` of HF tensor ``hf_name`` as fp32."""
        window = self._slice(hf_name)[tuple(slice(a, b) for a, b in hf_dims)]
        return window.to(torch.float32)

    def _check_tied_head(self, embedding: torch.Tensor, hf_dims: list[tuple[int, int]]) -> None:
        """The saved output projection equals the embedding where this rank reads it. One that differs is a
        trained head: transformers keeps it untied (and computes other logits), tying it would drop it."""
        head = self._read(TIED_HEAD, hf_dims)
        if not torch.equal(head, embedding):
            fam = self._fam
            raise CheckpointError(
                f"{self._files[TIED_HEAD]}: {TIED_HEAD} differs from the embedding {fam.embedding}, but config.json "
                f"ties them (tie_word_embeddings true, or absent: {str(fam.tie_default).lower()} for "
                f"{fam.model_type}); transformers keeps such an output projection untied, tessera would drop it"
                '\n    fix: set "tie_word_embeddings": false in config.json to train it as its own output projection'
            )

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _folder_family(folder: Path) -> HFFamily | None:
    """The architecture a folder's config.json names (None without one: validation reported it already)."""
    from tessera.errors import ConfigError
    from tessera.hf.config import read_hf_config

    try:
        return family_for_model_type(str(read_hf_config(folder).get("model_type")))
    except ConfigError:
        return None


def _rank() -> int:
    """This process's rank (0 outside torch.distributed)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _opened(safe_open: Callable, path: Path) -> Any:
    """``safe_open(path)``; a missing, truncated or corrupt file as a CheckpointError naming it. safetensors
    reads the header and checks that it covers the whole file here, so later reads meet no such surprise."""
    from safetensors import SafetensorError

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{path} cannot be read as safetensors ({e}): the file is missing, truncated or corrupt\n    fix: "
            "copy the folder again, or re-save it with `save_pretrained(DIR, safe_serialization=True)`"
        ) from None


def _tessera_dim(planned: HFPlanned, d: int) -> int:
    """Size of tessera dimension d > 0 of a part (the HF tensor's non-output dimension)."""
    return planned.shape[0] if planned.out_dim == 1 else planned.shape[d]


def _bounds(s: slice, size: int) -> tuple[int, int]:
    start, stop, step = s.indices(size)
    if step != 1:
        raise ValueError(f"HF slices must be contiguous, got step {step}")
    return start, stop


def load_init(cfg: ModelConfig, device: torch.device | str | None = None) -> TransformerLM:
    """The plain model of ``cfg`` filled from ``cfg.init`` ("hf:DIR"): built on the meta device and
    materialised from the folder by the mechanism every rank uses for its shard (tessera.model.materialize)."""
    from tessera.hf.config import init_folder

    model = meta_model(cfg)
    with HFCheckpoint(init_folder(cfg.init), model) as source:
        declare(model, replicated_specs(model), source, device or torch.get_default_device())
        materialize(model)
    return model


def hf_tensors(model: nn.Module, get: Callable[[str], torch.Tensor]) -> Iterator[tuple[HFPlanned, Callable]]:
    """(planned HF tensor, a function building it) for ``model`` (plain; meta is fine), where ``get(name)``
    returns a full tessera parameter; the export asks for one HF tensor at a time."""
    for planned in plan_tensors(model):

        def build(planned: HFPlanned = planned) -> torch.Tensor:
            parts = [get(p).detach() for p in planned.parts]
            t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            return t.t().contiguous() if planned.out_dim == 1 else t.contiguous()

        yield planned, build
