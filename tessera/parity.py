"""Numerical parity of two layouts of one training run (`tessera compare`, docs/parity.md).

Both configs train from the same seed on the same samples for a few steps, each in its own local process group
(`tessera.train.launch.launch_local`, as ``tessera train --nproc`` starts ranks). Before every update, every
parameter's full gradient is gathered under its plain (single-device) name from whatever this rank holds — whole
tensors, tensor-parallel blocks, pipeline stages, ZeRO shards — through the geometry the layout-free checkpoints
use (`tessera.train.checkpoint.state.pieces`: ``ShardSpec.boxes`` maps any local element range to its place in
the global tensor); after every update the parameters are gathered alike. Rank 0 saves the losses, gradient
norms, gradients and parameters (a `Record`).

B runs first and also records its whole state (parameters and AdamW moments) after every step. A then starts
every step after the first from B's state, loaded into A's layout as a resume at A's layout would load it
(`RankState.to_load`): every step of A is computed from the inputs B's was, so step k's tolerances are step 0's.
Without it the runs compare trajectories, and Adam turns rounding-level gradient differences into full-size
updates (lr·sign) that compound (docs/parity.md, "Why A follows B's state").

`compare_records` sets the two side by side against `tolerance_for`'s tolerances, the repository's distributed
tests' own. Only layout and parallel settings (and the compute dtype) may differ: `check_comparable` refuses,
naming the key, anything that changes the model, the data, the optimizer or the learning rate.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.config import Config, from_dict
from tessera.errors import ConfigError, TesseraError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from tessera.train.checkpoint.state import Piece, Region
    from tessera.train.trainer import TrainingRun

__all__ = [
    "BF16",
    "FP32",
    "Record",
    "Report",
    "Tolerance",
    "check_comparable",
    "compare",
    "compare_records",
    "default_nproc",
    "record",
    "record_run",
    "run_config",
    "tolerance_for",
]

# --- what may differ ------------------------------------------------------------------------------------------

FREE_TRAIN_KEYS = frozenset(
    {
        "micro_batch",  # how the global batch is cut: the step's mean loss and gradient are the same
        "dtype",  # compared, with the looser tolerance of the two
        "grad_reduce_dtype",  # likewise (a bf16 ZeRO reduction)
        "device",
        "bucket_mb",
        "eval_every",
        "eval_batches",
        "hang_timeout_s",
        "collective_timeout_s",
        "stop_signal",
        "nonfinite",
        "max_skips",
        "fp16_init_scale",
        "skip_steps",  # which steps run, not what a step computes: compare trains each of its steps 0..N-1
    }
)
"""train keys that do not change what a step computes (the other train keys do: seed, lr and its schedule,
global_batch, AdamW's settings, grad_clip)."""
FREE_SECTIONS = frozenset({"parallel", "checkpoint", "log"})
"""Sections that may differ at will: the layout itself; compare saves no checkpoint and writes no log."""
DTYPES = ("fp32", "bf16")


def check_comparable(a: Config, b: Config) -> None:
    """Raise ConfigError naming every key whose difference makes the comparison meaningless (model, data,
    optimizer, learning rate, seed, batch) and any dtype compare has no tolerance for."""
    da, db = a.to_dict(), b.to_dict()
    problems = []
    for section in da:
        if section in FREE_SECTIONS:
            continue
        for key, va in da[section].items():
            vb = db[section].get(key)
            if va != vb and not (section == "train" and key in FREE_TRAIN_KEYS):
                problems.append(f"{section}.{key} is {va!r} in A but {vb!r} in B")
    for name, cfg in (("A", a), ("B", b)):
        if cfg.train.dtype not in DTYPES:
            problems.append(
                f"train.dtype = {cfg.train.dtype!r} in {name}: compare has tolerances for {DTYPES}"
            )
    if problems:
        raise ConfigError(
            "the two configs must differ only in layout (parallel.*, train.micro_batch, train.dtype, ...):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\n    fix: give both configs the same value, e.g. --b.train.lr=... (an override for one side only)"
        )


def default_nproc(cfg: Config) -> int:
    """The world size a config states: pipeline × context × tensor ranks × data (1 when data is left to the
    world)."""
    par = cfg.parallel
    return par.pipeline * par.context * par.tensor_ranks * (par.data or 1)


# --- tolerances -----------------------------------------------------------------------------------------------

U_BF16 = 2.0**-8
"""bf16's unit roundoff (8 significant bits, round to nearest)."""
EPS_FP32 = 2.0**-23
"""float32's machine epsilon (torch.finfo(torch.float32).eps)."""


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How far A may be from B, per quantity (docs/parity.md derives each from the repository's tests).

    The loss: ``loss_atol + loss_rtol·|loss_B|``; the gradient norm: ``norm_rtol·norm_B``. A gradient element:
    ``g_tol = grad_atol + grad_rtol·|g_B| + grad_scale·max|g_B|`` (the max over its tensor, and for a bias over its
    weight too). A parameter element after an update of learning rate lr from equal inputs:
    ``param_atol + 2·lr·g_tol/|g_B|``: AdamW's update moves by about lr times its gradient's relative change,
    doubled (for fp32's rtol that is test_zero.py's PARAM_ATOL = 2e-6 at lr 1e-2); an element whose gradient
    is within its tolerance of 0 is not bounded (Adam normalises rounding noise to a full step).

    A gradient tensor as a whole (``tensor_rtol`` > 0, fp32): ``‖A − B‖ ≤ tensor_rtol·‖B‖ + floor`` with
    ``floor = EPS_FP32·R·scale·√n`` (R: tokens per step, the length of the sum each weight gradient element is;
    scale: ``max|g_B|`` as above; n: its elements). The elementwise atol is absolute, so a relative error in a
    tensor of small gradients passes it; this bound is relative to the tensor itself, its floor the
    rounding of a length-R sum of terms of the tensor's scale (Higham's γ_R), which covers a gradient that is
    exactly zero (GPT's key bias) through its weight's scale.
    """

    name: str
    loss_rtol: float
    loss_atol: float
    norm_rtol: float
    grad_rtol: float
    grad_atol: float
    grad_scale: float
    param_atol: float
    tensor_rtol: float = 0.0


FP32 = Tolerance("fp32", 1e-5, 1e-6, 1e-4, 1e-4, 1e-5, 0.0, 1e-7, tensor_rtol=1e-4)
# bf16's elementwise bound is relative to the tensor's scale already (8u of it); its tensor check stays off
BF16 = Tolerance("bf16", 1e-2, 1e-6, 8 * U_BF16, 1e-4, 1e-5, 8 * U_BF16, 1e-7)


def tolerance_for(a: Config, b: Config) -> Tolerance:
    """bf16's when either run computes or reduces in bf16, else fp32's."""
    narrow = {a.train.dtype, b.train.dtype, a.train.grad_reduce_dtype, b.train.grad_reduce_dtype}
    return BF16 if "bf16" in narrow else FP32


# --- recording one run (every rank) ---------------------------------------------------------------------------


@dataclass
class Record:
    """One run's numbers (rank 0's; full tensors by plain name), per step."""

    layout: str
    world: int
    dtype: str
    losses: list[float] = field(default_factory=list)
    """NaN at a step `tessera train` skips for having no target (data.loss_mask, an all-prompt global batch),
    as its norm; such a step has no gradients (an empty dict) and its parameters are the ones it started from."""
    norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Before each update (after the gradients' synchronisation, before clipping)."""
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """After each update."""
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """After each update, everything a layout-free checkpoint holds (``model.*``, ``optim.state.*``); recorded
    only for the run the other follows (``keep_states``)."""
    replica_spread: float = 0.0
    """Largest difference between two ranks' copies of the same block (replicas hold the same reduced numbers: a
    larger value means they drifted apart)."""
    tokens: int = 0
    """Tokens per step (global batch × sequence length): the length of the sum each weight gradient element is,
    R of the fp32 tensor check's rounding floor (`Tolerance`)."""


def _grad_regions(run: TrainingRun) -> list[Region]:
    """This rank's gradients laid out as `RankState`'s regions lay out its parameters (same param, same start):
    the reduced ZeRO shards, or each held parameter's ``.grad`` (zeros where none)."""
    import torch

    from tessera.train.checkpoint.state import Region
    from tessera.train.steppers import DirectStepper

    stepper = run.stepper
    if stepper.zero is not None:
        out = []
        for flat in stepper.zero.flats.values():
            g = flat.grad_shard if flat.grad_shard is not None else torch.zeros_like(flat.shard)
            out += [Region(p, first, g[a:b], dict) for p, a, b, first in flat.owned()]
        return out
    params = stepper.params if isinstance(stepper, DirectStepper) else stepper.engine.parameters()
    out = []
    for p in params:
        if p.numel() == 0:
            continue
        # no gradient reads as zeros, without giving the parameter one (AdamW skips a parameter without)
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out.append(Region(p, 0, g.view(-1) if g.is_contiguous() else g.reshape(-1), dict))
    return out


def _pieces(run: TrainingRun, grads: bool = False, moments: bool = False) -> list[Piece]:
    """This rank's blocks of every global tensor: of the gradients or the parameters (``model.NAME``), with
    ``moments`` also AdamW's state (``optim.state.NAME.*``)."""
    state = run.stepper.rank_state(run.model, run.specs)
    if grads:
        state = replace(state, regions=_grad_regions(run))
    return [p for p in state.to_save() if moments or p.fqn.startswith("model.")]


def _gather_full(parts: list[Piece]) -> tuple[dict[str, torch.Tensor], float]:
    """Every rank's blocks assembled into full tensors on rank 0 by name (collective; {} elsewhere), and the
    largest difference between two ranks' copies of one block. Raises if the blocks leave an element uncovered."""
    import torch
    import torch.distributed as dist

    mine = [(p.fqn, tuple(p.size), tuple(p.offsets), p.view.detach().float().cpu().clone()) for p in parts]
    if dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(mine, everyone if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return {}, 0.0
    else:
        everyone = [mine]
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    spread = 0.0
    for blocks in everyone:
        for name, size, offsets, block in blocks:
            if name not in full:
                full[name] = torch.zeros(size)
                covered[name] = torch.zeros(size, dtype=torch.bool)
            where = _box(offsets, block.shape)
            seen = covered[name][where]
            if seen.any():
                spread = max(spread, float((full[name][where] - block)[seen].abs().max()))
            full[name][where] = block
            covered[name][where] = True
    missing = [n for n, c in covered.items() if not c.all()]
    if missing:
        raise RuntimeError(
            f"the ranks' blocks do not cover {missing[:3]}: a gap in the layout's shard geometry"
        )
    return full, spread


def _box(offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))


def _plain(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.NAME`` entries under NAME."""
    return {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")}


def _load_full(run: TrainingRun, full: dict[str, torch.Tensor]) -> None:
    """Set this rank's parameters and AdamW state to ``full``'s (global tensors by checkpoint name), as a resume
    at this layout would: each piece of `RankState.to_load` is read from its block of the global tensor."""
    import torch

    state = run.stepper.rank_state(run.model, run.specs)
    # no AdamW state in ``full``: its run has made no update yet (every step so far had no target, data.loss_mask)
    # and neither has this one (else their losses differ), so this run's own fresh optimizer state stands
    moments = any(k.startswith("optim.state.") for k in full)
    with torch.no_grad():
        for piece in state.to_load(with_moments=moments):
            if not moments and piece.fqn.startswith("optim.state."):
                continue
            piece.view.copy_(full[piece.fqn][_box(tuple(piece.offsets), tuple(piece.view.shape))])
    if state.after_load is not None:
        state.after_load()


def _scale_grad(run: TrainingRun, name: str, factor: float) -> bool:
    """Multiply the gradient of plain parameter ``name`` by ``factor`` wherever this rank holds part of it (every
    copy: replicas, pipeline copies of a tie), as a wrong gradient would be. Whether this rank held any."""
    state = run.stepper.rank_state(run.model, run.specs)
    hit = False
    for region in _grad_regions(run):
        if any(spec.name == name for spec in state.specs.get(id(region.param), [])):
            region.values.mul_(factor)
            hit = True
    return hit


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (collective under torch.distributed)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    t = torch.tensor(int(flag))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def record(
    cfg: Config,
    steps: int,
    scale_grad: tuple[str, float] | None = None,
    follow: list[dict[str, torch.Tensor]] | None = None,
    keep_states: bool = False,
) -> Record | None:
    """Train ``cfg`` for ``steps`` steps on this rank (collective under torchrun); rank 0's `Record`, None on
    the other ranks (`record_run`'s arguments). Writes no checkpoint and no metrics."""
    import torch.distributed as dist

    from tessera.train.trainer import TrainingRun, init_distributed

    rank, world = init_distributed(cfg.train.collective_timeout_s)
    run = TrainingRun(cfg, rank, world)
    try:
        out = record_run(run, steps, scale_grad, follow, keep_states)
    finally:
        run.stepper.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return out if rank == 0 else None


def record_run(
    run: TrainingRun,
    steps: int,
    scale_grad: tuple[str, float] | None = None,
    follow: list[dict[str, torch.Tensor]] | None = None,
    keep_states: bool = False,
    before_step: Callable[[int], None] | None = None,
    after_step: Callable[[int], None] | None = None,
) -> Record:
    """Train ``run`` (already built, in this process group) for steps 0..``steps``−1 and record them (collective;
    the Record is complete on rank 0 only, its tensors empty elsewhere). ``follow``: another run's
    `Record.states`; step k > 0 starts from its state after step k − 1. ``keep_states``: record this run's own
    states so. ``scale_grad`` = (plain name, factor): that gradient is scaled before each update (the sensitivity
    check of docs/parity.md). ``before_step(k)``: called right before step k computes (after any load), e.g. to
    reset counters; ``after_step(k)``: right after its update, before its parameters are gathered. A step
    without targets (data.loss_mask: an all-prompt global batch) is skipped as `tessera train` skips it
    (`Record.losses`)."""
    from tessera.train.schedule import lr_at

    cfg = run.cfg
    out = Record(
        run.layout.describe(), run.world, cfg.train.dtype, tokens=cfg.train.global_batch * cfg.model.seq_len
    )

    def hook(step: int, model: Any) -> None:
        if scale_grad is not None and not _any_rank(_scale_grad(run, *scale_grad)):
            raise TesseraError(f"--scale-grad: no rank holds a parameter {scale_grad[0]!r}")
        grads, spread = _gather_full(_pieces(run, grads=True))
        out.grads.append(_plain(grads))
        out.replica_spread = max(out.replica_spread, spread)

    for step in range(steps):
        if follow is not None and step > 0:
            _load_full(run, follow[step - 1])
        if before_step is not None:
            before_step(step)
        targets = run.target_tokens(step)
        if targets == 0:  # as `tessera train`: no target, no loss per target, so no forward or update
            loss, norm = math.nan, math.nan
            out.grads.append({})
        else:
            loss, norm = run.step(step, hook, targets)
        if after_step is not None:
            after_step(step)
        out.losses.append(loss)
        out.norms.append(norm)
        out.lrs.append(lr_at(step, cfg.train))
        state, spread = _gather_full(_pieces(run, moments=keep_states))
        out.params.append(_plain(state))
        if keep_states:
            out.states.append(state)
        out.replica_spread = max(out.replica_spread, spread)
    return out


def record_to_file(
    config_json: Path, steps: int, out: Path, scale_grad: str | None, follow: Path | None, keep_states: bool
) -> int:
    """`record` as a rank of ``tessera compare``'s launch: the config from JSON, the states to follow from a
    torch file, rank 0's Record to ``out``."""
    import torch

    cfg = from_dict(json.loads(config_json.read_text()))
    states = torch.load(follow, weights_only=True) if follow is not None else None
    result = record(cfg, steps, _parse_scale(scale_grad), states, keep_states)
    if result is not None:
        torch.save(result.__dict__, out)
    return 0


def _parse_scale(spec: str | None) -> tuple[str, float] | None:
    if spec is None:
        return None
    name, sep, factor = spec.partition("=")
    try:
        value = float(factor)
    except ValueError:
        value = math.nan
    if not sep or not name or not math.isfinite(value):
        raise TesseraError(f"--scale-grad {spec!r} must be NAME=FACTOR, e.g. blocks.0.attn.wq.weight=1.01")
    return name, value


def check_scale_grad(cfg: Config, spec: str | None) -> None:
    """Refuse a malformed ``--scale-grad`` or one naming no parameter of ``cfg``'s model, before any run."""
    parsed = _parse_scale(spec)
    if parsed is None:
        return
    from tessera.model.build import meta_model

    names = [n for n, _ in meta_model(cfg.model).named_parameters(remove_duplicate=False)]
    if parsed[0] not in names:
        raise TesseraError(
            f"--scale-grad: the model has no parameter {parsed[0]!r}; its parameters are "
            f"{', '.join(names[:6])}, ... ({len(names)} in all)"
        )


# --- launching one run ----------------------------------------------------------------------------------------


def run_config(
    cfg: Config,
    nproc: int,
    steps: int,
    workdir: Path,
    tag: str = "run",
    scale_grad: str | None = None,
    follow: Record | None = None,
    keep_states: bool = False,
) -> Record:
    """Train ``cfg`` on ``nproc`` local processes for ``steps`` steps and return rank 0's `Record` (``follow``,
    ``keep_states``: `record`'s). A failed run raises TesseraError with the launcher's exit status (its ranks'
    messages were printed already)."""
    import torch

    from tessera.train.launch import launch_local

    workdir.mkdir(parents=True, exist_ok=True)
    raw = cfg.to_dict()
    raw["checkpoint"] |= {"resume": False, "every": 0}
    raw["log"] |= {"run_dir": str(workdir / f"{tag}_run"), "progress": False, "tensorboard": False}
    config_json, out = workdir / f"{tag}.json", workdir / f"{tag}.pt"
    config_json.write_text(json.dumps(raw))
    argv = ["compare", "--record", str(out), "--config-json", str(config_json), "--steps", str(steps)]
    if scale_grad is not None:
        argv += ["--scale-grad", scale_grad]
    if follow is not None:
        torch.save(follow.states, workdir / f"{tag}.follow.pt")
        argv += ["--follow", str(workdir / f"{tag}.follow.pt")]
    if keep_states:
        argv.append("--keep-states")
    out.unlink(missing_ok=True)
    code = launch_local(nproc, argv)
    if code != 0 or not out.exists():
        err = TesseraError(
            f"run {tag} ({nproc} process(es)) failed with exit status {code}; see its message above"
        )
        err.exit_code = code or 1
        raise err
    return Record(**torch.load(out, weights_only=False))


# --- comparing two records ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One compared quantity: ``ratio`` = its largest difference over the difference allowed (≤ 1: within)."""

    step: str
    what: str
    name: str
    max_abs: float
    rel: float
    ratio: float
    note: str = ""
    tiny: bool = False
    """B's tensor is at the tolerance's absolute level (‖B‖ ≤ atol·√n: rounding noise, e.g. a key bias's
    gradient), so its relative difference says nothing; left out of `Report.max_rel`."""

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


@dataclass
class Report:
    a: Record
    b: Record
    tolerance: Tolerance
    rows: list[Row]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def worst(self, what: str | None = None) -> Row | None:
        rows = [r for r in self.rows if what is None or r.what == what]
        return max(rows, key=lambda r: r.ratio, default=None)

    def max_rel(self, what: str) -> float:
        rows = [r.rel for r in self.rows if r.what == what and not r.tiny and math.isfinite(r.rel)]
        return max(rows, default=0.0)

    def table(self, top: int = 10) -> str:
        """The per-step losses and norms, then the ``top`` tensors nearest to (or over) their tolerance."""
        lines = [f"A: {self.a.layout} ({self.a.world} process(es), {self.a.dtype})"]
        lines.append(f"B: {self.b.layout} ({self.b.world} process(es), {self.b.dtype})")
        lines.append(f"tolerances: {self.tolerance.name} (docs/parity.md)")
        lines.append(f"{'step':>5}  {'loss A':>12} {'loss B':>12}  {'grad norm A':>12} {'grad norm B':>12}")
        for k, (la, lb, na, nb) in enumerate(
            zip(self.a.losses, self.b.losses, self.a.norms, self.b.norms, strict=True)
        ):
            lines.append(f"{k:>5}  {la:12.6f} {lb:12.6f}  {na:12.6f} {nb:12.6f}")
        lines.append(
            f"{'step':>5}  {'what':<5} {'tensor':<36} {'max |A-B|':>10} {'|A-B|/|B|':>10} {'/allowed':>9}"
        )
        for r in sorted(self.rows, key=lambda r: -r.ratio)[:top]:
            flag = "" if r.ok else "  DIVERGED"
            lines.append(
                f"{r.step:>5}  {r.what:<5} {r.name:<36} {r.max_abs:10.3e} {r.rel:10.3e} {r.ratio:9.3f}{flag}"
                + (f"  ({r.note})" if r.note else "")
            )
        return "\n".join(lines)

    def verdict(self) -> str:
        bad = [r for r in self.rows if not r.ok]
        if not bad:
            w = self.worst()
            at = f"; closest: {w.what} {w.name} at {w.ratio:.2f} of its tolerance" if w else ""
            return f"parity: every quantity within the {self.tolerance.name} tolerances{at}"
        first = sorted(bad, key=lambda r: -r.ratio)[0]
        return (
            f"DIVERGED: {len(bad)} quantity(ies) over the {self.tolerance.name} tolerances; worst: step "
            f"{first.step} {first.what} {first.name} ({first.ratio:.3g}× its tolerance)"
        )


def _scalar_row(step: int, what: str, a: float, b: float, atol: float, rtol: float) -> Row:
    diff = abs(a - b)
    allowed = atol + rtol * abs(b)
    rel = diff / abs(b) if b else (0.0 if diff == 0 else math.inf)
    ratio = diff / allowed if allowed > 0 else (0.0 if diff == 0 else math.inf)
    if not (math.isfinite(a) and math.isfinite(b)):
        ratio = 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf
    return Row(str(step), what, "-", diff, rel, ratio)


def grad_scale(name: str, gb: dict[str, torch.Tensor]) -> float:
    """``max|g|`` of gradient ``name``; a bias's includes its weight's, since its rounding noise follows that
    weight's gradient (a key bias, analytically zero, is pure noise)."""
    g = gb[name]
    scale = float(g.abs().max()) if g.numel() else 0.0
    weight = name.removesuffix("bias") + "weight"
    if name.endswith(".bias") and weight in gb:
        scale = max(scale, float(gb[weight].abs().max()))
    return scale


def _grad_allowed(name: str, gb: dict[str, torch.Tensor], tol: Tolerance) -> torch.Tensor:
    """The elementwise allowance for gradient ``name`` (`Tolerance`)."""
    return tol.grad_atol + tol.grad_rtol * gb[name].abs() + tol.grad_scale * grad_scale(name, gb)


def tensor_ratio(a: torch.Tensor, b: torch.Tensor, scale: float, tokens: int, tol: Tolerance) -> float:
    """‖A − B‖ over the fp32 tensor check's allowance ``tensor_rtol·‖B‖ + EPS_FP32·R·scale·√n`` (`Tolerance`);
    0 where the check is off."""
    if not tol.tensor_rtol:
        return 0.0
    diff = float((a - b).norm())
    allowed = tol.tensor_rtol * float(b.norm()) + EPS_FP32 * max(tokens, 1) * scale * math.sqrt(b.numel())
    return diff / allowed if allowed > 0 else (0.0 if diff == 0 else math.inf)


def _tensor_row(
    step: str, what: str, name: str, a: Any, b: Any, allowed: Any, mask: Any = None, atol: float = 0.0
) -> Row:
    """A against B elementwise within ``allowed``; ``mask``: only those elements are judged (and enter the
    relative difference)."""
    if a is None or b is None or a.shape != b.shape:
        shapes = (None if a is None else tuple(a.shape), None if b is None else tuple(b.shape))
        return Row(step, what, name, math.inf, math.inf, math.inf, f"shapes A/B {shapes}")
    diff = (a - b).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    over = diff / allowed
    if mask is not None:
        over, a, b = over[mask], a[mask], b[mask]
    norm_b, norm_d = float(b.norm()), float((a - b).norm())
    rel = norm_d / norm_b if norm_b else (0.0 if norm_d == 0 else math.inf)
    ratio = float(over.max()) if over.numel() else 0.0
    if not math.isfinite(ratio) or over.isnan().any():
        ratio = math.inf
    tiny = norm_b <= atol * math.sqrt(b.numel())
    return Row(step, what, name, max_abs, rel, ratio, tiny=tiny)


def compare_records(a: Record, b: Record, tol: Tolerance) -> Report:
    """Every step's loss, gradient norm, gradients and updated parameters of A against B (B is the reference of
    relative differences)."""
    if len(a.losses) != len(b.losses):
        raise ValueError(f"A ran {len(a.losses)} steps, B {len(b.losses)}")
    rows: list[Row] = []
    for k in range(len(b.losses)):
        rows.append(_scalar_row(k, "loss", a.losses[k], b.losses[k], tol.loss_atol, tol.loss_rtol))
        rows.append(_scalar_row(k, "norm", a.norms[k], b.norms[k], 0.0, tol.norm_rtol))
        ga, gb, pa, pb = a.grads[k], b.grads[k], a.params[k], b.params[k]
        for name in sorted(set(ga) | set(gb)):
            if name not in gb or name not in ga:
                rows.append(_tensor_row(str(k), "grad", name, ga.get(name), gb.get(name), None))
                continue
            g_tol = _grad_allowed(name, gb, tol)
            row = _tensor_row(str(k), "grad", name, ga[name], gb[name], g_tol, atol=tol.grad_atol)
            # the tensor as a whole, relative to itself: sees a relative error that the elementwise atol hides
            if row.note == "":  # same shapes
                whole = tensor_ratio(ga[name], gb[name], grad_scale(name, gb), b.tokens, tol)
                if whole > row.ratio:
                    row = replace(row, ratio=whole, note="‖A−B‖ over its tensor")
            rows.append(row)
            # AdamW moves an element by about lr × its gradient's relative change (Tolerance); where the
            # gradient is within its tolerance of 0 the direction is undetermined: not judged
            p_tol = tol.param_atol + 2 * b.lrs[k] * g_tol / gb[name].abs()
            judged = g_tol < gb[name].abs()
            rows.append(_tensor_row(str(k), "param", name, pa.get(name), pb.get(name), p_tol, judged))
    if a.replica_spread or b.replica_spread:
        rows.append(_replica_row(a, b, tol))
    return Report(a, b, tol, rows)


def _replica_row(a: Record, b: Record, tol: Tolerance) -> Row:
    """Copies of one block on different ranks of one run must agree as two layouts do: within the gradient
    tolerance's absolute part (they hold the same reduced numbers)."""
    spread = max(a.replica_spread, b.replica_spread)
    who = "A" if a.replica_spread >= b.replica_spread else "B"
    return Row("any", "copy", f"replicas of run {who}", spread, math.nan, spread / tol.grad_atol)


def compare(
    a: Config,
    b: Config,
    nproc_a: int,
    nproc_b: int,
    steps: int,
    workdir: Path | None = None,
    scale_grad_b: str | None = None,
) -> Report:
    """Check that A and B are comparable, run B and then A (following B's state), and compare them: the
    library function behind ``tessera compare``."""
    check_comparable(a, b)
    a.validate(nproc_a)
    b.validate(nproc_b)
    check_scale_grad(b, scale_grad_b)
    with tempfile.TemporaryDirectory(prefix="tessera-compare-") as tmp:
        where = workdir or Path(tmp)
        rb = run_config(b, nproc_b, steps, where, "B", scale_grad_b, keep_states=steps > 1)
        ra = run_config(a, nproc_a, steps, where, "A", follow=rb if steps > 1 else None)
    return compare_records(ra, rb, tolerance_for(a, b))
