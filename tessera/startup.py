"""Start-up memory per rank: the peak of building (or loading) a rank's model, before the first step. No torch.

Construction is sharded (docs/sharded-init.md): a rank allocates only the tensors it holds — its tensor-parallel
blocks of its pipeline stages; with ZeRO-3 only its 1/d of each stage's flat buffer (ZeRO-1/2: the whole flat
buffer, which *is* the parameters) — and fills them one parameter at a time from the value source. The build
peak is replayed here from what the code allocates, in its order (`_build_peak`):

- the RoPE tables (cos and sin, [seq_len, head_dim/2] fp32 each; Gemma 3 a second pair for its local layers);
- without ZeRO, each parameter's local tensor, which stays (`materialize.read_local`); with ZeRO, each of the
  rank's stages' flat buffer (ZeRO-3: its 1/d shard), allocated before its parameters are read into it
  (`zero.FlatStage`, `materialize.read_flat`);
- on top of what is live, while one parameter is read: one read of the value source, ≤ `INIT_BLOCK_ELEMENTS`
  global rows at a time — the answer (the read rows × the block's own width) and the drawn row block (whole
  global rows; a norm or a bias is a constant and draws none); under ZeRO-3, where a parameter's part of the
  shard begins or ends inside a local row, that row is read whole into a one-row tensor first.

The estimate is for tensor rank 0 and data rank 0 (the dry run's default ranks), whose blocks and shards are
the first ones. Loading a checkpoint (`tessera train` resuming) reads into those same tensors after torch's
state-dict helpers have created the optimizer state and zero gradients, with one tensor buffered at a time:

    load = params + grads + optimizer state (as in training, sharded by ZeRO) + the largest tensor held

Neither needs activations, so the training peak binds unless the run is tiny; `tessera memory` shows all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.config import Config
from tessera.execution import ExecutionPlan, resolve
from tessera.model import INIT_BLOCK_ELEMENTS
from tessera.model.family import LinearShape
from tessera.planner.cost import ModelShape, Plan, model_state_bytes

__all__ = ["StartupEstimate", "startup_memory"]

_FP32 = 4


@dataclass(frozen=True, slots=True)
class StartupEstimate:
    """Start-up peak bytes of the fullest pipeline rank ``stage`` (beyond the process's baseline)."""

    build: float
    """Building the model on this rank: the most allocated at once, replayed in the build's order (what stays:
    local tensors or ZeRO's flat buffers and shards, RoPE tables; one read of the value source on top)."""
    load: float
    """Loading a checkpoint into it: model state (params, grads, optimizer) + one tensor buffer."""
    held_params: float
    """Parameter bytes this rank holds after construction."""
    largest_tensor: float
    """The largest tensor this rank holds (its block of it), in bytes."""
    stage: int

    @property
    def peak(self) -> float:
        return max(self.build, self.load)

    def describe(self) -> str:
        return (
            f"start-up (pipeline rank {self.stage}): build {_fmt(self.build)}, checkpoint load "
            f"{_fmt(self.load)} (holds {_fmt(self.held_params)} of parameters; largest tensor "
            f"{_fmt(self.largest_tensor)})"
        )


def _fmt(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _largest(shape: ModelShape, plan: Plan, holds_table: bool) -> float:
    """Elements of the largest tensor block a rank holds: every matrix is split by the tensor degree (the
    vocabulary padded to it); GPT's position table stays whole under 1D tensor parallelism."""
    tp, h = plan.tp, shape.d_model
    q = plan.q
    candidates = [h * shape.ffn_hidden / tp, h * max(h, shape.q_dim, shape.kv_dim) / tp]
    if holds_table:
        candidates.append(
            -(-shape.vocab_size // tp) * h if plan.tp_kind == "1d" else -(-shape.vocab_size // q) * h / q
        )
        if shape.features.has_position_embedding:
            candidates.append(shape.seq_len * h / q)  # positions: replicated in 1D, j-th slice in 2D
    return max(candidates)


def startup_memory(
    cfg: Config, world_size: int, plan: ExecutionPlan | None = None, *, stage: int | None = None
) -> StartupEstimate:
    """The start-up peak of pipeline rank ``stage``, or of the pipeline rank that needs most, for ``cfg`` on
    ``world_size`` ranks (its stages and their blocks from the execution plan, `tessera.execution.resolve`)."""
    from tessera.memory import cost_plan, stage_params

    plan = plan or resolve(cfg, world_size, training=False)
    if stage is not None and not 0 <= stage < plan.pp:
        raise ValueError(
            f"stage = {stage} is not a pipeline rank of {plan.layout.describe()}: give 0..{plan.pp - 1}, or None "
            "for the pipeline rank that needs most"
        )
    cost = cost_plan(plan)
    shape = ModelShape.from_config(cfg.model)
    per_stage = stage_params(shape, cost, plan.stage_layers)
    ranks = range(plan.pp) if stage is None else [stage]
    best: StartupEstimate | None = None
    for rank in ranks:
        mine = plan.rank_stages(rank)
        psi = sum(per_stage[s] for s in mine)
        largest = _largest(shape, cost, holds_table=0 in mine or plan.n_stages - 1 in mine) * _FP32
        held = psi * _FP32 / (plan.zero_shard if plan.zero >= 3 else 1)
        build = _build_peak(shape, cost, plan, mine)
        load = sum(model_state_bytes(psi, plan.zero_shard, plan.zero, "fp32")) + largest
        candidate = StartupEstimate(build, load, held, largest, rank)
        if best is None or candidate.peak > best.peak:
            best = candidate
    assert best is not None  # pp >= 1
    return best


# --- the build, replayed ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Block:
    """A rank's block of one global parameter, as `tessera.model.materialize.ShardSpec` says it (tensor rank 0):
    the global ``shape``, the ``index`` range held along each global dim (counted in the padded tensor), whether
    the local tensor is the block transposed, and whether reading it draws (normal init) or fills a constant."""

    shape: tuple[int, ...]
    index: tuple[tuple[int, int], ...]
    transpose: bool = False
    drawn: bool = True

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.index)

    @property
    def local_rows(self) -> int:
        a, b = self.index[-1 if self.transpose else 0]
        return b - a

    def rows(self, start: int, stop: int) -> _Block:
        """Local rows [start, stop) (`ShardSpec.rows`)."""
        d = len(self.index) - 1 if self.transpose else 0
        index = list(self.index)
        index[d] = (self.index[d][0] + start, self.index[d][0] + stop)
        return _Block(self.shape, tuple(index), self.transpose, self.drawn)


def _split(
    shape: tuple[int, ...], parts: dict[int, int], transpose: bool = False, drawn: bool = True
) -> _Block:
    """Block 0 of ``parts[d]`` along each global dim d (padded to a multiple), other dims whole
    (`ShardSpec.split` at tensor rank 0)."""
    index = tuple((0, -(-n // parts.get(d, 1))) for d, n in enumerate(shape))
    return _Block(shape, index, transpose, drawn)


def _read_bytes(block: _Block) -> int:
    """The most one read of ``block`` adds on top of its destination (`materialize.read_local` over
    `InitSource`): per row block of the global parameter (``rows`` rows of INIT_BLOCK_ELEMENTS), the answer
    (those of its rows in the block × the block's real width) and, drawn, the whole row block."""
    real = [(a, min(b, n)) for (a, b), n in zip(block.index, block.shape, strict=True)]
    if any(b <= a for a, b in real):
        return 0  # all padding: nothing is read
    (lo, hi), width = real[0], math.prod(b - a for a, b in real[1:])
    row = math.prod(block.shape[1:])
    step = max(1, INIT_BLOCK_ELEMENTS // max(1, row))  # `tessera.model.init.block_rows`
    first, last = lo // step, (hi - 1) // step
    most = 0
    for k in {first, min(first + 1, last), last}:  # the first, an inner (all alike) and the last row block
        answer = (min(hi, (k + 1) * step) - max(lo, k * step)) * width
        drawn = min(step, block.shape[0] - k * step) * row if block.drawn else 0
        most = max(most, answer + drawn)
    return most * _FP32


def _flat_read_bytes(block: _Block, first: int, count: int) -> int:
    """The most `materialize.read_flat` adds while it writes the local elements [first, first + count) into a
    flat buffer: whole local rows read in place, a partial row through a one-row tensor."""
    width = block.numel // block.local_rows
    last, pos, most = first + count, first, 0
    while pos < last:
        row = pos // width
        if pos == row * width and last >= (row + 1) * width:
            end = last // width
            most = max(most, _read_bytes(block.rows(row, end)))
            pos = end * width
        else:
            most = max(most, width * _FP32 + _read_bytes(block.rows(row, row + 1)))
            pos = min(last, (row + 1) * width)
    return most


def _stage_blocks(shape: ModelShape, plan: Plan, n_stages: int, stage: int, layers: int) -> list[_Block]:
    """The blocks of global stage ``stage`` (``layers`` transformer blocks), in the model's parameter order:
    the embedding tables on stage 0, each block's norms and Linears, the final norm and the head on the last."""
    fam, h = shape.features, shape.d_model
    two_d = plan.tp_kind == "2d" and plan.tp > 1
    t, q = plan.tp, plan.q if two_d else 1

    def vector(n: int, split: bool = True) -> _Block:  # norms and biases: constants, never drawn
        parts = {0: q} if two_d else {}
        return _split((n,), parts if split else {}, drawn=False)

    def norm(n: int = h) -> list[_Block]:
        return [vector(n)] + ([vector(n)] if fam.norm_bias else [])

    def table(rows: int) -> _Block:  # token table and untied head: vocabulary by the tensor degree (2D: i, j)
        return _split((rows, h), {0: q, 1: q} if two_d else {0: t})

    def linear(lin: LinearShape) -> list[_Block]:
        weight = (lin.d_out, lin.d_in)
        if two_d:  # the transposed weight's block (i, j), its bias split by j
            out = [_split(weight, {0: q, 1: q}, transpose=True)]
            return out + ([vector(lin.d_out)] if lin.bias else [])
        column = lin.role == "column"
        out = [_split(weight, {0: t} if column else {1: t})]
        return out + ([_split((lin.d_out,), {0: t} if column else {}, drawn=False)] if lin.bias else [])

    linears = {lin.name: lin for lin in shape.block_linears()}
    attention = [f"attn.{n}" for n in fam.attention_in] + [f"attn.{fam.attention_out}"]
    mlp = [f"mlp.{n}" for n in fam.mlp_in] + [f"mlp.{fam.mlp_out}"]
    block = norm() + [b for name in attention for b in linear(linears[name])]
    block += [vector(shape.head_dim, split=False) for _ in fam.head_norms]  # per-head q/k norms: whole
    block += norm() + [b for name in mlp for b in linear(linears[name])]
    block += [b for _ in fam.block_norms[2:] for b in norm()]  # Gemma 2's post-norms, last in the block
    out: list[_Block] = []
    if stage == 0:
        out.append(table(shape.vocab_size))
        if fam.has_position_embedding:  # 1D: whole; 2D: the hidden dim by j
            out.append(_split((shape.seq_len, h), {1: q} if two_d else {}))
    out += block * layers
    if stage == n_stages - 1:
        out += norm()
        if not shape.tied or plan.pp > 1:  # tied on one pipeline rank: the embedding's own tensor
            out.append(table(shape.vocab_size))
    return out


def _rope_bytes(shape: ModelShape) -> tuple[int, int]:
    """The RoPE buffers every rank allocates with its model: cos and sin, [seq_len, head_dim / 2] each, in the
    first block's attention; Gemma 3 a second pair for its local layers (the model's last module)."""
    fam = shape.features
    pair = 2 * shape.seq_len * (shape.head_dim // 2) * _FP32
    return (pair if fam.rope else 0), (pair if fam.local_attention else 0)


def _direct_peak(
    shape: ModelShape, cost: Plan, plan: ExecutionPlan, stages: list[int], rope: int, local_rope: int
) -> float:
    """Without ZeRO, `materialize` walks the whole model's modules in order and allocates each local tensor,
    reads into it and keeps it, and every buffer where its module is: the embedding's tables (or, tied on another
    pipeline rank than the head, the head's copy, which is the embedding's Parameter), the RoPE tables, this
    rank's blocks, the head, Gemma 3's local RoPE tables last."""
    per_stage = [_stage_blocks(shape, cost, plan.n_stages, s, plan.stage_layers[s]) for s in stages]
    blocks = [b for stage in per_stage for b in stage]
    if shape.tied and plan.pp > 1 and plan.n_stages - 1 in stages:
        blocks.insert(0, blocks.pop())  # the tied copy: at the embedding's place in module order
    first_block = 0
    if 0 in stages:
        first_block = 1 + shape.features.has_position_embedding
    elif shape.tied and plan.pp > 1 and plan.n_stages - 1 in stages:
        first_block = 1
    live = peak = 0
    for i, block in enumerate(blocks):
        if i == first_block:
            live += rope
        live += block.numel * _FP32
        peak = max(peak, live + _read_bytes(block))
    if first_block >= len(blocks):
        live += rope
    return float(max(peak, live + local_rope))


def _build_peak(shape: ModelShape, cost: Plan, plan: ExecutionPlan, stages: list[int]) -> float:
    """The most a pipeline rank holding ``stages`` has allocated while it builds (module docstring): what stays
    (local tensors, or ZeRO's flat buffers and shards) as it is allocated, plus each parameter's read on top."""
    rope, local_rope = _rope_bytes(shape)
    if not plan.zero:
        return _direct_peak(shape, cost, plan, stages, rope, local_rope)
    live = peak = rope + local_rope  # ZeRO: every buffer is allocated before the first flat buffer
    # before them each parameter is made at its local size and freed at once, its storage resized to 0
    # (`materialize._real_parameter` with defer: a tensor of that shape cannot be made without its storage), so
    # the largest one is a moment of its own (megatron-1t, t8: the token table's [12800, 25600] fp32, 1.25 GiB)
    blocks_of = {s: _stage_blocks(shape, cost, plan.n_stages, s, plan.stage_layers[s]) for s in stages}
    largest = max((b.numel for blocks in blocks_of.values() for b in blocks), default=0)
    peak = max(peak, live + largest * _FP32)
    d = plan.zero_shard
    for s in stages:
        blocks = blocks_of[s]
        numel = sum(b.numel for b in blocks)
        padded = -(-max(numel, 1) // d) * d
        # ZeRO-1/2, or one shard: the whole flat buffer; ZeRO-3: data rank 0's first 1/d of it
        shard = padded // d if plan.zero >= 3 and d > 1 else padded
        live += shard * _FP32
        offset = 0
        for block in blocks:
            part = min(block.numel, shard - offset)
            if part <= 0:
                break
            peak = max(peak, live + _flat_read_bytes(block, 0, part))
            offset += block.numel
    return float(peak)
