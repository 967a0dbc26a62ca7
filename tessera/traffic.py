"""Tensor-parallel traffic, one source: every collective a rank issues on its tensor group(s) for one micro-batch.

The runtime's byte counters (`comm.STATS`) are checked against these lists (tests/distributed/test_tensor_1d.py,
test_tensor_2d.py, the dry run's tests/unit/test_dryrun_formulas.py), the dry run's traffic tables sum them
(`tessera.dryrun.formula_traffic`), and the planner prices each call on the network (`tessera.planner.cost`:
`tp_comm_time_per_layer`, `embedding_time`, `logits_time`). A change to the runtime's collectives is made here once.

A `Collective` is `calls` calls of one kind on one group, each handing `nbytes` to the collective with comm.py's
conventions (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the unreduced input;
broadcast / reduce: the block), in the forward or the backward pass. Groups: "tensor" (Megatron 1D), "row" (the
Optimus row group of P_ij: same i, every j; the mesh axis TENSOR_COL) and "col" (same j; the mesh axis TENSOR_ROW).

Each collective moves its tensor in that tensor's dtype. In fp32 every one is 4 bytes; under tessera's bf16
autocast (`Plan.autocast`) a matmul's output and the gradient flowing into a matmul are bf16 (``act_bytes``),
while the residual stream, the norms' outputs, the embedding's output and their gradients stay fp32
(``stream_bytes``), and so do gradients of parameters and the loss's statistics. So a 1D entry moves the fp32
norm output (forward under SP) and its fp32 gradient (backward, without SP), an exit the bf16 partial sums and
their bf16 gradient; 2D SUMMA moves bf16 blocks and everything else fp32 (measured by the dry run,
tests/unit/test_traffic.py). ``stream_bytes`` defaults to ``act_bytes`` (one dtype everywhere).

Which Linears a block has, their biases, its norms and position table come from the family's declaration
(`tessera.model.family.FamilyPlan`, read through `ModelShape.features`). Derivations: docs/tensor-1d.md,
docs/tensor-2d.md. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the cost model's package imports this module: import its ModelShape lazily
    from tessera.planner.cost.shape import ModelShape

__all__ = [
    "BACKWARD",
    "FORWARD",
    "RING_GEMM_LANES",
    "Collective",
    "block_1d",
    "block_2d",
    "bytes_by_group",
    "comm_bytes_2d",
    "context_block",
    "context_traffic",
    "embedding_1d",
    "embedding_2d",
    "head_1d",
    "head_2d",
    "linear_2d",
    "replayed_1d",
    "replayed_2d",
    "replays_mlp_exit",
    "ring_gemm_lanes",
    "summa",
    "summa_bytes",
    "tensor_1d_comm",
    "tensor_calls",
    "times",
    "totals",
]

FORWARD, BACKWARD = "forward", "backward"
_FP32 = 4
"""Loss statistics are fp32."""

RING_GEMM_LANES = 3
"""Side streams ("lanes") a ``tp_comm_overlap`` ring issues its chunk GEMMs on, round robin, on CUDA:
min(RING_GEMM_LANES, t) for a ring of t chunks (``tessera.parallel.ring_1d``; CPU runs one lane, the current
stream). A chunk GEMM alone on one stream ends with a partly empty wave of thread blocks that the next chunk
cannot fill; chunks on different streams fill each other's tails. The value is Transformer Engine's default
pool: ``NVTE_COMM_OVERLAP_MAX_STREAMS`` = 3 in NVIDIA/TransformerEngine
``transformer_engine/common/include/transformer_engine/comm_gemm_overlap.h``, the pool
min(that, num_splits) that ``CommOverlapP2PBase::split_overlap_ag`` in
``transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp`` round-robins its chunk GEMMs over (commit
d0067d0da6cb01811b8072a7d304f0e00344ce2b). Moves no bytes: the traffic lists below do not depend on it. The
planner prices a ring's chunks on these lanes (`tessera.planner.cost.tp_overlap.ring_lanes`)."""


