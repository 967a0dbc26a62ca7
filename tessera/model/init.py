"""Deterministic initial values: each parameter a pure function of (seed, global parameter name).

A value source is any callable ``(global_name, index) -> tensor`` returning the block ``full[index]`` of the plain
model's parameter ``global_name`` (``index``: one ``slice`` per dimension, within the parameter's shape) as a CPU
fp32 tensor. `InitSource` is the one used to start training; a checkpoint reader (e.g. Hugging Face safetensors)
can be another. Nothing here ever needs the whole model: a rank asks for exactly the blocks it holds.

How `InitSource` draws, and why every layout gets the single-device values (docs/sharded-init.md):

- parameter ``name`` of shape ``[n0, n1, ...]`` is cut into row blocks of ``rows = max(1, 2^20 // (n1·n2·…))``
  rows (a function of the shape alone, never of the layout);
- row block ``k`` is ``N(0, std²)`` drawn by a fresh ``torch.Generator`` seeded with ``hash(seed, name, k)``
  (blake2b, stable across processes and Python versions), on the CPU whatever the device;
- so any sub-block of the parameter is obtained by drawing only the row blocks it overlaps and slicing them —
  the same numbers the single-device build draws for the whole tensor, bit for bit. Norm weights are 1 and
  biases 0 without drawing.

The kind of each parameter (which std, or constant) is read from the module types of the plain model
(`init_kinds`); tied parameters answer to both of their names.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tessera.model import INIT_BLOCK_ELEMENTS

__all__ = [
    "BLOCK_ELEMENTS",
    "InitKind",
    "InitSource",
    "ValueSource",
    "block_rows",
    "draw_seed",
    "init_kinds",
    "stream_seed",
]

ValueSource = Callable[[str, tuple[slice, ...]], torch.Tensor]
"""``(global parameter name, one slice per dimension) -> that block of the full tensor`` (CPU, fp32)."""

BLOCK_ELEMENTS = INIT_BLOCK_ELEMENTS
"""Elements per row block drawn at once (4 MiB in fp32): the transient memory of drawing any slice."""


@dataclass(frozen=True, slots=True)
class InitKind:
    """How one parameter starts: ``"normal"`` with ``std``, or the constant ``"ones"`` / ``"zeros"``."""

    kind: str
    std: float = 0.0


def draw_seed() -> int:
    """An init seed drawn from the global torch RNG: ``torch.manual_seed(s)`` then building gives the same model
    every time, and consecutive builds differ, as when init drew from the global RNG directly."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu").item())


def stream_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of row block ``block`` of parameter ``name``: stable across processes and platforms."""
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def block_rows(shape: tuple[int, ...] | torch.Size) -> int:
    """Rows per drawn block for a parameter of ``shape`` (a vector is one row of its elements per element)."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(1, row))


def init_kinds(
    model: nn.Module,
    residual_outputs: tuple[str, ...],
    norm_types: tuple[type, ...],
    n_layers: int,
    std: float,
) -> dict[str, InitKind]:
    """``{name: InitKind}`` for every parameter name of ``model`` (a tied parameter under each of its names).

    Linear and Embedding weights ~ N(0, std); the residual-stream output projections (module names ending in
    ``residual_outputs``) ~ N(0, std / sqrt(2·n_layers)) as in GPT-2; biases 0; weights of ``norm_types`` 1 (0
    for an RMSNorm with an offset: Gemma's x̂·(1 + w)).
    """
    kinds: dict[str, InitKind] = {}
    by_id: dict[int, InitKind] = {}
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) not in by_id:
                # a norm computing x̂·(offset + w) (Gemma) starts at w = 0, the identity scale, as ones elsewhere
                norm = (
                    ("zeros" if getattr(module, "offset", 0.0) else "ones")
                    if isinstance(module, norm_types)
                    else None
                )
                by_id[id(p)] = _kind(norm, mod_name, pname, residual_outputs, n_layers, std)
            kinds[name] = by_id[id(p)]
    return kinds


