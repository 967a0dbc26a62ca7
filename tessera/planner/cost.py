"""Analytical cost model: FLOPs, compute time, collective time, communication volume and memory per rank.

Every formula is written in the docstring of the function that computes it, with its source; the derivations and
the validation against published measurements are in docs/cost-model.md. Symbols: L layers, h hidden size, a query
heads, g key/value heads, f MLP hidden size, V vocabulary, s sequence length, b micro-batch (sequences), t 1D tensor
degree, q×q the 2D (Optimus/SUMMA) grid, p pipeline stages, v model chunks per pipeline rank, d data-parallel
degree, m micro-batches per step per pipeline.

Step-time pieces are separately callable so a pipeline simulator can place them on a timeline:
`layer_time` (per-layer forward/backward/recompute compute), `stage_time` (one pipeline stage, one micro-batch,
including exposed tensor-parallel communication), `p2p_time_per_microbatch` (one stage boundary, one direction),
`dp_time` (per-stage data-parallel reduction), `tp_comm_time_per_layer` (exposed tensor-parallel time).
Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from tessera.modes import CHECKPOINTING
from tessera.planner.gemm import gemm_call_time, plateau_time
from tessera.planner.hardware import DTYPE_BYTES, Hardware
from tessera.planner.network import (
    MEGATRON_ORDER,
    Placement,
    axis_stride,
    bus_bandwidth,
    collective_time,
    placement,
)

__all__ = [
    "CommVolume",
    "LayerTime",
    "MemoryBreakdown",
    "ModelShape",
    "Plan",
    "activation_bytes_per_layer",
    "all_gather_time",
    "all_reduce_time",
    "broadcast_time",
    "dp_collective_times",
    "dp_time",
    "dp_volume",
    "elementwise_bytes_per_layer",
    "embedding_time",
    "gemm_time",
    "group_bandwidth",
    "group_placement",
    "hardware_flops_per_token",
    "layer_forward_flops",
    "layer_time",
    "layers_per_stage",
    "logits_forward_flops",
    "logits_time",
    "memory_per_rank",
    "model_flops_per_token",
    "model_state_bytes",
    "narayanan_flops_per_iteration",
    "narayanan_params",
    "p2p_time",
    "p2p_time_per_microbatch",
    "params_per_rank",
    "pp_p2p_volume",
    "reduce_scatter_time",
    "stage_time",
    "tp1d_layer_volume",
    "tp2d_layer_volume",
    "tp_comm_time_per_layer",
]

RECOMPUTE = CHECKPOINTING
"""Activation recomputation modes: the checkpointing modes of `tessera.modes`."""
OPTIMIZER_BYTES_PER_PARAM = 32
"""HBM traffic of one fused mixed-precision Adam step per parameter: read grad 2 + master 4 + m 4 + v 4, write
master 4 + m 4 + v 4 + param 2 (= 28) plus ≈4 for unscale/norm. Assumption (documented in docs/cost-model.md)."""
LOGIT_ELEMENTWISE_BYTES = 10
"""HBM bytes per logit element in the forward loss (fp32 upcast write, max/sum-exp reads); backward 2×. Assumption."""


# ---------------------------------------------------------------------------------------------------------------
# Model shape and FLOPs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelShape:
    """The parts of a model configuration that the cost model needs.

    GPT style (`swiglu=False`): LayerNorm with bias, biased linears, GELU MLP, learned positions.
    Llama style (`swiglu=True`): RMSNorm, no biases, SwiGLU MLP (3 matrices), rotary positions.
    """

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int
    swiglu: bool = False
    tied: bool = True
    dropout: bool = False
    """Dropout layers present (adds 1-byte masks to activation memory and HBM traffic, Korthikanti's accounting)."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) and n_heads by "
                f"n_kv_heads ({self.n_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Weights + biases + norm parameters of one block. GPT with f = 4h, g = a: 12h² + 13h (Narayanan eq. 2)."""
        h, kv, f = self.d_model, self.kv_dim, self.ffn_hidden
        attn = h * (h + 2 * kv) + h * h
        mlp = (3 if self.swiglu else 2) * h * f
        if self.swiglu:
            return attn + mlp + 2 * h  # two RMSNorm weights
        return attn + mlp + (h + 2 * kv) + h + f + h + 4 * h  # biases (qkv, proj, fc1, fc2) + two LayerNorms

    def embedding_params(self) -> int:
        """Token embedding (+ learned positions for GPT) (+ untied output head) + final norm."""
        h = self.d_model
        n = self.vocab_size * h + (0 if self.swiglu else self.seq_len * h)
        n += 0 if self.tied else self.vocab_size * h
        return n + (h if self.swiglu else 2 * h)

    def n_params(self) -> int:
        """Total parameter count."""
        return self.n_layers * self.layer_params() + self.embedding_params()

    def n_params_non_embedding(self) -> int:
        """Parameters outside embeddings/head (Kaplan's N): L × layer_params."""
        return self.n_layers * self.layer_params()

    @classmethod
    def from_config(cls, obj: Any) -> ModelShape:
        """Duck-typed from an object with n_layers, d_model, n_heads, vocab_size, seq_len and optionally
        n_kv_heads (None ⇒ n_heads), ffn_hidden (None ⇒ 4h, or Llama's 8h/3 rounded up to 64), family
        ("llama" ⇒ swiglu), swiglu, tie_embeddings/tied, dropout (a rate > 0 ⇒ True)."""
        h = int(obj.d_model)
        swiglu = bool(getattr(obj, "swiglu", getattr(obj, "family", "gpt") == "llama"))
        ffn = getattr(obj, "ffn_hidden", None)
        if not ffn:
            ffn = 64 * -(-(8 * h // 3) // 64) if swiglu else 4 * h
        tied = getattr(obj, "tie_embeddings", getattr(obj, "tied", True))
        return cls(
            n_layers=int(obj.n_layers),
            d_model=h,
            n_heads=int(obj.n_heads),
            n_kv_heads=int(getattr(obj, "n_kv_heads", None) or obj.n_heads),
            ffn_hidden=int(ffn),
            vocab_size=int(obj.vocab_size),
            seq_len=int(obj.seq_len),
            swiglu=swiglu,
            tied=bool(tied),
            dropout=bool(getattr(obj, "dropout", 0) or 0),
        )


def layer_forward_flops(shape: ModelShape, tokens: float, *, attention: bool = True) -> float:
    """Matmul FLOPs of one block's forward on `tokens` tokens (sequences of length s, full attention).

    2·T·[h(h + 2·kv) + h² + c·h·f] + 4·T·s·h, c = 3 for SwiGLU else 2. GPT (kv = h, f = 4h): 24Th² + 4Tsh,
    Narayanan 2021 Appendix (per layer 24Bsh² + 4Bs²h). Attention scores and A·V: 2·T·s·h each (`attention`).
    """
    h, kv, f, s = shape.d_model, shape.kv_dim, shape.ffn_hidden, shape.seq_len
    dense = 2 * tokens * (h * (h + 2 * kv) + h * h + (3 if shape.swiglu else 2) * h * f)
    return dense + (4 * tokens * s * h if attention else 0.0)


def logits_forward_flops(shape: ModelShape, tokens: float) -> float:
    """Output projection forward: 2·T·h·V."""
    return 2 * tokens * shape.d_model * shape.vocab_size


def model_flops_per_token(shape: ModelShape) -> float:
    """Model FLOPs per token for forward + backward (backward = 2× forward), no recomputation (MFU convention).

    = 3·(L·layer_fwd + logits_fwd) per token. GPT: 72Lh²(1 + s/(6h) + V/(12Lh)) (Korthikanti eq. 7); general
    GQA/SwiGLU: 12Lh²[(1 + g/a + s/h) + (f/h)(3/2 if SwiGLU else 1) + V/(2Lh)] (Megatron-Core, §1.5).
    """
    return 3 * (shape.n_layers * layer_forward_flops(shape, 1) + logits_forward_flops(shape, 1))


def hardware_flops_per_token(shape: ModelShape, recompute: str = "full") -> float:
    """FLOPs actually executed per token: model FLOPs plus the recomputed forward.

    full: + L·layer_fwd → GPT 96Lh²(1 + s/(6h) + V/(16Lh)) (Narayanan eq. 3 per token);
    selective: + the recomputed attention forward (QKᵀ and A·V) 4sh per layer → 72Lh²(1 + 2s/(9h) + V/(12Lh)).
    Note Korthikanti eq. 8 writes 72Lh²(1 + s/(3h) + ...), i.e. +12sh per layer (their "2.7 % extra" for GPT-3);
    we count only the replayed forward GEMMs. The difference is ≤ 2 % of total FLOPs for s ≤ h.
    """
    _check_recompute(recompute)
    extra = 0.0
    if recompute == "full":
        extra = shape.n_layers * layer_forward_flops(shape, 1)
    elif recompute == "selective":
        extra = shape.n_layers * 4 * shape.seq_len * shape.d_model
    return model_flops_per_token(shape) + extra


def narayanan_flops_per_iteration(batch: int, seq_len: int, n_layers: int, hidden: int, vocab: int) -> float:
    """Narayanan 2021 eq. 3: F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) (includes the recompute forward)."""
    b, s, l, h, v = batch, seq_len, n_layers, hidden, vocab
    return 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))


def narayanan_params(seq_len: int, n_layers: int, hidden: int, vocab: int) -> float:
    """Narayanan 2021 eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    l, h = n_layers, hidden
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


# ---------------------------------------------------------------------------------------------------------------
# Parallel plan
# ---------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """One parallel layout + execution choice, as the cost model sees it (no ranks, no groups).

    Rank order for topology: `rank_order`, outermost first; tensor is innermost in both orders used (1D stride 1;
    2D rows stride 1, columns stride q). Default: Megatron's order (data stride t, pipeline stride t·d); the
    search plans tessera runs with `network.TESSERA_ORDER` (`tessera.layout`: pipeline stride t, data t·p).
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    """Tensor ranks per replica: t for 1D, q² for 2D."""
    tp_kind: str = "1d"
    """"1d" (Megatron) or "2d" (Optimus/SUMMA on a q×q grid, tp = q²)."""
    sequence_parallel: bool = False
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved / looped schedules)."""
    zero_stage: int = 0
    micro_batch: int = 1
    n_microbatches: int = 1
    recompute: str = "none"
    accumulation: str = "layered"
    """"layered" (breadth-first: one DP reduction per layer per step) or "depth_first"."""
    dtype: str = "bf16"
    flash_attention: bool = False
    """Fused attention: no s×s score tensor in HBM (drops the 5as/h activation term and its traffic)."""
    rank_order: tuple[str, ...] = MEGATRON_ORDER
    """Parallel axes outermost first ("data", "pipe", "tensor"): decides which groups share a node."""
    stage_layers: tuple[int, ...] | None = None
    """Blocks per global stage (p·v entries, 0 allowed), as the trainer's `parallel.stage_layers`; None: an
    even split, which requires p·v to divide the layer count (`layers_per_stage`)."""

    @property
    def q(self) -> int:
        """Side of the 2D grid (1 for 1D)."""
        if self.tp_kind != "2d":
            return 1
        q = round(self.tp**0.5)
        if q * q != self.tp:
            raise ValueError(
                f"2D tensor parallelism needs tp = q² (got tp={self.tp}); use tp in 1, 4, 9, 16, ..."
            )
        return q

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


# ---------------------------------------------------------------------------------------------------------------
# Compute time
# ---------------------------------------------------------------------------------------------------------------


def gemm_time(hw: Hardware, m: float, n: float, k: float, *, batch: float = 1, dtype: str = "bf16") -> float:
    """Roofline time of a (batched) GEMM [m×k]·[k×n] with the size curve: max(F / (peak·η(F)), bytes / HBM
    bandwidth), F = 2·m·n·k·batch, η = hw.efficiency(F) (`gemm.plateau_time`). The compute-time functions below
    price GEMMs with `gemm.gemm_call_time`, which uses this only for hardware without an SM count."""
    return plateau_time(hw, m, n, k, batch=batch, dtype=dtype)


@dataclass(kw_only=True, slots=True, frozen=True)
class LayerTime:
    """Seconds for one block and one micro-batch on one rank."""

    forward: float
    backward: float
    """Backward without recompute (≈ 2× forward)."""
    recompute: float
    """Extra forward work replayed before backward (0, attention part, or a full forward)."""


def elementwise_bytes_per_layer(shape: ModelShape, plan: Plan) -> float:
    """HBM bytes moved by the memory-bound (non-GEMM) ops of one block's forward, per rank, per micro-batch.

    Per token-hidden element (×s·b·h): two norms 4 each (read+write 2-byte tensors); residual adds 6 each, 7 with
    fused bias-dropout-add (1-byte mask); activation: GELU 4f/h, SwiGLU 6f/h; rotary 4(h+kv)/h (Llama). Softmax on
    the a·s² scores: 4 bytes per score, 9 with dropout (+read/write/mask) unless flash attention. Replicated ops
    (norms, residuals) are divided by t only with sequence parallelism (always by q² in 2D); the rest by t or q².
    Backward is taken as 2× these bytes. (Op-by-op count of Megatron's fused kernels; an approximation.)
    """
    s, b, h, a, f = shape.seq_len, plan.micro_batch, shape.d_model, shape.n_heads, shape.ffn_hidden
    sbh = s * b * h
    replicated = 8 + 2 * (7 if shape.dropout else 6)
    sharded = (6 * f / h + 4 * (h + shape.kv_dim) / h) if shape.swiglu else 4 * f / h
    scores = 0.0 if plan.flash_attention else (9 if shape.dropout else 4) * a * s * s * b
    div_rep = plan.tp if (plan.tp_kind == "2d" or plan.sequence_parallel) else 1
    return sbh * replicated / div_rep + (sbh * sharded + scores) / plan.tp


def layer_time(shape: ModelShape, hw: Hardware, plan: Plan) -> LayerTime:
    """Compute seconds of one block for one micro-batch on one rank (communication excluded).

    Each linear [M×h_in]·[h_in×h_out] (M = b·s) runs at its own size: 1D splits the output (column-parallel) or the
    input (row-parallel) dimension by t; 2D runs q SUMMA steps of [M/q × h_in/q]·[h_in/q × h_out/q]. Attention
    score and A·V GEMMs are batched over a·b/tp heads. Elementwise time = `elementwise_bytes_per_layer` / HBM
    bandwidth. Backward = 2 × forward (two GEMMs per forward GEMM). Recompute: full ⇒ one forward, selective ⇒
    the attention core (QKᵀ, softmax/dropout on the scores, A·V) of a forward, none ⇒ 0.
    """
    s, b, dt = shape.seq_len, plan.micro_batch, plan.dtype
    M, q = s * b, plan.q
    dense = 0.0
    for (k_in, n_out), row_parallel in zip(_linears(shape), _ROW_PARALLEL, strict=True):
        if plan.tp_kind == "2d":
            dense += q * gemm_call_time(hw, M / q, n_out / q, k_in / q, dtype=dt)
        elif row_parallel:  # proj, fc2: the input width is split, the output is full (then all-reduced)
            dense += gemm_call_time(hw, M, n_out, k_in / plan.tp, dtype=dt)
        else:
            dense += gemm_call_time(hw, M, n_out / plan.tp, k_in, dtype=dt)
    heads = shape.n_heads * b / plan.tp
    d = shape.head_dim
    attn = gemm_call_time(hw, s, s, d, batch=heads, dtype=dt) + gemm_call_time(
        hw, s, d, s, batch=heads, dtype=dt
    )
    elementwise = elementwise_bytes_per_layer(shape, plan) / hw.hbm_bandwidth
    score_bytes = 0.0 if plan.flash_attention else (9 if shape.dropout else 4) * shape.n_heads * s * s * b
    fwd = dense + attn + elementwise
    selective = attn + score_bytes / plan.tp / hw.hbm_bandwidth  # QKᵀ, softmax(+dropout), A·V replayed
    recompute = {"none": 0.0, "selective": selective, "full": fwd}[plan.recompute]
    return LayerTime(forward=fwd, backward=2 * fwd, recompute=recompute)


def layers_per_stage(shape: ModelShape, plan: Plan) -> tuple[int, ...]:
    """Blocks of each global stage (chunk c of pipeline rank r is global stage c·p + r): `plan.stage_layers`, or
    the even split. A layer count that p·v does not divide, without `stage_layers`, is an error (never rounded)."""
    n = plan.pp * plan.virtual_stages
    if plan.stage_layers is not None:
        counts = tuple(plan.stage_layers)
        if len(counts) != n or sum(counts) != shape.n_layers or min(counts) < 0:
            raise ValueError(
                f"stage_layers {list(counts)} must have p·v = {n} non-negative entries summing to the "
                f"{shape.n_layers} layers"
            )
        return counts
    if shape.n_layers % n:
        from tessera.config import even_split  # torch-free; the one place that splits layers evenly

        raise ValueError(
            f"{shape.n_layers} layers do not split evenly over p·v = {plan.pp}·{plan.virtual_stages} = {n} stages; "
            f"pass stage_layers explicitly (e.g. {even_split(shape.n_layers, n)}) or use a p·v that divides "
            f"{shape.n_layers}"
        )
    return (shape.n_layers // n,) * n


def embedding_time(shape: ModelShape, hw: Hardware, plan: Plan) -> tuple[LayerTime, LayerTime]:
    """(compute, exposed tensor-parallel) seconds of the input embedding for one micro-batch on the first stage.

    Memory bound: the lookup reads b·s rows of h and writes the b·s·h output (GPT adds the learned positions:
    another read and an add), 2·b·s·h·bytes (4 with positions), backward 2× (the scatter-add into the gradient).
    With a vocabulary-parallel embedding (1D) each rank writes a partial output that is all-reduced over the tensor
    group (reduce-scattered with sequence parallelism): one collective of b·s·h forward, none backward."""
    sbh = shape.seq_len * plan.micro_batch * shape.d_model * plan.act_bytes
    nbytes = sbh * (2 if shape.swiglu else 4)
    shard = plan.tp if plan.tp_kind == "2d" else 1
    fwd = nbytes / shard / hw.hbm_bandwidth
    comm = 0.0
    if plan.tp > 1 and plan.tp_kind == "1d":
        kind = "reduce_scatter" if plan.sequence_parallel else "all_reduce"
        comm = collective_time(hw, kind, sbh, group_placement(hw, plan, "tensor"))
    compute = LayerTime(forward=fwd, backward=2 * fwd, recompute=0.0)
    return compute, LayerTime(forward=comm, backward=0.0, recompute=0.0)


def logits_time(shape: ModelShape, hw: Hardware, plan: Plan) -> LayerTime:
    """Output projection + loss for one micro-batch (vocabulary split over tp): GEMM [M×h]·[h×V/tp], backward 2×;
    loss elementwise `LOGIT_ELEMENTWISE_BYTES` per logit. Never recomputed."""
    M = shape.seq_len * plan.micro_batch
    gemm = gemm_call_time(hw, M, shape.vocab_size / plan.tp, shape.d_model, dtype=plan.dtype)
    loss = LOGIT_ELEMENTWISE_BYTES * M * shape.vocab_size / plan.tp / hw.hbm_bandwidth
    return LayerTime(forward=gemm + loss, backward=2 * (gemm + loss), recompute=0.0)


# ---------------------------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------------------------


def group_bandwidth(hw: Hardware, group_size: int, stride: int = 1) -> tuple[float, float]:
    """(bandwidth per rank per direction, latency per step) of a group of `group_size` ranks `stride` apart.

    Intra-node iff the group's ranks share one node (`network.placement`). Otherwise the ring crosses nodes: with
    k members per node the k NICs of a node carry its node-crossing traffic (NCCL runs one ring channel per NIC,
    intra-node hops on NVLink), so the per-rank bandwidth is k × inter_node_bandwidth capped by NVLink
    (`network.bus_bandwidth`); k = 1 when stride ≥ gpus_per_node.
    """
    pl = placement(group_size, stride, hw.gpus_per_node)
    latency = hw.intra_node_latency if pl.intra_node else hw.inter_node_latency
    return bus_bandwidth(hw, pl), latency


def group_placement(hw: Hardware, plan: Plan, axis: str) -> Placement:
    """Where the group along `axis` sits: "tensor" (1D group, or the 2D row group: stride 1, q members),
    "tensor_col" (2D column group, stride q), "data" (d members), "pipe" (two pipeline neighbours). Strides
    follow `plan.rank_order`."""
    G = hw.gpus_per_node
    if axis == "tensor":
        return placement(plan.q if plan.tp_kind == "2d" else plan.tp, 1, G)
    if axis == "tensor_col":
        return placement(plan.q, plan.q, G)
    sizes = {"data": plan.dp, "pipe": plan.pp, "tensor": plan.tp}
    if axis not in ("data", "pipe"):
        raise ValueError(f"axis must be tensor, tensor_col, data or pipe, got {axis!r}")
    size = plan.dp if axis == "data" else min(2, plan.pp)
    return placement(size, axis_stride(plan.rank_order, sizes, axis), G)


def all_reduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of an `nbytes` buffer over n ranks: 2(n−1)/n·bytes/bw + 2(n−1)·latency (0 if n = 1)."""
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def reduce_scatter_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring reduce-scatter of a full `nbytes` buffer: (n−1)/n·bytes/bw + (n−1)·latency."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def all_gather_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather producing a full `nbytes` buffer: (n−1)/n·bytes/bw + (n−1)·latency."""
    return reduce_scatter_time(nbytes, n, bandwidth, latency)


def broadcast_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Pipelined (chain/ring) broadcast of `nbytes` to n ranks: bytes/bw + (n−1)·latency (0 if n = 1)."""
    return 0.0 if n <= 1 else nbytes / bandwidth + (n - 1) * latency


def p2p_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """One point-to-point transfer: bytes/bw + latency."""
    return nbytes / bandwidth + latency


# ---------------------------------------------------------------------------------------------------------------
# Communication volume (payload bytes per rank per step; what a per-collective byte counter records)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class CommVolume:
    """Payload bytes handed to each kind of collective by one rank (full-size buffer for all-reduce, the gathered
    output for all-gather, the unreduced input for reduce-scatter, the block for broadcast/reduce, the tensor
    for send/recv), and the number of calls."""

    all_reduce: float = 0.0
    all_gather: float = 0.0
    reduce_scatter: float = 0.0
    broadcast: float = 0.0
    reduce: float = 0.0
    send: float = 0.0
    recv: float = 0.0
    calls: int = 0

    def __add__(self, other: CommVolume) -> CommVolume:
        return CommVolume(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def scaled(self, k: float) -> CommVolume:
        """Volume of `k` repetitions."""
        out = CommVolume(**{f.name: getattr(self, f.name) * k for f in fields(self)})
        out.calls = round(self.calls * k)
        return out

    def wire_bytes(self, n: int) -> float:
        """Bytes each rank sends on the wire with ring algorithms in a group of n (broadcast/reduce: one block
        moved per rank on average, (n−1)/n of the payload)."""
        if n <= 1:
            return self.send
        frac = (n - 1) / n
        collective = (
            2 * self.all_reduce + self.all_gather + self.reduce_scatter + self.broadcast + self.reduce
        )
        return frac * collective + self.send


def tp1d_layer_volume(shape: ModelShape, plan: Plan) -> CommVolume:
    """Megatron 1D tensor parallelism, one block, one micro-batch, per rank (payload of b·s·h elements each).

    Without sequence parallelism: forward 2 all-reduces, backward 2 (Narayanan §3.2: 8·b·s·h·(t−1)/t on the wire);
    with sequence parallelism: each all-reduce becomes an all-gather + a reduce-scatter (Korthikanti §4.2.2).
    Full recompute replays the forward's 2 collectives. 0 when t = 1.
    """
    if plan.tp <= 1 or plan.tp_kind != "1d":
        return CommVolume()
    n_fwd = 2 + (2 if plan.recompute == "full" else 0)
    nbytes = shape.seq_len * plan.micro_batch * shape.d_model * plan.act_bytes
    n = n_fwd + 2
    if plan.sequence_parallel:
        return CommVolume(all_gather=n * nbytes, reduce_scatter=n * nbytes, calls=2 * n)
    return CommVolume(all_reduce=n * nbytes, calls=n)


_ROW_PARALLEL = (False, True, False, True)
"""Which of `_linears` Megatron splits by input width (row-parallel: proj, fc2); the others by output width."""


def _linears(shape: ModelShape) -> list[tuple[int, int]]:
    """(input width, output width) of the four linears of a block: QKV, proj, fc1 (+gate), fc2."""
    h, f = shape.d_model, shape.ffn_hidden
    return [(h, h + 2 * shape.kv_dim), (h, h), (h, (2 if shape.swiglu else 1) * f), (f, h)]


def _summa_linear(M: float, k_in: float, n_out: float, q: int, nbytes: int) -> CommVolume:
    """One SUMMA linear on q×q, per rank: forward C = A·B broadcasts q blocks of A (M/q × K/q) along rows and q
    of B (K/q × N/q) along columns; backward dA = dC·Bᵀ broadcasts B blocks and reduces dA blocks (M/q × K/q);
    dB = Aᵀ·dC broadcasts A blocks and reduces dB blocks (K/q × N/q). Wire: (q−1)/q·(3MK + 3KN)/q (optimus §1.6).
    """
    act = M * k_in / q**2 * nbytes
    wgt = k_in * n_out / q**2 * nbytes
    return CommVolume(broadcast=q * (2 * act + 2 * wgt), reduce=q * (act + wgt), calls=6 * q)


def tp2d_layer_volume(shape: ModelShape, plan: Plan) -> CommVolume:
    """Optimus 2D (SUMMA) tensor parallelism, one block, one micro-batch, per rank.

    Sum of `_summa_linear` over QKV, proj, fc1(+gate), fc2: for GPT wire (q−1)/q²·(21·M·h + 36·h²) elements
    (Xu et al. 2021, derived in docs/cost-model.md §5), M = b·s. Full recompute replays the forward broadcasts. Plus LayerNorm statistics:
    per norm an all-reduce of 2 fp32 values per local token (M/q) along the row, forward and backward.
    """
    q = plan.q
    if q <= 1:
        return CommVolume()
    M, nb = shape.seq_len * plan.micro_batch, plan.act_bytes
    vol = CommVolume()
    for k_in, n_out in _linears(shape):
        one = _summa_linear(M, k_in, n_out, q, nb)
        vol = vol + one
        if plan.recompute == "full":  # forward broadcasts of A and B replayed
            act, wgt = M * k_in / q**2 * nb, k_in * n_out / q**2 * nb
            vol = vol + CommVolume(broadcast=q * (act + wgt), calls=2 * q)
    stats = 2 * (M / q) * 4  # (sum, sum of squares) in fp32 per local token
    vol = vol + CommVolume(all_reduce=2 * 2 * stats, calls=4)
    return vol


def pp_p2p_volume(shape: ModelShape, plan: Plan, stage: int) -> CommVolume:
    """Pipeline sends/receives of one rank (pipeline position `stage`) per step.

    Chunk c of rank `stage` is global stage c·p + stage (looping assignment). Each micro-batch sends its
    activation b·s·h forward from every chunk with a successor and its gradient backward from every chunk with a
    predecessor (Narayanan §3.2), divided by t with the scatter/gather optimisation (sequence parallel / 2D
    layouts hold sharded boundary activations: /t, /q²). Receives mirror the sends.
    """
    p, v, m = plan.pp, plan.virtual_stages, plan.n_microbatches
    if p <= 1:
        return CommVolume()
    positions = [c * p + stage for c in range(v)]
    with_next = sum(pos < v * p - 1 for pos in positions)
    with_prev = sum(pos > 0 for pos in positions)
    shard = plan.tp if (plan.sequence_parallel or plan.tp_kind == "2d") else 1
    nbytes = shape.seq_len * plan.micro_batch * shape.d_model * plan.act_bytes / shard
    sends = m * (with_next + with_prev)
    return CommVolume(send=sends * nbytes, recv=sends * nbytes, calls=2 * sends)


def dp_volume(params_local: float, plan: Plan, *, grad_bytes: int = 2, param_bytes: int = 2) -> CommVolume:
    """Data-parallel payload per rank per step for `params_local` parameters (those held by this rank's stage
    and tensor shard, before ZeRO sharding).

    ZeRO 0: all-reduce of gradients (2Ψ on the wire). ZeRO 1/2: reduce-scatter gradients + all-gather updated
    params (2Ψ). ZeRO 3: all-gather params for forward and again for backward + reduce-scatter gradients (3Ψ)
    (Rajbhandari 2020 Table). Depth-first accumulation: ZeRO 2 reduce-scatters every micro-batch (×m) and ZeRO 3
    also gathers every micro-batch (×m); layered accumulation does each once per step (layered-pipeline §2.2).
    """
    if plan.dp <= 1:
        return CommVolume()
    g, w = params_local * grad_bytes, params_local * param_bytes
    m = plan.n_microbatches if plan.accumulation == "depth_first" else 1
    if plan.zero_stage == 0:
        return CommVolume(all_reduce=g, calls=1)
    if plan.zero_stage == 1:
        return CommVolume(reduce_scatter=g, all_gather=w, calls=2)
    if plan.zero_stage == 2:
        return CommVolume(reduce_scatter=m * g, all_gather=w, calls=m + 1)
    if plan.zero_stage == 3:
        return CommVolume(reduce_scatter=m * g, all_gather=2 * m * w, calls=3 * m)
    raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {plan.zero_stage}")


# ---------------------------------------------------------------------------------------------------------------
# Step-time pieces
# ---------------------------------------------------------------------------------------------------------------


def tp_comm_time_per_layer(shape: ModelShape, hw: Hardware, plan: Plan) -> LayerTime:
    """Exposed tensor-parallel seconds per block per micro-batch, split like `LayerTime`.

    Assumed not overlapped with compute (Megatron 2021 behaviour). 1D: two all-reduces (or AG+RS pairs with SP) of
    b·s·h per pass on the tensor group (stride 1). 2D: per linear and pass q rounds of block broadcasts/reduces on
    row groups (stride 1) and column groups (stride q), each priced by `broadcast_time` (a reduce costs the
    same): forward moves one A and one B block per round, backward two of each. Full recompute replays forward.
    """
    if plan.tp <= 1:
        return LayerTime(forward=0.0, backward=0.0, recompute=0.0)
    group = group_placement(hw, plan, "tensor")
    if plan.tp_kind == "1d":
        nbytes = shape.seq_len * plan.micro_batch * shape.d_model * plan.act_bytes
        one = (
            collective_time(hw, "all_gather", nbytes, group)
            + collective_time(hw, "reduce_scatter", nbytes, group)
            if plan.sequence_parallel
            else collective_time(hw, "all_reduce", nbytes, group)
        )
        fwd, bwd = 2 * one, 2 * one
    else:
        q, cols = plan.q, group_placement(hw, plan, "tensor_col")
        M, nb = shape.seq_len * plan.micro_batch, plan.act_bytes
        fwd = bwd = 0.0
        for k_in, n_out in _linears(shape):
            act, wgt = M * k_in / q**2 * nb, k_in * n_out / q**2 * nb
            a_t = collective_time(hw, "broadcast", act, group)
            w_t = collective_time(hw, "broadcast", wgt, cols)
            fwd += q * (a_t + w_t)
            bwd += q * 2 * (a_t + w_t)
    return LayerTime(forward=fwd, backward=bwd, recompute=fwd if plan.recompute == "full" else 0.0)


def stage_time(
    shape: ModelShape, hw: Hardware, plan: Plan, n_layers: int, *, last: bool = False
) -> tuple[float, float]:
    """(forward, backward incl. recompute) seconds of one pipeline chunk of `n_layers` blocks for one
    micro-batch: compute + exposed tensor-parallel communication; `last` adds the output layer and loss."""
    lt = layer_time(shape, hw, plan)
    tp = tp_comm_time_per_layer(shape, hw, plan)
    fwd = n_layers * (lt.forward + tp.forward)
    bwd = n_layers * (lt.backward + lt.recompute + tp.backward + tp.recompute)
    if last:
        lg = logits_time(shape, hw, plan)
        fwd, bwd = fwd + lg.forward, bwd + lg.backward
    return fwd, bwd


def p2p_time_per_microbatch(shape: ModelShape, hw: Hardware, plan: Plan) -> float:
    """Seconds to move one micro-batch's boundary tensor (b·s·h, /t with scatter/gather) across one stage
    boundary in one direction. Pipeline neighbours sit `axis_stride(rank_order, "pipe")` ranks apart (t·d in
    Megatron's order, t in tessera's), so they share a node only if that fits in one node. With 1D tensor
    parallelism (no SP) the scatter/gather optimisation sends 1/t and re-assembles with an all-gather on the
    tensor group (Narayanan §4.1)."""
    if plan.pp <= 1:
        return 0.0
    full = shape.seq_len * plan.micro_batch * shape.d_model * plan.act_bytes
    pair = group_placement(hw, plan, "pipe")
    latency = hw.intra_node_latency if pair.intra_node else hw.inter_node_latency
    t = p2p_time(full / plan.tp, bus_bandwidth(hw, pair), latency)
    if plan.tp_kind == "1d" and not plan.sequence_parallel and plan.tp > 1:
        t += collective_time(hw, "all_gather", full, group_placement(hw, plan, "tensor"))
    return t


def dp_collective_times(
    params_local: float,
    hw: Hardware,
    plan: Plan,
    *,
    grad_bytes: int = 2,
    param_bytes: int = 2,
    buckets: int = 1,
) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) seconds per step of `params_local` parameters on the data
    group, placed by `plan.rank_order`: the collectives of `dp_volume` (ZeRO-0 one all-reduce; ZeRO ≥ 1 a
    reduce-scatter, ×m with depth-first ZeRO-2/3; all-gathers once, twice for ZeRO-3, ×m depth-first), each
    split into `buckets` calls (one per layer in the trainer) and priced by `network.collective_time`, so the
    latency terms count every call."""
    if plan.dp <= 1:
        return 0.0, 0.0
    group = group_placement(hw, plan, "data")
    m = plan.n_microbatches if plan.accumulation == "depth_first" else 1
    g, w = params_local * grad_bytes, params_local * param_bytes
    if plan.zero_stage == 0:
        calls = [("all_reduce", g, 1)]
    elif plan.zero_stage in (1, 2, 3):
        reps = m if plan.zero_stage >= 2 else 1
        calls = [("reduce_scatter", g, reps)]
    else:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {plan.zero_stage}")
    gathers = {0: 0, 1: 1, 2: 1, 3: 2 * m}[plan.zero_stage]
    buckets = max(1, buckets)

    def price(kind: str, total: float, reps: int) -> float:
        return reps * buckets * collective_time(hw, kind, total / buckets, group)

    reduce = sum(price(*c) for c in calls)
    gather = price("all_gather", w, gathers) if gathers else 0.0
    return reduce, gather


def dp_time(
    params_local: float, hw: Hardware, plan: Plan, *, grad_bytes: int = 2, param_bytes: int = 2
) -> float:
    """Seconds of this stage's data-parallel traffic per step (`dp_collective_times`, one bucket), not
    overlapped. The caller decides how much of it hides behind backward (schedule dependent)."""
    reduce, gather = dp_collective_times(
        params_local, hw, plan, grad_bytes=grad_bytes, param_bytes=param_bytes
    )
    return reduce + gather


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True, frozen=True)
class MemoryBreakdown:
    """Bytes per rank by component."""

    params: float
    grads: float
    optimizer: float
    activations: float
    """Stored activations of all in-flight micro-batches (checkpoints or full, per the recompute mode)."""
    working: float
    """Transient: one block's full activations while recomputing, the logits of one micro-batch on the last stage."""
    comm_buffers: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.working + self.comm_buffers