def ring_gemm_lanes(t: int) -> int:
    """Lanes a ring of t chunks runs its chunk GEMMs on, on CUDA: min(`RING_GEMM_LANES`, t) (the runtime's
    `ring_1d._open_lanes` and the planner's `tp_overlap.ring_lanes` both ask here)."""
    return min(RING_GEMM_LANES, t)


@dataclass(frozen=True, slots=True)
class Collective:
    """``calls`` collectives of ``kind`` on ``group``, ``nbytes`` each, in ``phase`` (see the module docstring)."""

    kind: str
    group: str
    nbytes: float
    phase: str
    calls: int = 1

    @property
    def total(self) -> float:
        return self.calls * self.nbytes


def times(calls: list[Collective], n: int) -> list[Collective]:
    """The same collectives issued ``n`` times (e.g. once per block)."""
    return [replace(c, calls=c.calls * n) for c in calls if n]


def totals(calls: list[Collective]) -> dict[tuple[str, str], tuple[int, float]]:
    """(kind, group) → (calls, bytes)."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for c in calls:
        n, b = out.get((c.kind, c.group), (0, 0))
        out[(c.kind, c.group)] = (n + c.calls, b + c.total)
    return out


def bytes_by_group(calls: list[Collective]) -> dict[tuple[str, str], float]:
    """(kind, group) → bytes."""
    return {key: nbytes for key, (_, nbytes) in totals(calls).items()}


# --- Megatron 1D (t ranks), with or without sequence parallelism -------------------------------------------------
# X = tokens·h is one hidden-state tensor. A region entry (f: identity forward, all-reduce backward) and exit
# (g: all-reduce forward, identity backward) each cost one all-reduce of X; with SP an entry all-gathers forward
# and reduce-scatters backward, an exit the reverse, and each entry's backward all-gathers its saved shard again
# (Megatron does the same rather than keep the gathered input); the replicated parameters then used on sequence
# shards all-reduce their gradients. An entry reads the stream (the norm's output: stream bytes) and its
# backward reduce-scatter sums the Linears' input gradients (compute bytes; without SP the all-reduce runs on
# the stream tensor's gradient); an exit carries a Linear's output (compute bytes). The embedding's exit carries
# the looked-up stream tensor both ways.


def _region(x: float, sp: bool, *, entry: bool, stream: float | None = None) -> list[Collective]:
    """One region boundary of Megatron 1D: an entry (f) or an exit (g). ``x``: the tensor's bytes in the
    compute dtype; ``stream``: in the stream dtype (default ``x``)."""
    stream = x if stream is None else stream
    if not sp:
        return [Collective("all_reduce", "tensor", stream if entry else x, BACKWARD if entry else FORWARD)]
    if not entry:
        return [
            Collective("all_gather", "tensor", x, BACKWARD),
            Collective("reduce_scatter", "tensor", x, FORWARD),
        ]
    return [
        Collective("all_gather", "tensor", stream, FORWARD),
        Collective("reduce_scatter", "tensor", x, BACKWARD),
        Collective("all_gather", "tensor", stream, BACKWARD),  # re-gather the saved shard
    ]


def block_1d(
    shape: ModelShape,
    tokens: float,
    sp: bool,
    act_bytes: int,
    param_bytes: int = 4,
    *,
    stream_bytes: int | None = None,
) -> list[Collective]:
    """One block: attention and MLP, each an entry and an exit region; with SP the family's replicated vectors
    (norms, row-parallel biases: `FamilyPlan.replicated_block_vectors`) all-reduce their h-sized gradients; the
    per-head q/k norms (Qwen3) all-reduce their head_dim-sized gradients with or without SP (each rank
    normalises only its heads)."""
    x, stream = _hidden(shape, tokens, act_bytes, stream_bytes)
    regions = [*_region(x, sp, entry=True, stream=stream), *_region(x, sp, entry=False)]
    out = regions + regions
    vectors = shape.features.replicated_block_vectors()
    if sp and vectors:
        out.append(Collective("all_reduce", "tensor", shape.d_model * param_bytes, BACKWARD, vectors))
    out += _head_norms(shape, "tensor", param_bytes)
    return out


def _head_norms(shape: ModelShape, group: str, nbytes: int) -> list[Collective]:
    """The per-head q/k norms' weight gradients [head_dim] summed over ``group`` (none without them)."""
    norms = len(shape.features.head_norms)
    return [Collective("all_reduce", group, shape.head_dim * nbytes, BACKWARD, norms)] if norms else []


