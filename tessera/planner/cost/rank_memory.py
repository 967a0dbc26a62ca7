"""Memory per rank by component: model state (ZeRO), stored activations (Korthikanti), working buffers.
Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.planner.cost.compute import rank_layers
from tessera.planner.cost.plan import Plan
from tessera.planner.cost.shape import ModelShape

__all__ = [
    "MemoryBreakdown",
    "activation_bytes_per_layer",
    "head_activation_bytes",
    "memory_per_rank",
    "model_state_bytes",
    "params_per_rank",
]


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
    """Parameters held by one rank of pipeline position `stage` before ZeRO sharding: its blocks (`rank_layers`:
    the actual stage split) and, on the first stage, the embedding (+ positions); on the last stage the head if
    untied (or a tied copy if p > 1), all divided by the tensor degree (norm/bias vectors are counted as sharded
    too: a small over-estimate of savings)."""
    n = rank_layers(shape, plan, stage) * shape.layer_params()
    h, V = shape.d_model, shape.vocab_size
    if stage == 0:
        n += V * h + shape.features.position_params(shape.seq_len, h)
    if stage == plan.pp - 1:
        n += shape.features.norm_params(h) + (0 if (shape.tied and plan.pp == 1) else V * h)
    return n / plan.tp


def activation_bytes_per_layer(shape: ModelShape, plan: Plan, recompute: str | None = None) -> float:
    """Stored activation bytes of one block for one micro-batch on one rank (Korthikanti 2022 Table 2).

    No recompute: s·b·h·(34 + 5as/h) without parallelism; 1D TP: s·b·h·(10 + 24/t + 5as/(ht)); 1D TP + SP:
    s·b·h·(34/t + 5as/(ht)); 2D: everything /q² (optimus §1.6). Selective: drop the 5as/h term.
    Full: only the block input 2·s·b·h (÷t with SP, ÷q² in 2D). Generalised to GQA/SwiGLU/no-dropout by the same
    per-tensor accounting: replicated 4 (norms) + 4 (QKV and MLP inputs) + 2 masks; sharded 2 (Q) + 4·kv/h (K,V)
    + 2 (proj input) + MLP (GELU 4f/h, SwiGLU 6f/h); scores (2 + 3 with dropout)·as/h; flash attention stores
    no scores. Counts assume 2-byte activations; other dtypes scale by bytes/2 (masks included, approximate).

    The Llama family (`swiglu`) is counted as tessera's Llama block saves, tensor by tensor (measured by the dry
    run, tests/unit/test_activation_formula.py): each RMSNorm keeps its input, the normalised tensor and its
    output (3 × 2; the 2D norm keeps the last two), attention keeps Q, K and V expanded to all heads, SDPA's
    output and the output projection's input (a transposed copy of it), SwiGLU keeps gate, up, silu(gate) and
    their product (8f/h). Selective recomputation drops SDPA's output and the expansion (K, V at 4·kv/h).
    `recompute` overrides `plan.recompute` (the working memory of a recomputed block is its "none" count).
    """
    recompute = plan.recompute if recompute is None else recompute
    s, b, h, a = shape.seq_len, plan.micro_batch, shape.d_model, shape.n_heads
    sbh = s * b * h
    shard_all = plan.tp if (plan.tp_kind == "2d" or plan.sequence_parallel) else 1
    scale = plan.act_bytes / 2
    if recompute == "full":
        return 2 * sbh / shard_all * scale
    f_h = shape.ffn_hidden / h
    if shape.swiglu:
        replicated = (8 if plan.tp_kind == "2d" else 12) + (2 if shape.dropout else 0)
        attention = 2 + 4 * shape.kv_dim / h + 2 if recompute == "selective" else 10
        return sbh * (replicated / shard_all + (attention + 8 * f_h) / plan.tp) * scale
    replicated = 8 + (2 if shape.dropout else 0)
    sharded = 2 + 4 * shape.kv_dim / h + 2 + 4 * f_h
    scores = 0.0 if plan.flash_attention else (5 if shape.dropout else 2) * a * s / h
    if recompute == "selective":
        scores = 0.0
    return sbh * (replicated / shard_all + (sharded + scores) / plan.tp) * scale


def head_activation_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes one micro-batch keeps for backward in the head, besides its fp32 logits: the final norm's saved
    tensors (as in the blocks: LayerNorm input and output; RMSNorm also the normalised tensor, except in 2D),
    split by the tensor degree where the sequence is (sequence parallel, 2D)."""
    sbh = shape.seq_len * plan.micro_batch * shape.d_model * plan.act_bytes
    shard_all = plan.tp if (plan.tp_kind == "2d" or plan.sequence_parallel) else 1
    tensors = 3 if shape.swiglu and plan.tp_kind != "2d" else 2
    return tensors * sbh / shard_all


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
    gradients, ZeRO-3 also parameters. Activations = `activation_bytes_per_layer` × the rank's blocks
    (`rank_layers`) × `inflight_microbatches` (from the schedule: 1F1B p − stage, GPipe/breadth-first m·v chunks ...). Working:
    one block's un-checkpointed activations when recomputing, fp32 logits 4·s·b·V/t on the last stage. Buffers:
    p2p send+recv (2 boundary tensors), ZeRO-3 gather of 2 blocks (prefetch), ZeRO-2/3 one block of full grads.
    """
    psi = params_per_rank(shape, plan, stage)
    params, grads, optimizer = model_state_bytes(psi, plan.dp, plan.zero_stage, precision)
    w_b, g_b = (2, 2) if precision == "mixed" else (4, 4)
    z = plan.zero_stage
    acts = activation_bytes_per_layer(shape, plan) * rank_layers(shape, plan, stage) * inflight_microbatches
    working = 0.0
    if plan.recompute != "none":
        working += activation_bytes_per_layer(shape, plan, recompute="none")
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