def params_per_rank(shape: ModelShape, plan: Plan, stage: int = 0) -> float:
    """Parameters held by one rank of pipeline position `stage` before ZeRO sharding: its L/p blocks and, on the
    first stage, the embedding (+ positions); on the last stage the head if untied (or a tied copy if p > 1), all
    divided by the tensor degree (norm/bias vectors are counted as sharded too: a small over-estimate of savings)."""
    layers = shape.n_layers / plan.pp
    n = layers * shape.layer_params()
    h, V = shape.d_model, shape.vocab_size
    if stage == 0:
        n += V * h + (0 if shape.swiglu else shape.seq_len * h)
    if stage == plan.pp - 1:
        n += (h if shape.swiglu else 2 * h) + (0 if (shape.tied and plan.pp == 1) else V * h)
    return n / plan.tp


def activation_bytes_per_layer(shape: ModelShape, plan: Plan) -> float:
    """Stored activation bytes of one block for one micro-batch on one rank (Korthikanti 2022 Table 2).

    No recompute: s·b·h·(34 + 5as/h) without parallelism; 1D TP: s·b·h·(10 + 24/t + 5as/(ht)); 1D TP + SP:
    s·b·h·(34/t + 5as/(ht)); 2D: everything /q² (optimus §1.6). Selective: drop the 5as/h term.
    Full: only the block input 2·s·b·h (÷t with SP, ÷q² in 2D). Generalised to GQA/SwiGLU/no-dropout by the same
    per-tensor accounting: replicated 4 (norms) + 4 (QKV and MLP inputs) + 2 masks; sharded 2 (Q) + 4·kv/h (K,V)
    + 2 (proj input) + MLP (GELU 4f/h, SwiGLU 6f/h); scores (2 + 3 with dropout)·as/h; flash attention stores
    no scores. Counts assume 2-byte activations; other dtypes scale by bytes/2 (masks included, approximate).
    """
    s, b, h, a = shape.seq_len, plan.micro_batch, shape.d_model, shape.n_heads
    sbh = s * b * h
    shard_all = plan.tp if (plan.tp_kind == "2d" or plan.sequence_parallel) else 1
    scale = plan.act_bytes / 2
    if plan.recompute == "full":
        return 2 * sbh / shard_all * scale
    replicated = 8 + (2 if shape.dropout else 0)
    f_h = shape.ffn_hidden / h
    sharded = 2 + 4 * shape.kv_dim / h + 2 + (6 * f_h if shape.swiglu else 4 * f_h)
    scores = 0.0 if plan.flash_attention else (5 if shape.dropout else 2) * a * s / h
    if plan.recompute == "selective":
        scores = 0.0
    return sbh * (replicated / shard_all + (sharded + scores) / plan.tp) * scale