def _hidden(
    shape: ModelShape, tokens: float, act_bytes: int, stream_bytes: int | None
) -> tuple[float, float]:
    """Bytes of one hidden-state tensor [tokens, h] in the compute and in the stream dtype."""
    x = tokens * shape.d_model
    return x * act_bytes, x * (act_bytes if stream_bytes is None else stream_bytes)


def replays_mlp_exit(shape: ModelShape) -> bool:
    """Whether full checkpointing's replay of a block runs its MLP exit (the output Linear's GEMM and, under 1D
    tensor parallelism, its all-reduce or reduce-scatter). torch.utils.checkpoint (non-reentrant) stops once the
    last tensor the block saved for backward is rebuilt: a post-norm (Gemma 2/3's ``mlp_post_norm``) saves the
    exit's output, so the replay runs the exit; otherwise nothing after the output Linear's own saved input and
    weight saves anything, and the replay stops before its GEMM (F.linear packs its inputs before it computes;
    the ring of ``tp_comm_overlap`` saves them before its ring, `checkpointing.save_early`)."""
    return shape.features.post_norms


def replayed_1d(
    shape: ModelShape, tokens: float, sp: bool, act_bytes: int, *, stream_bytes: int | None = None
) -> list[Collective]:
    """What full checkpointing replays per block before its backward: the block's forward collectives but the
    last exit's, unless a post-norm saves that exit's output (`replays_mlp_exit`)."""
    x = tokens * shape.d_model * act_bytes
    block = block_1d(shape, tokens, sp, act_bytes, stream_bytes=stream_bytes)
    forward = [c for c in block if c.phase == FORWARD]
    if replays_mlp_exit(shape):
        return forward
    last_exit = "reduce_scatter" if sp else "all_reduce"
    out, dropped = [], False
    for c in reversed(forward):
        if not dropped and c.kind == last_exit and c.nbytes == x:
            dropped = True
            continue
        out.append(c)
    return out[::-1]


def embedding_1d(
    shape: ModelShape,
    tokens: float,
    sp: bool,
    act_bytes: int,
    param_bytes: int = 4,
    *,
    stream_bytes: int | None = None,
) -> list[Collective]:
    """The vocabulary-parallel embedding's exit region (the looked-up tensor is in the stream dtype); with SP a
    learned position table (replicated, used on sequence shards) all-reduces its gradient [S, h]."""
    out = _region(_hidden(shape, tokens, act_bytes, stream_bytes)[1], sp, entry=False)
    positions = shape.features.position_params(shape.seq_len, shape.d_model)
    if sp and positions:
        out.append(Collective("all_reduce", "tensor", positions * param_bytes, BACKWARD))
    return out


def head_1d(
    shape: ModelShape,
    tokens: float,
    sp: bool,
    act_bytes: int,
    param_bytes: int = 4,
    *,
    stream_bytes: int | None = None,
) -> list[Collective]:
    """The head's entry region, the vocabulary-parallel loss (all-reduce of the row max [N], then of [Σexp,
    target] [2N], fp32) and, with SP, the final norm's replicated vectors."""
    x, stream = _hidden(shape, tokens, act_bytes, stream_bytes)
    out = _region(x, sp, entry=True, stream=stream)
    out += [
        Collective("all_reduce", "tensor", tokens * _FP32, FORWARD),
        Collective("all_reduce", "tensor", 2 * tokens * _FP32, FORWARD),
    ]
    vectors = shape.features.norm_params(1)
    if sp:
        out.append(Collective("all_reduce", "tensor", shape.d_model * param_bytes, BACKWARD, vectors))
    return out