def _kind(
    norm: str | None, mod_name: str, pname: str, residual: tuple[str, ...], n_layers: int, std: float
) -> InitKind:
    """``norm``: the constant a norm's weight starts at ("ones", or "zeros" for an offset norm), None elsewhere."""
    if norm is not None and pname == "weight":
        return InitKind(norm)
    if pname == "bias":
        return InitKind("zeros")
    if mod_name.endswith(residual):
        return InitKind("normal", std / math.sqrt(2 * n_layers))
    return InitKind("normal", std)


class InitSource:
    """The training-start `ValueSource`: any block of any parameter, drawn independently of the layout.

    ``kinds`` maps every global parameter name to its `InitKind`; ``shapes`` every name to the full shape.

    ``values=False`` (the dry run's, `tessera.dryrun.dry_run`): every read allocates exactly the tensors a
    drawing read does — the same shapes and dtypes, in the same order, freed at the same points — and writes
    nothing into them, and `tessera.model.materialize.read_local` copies nothing out of them. Under fake tensors
    there are no values to draw, only the time of drawing them (docs/dryrun.md), while the row blocks are part
    of the start-up peak the dry run reports, which must stay the real run's.
    """

    def __init__(
        self,
        kinds: dict[str, InitKind],
        shapes: dict[str, tuple[int, ...]],
        seed: int,
        *,
        values: bool = True,
    ) -> None:
        self.kinds, self.shapes, self.seed, self.values = kinds, shapes, seed, values
        self._canonical: dict[str, str] = {}

    @classmethod
    def for_model(cls, model: nn.Module, seed: int, *, values: bool = True) -> InitSource:
        """The source for a plain `TransformerLM` (meta or real), keyed by its parameter names."""
        from tessera.model.family import family_plan
        from tessera.model.layers import RMSNorm

        cfg = model.cfg
        residual = family_plan(cfg).residual_outputs
        kinds = init_kinds(model, residual, (nn.LayerNorm, RMSNorm), cfg.n_layers, cfg.init_std)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        source = cls(kinds, shapes, seed, values=values)
        for a, b in getattr(model, "tied_parameters", list)():
            source._canonical[a] = b  # one tensor, one stream: the embedding's name draws it
        return source

    def __call__(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if name not in self.kinds:
            raise KeyError(f"no parameter named {name!r} in the model being initialised")
        shape = self.shapes[name]
        bounds = [s.indices(n) for s, n in zip(index, shape, strict=True)]
        out_shape = tuple(len(range(*b)) for b in bounds)
        kind = self.kinds[name]
        if kind.kind != "normal":
            fill = 1.0 if kind.kind == "ones" else 0.0
            return torch.full(out_shape, fill, dtype=torch.float32)
        return self._normal(self._canonical.get(name, name), shape, bounds, kind.std)

    def _normal(self, name: str, shape: tuple[int, ...], bounds: list, std: float) -> torch.Tensor:
        (lo, hi, step), rest = bounds[0], tuple(slice(*b) for b in bounds[1:])
        if step != 1:
            raise ValueError(f"InitSource serves contiguous row ranges, got step {step} for {name}")
        rows = block_rows(shape)
        out = torch.empty((hi - lo, *(len(range(*b)) for b in bounds[1:])), dtype=torch.float32)
        for k in range(lo // rows, -(-hi // rows)):
            start = k * rows
            block = torch.empty((min(rows, shape[0] - start), *shape[1:]), dtype=torch.float32)
            if not self.values:
                continue  # allocated as when drawing (the start-up peak), left unwritten
            block.normal_(0.0, std, generator=torch.Generator().manual_seed(stream_seed(self.seed, name, k)))
            a, b = max(lo, start), min(hi, start + rows)
            out[a - lo : b - lo] = block[a - start : b - start][(slice(None), *rest)]
        return out
