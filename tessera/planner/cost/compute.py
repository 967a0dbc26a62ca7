"""Compute seconds of one block, the embedding and the output layer on one rank (communication excluded), and
the memory-bound bytes they move. Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.planner.cost.collectives import traffic_time
from tessera.planner.cost.plan import Plan
from tessera.planner.cost.shape import ROW_PARALLEL, ModelShape, linears
from tessera.planner.cost.tp_overlap import ring_lanes, tensor_traffic_time
from tessera.planner.gemm import gemm_call_time, lanes_call_time, plateau_time
from tessera.planner.hardware import Hardware
from tessera.traffic import BACKWARD, FORWARD, replays_mlp_exit, tensor_calls

__all__ = [
    "FLASH_BACKWARD_FACTOR",
    "LOGIT_UPCAST_BYTES",
    "OPTIMIZER_BYTES_PER_PARAM",
    "LayerTime",
    "attention_core_time",
    "elementwise_bytes_per_layer",
    "embedding_time",
    "gemm_time",
    "layer_time",
    "layers_per_stage",
    "linear_gemm_times",
    "local_tokens",
    "logit_bytes",
    "logits_time",
    "op_recompute_time",
    "op_replayed_linears",
    "score_bytes",
    "weight_cast_bytes_per_layer",
]

OPTIMIZER_BYTES_PER_PARAM = 32
"""HBM traffic of one fused mixed-precision Adam step per parameter: read grad 2 + master 4 + m 4 + v 4, write
master 4 + m 4 + v 4 + param 2 (= 28) plus ≈4 for unscale/norm. Assumption (documented in docs/cost-model.md)."""
LOGIT_UPCAST_BYTES = 8
"""HBM bytes per logit element in the forward loss besides reading the logits (`logit_bytes`): the fp32 upcast's
write and the max/sum-exp reads; backward 2×. Assumption."""


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
    """Extra forward work replayed before backward (0, the attention part, or the forward less what the
    checkpoint does not replay: `layer_time`)."""


FLASH_BACKWARD_FACTOR = 2.5
"""Backward FLOPs of fused (flash) attention per forward FLOP: the backward recomputes the scores QKᵀ and their
softmax from the saved log-sum-exp, then runs four products (dV, dP, dQ, dK), five matmuls against the forward's
two (Dao, FlashAttention-2, arXiv 2307.08691 §4.1, whose benchmark counts backward = 2.5 × forward)."""


def attention_core_time(shape: ModelShape, hw: Hardware, plan: Plan) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core (QKᵀ, softmax, A·V) of one block for one micro-batch on
    one rank: a·b/tp heads of s×s scores over head dimension d.

    Fused (flash) attention on hardware with a measured kernel rate (`Hardware.flash_attention_flops`): the
    scores never reach HBM and a causal kernel skips the masked half, so forward FLOPs = 4·s²·d per head / 2,
    backward `FLASH_BACKWARD_FACTOR` × that, both at the measured rate × `gemm_framework_share` (the share of a
    kernel's rate a framework keeps, as for GEMMs). Otherwise two batched GEMMs (QKᵀ and A·V, full s×s: the
    masked half is computed, and the roofline charges the scores' HBM traffic), backward 2× forward.

    Context parallelism (`Plan.cp` = c): a rank's s/c queries attend to the whole gathered sequence's s keys.
    Unfused, its two GEMMs are [s/c × d]·[d × s] and [s/c × s]·[s × d]: 4·(s/c)·s·d FLOPs per head, 1/c of one
    device's. Fused, the causal work of one device is 4·s²·d/2 per head; with the 2c-chunk balance rank i holds
    chunks i and 2c−1−i, whose queries see (i + 1/2) + (2c − 1 − i + 1/2) = 2c chunk-widths of keys, so every
    rank does 2c·(s/2c)²·4d = 4·s²·d/(2c): 1/c of the causal work (docs/context-parallel.md, "The chunks")."""
    s, d, c = shape.seq_len, shape.head_dim, plan.cp
    heads = shape.n_heads * plan.micro_batch / plan.tp
    if plan.flash_attention and hw.flash_attention_flops > 0 and plan.act_bytes == 2:
        forward = 4 * s * s * d * heads / 2 / c / (hw.flash_attention_flops * hw.gemm_framework_share)
        return forward, FLASH_BACKWARD_FACTOR * forward
    dt = plan.dtype
    forward = gemm_call_time(hw, s / c, s, d, batch=heads, dtype=dt) + gemm_call_time(
        hw, s / c, d, s, batch=heads, dtype=dt
    )
    return forward, 2 * forward