def model_state_bytes(
    psi: float, dp: int, zero_stage: int, precision: str = "mixed"
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank for Ψ = `psi` parameters (Rajbhandari 2020 §5, K = 12).

    Mixed precision: 2Ψ + 2Ψ + 12Ψ (fp32 master, momentum, variance); fp32: 4Ψ + 4Ψ + 8Ψ. ZeRO-1 divides the
    optimizer by d, ZeRO-2 also the gradients, ZeRO-3 also the parameters: e.g. ZeRO-2 = 2Ψ + 14Ψ/d.
    """
    if precision not in ("mixed", "fp32"):
        raise ValueError(f"precision must be 'mixed' or 'fp32', got {precision!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    w_b, g_b, o_b = (2, 2, 12) if precision == "mixed" else (4, 4, 8)
    params = psi * w_b / (dp if zero_stage >= 3 else 1)
    grads = psi * g_b / (dp if zero_stage >= 2 else 1)
    return params, grads, psi * o_b / (dp if zero_stage >= 1 else 1)


def memory_per_rank(
    shape: ModelShape,
    plan: Plan,
    *,
    inflight_microbatches: int,
    stage: int = 0,
    precision: str = "mixed",
) -> MemoryBreakdown:
    """Peak memory of one rank at pipeline position `stage`.

    Model state on Ψ = `params_per_rank` (Rajbhandari 2020, K = 12): mixed precision 2Ψ params + 2Ψ grads +
    12Ψ optimizer (fp32 master, m, v); fp32 training 4Ψ + 4Ψ + 8Ψ. ZeRO-1 shards the optimizer over d, ZeRO-2 also
    gradients, ZeRO-3 also parameters. Activations = `activation_bytes_per_layer` × L/p layers ×
    `inflight_microbatches` (from the schedule: 1F1B p − stage, GPipe/breadth-first m·v chunks ...). Working:
    one block's un-checkpointed activations when recomputing, fp32 logits 4·s·b·V/t on the last stage. Buffers:
    p2p send+recv (2 boundary tensors), ZeRO-3 gather of 2 blocks (prefetch), ZeRO-2/3 one block of full grads.
    """
    psi = params_per_rank(shape, plan, stage)
    params, grads, optimizer = model_state_bytes(psi, plan.dp, plan.zero_stage, precision)
    w_b, g_b = (2, 2) if precision == "mixed" else (4, 4)
    z = plan.zero_stage
    layers = shape.n_layers / plan.pp
    acts = activation_bytes_per_layer(shape, plan) * layers * inflight_microbatches
    working = 0.0
    if plan.recompute != "none":
        working += activation_bytes_per_layer(shape, replace(plan, recompute="none"))
    if stage == plan.pp - 1:
        working += 4 * shape.seq_len * plan.micro_batch * shape.vocab_size / plan.tp
    sbh = shape.seq_len * plan.micro_batch * shape.d_model * plan.act_bytes
    layer_local = shape.layer_params() / plan.tp
    buffers = (2 * sbh if plan.pp > 1 else 0.0) + (2 * layer_local * w_b if z >= 3 else 0.0)
    buffers += layer_local * g_b if z >= 2 else 0.0
    return MemoryBreakdown(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=acts,
        working=working,
        comm_buffers=buffers,
    )