def tensor_1d_comm(
    model_cfg: Any,
    batch: int,
    seq: int,
    t: int,
    sequence_parallel: bool,
    act_bytes: int = 4,
    param_bytes: int = 4,
    *,
    first: bool = True,
    last: bool = True,
) -> dict[str, tuple[int, int]]:
    """Collectives one forward + backward of the model (``model_cfg.n_layers`` blocks) issues on the tensor group,
    per rank: ``{kind: (calls, bytes)}``; ``first`` / ``last``: whether this rank holds the embedding and the head
    (a pipeline stage holds one, both or neither). Empty when t = 1."""
    from tessera.planner.cost.shape import ModelShape

    if t == 1:
        return {}
    shape, tokens, sp = ModelShape.from_config(model_cfg), batch * seq, sequence_parallel
    calls = times(block_1d(shape, tokens, sp, act_bytes, param_bytes), model_cfg.n_layers)
    calls += embedding_1d(shape, tokens, sp, act_bytes, param_bytes) if first else []
    calls += head_1d(shape, tokens, sp, act_bytes, param_bytes) if last else []
    return {kind: (n, round(b)) for (kind, _), (n, b) in totals(calls).items()}


# --- Optimus 2D (q×q grid, SUMMA) --------------------------------------------------------------------------------
# m local tokens per rank ((b/q)·s); K, N full feature widths; each SUMMA product runs q steps, each moving one
# block, and every member of the group counts it (comm.py's convention).