def elementwise_bytes_per_layer(shape: ModelShape, plan: Plan) -> float:
    """HBM bytes moved by the memory-bound (non-GEMM) ops of one block's forward, per rank, per micro-batch.

    Each tensor in its own dtype, by the rules of the memory estimate (`Plan.act_bytes` c for matmul inputs and
    outputs and what attention and the MLP compute from them, `Plan.stream_bytes` r for the residual stream and
    the norms; c = r = 2 in the published accounting, r = 4 under tessera's autocast). Per token-hidden element
    (×s·b·h): two norms 2r each (read + write); two residual adds 2r + c each (read the stream and the branch's
    matmul output, write the stream), +1 with fused bias-dropout-add (1-byte mask); activation: GELU 2c·f/h,
    SwiGLU 3c·f/h; rotary 2c(q+kv)/h (Llama; q = n_heads·head_dim, = h by default); per-head q/k norms
    (c + r)(q+kv)/h (Qwen3). Softmax on the a·s² scores: 2c bytes per score, 4c + 1 with dropout
    (+read/write/mask) unless flash attention. Under autocast (`Plan.casts`) each Linear reading a norm's output
    casts it (read r, write c; wq, wk, wv and the MLP's input Linears); the weights are cast once per step, not
    per micro-batch (`weight_cast_bytes_per_layer`). Published bf16: norms 4, adds 6 (7), GELU 4f/h, SwiGLU
    6f/h, rotary 4(h+kv)/h, scores 4 (9): Megatron's fused kernels op by op (an approximation); fused bias adds.
    Replicated ops (norms, residuals) are divided by t only with sequence parallelism (always by q² in 2D); the
    rest by t or q²; a cast's input is the gathered tensor under sequence parallelism (not divided by t).
    Backward is taken as 2× these bytes (`layer_time`).
    """
    h, f = shape.d_model, shape.ffn_hidden
    c, r = plan.act_bytes, plan.stream_bytes
    sbh = local_tokens(shape, plan) * h  # a context rank's s/c tokens of each sequence
    residual_add = 2 * r + c + (1 if shape.dropout else 0)
    replicated = len(shape.features.block_norms) * (2 * r) + 2 * residual_add  # Gemma 2: four norms
    activation = (3 if shape.swiglu else 2) * c * f / h
    qk = shape.q_dim + shape.kv_dim  # Q's and K's widths: what RoPE and the per-head norms touch
    sharded = activation + (2 * c * qk / h if shape.features.rope else 0)
    # per-head q/k norms: read Q and K (c), write them (r: their fp32 weights promote them)
    if shape.features.qk_norm:
        sharded += (c + r) * qk / h
    div_rep = plan.tp if (plan.tp_kind == "2d" or plan.sequence_parallel) else 1
    out = sbh * replicated / div_rep + (sbh * sharded + score_bytes(shape, plan)) / plan.tp
    if plan.casts:
        fam = shape.features
        div_cast = plan.tp if plan.tp_kind == "2d" else 1
        out += sbh * (len(fam.attention_in) + len(fam.mlp_in)) * (r + c) / div_cast
    return out + weight_cast_bytes_per_layer(shape, plan)[0]


def score_bytes(shape: ModelShape, plan: Plan) -> float:
    """HBM bytes of the softmax (and dropout) on one micro-batch's a·s²·b attention scores, before any tensor
    split: 2c per score (read + write in the compute dtype `Plan.act_bytes`), 4c + 1 with dropout (its output and
    1-byte mask); 0 with flash attention (the scores never reach HBM). Soft-capped attention (Gemma 2) is written
    out whatever the kernel (`tessera.model.layers.AttentionCore`): its scores reach HBM, and the scaling, the cap's
    divide, tanh and multiply add three read + write passes, 6c per score."""
    capped = shape.attn_softcap is not None
    if plan.flash_attention and not capped:
        return 0.0
    per_score = 4 * plan.act_bytes + 1 if shape.dropout else 2 * plan.act_bytes
    per_score += 6 * plan.act_bytes if capped else 0
    # context parallelism: the rank's s/c queries against all s keys
    return per_score * shape.n_heads * shape.seq_len**2 / plan.cp * plan.micro_batch


def weight_cast_bytes_per_layer(shape: ModelShape, plan: Plan) -> tuple[float, float]:
    """(forward, backward) HBM bytes of one block's weight casts per micro-batch on one rank under autocast
    (`Plan.casts`; (0, 0) otherwise: the published runs keep bf16 weights and accumulate weight gradients in the
    GEMM, Megatron's gradient-accumulation fusion).

    Forward: nothing per micro-batch in any layout: a weight is cast once per autocast region and the copy
    reused (autocast's cache under 1D; 2D's SUMMA casts its blocks under the same rule,
    `tessera.parallel.precision.cast_operand`), once per step in the schedule runtime (the copies
    `rank_memory.autocast_weight_bytes` counts). Backward, every layout: each weight's bf16 gradient is cast
    back to fp32 (read c, write r) and added into the fp32 gradient (read 2r, write r), c + 4r per local weight.
    """
    if not plan.casts:
        return 0.0, 0.0
    c, r = plan.act_bytes, plan.stream_bytes
    local = shape.block_matmul_params() / plan.tp
    return 0.0, (c + 4 * r) * local


def layer_time(shape: ModelShape, hw: Hardware, plan: Plan) -> LayerTime:
    """Compute seconds of one block for one micro-batch on one rank (communication excluded).

    Each linear [M×h_in]·[h_in×h_out] (M = b·s) runs at its own size: 1D splits the output (column-parallel)
    or the input (row-parallel) dimension by t; 2D runs q SUMMA steps of [M/q × h_in/q]·[h_in/q × h_out/q].
    The attention core is `attention_core_time` (a fused kernel's measured rate, or two GEMMs batched over
    a·b/tp heads). Elementwise time = `elementwise_bytes_per_layer` / HBM bandwidth. Backward = 2 × forward (two
    GEMMs per forward GEMM), except the attention core (its own backward) and the weight casts under autocast
    (`weight_cast_bytes_per_layer`: their forward and backward bytes differ).
    Context parallelism (`Plan.cp` = c): every GEMM and elementwise op runs on the rank's b·s/c tokens
    (`local_tokens`), the attention core on its s/c queries against all s keys (`attention_core_time`).
    Recompute: full ⇒ one forward less the MLP's output GEMM (torch's non-reentrant checkpoint stops early;
    the whole forward under `Plan.replays_last_exit`, or where a post-norm saves that GEMM's output:
    `traffic.replays_mlp_exit`), selective ⇒ the attention core (QKᵀ, softmax/dropout on
    the scores, A·V) of a forward, op ⇒ wk, wo, SwiGLU's w3 and the forward's non-matmul ops, not the core
    (`op_recompute_time`), none ⇒ 0.
    """
    gemms = linear_gemm_times(shape, hw, plan, local_tokens(shape, plan))
    dense = sum(gemms)
    attn, attn_backward = attention_core_time(shape, hw, plan)
    elementwise = elementwise_bytes_per_layer(shape, plan) / hw.hbm_bandwidth
    fwd = dense + attn + elementwise
    selective = attn + score_bytes(shape, plan) / plan.tp / hw.hbm_bandwidth  # QKᵀ, softmax(+dropout), A·V
    # torch's non-reentrant checkpoint stops once every tensor the backward saved is rebuilt: unless a post-norm
    # saves the MLP's output projection's output (Gemma 2/3), nothing does, so its GEMM (with the exit
    # collective, tessera.traffic.replayed_1d) is not replayed; Megatron's checkpointing (replays_last_exit)
    # re-runs the whole forward
    full = fwd if plan.replays_last_exit or replays_mlp_exit(shape) else fwd - gemms[-1]
    recompute = {"none": 0.0, "selective": selective, "full": full}.get(plan.recompute)
    if plan.recompute == "op":
        recompute = op_recompute_time(shape, hw, plan, elementwise, selective)
    # the weight gradients' cast back to fp32 and accumulation are backward-only (not twice the forward cast)
    cast_fwd, cast_bwd = weight_cast_bytes_per_layer(shape, plan)
    backward = (
        2 * (dense + elementwise - cast_fwd / hw.hbm_bandwidth) + attn_backward + cast_bwd / hw.hbm_bandwidth
    )
    return LayerTime(forward=fwd, backward=backward, recompute=recompute)