def summa(op: str, m: float, k: int, n: int, q: int, elem: int, phase: str = FORWARD) -> list[Collective]:
    """One SUMMA product. "ab": C[M,N] = A[M,K]·B[K,N]; "abt": C[M,K] = A[M,N]·B[K,N]ᵀ; "atb": C[K,N] = A[M,K]ᵀ·B[M,N].
    Activation blocks (m × K/q) move on the row group, weight blocks (K/q × N/q) on the column group."""
    if q == 1:
        return []
    act, w = m * (k // q) * elem, (k // q) * (n // q) * elem
    kinds = {
        "ab": (("broadcast", "row", act), ("broadcast", "col", w)),
        "abt": (("broadcast", "col", w), ("reduce", "row", act)),
        "atb": (("broadcast", "row", act), ("reduce", "col", w)),
    }
    if op not in kinds:
        raise ValueError(f"unknown SUMMA op {op!r}; use 'ab', 'abt' or 'atb'")
    return [Collective(kind, group, nbytes, phase, q) for kind, group, nbytes in kinds[op]]


def summa_bytes(op: str, m: int, k: int, n: int, q: int, elem: int = 4) -> dict[tuple[str, str], int]:
    """Bytes one rank hands to collectives for one SUMMA product, keyed (kind, "row" | "col")."""
    return {key: round(b) for key, b in bytes_by_group(summa(op, m, k, n, q, elem)).items()}


def linear_2d(
    m: float, k: int, n: int, q: int, bias: bool, elem: int, stream: int | None = None
) -> list[Collective]:
    """One Linear2D: AB forward; ABᵀ (input grad) and AᵀB (weight grad) backward, blocks of ``elem`` bytes; a
    bias's gradient (``stream`` bytes, default ``elem``: fp32 under autocast) is summed over the grid rows."""
    out = summa("ab", m, k, n, q, elem) + summa("abt", m, k, n, q, elem, BACKWARD)
    out += summa("atb", m, k, n, q, elem, BACKWARD)
    if bias:
        out.append(Collective("all_reduce", "col", n // q * (stream or elem), BACKWARD))
    return out


def _norm_2d(shape: ModelShape, m: float, q: int, stream: int) -> list[Collective]:
    """A norm on the grid: row sums of each local token's statistics (LayerNorm: mean and variance forward, two
    sums backward; RMSNorm: one each), and the weight (and bias) gradients summed over the grid rows; all in
    the stream dtype (the norm runs on the residual stream)."""
    stats = 2 if shape.features.norm_bias else 1
    return [
        Collective("all_reduce", "row", m * stream, FORWARD, stats),
        Collective("all_reduce", "row", stats * m * stream, BACKWARD),
        Collective("all_reduce", "col", shape.features.norm_params(shape.d_model) // q * stream, BACKWARD),
    ]


def block_2d(shape: ModelShape, m: float, q: int, elem: int, stream: int | None = None) -> list[Collective]:
    """One block: its norms (two; four with post-norms), every Linear the family declares
    (`FamilyPlan.block_linears`) and the per-head q/k norms (Qwen3: whole weights, gradients summed over the rows
    and the columns); SUMMA blocks in ``elem`` bytes, the rest in ``stream`` bytes (default ``elem``)."""
    stream = stream or elem
    out = _norm_2d(shape, m, q, stream) * len(shape.features.block_norms)  # 2, or 4 with Gemma 2's post-norms
    for lin in shape.block_linears():
        out += linear_2d(m, lin.d_in, lin.d_out, q, lin.bias, elem, stream)
    return out + _head_norms(shape, "row", stream) + _head_norms(shape, "col", stream)


def replayed_2d(
    shape: ModelShape, m: float, q: int, elem: int, stream: int | None = None
) -> list[Collective]:
    """What full checkpointing replays per block before its backward: the block's forward collectives but the
    MLP output Linear's SUMMA broadcasts, unless a post-norm saves that Linear's output (`replays_mlp_exit`).
    The replay stops once that Linear's saved input and weight are packed, before its SUMMA runs
    (`checkpointing.save_early`)."""
    forward = [c for c in block_2d(shape, m, q, elem, stream) if c.phase == FORWARD]
    if replays_mlp_exit(shape):
        return forward
    exit_ = shape.block_linears()[-1]  # the MLP's output Linear, the block's last (column before row)
    skipped = summa("ab", m, exit_.d_in, exit_.d_out, q, elem)
    for c in skipped:  # the last equal one: the exit's, the block's last forward product
        del forward[len(forward) - 1 - forward[::-1].index(c)]
    return forward


def embedding_2d(
    shape: ModelShape, m: float, seq: int, q: int, elem: int, stream: int | None = None
) -> list[Collective]:
    """The vocabulary-split embedding: partial rows reduce-scattered over the column group (all-gathered
    backward); a learned position table's gradient (h/q columns of the ``seq`` rows used) summed over the rows.
    The looked-up rows and the gradients are in the stream dtype (``stream``, default ``elem``)."""
    stream = stream or elem
    x = m * shape.d_model * stream
    out = [Collective("reduce_scatter", "col", x, FORWARD), Collective("all_gather", "col", x, BACKWARD)]
    if shape.features.has_position_embedding:
        out.append(Collective("all_reduce", "col", seq * shape.d_model // q * stream, BACKWARD))
    return out


def head_2d(shape: ModelShape, m: float, q: int, elem: int, stream: int | None = None) -> list[Collective]:
    """Final norm; logits Z = X·Eᵀ (ABᵀ, Z is [m, V padded to q]), backward dX = dZ·E (AB) and dE = dZᵀ·X (AᵀB);
    the loss all-gathers the (lse, target) pairs over the row and sums the grid rows' shares (the loss's
    statistics in the stream dtype, ``stream``, default ``elem``: fp32 under autocast)."""
    stream = stream or elem
    vpad = -(-shape.vocab_size // q) * q
    h = shape.d_model
    out = _norm_2d(shape, m, q, stream) + summa("abt", m, vpad, h, q, elem)
    out += summa("ab", m, vpad, h, q, elem, BACKWARD) + summa("atb", m, vpad, h, q, elem, BACKWARD)
    out += [
        Collective("all_gather", "row", q * 2 * m * stream, FORWARD),
        Collective("all_reduce", "col", stream, FORWARD),
    ]
    return out


def comm_bytes_2d(
    cfg: Any, batch: int, seq: int, q: int, elem: int = 4, *, first: bool = True, last: bool = True
) -> dict[tuple[str, str], int]:
    """Bytes each rank hands to collectives in one forward + backward of ``cfg.n_layers`` blocks, keyed
    (kind, "row" | "col"); m = (b/q)·s local tokens; ``first`` / ``last``: whether the rank holds the embedding
    and the head. Empty when q = 1."""
    from tessera.planner.cost.shape import ModelShape

    if q == 1:
        return {}
    shape, m = ModelShape.from_config(cfg), batch // q * seq
    calls = times(block_2d(shape, m, q, elem), cfg.n_layers)
    calls += embedding_2d(shape, m, seq, q, elem) if first else []
    calls += head_2d(shape, m, q, elem) if last else []
    return {key: round(b) for key, b in bytes_by_group(calls).items()}


# --- a layout's parts --------------------------------------------------------------------------------------------

PARTS = ("block", "replay", "embedding", "head")


def tensor_calls(shape: ModelShape, plan: Any, part: str) -> list[Collective]:
    """The tensor-parallel collectives of one micro-batch for ``plan`` (a cost-model `Plan`: tp, tp_kind, q,
    micro_batch, sequence_parallel, act_bytes, stream_bytes), for one ``part``: "block", "replay" (what full checkpointing
    replays per block), "embedding" or "head". Empty without tensor parallelism."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if plan.tp <= 1:
        return []
    b, s, e, r = plan.micro_batch, shape.seq_len, plan.act_bytes, plan.stream_bytes
    if plan.tp_kind == "2d":
        q = plan.q
        m = b // q * s if b % q == 0 else b * s / q  # local tokens (a planner may try b < q)
        return {
            "block": lambda: block_2d(shape, m, q, e, r),
            "replay": lambda: replayed_2d(shape, m, q, e, r),
            "embedding": lambda: embedding_2d(shape, m, s, q, e, r),
            "head": lambda: head_2d(shape, m, q, e, r),
        }[part]()
    n, sp = b * s // plan.cp, plan.sequence_parallel  # a context rank's s/c tokens of each sequence
    return {
        "block": lambda: block_1d(shape, n, sp, e, stream_bytes=r),
        "replay": lambda: replayed_1d(shape, n, sp, e, stream_bytes=r),
        "embedding": lambda: embedding_1d(shape, n, sp, e, stream_bytes=r),
        "head": lambda: head_1d(shape, n, sp, e, stream_bytes=r),
    }[part]()


# --- context parallelism (c ranks, all-gather K/V; docs/context-parallel.md) --------------------------------------
# Per attention layer and micro-batch, each context rank all-gathers its K and V, [b, n_kv/t, s/c, hd] each, into
# the whole sequence's [b, n_kv/t, s, hd] (the gathered output: s tokens), and in backward reduce-scatters dK and
# dV of that size (the unreduced input). K and V are matmul outputs after RoPE: compute bytes. Nothing else in a
# block crosses the context group: every other operation is per token.


def context_block(shape: ModelShape, b: int, c: int, t: int, elem: int) -> list[Collective]:
    """One block's context-group collectives for one micro-batch of ``b`` sequences on c context ranks of a
    1D tensor split t (each rank's n_kv/t heads), ``elem`` bytes per element; none when c = 1."""
    if c == 1:
        return []
    kv = b * (shape.kv_dim // t) * shape.seq_len * elem  # one of K, V gathered: [b, n_kv/t, s, hd]
    return [
        Collective("all_gather", "context", kv, FORWARD, 2),
        Collective("reduce_scatter", "context", kv, BACKWARD, 2),
    ]


def context_traffic(model: Any, b: int, c: int, t: int = 1, bytes_per_element: int = 4) -> int:
    """Bytes one micro-batch hands to each of the context group's all-gather and reduce-scatter (the two are
    equal), over every block of ``model`` (a `ModelConfig`). Full checkpointing gathers K/V once more in each
    block's replayed forward (the all-gather's bytes twice)."""
    from tessera.planner.cost.shape import ModelShape

    shape = ModelShape.from_config(model)
    calls = times(context_block(shape, b, c, t, bytes_per_element), shape.n_layers)
    return int(sum(x.total for x in calls if x.kind == "all_gather"))