def op_replayed_linears(shape: ModelShape) -> list[tuple[int, int, bool]]:
    """(input width, output width, row-parallel) of the Linears op checkpointing replays in a block: the 2nd, 4th
    and 6th matmuls of its forward (`tessera.parallel.checkpointing`; wq wk wv wo, then the MLP's: SwiGLU's gate
    up down, or fc proj), those torch's early-stopping replay reaches: wk, wo and SwiGLU's up (w3); fc2 (GPT's
    proj, the 6th) only where a post-norm saves its output (`traffic.replays_mlp_exit`; SwiGLU's down is the 7th,
    kept)."""
    h, q, kv, f = shape.d_model, shape.q_dim, shape.kv_dim, shape.ffn_hidden
    out = [(h, kv, False), (q, h, True)]
    if shape.swiglu:
        out.append((h, f, False))
    elif replays_mlp_exit(shape):
        out.append((f, h, True))
    return out


def op_recompute_time(
    shape: ModelShape, hw: Hardware, plan: Plan, elementwise: float, selective: float
) -> float:
    """Seconds op checkpointing replays of one block's forward per micro-batch on one rank: the GEMMs of
    `op_replayed_linears` (1D: column-parallel [M×h_in]·[h_in×h_out/t], row-parallel [M×h_in/t]·[h_in/t×h_out],
    `gemm.gemm_call_time`), and every non-matmul op of the forward (``elementwise``, the block's
    `elementwise_bytes_per_layer` / HBM bandwidth, norms, RoPE, the activation, residual adds and casts) less the
    attention core's softmax bytes: SDPA's output and log-sum-exp are kept. A soft-capped core (Gemma 2) is written
    out in matmuls and elementwise ops, which op mode replays: then ``selective``, the core's time, is added.
    1D only: op mode refuses the 2D grid (`tessera.execution.op_checkpointing_violations`)."""
    rows, t = local_tokens(shape, plan), plan.tp
    gemms = sum(
        gemm_call_time(hw, rows, n_out, k_in / t, dtype=plan.dtype)
        if row_parallel
        else gemm_call_time(hw, rows, n_out / t, k_in, dtype=plan.dtype)
        for k_in, n_out, row_parallel in op_replayed_linears(shape)
    )
    if shape.attn_softcap is not None:
        return gemms + elementwise + selective - score_bytes(shape, plan) / t / hw.hbm_bandwidth
    return gemms + elementwise - score_bytes(shape, plan) / t / hw.hbm_bandwidth


def linear_gemm_times(
    shape: ModelShape, hw: Hardware, plan: Plan, rows: float, *, chunks: int = 1, lanes: int = 1
) -> list[float]:
    """Forward seconds of each of the block's four linears (`shape.linears`: QKV, proj, fc1 (+gate), fc2) on
    `rows` token rows (b·s for the block, b·s/t for a tensor-parallel ring's chunk): 1D column-parallel
    [rows×h_in]·[h_in×h_out/t], row-parallel [rows×h_in/t]·[h_in/t×h_out]; 2D q SUMMA steps of
    [rows/q × h_in/q]·[h_in/q × h_out/q]; each priced by `gemm.gemm_call_time`. A ring's `chunks` such GEMMs
    issued on `lanes` streams (`tp_overlap.ring_lanes`) are priced together (`gemm.lanes_call_time`, their tiles
    filling waves together) and each entry is their time / `chunks`."""
    dt, q = plan.dtype, plan.q

    def per_chunk(m: float, n: float, k: float) -> float:
        return lanes_call_time(hw, m, n, k, calls=chunks, lanes=lanes, dtype=dt) / chunks

    out = []
    for (k_in, n_out), row_parallel in zip(linears(shape), ROW_PARALLEL, strict=True):
        if plan.tp_kind == "2d":
            out.append(q * per_chunk(rows / q, n_out / q, k_in / q))
        elif row_parallel:  # proj, fc2: the input width is split, the output is full (then all-reduced)
            out.append(per_chunk(rows, n_out, k_in / plan.tp))
        else:
            out.append(per_chunk(rows, n_out / plan.tp, k_in))
    return out


def local_tokens(shape: ModelShape, plan: Plan) -> float:
    """Token rows of one micro-batch on one rank before any tensor split: b·s, or b·s/c on a context rank
    (`Plan.cp`), which holds s/c tokens of each sequence (docs/context-parallel.md)."""
    return shape.seq_len * plan.micro_batch / plan.cp


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


def rank_layers(shape: ModelShape, plan: Plan, stage: int = 0) -> float:
    """Blocks held by pipeline rank `stage`: the sum of its chunks c·p + stage of `plan.stage_layers`, or L/p
    without them (a fraction when p does not divide L: the Megatron comparison's average rank)."""
    if plan.stage_layers is None:
        return shape.n_layers / plan.pp
    return float(sum(layers_per_stage(shape, plan)[stage :: plan.pp]))


def embedding_time(shape: ModelShape, hw: Hardware, plan: Plan) -> tuple[LayerTime, LayerTime]:
    """(compute, exposed tensor-parallel) seconds of the input embedding for one micro-batch on the first stage.

    Memory bound: the lookup reads b·s rows of h and writes the b·s·h output (GPT adds the learned positions:
    another read and an add), 2·b·s·h·bytes (4 with positions), backward 2× (the scatter-add into the gradient);
    bytes = `Plan.stream_bytes` (the table and its output are fp32 under tessera's autocast).
    Tensor parallel: the vocabulary-split embedding's collectives as the runtime issues them
    (`tessera.traffic.tensor_calls`): 1D an all-reduce of b·s·h forward (with SP a reduce-scatter forward and an
    all-gather backward, and the position table's gradient), 2D a reduce-scatter / all-gather on the columns."""
    sbh = local_tokens(shape, plan) * shape.d_model * plan.stream_bytes
    nbytes = sbh * (4 if shape.features.has_position_embedding else 2)
    shard = plan.tp if plan.tp_kind == "2d" else 1
    fwd = nbytes / shard / hw.hbm_bandwidth
    calls = tensor_calls(shape, plan, "embedding")
    comm = LayerTime(
        forward=traffic_time(hw, plan, calls, FORWARD),
        backward=traffic_time(hw, plan, calls, BACKWARD),
        recompute=0.0,
    )
    return LayerTime(forward=fwd, backward=2 * fwd, recompute=0.0), comm


def logit_bytes(plan: Plan) -> float:
    """HBM bytes per logit in the forward loss: read the output projection's logits (a matmul output: the
    compute dtype, `Plan.act_bytes`, under autocast too) + `LOGIT_UPCAST_BYTES` (10 in bf16; tessera's loss
    upcasts the logits to fp32 as this count assumes). The head's final norm is not counted."""
    return plan.act_bytes + LOGIT_UPCAST_BYTES


def logits_time(shape: ModelShape, hw: Hardware, plan: Plan) -> LayerTime:
    """Output projection + loss for one micro-batch (vocabulary split over tp): GEMM [M×h]·[h×V/tp], backward 2×;
    loss elementwise `logit_bytes` per logit; plus the head's tensor-parallel collectives as the runtime
    issues them (`tessera.traffic.tensor_calls`: 1D the entry region and the loss's two small all-reduces; 2D the
    final norm, the SUMMA logits products and the loss); with `Plan.tp_comm_overlap` the entry's all-gather and
    its backward pair run as rings under the logits GEMM's chunks (`cost.tp_overlap`). Never recomputed."""
    M = local_tokens(shape, plan)
    gemm = gemm_call_time(hw, M, shape.vocab_size / plan.tp, shape.d_model, dtype=plan.dtype)
    loss = logit_bytes(plan) * M * shape.vocab_size / plan.tp / hw.hbm_bandwidth
    calls = tensor_calls(shape, plan, "head")
    ring = []  # with tp_comm_overlap the head's entry is a ring under the logits GEMM's chunks (backward: the
    # input gradient's reduce-scatter under the dgrad chunks, then the re-gather under the wgrad chunks)
    if plan.tp_comm_overlap:
        t = plan.tp  # t chunks on the runtime's concurrent streams (cost.tp_overlap)
        chunks = lanes_call_time(
            hw,
            M / t,
            shape.vocab_size / t,
            shape.d_model,
            calls=t,
            lanes=ring_lanes(hw, plan),
            dtype=plan.dtype,
        )
        ring = [(chunks / t, gemm)]
    fwd = gemm + loss + tensor_traffic_time(hw, plan, calls, FORWARD, ring)
    bwd = 2 * (gemm + loss) + tensor_traffic_time(hw, plan, calls, BACKWARD, ring * 2)
    return LayerTime(forward=fwd, backward=bwd, recompute=0.0)
