"""Memory per rank by component: model state (ZeRO), stored activations (Korthikanti), working buffers.
Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from tessera.model.family import LinearShape
from tessera.planner.cost.compute import layers_per_stage, rank_layers
from tessera.planner.cost.plan import Plan
from tessera.planner.cost.ring_memory import ring_entry_backward_bytes, ring_exit_backward_bytes
from tessera.planner.cost.shape import ModelShape
from tessera.traffic import replays_mlp_exit

_MEMO = lru_cache(maxsize=4096)
"""The memo of the per-block terms below that the estimate asks for most (the floor, each candidate rank, the
rings' variant and the shard-copy variant of one layout ask for the same ones: ~5 times per plan in the planner's
search). Keyed on the whole (shape, plan, argument), so a value is never returned for any other plan."""

_FP32 = 4
"""Bytes of an fp32 element (the RMSNorm's upcast of its input, whatever the compute dtype)."""

__all__ = [
    "REPLAYS_BLOCK",
    "MemoryBreakdown",
    "activation_bytes_per_layer",
    "attention_bias_bytes",
    "attention_entry_bytes",
    "autocast_weight_bytes",
    "autocast_weight_bytes_per_layer",
    "boundary_bytes",
    "cached_weight_bytes",
    "capped_score_bytes",
    "entry_moment_bytes",
    "exit_backward_2d_bytes",
    "first_backward_gradient_bytes",
    "head_activation_bytes",
    "head_transient_bytes",
    "mask_kinds",
    "memory_per_rank",
    "model_state_bytes",
    "op_kept_bytes",
    "params_per_rank",
    "recompute_working_bytes",
    "replay_copy_bytes",
    "replay_exit_backward_bytes",
    "replay_forward_bytes",
    "replay_gradient_bytes",
    "replay_mask_bytes",
    "replay_skipped_copy_bytes",
    "rope_position_bytes",
    "shared_mask_bytes",
    "stage_params_per_rank",
    "tied_gradient_bytes",
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
    """Transient: one block's full activations while recomputing, or on the last stage the loss's and the output
    layer's moment (`head_transient_bytes`), whichever is larger (they are never alive together)."""
    comm_buffers: float
    cast_cache: float = 0.0
    """Compute-dtype weight copies that only autocast's cast cache holds, saved by no backward
    (`cached_weight_bytes`); the copies a Linear saves are in ``activations``."""
    peak: float | None = None
    """What coexists at the rank's peak (`tessera.memory` walks the rank's action list for it); None: every
    component at once, the cost model's bound."""

    @property
    def total(self) -> float:
        return self.everything if self.peak is None else self.peak

    @property
    def everything(self) -> float:
        """Every component at its size at once (what a measurement of each component's own peak adds up to)."""
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.working
            + self.comm_buffers
            + self.cast_cache
        )


def params_per_rank(shape: ModelShape, plan: Plan, stage: int = 0) -> float:
    """Parameters held by one rank of pipeline position `stage` before ZeRO sharding: its blocks (`rank_layers`:
    the actual stage split) and, on the first stage, the embedding (+ positions); on the last stage the head if
    untied (or a tied copy if p > 1), all divided by the tensor degree (norm/bias vectors are counted as sharded
    too: a small over-estimate of savings)."""
    n = rank_layers(shape, plan, stage) * shape.layer_params()
    return (n + _end_params(shape, plan, first=stage == 0, last=stage == plan.pp - 1)) / plan.tp


def stage_params_per_rank(shape: ModelShape, plan: Plan, stage: int) -> float:
    """Parameters of global stage `stage` (chunk c of pipeline rank r is stage c·p + r) on one rank before ZeRO
    sharding, counted as `params_per_rank` counts a rank's: its blocks (`layers_per_stage`), the embedding on
    stage 0, the head on the last stage, divided by the tensor degree."""
    n = layers_per_stage(shape, plan)[stage] * shape.layer_params()
    last = plan.pp * plan.virtual_stages - 1
    return (n + _end_params(shape, plan, first=stage == 0, last=stage == last)) / plan.tp


def _end_params(shape: ModelShape, plan: Plan, *, first: bool, last: bool) -> float:
    """The embedding (+ positions) on the first stage; the final norm and the head (untied, or a tied copy on
    another pipeline rank) on the last."""
    h, V = shape.d_model, shape.vocab_size
    n = V * h + shape.features.position_params(shape.seq_len, h) if first else 0.0
    if last:
        n += shape.features.norm_params(h) + (0 if (shape.tied and plan.pp == 1) else V * h)
    return n


@_MEMO
def activation_bytes_per_layer(shape: ModelShape, plan: Plan, recompute: str | None = None) -> float:
    """Stored activation bytes of one block for one micro-batch on one rank (Korthikanti 2022 Table 2).

    No recompute: s·b·h·(34 + 5as/h) without parallelism; 1D TP: s·b·h·(10 + 24/t + 5as/(ht)); 1D TP + SP:
    s·b·h·(34/t + 5as/(ht)); 2D: everything /q² (optimus §1.6). Selective: drop the 5as/h term.
    Full: only the block input s·b·h (÷t with SP, ÷q² in 2D). Generalised to GQA/SwiGLU/no-dropout by the same
    per-tensor accounting: replicated: each norm's input, each norm output read by the Linears (+ 2 masks);
    sharded: Q, K and V (kv/h each), the output projection's input, the MLP (GELU 2 × f/h, SwiGLU 4 × f/h);
    scores (2 + 3 with dropout)·as/h in 2-byte units; flash attention stores no scores.

    Each tensor in its own dtype: `plan.act_bytes` for matmul inputs/outputs and what attention and the MLP
    compute from them, `plan.stream_bytes` for the residual stream and the norms (fp32 under tessera's
    autocast, `Plan.autocast`; the same 2 bytes in the published accounting). Under autocast each Linear
    saves its own cast of its input (wq, wk, wv: three casts of the attention norm's output, `_input_bytes`),
    except the sequence-parallel entry, which keeps the fp32 shard and gathers it again in backward. The weights'
    casts are not here: every micro-batch saves the same copy, one per step (`autocast_weight_bytes`). Measured
    by the dry run tensor by tensor (tests/unit/test_activation_formula.py, fp32 and bf16).

    The Llama family (`swiglu`) is counted as tessera's Llama block saves: each RMSNorm keeps its input and the
    normalised tensor (the 2D norm only its input), attention keeps Q, K and V expanded to all heads, SDPA's
    output and the output projection's input (a transposed copy of it), SwiGLU keeps gate, up, silu(gate) and
    their product. Selective recomputation drops SDPA's output and the expansion (K, V at kv/h). The attention
    tensors are n_heads·head_dim wide (q/h of the stream's h; 1 unless `ModelShape.head_dim` differs). Qwen3's
    per-head q/k norms (`qk_norm`) keep Q's and K's fp32 upcast and their normalised tensors, split like the
    heads. Document masking adds its RoPE gathers (`rope_position_bytes`); attention masks are not per layer but
    per micro-batch (`shared_mask_bytes`: the documents', or without them Gemma 3's local band). Gemma 2's
    post-norms are two more
    norms (`FamilyPlan.block_norms`); its soft-capped attention is written out
    (`tessera.model.layers.AttentionCore`): no SDPA output is kept, its a·s² scores are (`capped_score_bytes`),
    no mask (the additive mask's add saves nothing).
    `recompute` overrides `plan.recompute` (the working memory of a recomputed block is its "none" count).
    """
    recompute = plan.recompute if recompute is None else recompute
    if plan.cp > 1:
        return _context_layer_bytes(shape, plan, recompute)
    s, b, h, a = shape.seq_len, plan.micro_batch, shape.d_model, shape.n_heads
    sbh = s * b * h
    c, r = plan.act_bytes, plan.stream_bytes
    shard_all = plan.tp if (plan.tp_kind == "2d" or plan.sequence_parallel) else 1
    if recompute == "full":
        return sbh * r / shard_all
    if recompute == "op":
        return sbh * r / shard_all + op_kept_bytes(shape, plan)
    # attention tensors are n_heads·head_dim (q_h) or n_kv·head_dim (kv_h) wide, per unit of h
    fam, f_h, q_h, kv_h = shape.features, shape.ffn_hidden / h, shape.q_dim / h, shape.kv_dim / h
    norms = len(fam.block_norms) * _norm_bytes(shape, plan)
    inputs = _input_bytes(plan, len(fam.attention_in)) + _input_bytes(plan, len(fam.mlp_in))
    replicated = norms + inputs + (c if shape.dropout else 0)  # two 1-byte masks, in Korthikanti's units
    # selective recomputation keeps the attention core's inputs as the Linears (and RoPE) left them; after the
    # per-head q/k norms (Qwen3) Q and K are fp32 under autocast, promoted by the norms' fp32 weights; a (1 + w)
    # norm (Gemma 3) casts its output back to its input's dtype
    kept = _output_bytes(plan, fam.qkv_bias) if recompute == "selective" else c
    qk_kept = r if (fam.qk_norm and not fam.norm_offset and recompute == "selective") else kept
    qkv = qk_kept * (q_h + kv_h) + kept * kv_h
    # each per-head norm keeps its input upcast to fp32 and the normalised tensor in the Linear's dtype; a (1 + w)
    # norm (Gemma 3) multiplies the normalised tensor in fp32 before casting, so keeps it in fp32
    head_norms = (_FP32 + (_FP32 if fam.norm_offset else c)) * (q_h + kv_h) if fam.qk_norm else 0.0
    if shape.swiglu:
        attention = qkv + c * q_h if recompute == "selective" else 5 * c * q_h
        if shape.attn_softcap is not None and recompute != "selective":  # scores instead of SDPA's output
            attention += capped_score_bytes(plan) * a * s / h - c * q_h
        sharded = attention + 4 * c * f_h + head_norms
    else:
        scores = 0.0 if plan.flash_attention else (5 if shape.dropout else 2) * a * s / h * c / 2
        mlp = (_output_bytes(plan, fam.mlp_bias) + c) * f_h  # GELU's input (fc's output), proj's input
        sharded = qkv + c * q_h + mlp + head_norms + (0.0 if recompute == "selective" else scores)
    return sbh * (replicated / shard_all + sharded / plan.tp) + rope_position_bytes(shape, plan)


REPLAYS_BLOCK = ("full", "op")
"""Checkpointing modes under which each block runs under torch's checkpoint, keeping its input (and, op, the
outputs `op_kept_bytes` counts): autograd's saved tensors, the weights' compute-dtype copies and the attention
masks are made again by each block's replay, as under full recomputation."""


def op_kept_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes op checkpointing keeps of one block for one micro-batch on one rank besides the block's input
    (`tessera.parallel.checkpointing`: the outputs of the block's odd-numbered matmuls and SDPA's), c = the compute
    dtype's bytes, N = the rank's tokens: wq's and wv's outputs (c·N·(q + kv)/t), SDPA's output (c·N·q/t) and its
    fp32 log-sum-exp (4·N·a/t; none for a soft-capped core, written out in bmm, which op mode replays), the MLP's
    first Linear's output (SwiGLU's gate, GPT's fc: c·N·f/t) and SwiGLU's down projection's (w2, the 7th matmul:
    the row-parallel partial sum before its all-reduce or reduce-scatter, c·N·h on every tensor rank)."""
    tokens = shape.seq_len // plan.cp * plan.micro_batch
    c, t, q = plan.act_bytes, plan.tp, shape.q_dim
    kept = c * (q + shape.kv_dim + shape.ffn_hidden) / t
    if shape.attn_softcap is None:
        kept += c * q / t + _FP32 * shape.n_heads / t
    if shape.swiglu:
        kept += c * shape.d_model
    return tokens * kept


def context_local(shape: ModelShape, plan: Plan) -> tuple[ModelShape, Plan]:
    """A context rank's view (tessera's `parallel.context` c, docs/context-parallel.md): its s/c tokens, and the
    mask every layer's SDPA then keeps (its positions are global, so the run always passes one)."""
    return replace(shape, seq_len=shape.seq_len // plan.cp), replace(plan, cp=1, document_mask=True)


def _context_layer_bytes(shape: ModelShape, plan: Plan, recompute: str) -> float:
    """`activation_bytes_per_layer` of a context rank: everything per token at s/c tokens, plus K and V of the
    other ranks' s − s/c tokens as attention keeps them (expanded to the query heads for SDPA; at n_kv heads as
    the checkpointed core's inputs under selective recomputation); its [b, 1, s/c, s] mask is one per micro-batch
    and kind, shared by the layers (`shared_mask_bytes`). Measured within 2 % by
    tests/distributed/test_context_parallel.py."""
    local_shape, local = context_local(shape, plan)
    per_token = activation_bytes_per_layer(local_shape, local, recompute)
    if recompute in REPLAYS_BLOCK:  # op: SDPA's inputs (the gathered K, V) are replayed, not kept
        return per_token
    c, s = plan.cp, shape.seq_len
    width = (shape.kv_dim if recompute == "selective" else shape.q_dim) / plan.tp
    gathered = 2 * plan.act_bytes * plan.micro_batch * width * (s - s // c)
    scores = 0.0  # soft-capped attention, written out (Gemma 2): [b, a, s/c, s] scores, c times those counted
    if shape.attn_softcap is not None and recompute != "selective":
        scores = (
            (c - 1) * capped_score_bytes(plan) * shape.n_heads / plan.tp * plan.micro_batch * (s // c) ** 2
        )
    return per_token + gathered + scores  # its masks: one per micro-batch and kind (`shared_mask_bytes`)


def mask_kinds(shape: ModelShape) -> int:
    """Distinct additive masks of a masked micro-batch (`Documents.bias`): one for the global layers, one for
    the local layers of a sliding window (Gemma 2 and 3), the band ANDed in. Counted for the whole model, also
    for a pipeline stage that holds layers of one kind only (an overestimate of one mask there)."""
    return 1 + (0 < shape.local_layers < shape.n_layers)


def attention_bias_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes of the additive masks one micro-batch builds on one rank for its layers to share
    (`tessera.model.documents.AttentionMasks.bias`): with document masking `mask_kinds` × [b, 1, s, s] in the
    compute dtype (b/q sequences on a 2D rank, all b on a 1D rank: attention sees the gathered sequence), a
    context rank's [b, 1, s/c, s] (it always masks: its positions are global); without either, the local layers'
    band (Gemma 3), one [s, s] whatever b (the same for every sequence, whole on every tensor rank), and none for
    global layers (SDPA's is_causal)."""
    s = shape.seq_len
    if plan.document_mask or plan.cp > 1:
        return mask_kinds(shape) * _rank_sequences(plan) * (s // plan.cp) * s * plan.act_bytes
    return (shape.local_layers > 0) * s * s * plan.act_bytes


def shared_mask_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes of attention masks that one pipeline stage keeps per micro-batch, shared by its layers: the
    micro-batch's additive masks (`attention_bias_bytes`: the documents' with document masking or context
    parallelism, else Gemma 3's local band), which every layer's SDPA saves by reference (one storage, not one per
    layer: tests/unit/test_shared_mask.py), or under selective recomputation every checkpointed core saves as its
    input (with documents; without them the checkpointed core cuts its band itself, again in backward, and keeps
    none). Not under full recomputation (the model drops them after its forward, `AttentionMasks.release`; the
    replayed blocks build them again: working memory), nor in soft-capped attention without selective
    recomputation (it adds them to the scores, which saves nothing). Until 2026-12-03 SDPA kept a cast of a
    boolean mask per layer instead (documents, and Gemma 3's band without them). Per stage: `tessera.memory` adds
    it to each stage that holds blocks."""
    if plan.recompute in REPLAYS_BLOCK:
        return 0.0
    if shape.attn_softcap is not None and plan.recompute != "selective":
        return 0.0
    if plan.recompute == "selective" and not (plan.document_mask or plan.cp > 1):
        return 0.0
    return attention_bias_bytes(shape, plan)


def replay_mask_bytes(shape: ModelShape, plan: Plan) -> float:
    """Under full recomputation, the masks a micro-batch's replays build again on a rank and keep in its masks
    object (`AttentionMasks`, which the checkpoints hold) until the micro-batch's last backward there: the
    additive masks (`attention_bias_bytes`: the documents' or a context rank's, else Gemma 3's local band), and
    with documents or context parallelism the boolean mask they are cut from (`Documents.mask`, [b, 1, L, S], one
    byte an element; b/q sequences on a 2D rank; the band's boolean is a temporary). 0 otherwise."""
    if plan.recompute not in REPLAYS_BLOCK:
        return 0.0
    bias = attention_bias_bytes(shape, plan)
    if not (plan.document_mask or plan.cp > 1):
        return bias
    s = shape.seq_len
    return bias + _rank_sequences(plan) * (s // plan.cp) * s


def rope_position_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes per layer of the RoPE tables gathered at each token's position in its document (`Plan.document_mask`;
    `tessera.model.layers.Rope`): cos and sin, [b, 1, s, hd/2] each in fp32, a fresh gather per layer that the
    rotation keeps for backward (with positions 0..s-1 it keeps slices of the tables instead: nothing new).
    Computed outside the attention core, so kept under selective recomputation too."""
    if not (plan.document_mask and shape.features.rope):
        return 0.0
    return _rank_sequences(plan) * shape.seq_len * shape.head_dim * _FP32


def _rank_sequences(plan: Plan) -> float:
    """Sequences of a micro-batch whose attention one rank computes: all b of them in 1D (sequence parallelism
    gathers the sequence before attention), b/q in 2D (the grid's rows split the batch)."""
    return plan.micro_batch / plan.q  # q: 1 in 1D


def capped_score_bytes(plan: Plan) -> float:
    """Bytes per attention score [b, a, s, s] that soft-capped attention keeps for backward: tanh's output (the
    compute dtype), the fp32 softmax and its cast back to the compute dtype (the same tensor in fp32), which A·V
    reads. SDPA keeps none of them; this is the s² memory the cap costs (FlexAttention would keep none either)."""
    c = plan.act_bytes
    return c + _FP32 + (c if c != _FP32 else 0)


def _norm_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes per element a norm saves of its own, in the stream dtype: its input; RMSNorm also the normalised
    tensor (the weight's gradient needs it), except the 2D norm, which recomputes it."""
    rms_extra = shape.features.norm == "rms" and plan.tp_kind != "2d"
    return plan.stream_bytes * (2 if rms_extra else 1)


def _input_bytes(plan: Plan, linears: int) -> float:
    """Bytes per element saved for the input of `linears` Linears reading one norm output: one tensor in the
    stream dtype, or under autocast one cast per Linear (autocast casts a non-parameter on every call); the
    sequence-parallel entry saves only its fp32 shard (tessera.parallel.tensor_1d._GatheredLinears)."""
    if plan.casts and not _gathered(plan):
        return linears * plan.act_bytes
    return plan.stream_bytes


def _output_bytes(plan: Plan, bias: bool) -> int:
    """Bytes per element of a Linear's output: the compute dtype, except a biased 2D Linear's, whose fp32 bias
    is added after the SUMMA product and promotes it to fp32 under autocast (a 1D F.linear adds the bias in
    the compute dtype)."""
    return plan.stream_bytes if bias and plan.tp_kind == "2d" else plan.act_bytes


def autocast_weight_bytes_per_layer(shape: ModelShape, plan: Plan) -> float:
    """Bytes of one block's weights cast to the compute dtype on one rank, 0 without casts (`Plan.casts`):
    act_bytes × the block's matmul weights / t (2D: blocks of h·h'/q², the same /t). Each weight is cast once
    per autocast region, by autocast's cache (1D, no tensor parallelism) or by SUMMA's cast of its weight block
    under the same rule (2D, `tessera.parallel.precision.cast_operand`), and tessera's pipeline runtime keeps
    one region open for the whole step, so one copy lives per step (`autocast_weight_bytes`), however many
    micro-batches saved it."""
    if not plan.casts:
        return 0.0
    return plan.act_bytes * shape.block_matmul_params() / plan.tp


def autocast_weight_bytes(shape: ModelShape, plan: Plan, stage: int = 0) -> float:
    """The compute-dtype copies of the weights that live through the step on one rank of pipeline position
    `stage` under autocast (1D, 2D or no tensor parallelism): its blocks' and, on the last stage, the output
    projection's (act_bytes · V·h/t; 2D: the padded table's block, V_pad·h/q²). 0 without casts.

    A Linear saves its weight's copy for backward; the sequence-parallel entry saves the fp32 weights instead, so
    its Linears' copies (the column-parallel ones and the head's) live only in autocast's cache, which lasts the
    step in the schedule runtime (one autocast region per step) unless ZeRO-3 clears it at every FREE, and one
    micro-batch's forward in the direct loop, the loss's forward included (`_cache_holds_copies`). Those are
    `cached_weight_bytes`, the rest are saved for backward (activations)."""
    if not plan.casts:
        return 0.0
    if (
        plan.recompute in REPLAYS_BLOCK
    ):  # no block saves a copy: the cache's, and the head's own unless cache-only
        saved_head = stage == plan.pp - 1 and not _gathered(plan)
        return cached_weight_bytes(shape, plan, stage) + (
            _head_copy_bytes(shape, plan) if saved_head else 0.0
        )
    if _gathered(plan) and not _cache_holds_copies(plan):  # only the row-parallel Linears' copies are saved
        return rank_layers(shape, plan, stage) * plan.act_bytes * _row_weights(shape) / plan.tp
    per_layer = autocast_weight_bytes_per_layer(shape, plan)
    head = _head_copy_bytes(shape, plan)
    return rank_layers(shape, plan, stage) * per_layer + (head if stage == plan.pp - 1 else 0.0)


def _head_copy_bytes(shape: ModelShape, plan: Plan) -> float:
    """The output projection's compute-dtype copy on one rank: act_bytes · V·h/t (2D: the padded table's
    block, V_pad·h/q²)."""
    return plan.act_bytes * _table_rows(shape, plan) * shape.d_model / plan.tp


def cached_weight_bytes(shape: ModelShape, plan: Plan, stage: int = 0) -> float:
    """The part of `autocast_weight_bytes` that no backward saves: under sequence parallelism (1D) the copies of
    the column-parallel weights (wq, wk, wv; the MLP's input Linears) and of the output projection, which the
    sequence-parallel entry casts through autocast's cache but saves in fp32 (`tensor_1d._GatheredLinears`),
    while the cache holds them (`_cache_holds_copies`). They are alive through the forward and backward (the
    direct loop: through each micro-batch's forward, up to the loss's moment) like the saved copies, but a count
    of what autograd saves (the dry run's activations) does not see them: counted among the activations, they made
    that row 8-68 % high on the bf16 1D + SP layouts of tests/unit/test_activation_row.py.

    Under full recomputation no block saves its copies (a checkpoint keeps only the block's input), so every
    block's copies are cache-only where the cache holds them; the replay finds them there. With ZeRO-3 (the cache
    cleared at every FREE) only the replayed block's copies exist, made again by the replay
    (`recompute_working_bytes`). Counted as saved until 2026-12-03: the activation row 16-32 % high on small
    bf16 layouts (docs/memory.md, "Full recomputation's moments")."""
    if plan.casts and plan.recompute in REPLAYS_BLOCK and _cache_holds_copies(plan):
        # every block's copies: the checkpoints save none, the replay finds them in the cache
        blocks = rank_layers(shape, plan, stage) * autocast_weight_bytes_per_layer(shape, plan)
        gathered_head = stage == plan.pp - 1 and _gathered(plan)
        return blocks + (_head_copy_bytes(shape, plan) if gathered_head else 0.0)
    if not (plan.casts and _gathered(plan) and _cache_holds_copies(plan)):
        return 0.0
    column = shape.block_matmul_params() - _row_weights(shape)
    head = _table_rows(shape, plan) * shape.d_model if stage == plan.pp - 1 else 0
    return plan.act_bytes * (rank_layers(shape, plan, stage) * column + head) / plan.tp


def zero3_block_copies_bytes(shape: ModelShape, plan: Plan) -> float:
    """ZeRO-3 under full recomputation and autocast: one block's compute-dtype weight copies that its replay casts
    (`replay_copy_bytes`) through autocast's cache (on a stage whose forward runs in the same GATHER/FREE window
    as its backward, always the last stage's, its forward already did, the ring exit's copy too:
    `memory._forward_in_window`), where they
    stay until the stage's FREE clears the cache (`ZeroStageComm.free`): a stage of L blocks holds L of them by
    its first block's replay, its backward's last. `recompute_working_bytes` counts one; 0 otherwise (without
    ZeRO-3 the cache keeps every block's through the step: `cached_weight_bytes`). Read off the dry run's live
    tensors: a 1F1B pipeline rank whose ZeRO-3 stage holds 2 GPT blocks (h 768, tensor 2 + SP, b 2) holds both
    blocks' copies at its peak, and the estimate with one was 5.3 % under the dry run (docs/memory.md)."""
    if plan.recompute not in REPLAYS_BLOCK or _cache_holds_copies(plan):
        return 0.0
    return replay_copy_bytes(shape, plan)


def zero3_window_copies_bytes(shape: ModelShape, plan: Plan) -> float:
    """ZeRO-3 under 1D sequence parallelism and autocast without a block replay (full, op): one block's cache-only
    compute-dtype weight copies (the column-parallel Linears', which the sequence-parallel entry casts through
    autocast's cache and saves in fp32: `cached_weight_bytes`' block part), 0 otherwise. The cache keeps them
    until the stage's FREE clears it (`ZeroStageComm.free`), so a stage whose backward runs in the GATHER/FREE
    window of one of its forwards (`memory._forward_in_window`) holds every block's at that backward. Read off
    the dry run's live tensors (`tessera dryrun --peak-tensors`): GPT h 4096, f 4h, pipeline 2 (1F1B) × data 2 ×
    tensor 2 + SP, ZeRO-3, bf16, no recomputation, rank 0's peak in its stage's backward holds both blocks' wq,
    wk, wv and MLP input copies (0.22 GiB, [2048, 4096] × 6 and [8192, 4096] × 2 bf16); until 2026-12-03 the
    estimate left them out (-6.8 %)."""
    if plan.recompute in REPLAYS_BLOCK or plan.zero_stage < 3 or not (plan.casts and _gathered(plan)):
        return 0.0
    return plan.act_bytes * (shape.block_matmul_params() - _row_weights(shape)) / plan.tp


def replay_copy_bytes(shape: ModelShape, plan: Plan) -> float:
    """The compute-dtype weight copies a block's replay under full recomputation casts (through autocast's cache):
    the block's (`autocast_weight_bytes_per_layer`) but the one it stops before (`replay_skipped_copy_bytes`)."""
    return autocast_weight_bytes_per_layer(shape, plan) - replay_skipped_copy_bytes(shape, plan)


def replay_skipped_copy_bytes(shape: ModelShape, plan: Plan) -> float:
    """With `Plan.tp_comm_overlap`'s rings under full recomputation and autocast, the MLP output Linear's
    compute-dtype weight copy, which a block's replay never makes (0 otherwise): the exit ring saves its input and
    fp32 weight before it runs (`ring_1d.ring_row_parallel`, `checkpointing.save_early`) and casts the weight
    inside its forward (`ring_1d._cast_weights_here`), so the replay, which stops once the block's last saved
    tensor is packed, stops before that cast, unless a post-norm saves the exit's output
    (`traffic.replays_mlp_exit`). The plain exit (F.linear under autocast) casts before it packs. Only a stage
    whose forward ran in the same autocast cache (ZeRO-3's last stage: the same GATHER/FREE window) holds it.
    Read off the dry run's live tensors: counted until 2026-12-03, h 4096, data 2, tensor 2 + SP, ZeRO-3 with
    the rings, one micro-batch of 2, was 2.2 % over the dry run (64 MiB, [4096, 8192] bf16; docs/memory.md,
    "The tensor-parallel rings' backward")."""
    if plan.recompute != "full" or not (plan.casts and plan.tp_comm_overlap) or replays_mlp_exit(shape):
        return 0.0
    exit_ = _mlp_exit(shape)
    return plan.act_bytes * exit_.d_in * exit_.d_out / plan.tp


def _mlp_exit(shape: ModelShape) -> LinearShape:
    """The block's MLP output Linear (its last Linear whose name starts with "mlp.")."""
    return next(lin for lin in reversed(shape.block_linears()) if lin.name.startswith("mlp."))


def zero3_cached_head_bytes(shape: ModelShape, plan: Plan) -> float:
    """ZeRO-3 under 1D sequence parallelism and autocast: the output projection's compute-dtype copy
    (`_head_copy_bytes`), which the head's forward casts through autocast's cache and no backward saves (the
    sequence-parallel entry saves the fp32 weight), alive from that forward until its stage's FREE clears the
    cache (`ZeroStageComm.free`); 0 otherwise (without ZeRO-3 the cache holds it through the step:
    `cached_weight_bytes`). In every named schedule's lowered list each backward of the last stage comes after a
    forward of it within the same GATHER/FREE window (checked over 1F1B, GPipe, interleaved and breadth-first, p up
    to 8, v up to 16, m up to 32, every rank), so the walk counts it with the last stage's gathered parameters.
    Read off the dry run's live tensors: megatron-1t's last stage holds it at its peak (0.31 GiB, [6400, 25600]
    bf16; docs/memory.md, "Full recomputation's moments")."""
    if plan.zero_stage < 3 or not (plan.casts and _gathered(plan)):
        return 0.0
    return _head_copy_bytes(shape, plan)


def _gathered(plan: Plan) -> bool:
    """Whether the blocks enter the tensor region through the sequence-parallel entry (1D + SP, t > 1)."""
    return plan.sequence_parallel and plan.tp_kind == "1d" and plan.tp > 1


def _row_weights(shape: ModelShape) -> int:
    """Elements of one block's row-parallel weights (the output projection, the MLP's output Linear)."""
    return sum(lin.d_in * lin.d_out for lin in shape.block_linears() if lin.role == "row")


def _table_rows(shape: ModelShape, plan: Plan) -> int:
    """Rows of the output projection's table as its casts count them: V, or in 2D V rounded up to a multiple of
    q (the padded table, tessera.parallel.layers_2d)."""
    if plan.tp_kind != "2d":
        return shape.vocab_size
    return -(-shape.vocab_size // plan.q) * plan.q


def _cache_holds_copies(plan: Plan) -> bool:
    """Whether autocast's cast cache holds each weight's copy at the rank's peak: the schedule runtime runs a step
    in one autocast region, so the copies last the step, unless ZeRO-3 clears the cache when it frees a stage;
    the direct loop (no pipeline, no ZeRO, one micro-batch at a time: `tessera.execution`) opens a region per
    micro-batch's forward, whose last moment is the loss's (logits, their fp32 copy, the shifted logits:
    `head_transient_bytes`), the copies still cached. Until 2026-12-03 the direct loop's copies were left out:
    gpt2-124m, 2 layers, tensor 2 + SP, bf16, one micro-batch of 2 fell 4.9 % under the dry run without them."""
    return plan.zero_stage < 3


def replay_gradient_bytes(shape: ModelShape, plan: Plan) -> float:
    """Under full recomputation, what a replayed block's backward holds at its fullest beyond the block's "none"
    count (the tensors its replay saves): the larger of two moments, which do not overlap (0 otherwise). N: the
    rank's tokens (s/c with context parallelism); c, r: the compute and stream dtypes' bytes.

    - The MLP's activation backward: the gradient of the output Linear's input and one gradient per input
      Linear's output (GELU: d(gelu out), d(fc out); SwiGLU/GeGLU: d(product), d(up), d(act(gate))), [N, f/t]
      each in c, while the output Linear's input, freed by that Linear's backward, is gone: ``len(mlp_in)``
      such tensors beyond the "none" count (2D: N/q·f/q, the same /t). The block's upstream gradient (fp32,
      [N, h]) is the replay's input counted twice (the checkpoint's and the "none" count's norm input), so it
      adds nothing.
    - With 1D sequence parallelism, the entry's backward (`tensor_1d._GatheredLinears`, which saved its fp32
      shard): by then every MLP tensor the "none" count names is freed (`_mlp_saved_bytes`), and alive are the
      input Linears' output gradients (its inputs, ``len(mlp_in)`` × [N, f/t] in c) and `_entry_buffer_bytes`.

    With `Plan.tp_comm_overlap` the entry and exit are rings (`tessera.parallel.ring_1d`) whose backward holds
    sequence chunks, weight casts and per-lane weight gradients instead of the entry's buffers: the MLP's moment
    or the rings' (`ring_moment_bytes`), whichever is larger.
    Read off the dry run's live tensors (docs/memory.md, "Full recomputation's moments"). Until 2026-12-03 the
    two moments were added (the MLP's gradients and two [N, h] stream-dtype tensors for the entry): the 1D +
    sequence-parallel rows +0.1 % to +3.3 % above the dry run, whose peak is at the entry's backward."""
    if plan.recompute not in REPLAYS_BLOCK:
        return 0.0
    grads = mlp_backward_bytes(shape, plan)
    if not _gathered(plan):
        return grads
    if plan.tp_comm_overlap:  # the rings replace the entries
        return max(grads, ring_moment_bytes(shape, plan))
    entry = grads - _mlp_saved_bytes(shape, plan) + _entry_buffer_bytes(shape, plan)
    return max(grads, entry, attention_entry_bytes(shape, plan))


def mlp_backward_bytes(shape: ModelShape, plan: Plan) -> float:
    """The MLP's activation backward beyond the block's saved tensors, whatever the recomputation: the gradient of
    the output Linear's input and one gradient per input Linear's output (GELU 2, SwiGLU/GeGLU 3, [N, f/t] each
    in the compute dtype; 2D [N/q, f/q]) while the output Linear's input, freed by that Linear's backward, is
    gone: ``len(mlp_in)`` such tensors (N: the rank's tokens, s/c with context parallelism). Under full
    recomputation part of the replay's backward (`replay_gradient_bytes`); without it a block's moment of its own
    (`recompute_working_bytes`), which until 2026-12-03 was left out where no sequence-parallel entry is: Llama,
    8 layers, h 256, s 128, pipeline 2 (1F1B) × data 2 × tensor 2, ZeRO-1, fp32, 2 micro-batches of 2, rank 0
    -2.6 % under the dry run (docs/memory.md, "The 2D grid's stage boundaries")."""
    tokens = shape.seq_len // plan.cp * plan.micro_batch
    return len(shape.features.mlp_in) * plan.act_bytes * tokens * shape.ffn_hidden / plan.tp


def entry_moment_bytes(shape: ModelShape, plan: Plan) -> float:
    """Under 1D sequence parallelism, the fullest of the tensor region's entries' (and with the rings, exits')
    backward moments beyond the block's saved tensors, 0 otherwise: with `Plan.tp_comm_overlap` the rings'
    (`ring_moment_bytes`), else the larger of the MLP's entry (its inputs, the input Linears' output gradients,
    and `_entry_buffer_bytes`, the MLP's own saved tensors freed) and the attention's (`attention_entry_bytes`).
    Under no and selective recomputation these are a block's moments beyond what it saves (full recomputation
    takes them in `replay_gradient_bytes`). Until 2026-12-03 the plain entries were counted under full
    recomputation only: GPT, h 2048, f = h, tensor 2 + SP, b 2, no recomputation, 5.3 % under the dry run."""
    if not _gathered(plan):
        return 0.0
    if plan.tp_comm_overlap:
        return ring_moment_bytes(shape, plan)
    grads = mlp_backward_bytes(shape, plan)
    entry = grads - _mlp_saved_bytes(shape, plan) + _entry_buffer_bytes(shape, plan)
    return max(entry, attention_entry_bytes(shape, plan))


@_MEMO
def ring_moment_bytes(shape: ModelShape, plan: Plan) -> float:
    """With `Plan.tp_comm_overlap` (1D + SP), the MLP's rings' backward at its fullest beyond the block's saved
    tensors (0 otherwise), the larger of (`tessera.planner.cost.ring_memory`):

    - the exit's (`ring_exit_backward_bytes`), which runs first, every saved tensor of the block still alive;
    - the entry's (`ring_entry_backward_bytes`), by when the MLP's own saved tensors are freed
      (`_mlp_saved_bytes`) and its inputs, the input Linears' output gradients (``len(mlp_in)`` × [N, f/t] in
      c), are alive;
    - the attention's exit ring (the output projection, input width q_dim), once the MLP's backward has freed its
      saved tensors and its norm's and entry's, and the attention's entry ring (`attention_entry_bytes`): they
      bind where f is not much larger than h (GPT at f = h: 10-17 % under the dry run without them).

    A moment of its own beside the others of a block's backward (the estimate is the largest). Read off the dry
    run's live tensors (docs/memory.md, "The tensor-parallel rings' backward"): without it the 1D + SP rows with
    the rings fell 3.1 % to 7.1 % under the dry run."""
    if not plan.tp_comm_overlap:
        return 0.0
    grads = mlp_backward_bytes(shape, plan)
    entry = grads - _mlp_saved_bytes(shape, plan) + ring_entry_backward_bytes(shape, plan)
    # the attention's exit ring runs once the MLP's backward (its norm's and entry's saved tensors too) is over
    mlp_freed = _mlp_saved_bytes(shape, plan) + _kept_bytes(shape, plan)
    attention_exit = ring_exit_backward_bytes(shape, plan, width=shape.q_dim) - mlp_freed
    return max(
        ring_exit_backward_bytes(shape, plan), entry, attention_exit, attention_entry_bytes(shape, plan)
    )


def _attention_widths(shape: ModelShape) -> list[int]:
    """The output features of the attention's input Linears (wq, wk, wv: q_dim, kv_dim, kv_dim)."""
    names = {f"attn.{n}" for n in shape.features.attention_in}
    return [lin.d_out for lin in shape.block_linears() if lin.name in names]


def _kept_bytes(shape: ModelShape, plan: Plan) -> float:
    """One sublayer's norm's saved tensors and its sequence-parallel entry's shard ([N/t, h] each, stream
    dtype): what of the block's saved tensors is left at that sublayer's entry backward (on the attention's,
    with the block's input the norm keeps standing for the block's upstream gradient, as in
    `replay_gradient_bytes`)."""
    tokens = shape.seq_len // plan.cp * plan.micro_batch
    return (_norm_bytes(shape, plan) + plan.stream_bytes) * tokens * shape.d_model / plan.tp


@_MEMO
def attention_entry_bytes(shape: ModelShape, plan: Plan) -> float:
    """Under 1D sequence parallelism, the attention's entry backward (wq, wk and wv sharing one entry:
    `tensor_1d._GatheredLinears`, or with `Plan.tp_comm_overlap` the ring, `ring_1d._RingGatheredLinears`) at
    its fullest, beyond the block's saved tensors (its "none" count; the selective count under selective
    recomputation); 0 otherwise. It is the block's backward's last moment: every saved tensor is freed but the
    attention norm's and the entry's shard (`_kept_bytes`), and alive are its inputs, the gradients of Q, K and
    V ([N, q_dim/t], [N, kv_dim/t] twice, in c), and the entry's own: `_entry_turns_bytes` with the three
    Linears' widths (the gathered input, its copies and casts, the input-gradient part and sum, the fp32 weight
    gradients of the Linears before the one at work), or the ring's (`ring_entry_backward_bytes`).

    Smaller than the MLP entry's where f exceeds h (its inputs and weight gradients are f-wide), but in a stage's
    first backward the block's other weight gradients are all made by then (`tessera.memory._first_backward`
    adds them): megatron-1t's winner (h 25600, t 4, one micro-batch per stage) peaks here, at wv's turn, the
    gathered input's cast (docs/memory.md, "The attention's entry")."""
    if not _gathered(plan):
        return 0.0
    tokens = shape.seq_len // plan.cp * plan.micro_batch
    widths = _attention_widths(shape)
    grads = plan.act_bytes * tokens * sum(widths) / plan.tp  # dQ, dK, dV
    saved = activation_bytes_per_layer(
        shape, plan, recompute="selective" if plan.recompute == "selective" else "none"
    )
    freed = saved - _kept_bytes(shape, plan)
    if plan.tp_comm_overlap:
        buffers = ring_entry_backward_bytes(shape, plan, widths)
    else:
        buffers = _entry_turns_bytes(shape, plan, [w / plan.tp * shape.d_model for w in widths])
    return grads - freed + buffers


def _mlp_saved_bytes(shape: ModelShape, plan: Plan) -> float:
    """The MLP's own saved tensors in a block's "none" count on a 1D rank, [N, f/t] each (SwiGLU: gate, up,
    act(gate), their product in c; GELU: fc's output and the output Linear's input), all freed before the
    sequence-parallel entry's backward (the norm's and the entry's saved tensors are not among them)."""
    tokens = shape.seq_len // plan.cp * plan.micro_batch
    per_token = (
        4 * plan.act_bytes if shape.swiglu else _output_bytes(plan, shape.features.mlp_bias) + plan.act_bytes
    )
    return per_token * tokens * shape.ffn_hidden / plan.tp


def _entry_buffer_bytes(shape: ModelShape, plan: Plan) -> float:
    """What the sequence-parallel entry's backward (`tensor_1d._GatheredLinears.backward`) holds at its fullest
    beyond its inputs (the input Linears' output gradients), the largest of four moments of its last Linear's
    turn in the loop (`_entry_turns_bytes`, which also prices the attention's entry, Linears of unequal widths); [N, h] tensors of the rank's N tokens, and the input Linears' weight gradients ([f/t, h]
    each, w elements), which the Function returns only when it is done, so that the fp32 gradients of the
    Linears before the last (``earlier``, 4·w each) are alive at all four:

    - the cast of the gathered input for the weight gradient's product: the shard gathered again (r;
      `comm.all_gather` fills an [s, b, h] buffer seen as [b, s, h]), its contiguous copy for the flattened
      product (r, only when b > 1: with one sequence the view is already contiguous), that copy's cast to the
      gradients' dtype (c, none when c = r), the last Linear's input-gradient part and the running sum (c each;
      the part alone with one input Linear);
    - the product itself: the contiguous copy freed once cast (kept as the operand when c = r), and the product
      [f/t, h] in c;
    - the product's cast to the fp32 master weight's dtype (`.to(w.dtype)`, only when c < 4): the gathered
      input, the part and the sum, the product and its fp32 cast ((c + 4)·w);
    - the reduce-scatter: the gathered input, the part and the sum, the sum made contiguous along the sequence
      (c) and the rank's [N/t, h] slice (c), beside every input Linear's fp32 weight gradient.

    The weight gradients are beyond the stage's accumulated ``.grad`` (the walk's gradients): from a stage's
    second micro-batch on the fp32 gradient is a new tensor, added into ``.grad`` once the Function returns. Left
    out: the bias gradients ([f/t] each) and, before each part's product, the weight's transient cast to c
    (c·w, less than the fp32 gradient the product's cast makes). Until 2026-12-03 the weight gradients were left
    out: megatron-1t's last stage (h 25600, f/t 12800, b 2, bf16) holds 1.83 GiB of them at its peak, the
    product's cast, where the [N, h] tensors are 0.59 GiB, and the estimate was 2.0 % under the dry run
    (docs/memory.md, "Full recomputation's moments")."""
    w = shape.ffn_hidden / plan.tp * shape.d_model  # one input Linear's weight gradient, [f/t, h] elements
    return _entry_turns_bytes(shape, plan, [w] * len(shape.features.mlp_in))


def _entry_turns_bytes(shape: ModelShape, plan: Plan, weights: list[float]) -> float:
    """`_entry_buffer_bytes`'s four moments for an entry whose Linears' weight gradients are ``weights``
    elements each ([out_i/t, h]; the attention's wq, wk, wv differ with GQA), the fullest over every Linear's
    turn in the loop: at turn i the fp32 gradients of the Linears before it are alive and the input-gradient sum
    exists from the second turn on. With equal widths the last turn is the fullest (the MLP's); with GQA's
    narrow wk and wv an earlier turn can be."""
    c, r = plan.act_bytes, plan.stream_bytes
    nh = shape.seq_len // plan.cp * plan.micro_batch * shape.d_model  # [N, h] elements
    copy = r if plan.micro_batch > 1 else 0  # the gathered input made contiguous
    fullest = 0.0
    for i, w in enumerate(weights):
        earlier = _FP32 * sum(weights[:i])  # the fp32 gradients of the Linears before this one
        sums = c * (2 if i else 1)  # this Linear's part and the running sum (the part alone at the first)
        input_cast = (r + copy + (c if c < r else 0) + sums) * nh
        product = (r + (c if c < r else copy) + sums) * nh + c * w
        product_cast = (r + sums) * nh + (c + _FP32) * w if c < _FP32 else 0.0
        fullest = max(fullest, earlier + max(input_cast, product, product_cast))
    # the reduce-scatter, after the loop: the sum made contiguous and the rank's slice, every fp32 gradient
    scatter = (r + c * (2 if len(weights) > 1 else 1) + c + c / plan.tp) * nh + _FP32 * sum(weights)
    return max(fullest, scatter)


def replay_forward_bytes(shape: ModelShape, plan: Plan) -> float:
    """Under full recomputation on the 2D grid, what a replayed block holds beyond the tensors its replay saves
    at its forward's fullest moment, and the upstream gradient, 0 otherwise. The replay runs inside the block's
    last backward node (the MLP output Linear's, whose saved tensors its unpacking recomputes) and stops once the
    last of them is packed: the product's operands are saved before its SUMMA (`checkpointing.save_early`), so the
    replay stops before that Linear's broadcasts and GEMMs, unless a post-norm saves its output (Gemma 2/3,
    `traffic.replays_mlp_exit`), whose replay runs the SUMMA whole. Alive then, [N/q, ·] blocks of the rank's
    N = s·b tokens (s/c with context parallelism):

    - the block's forward locals: the attention norm's output, the attention's output (the output Linear's, in
      the compute dtype or fp32 where its bias is added after the product; a post-norm's, fp32), the residual
      after attention and the MLP norm's output, the stream dtype, [N/q, h/q] each (the 2D norm's output is
      fp32, its weight promotes it);
    - where the replay runs the exit's SUMMA (`tensor_2d._summa_ab`): its output [N/q, h/q] and the two
      broadcast slots of each operand (`_broadcast_blocks`), the MLP product's [N/q, f/q] and the weight's
      [f/q, h/q], in the compute dtype;
    - the block's upstream gradient, [N/q, h/q] in the stream dtype, and under autocast its compute-dtype cast
      for the MLP output Linear's backward (the 2D norm saves its normalised tensor, not the block's input, so
      unlike 1D no saved tensor counted twice stands for the gradient).

    The replay's backward moments (`replay_exit_backward_bytes`, the exit's; `replay_gradient_bytes`, the MLP's)
    hold the same upstream gradient and gradients and SUMMA buffers instead of the locals:
    `recompute_working_bytes` takes the largest. Read off the dry run's live tensors (docs/memory.md, "Full
    recomputation's moments"): until 2026-12-03 the 2D estimate was 6.1 % under the dry run (Llama, 4 layers,
    h 256, s 256, tensor 2×2, bf16), when the replay still ran the exit's SUMMA."""
    if plan.recompute != "full" or plan.tp_kind != "2d" or plan.q < 2:
        return 0.0
    fam, c, r = shape.features, plan.act_bytes, plan.stream_bytes
    rows = shape.seq_len // plan.cp * plan.micro_batch / plan.q  # N/q: the tokens of this rank's grid row
    h, f = shape.d_model / plan.q, shape.ffn_hidden / plan.q
    attention_out = r if fam.post_norms else _output_bytes(plan, fam.out_bias)
    local = (3 * r + attention_out) * rows * h
    # the exit's SUMMA runs in the replay only where a post-norm saves its output (`checkpointing.save_early`)
    summa = c * (rows * h + 2 * rows * f + 2 * f * h) if replays_mlp_exit(shape) else 0.0
    cast = c if c < r else 0
    return local + summa + (r + cast) * rows * h


def replay_exit_backward_bytes(shape: ModelShape, plan: Plan) -> float:
    """Under full recomputation on the 2D grid, what a replayed block's MLP output Linear's backward holds at its
    fullest beyond the tensors the replay saves, 0 otherwise. Once the replay stops before that Linear's SUMMA
    (`checkpointing.save_early`), this is the replayed block's fullest moment: the weight gradient's AᵀB at its last
    step, in the compute dtype,

    - the input gradient dA = dC·Bᵀ (ABᵀ), [N/q, f/q], made first and alive until the node returns;
    - AᵀB's two broadcast slots of the product A (`_broadcast_blocks`), [N/q, f/q] each;
    - its q partial products [f/q, h/q], alive until their reduces down the column are awaited;

    and the block's upstream gradient, [N/q, h/q] in the stream dtype, with its compute-dtype cast under
    autocast. Read off the dry run's live tensors (docs/memory.md, "Full recomputation's moments"): without it
    the 2D estimate fell 2.1 % under the dry run once the replay stopped before the exit."""
    if plan.recompute != "full":
        return 0.0
    return exit_backward_2d_bytes(shape, plan)


def exit_backward_2d_bytes(shape: ModelShape, plan: Plan) -> float:
    """On the 2D grid, the MLP output Linear's backward (`tensor_2d._MatmulAB`) at its fullest beyond the block's
    saved tensors, whatever the recomputation, 0 elsewhere: at AᵀB's last step (`_summa_atb`) the input gradient
    dA ([N/q, f/q]), the two broadcast slots of the product A ([N/q, f/q] each), the q partial products
    ([f/q, h/q]) in the compute dtype, and the upstream gradient ([N/q, h/q], stream dtype) with its cast under
    autocast. It is the block's first backward node, so every saved tensor is still alive beside it
    (`replay_exit_backward_bytes` under full recomputation; `recompute_working_bytes` otherwise). Read off the
    dry run's live tensors (`tessera dryrun --peak-tensors`, docs/memory.md "The 2D grid's stage boundaries"):
    Llama, 4 layers, h 256, s 256, tensor 2×2, fp32, no recomputation, one block per stage: the peak is this
    moment (1.6 MiB of SUMMA buffers), which until 2026-12-03 the estimate counted under full recomputation only
    (-1.5 %; selective -1.7 %)."""
    if plan.tp_kind != "2d" or plan.q < 2:
        return 0.0
    c, r = plan.act_bytes, plan.stream_bytes
    rows = shape.seq_len // plan.cp * plan.micro_batch / plan.q  # N/q: the tokens of this rank's grid row
    h, f = shape.d_model / plan.q, shape.ffn_hidden / plan.q
    cast = c if c < r else 0
    return c * (3 * rows * f + plan.q * f * h) + (r + cast) * rows * h


def _replay_upstream_bytes(shape: ModelShape, plan: Plan) -> float:
    """The upstream gradient of a replayed 2D block at its backward moment ([N/q, h/q], stream dtype; see
    `replay_forward_bytes`), 0 elsewhere (1D and one rank: the replay's input, counted twice, stands for it)."""
    if plan.recompute != "full" or plan.tp_kind != "2d" or plan.q < 2:
        return 0.0
    return plan.stream_bytes * shape.seq_len // plan.cp * plan.micro_batch * shape.d_model / plan.tp


@_MEMO
def recompute_working_bytes(shape: ModelShape, plan: Plan) -> float:
    """A recomputed block's moment in its backward, beyond what the rank keeps for it (0 without recomputation):
    its un-checkpointed activations (`activation_bytes_per_layer`'s "none" count; under selective recomputation
    the part of it the selective count does not keep, which the replayed core makes again: until 2026-12-03 the
    whole "none" count, the block's kept tensors twice, Llama tensor 2 + SP b 2 +4.0 % over the dry run), and
    under full recomputation
    the gradients in flight (`replay_gradient_bytes`; on the 2D grid with the upstream gradient, or the replayed
    forward's SUMMA moment if larger, `replay_forward_bytes`) and, where autocast's cache does not hold the
    weight copies through the step (ZeRO-3 clears it at every FREE, `_cache_holds_copies`), the block's
    compute-dtype weight copies that its replay makes again (`replay_copy_bytes`: with the rings not the MLP
    exit's, which the replay stops before; a stage whose forward cast it in the same window adds it back,
    `tessera.memory`). The direct
    loop's replay runs after its forward's autocast region, so it makes them too (`tessera.memory` adds them
    there). Under selective recomputation without documents a local layer's replayed core cuts its band again
    (`shared_mask_bytes` keeps none); the masks full recomputation's replays build again `tessera.memory` adds
    beside this (`replay_mask_bytes`)."""
    # the saved tensors are the block's own: only these backwards hold more (selective: beside its replayed core)
    moments = (
        entry_moment_bytes(shape, plan),
        exit_backward_2d_bytes(shape, plan),
        mlp_backward_bytes(shape, plan),
    )
    if plan.recompute == "none":
        return max(moments)
    if plan.recompute == "selective":
        return max(_replay_bytes(shape, plan), *moments)
    return _replay_bytes(shape, plan)


def _replay_bytes(shape: ModelShape, plan: Plan) -> float:
    """`recompute_working_bytes`' replay: full or op recomputation's replayed block at its fullest, or selective
    recomputation's replayed attention core (without the block's own backward moments, which the caller adds)."""
    backward = replay_gradient_bytes(shape, plan) + _replay_upstream_bytes(shape, plan)
    # 2D: the larger of the replay's forward, its MLP output Linear's backward and the MLP's backward
    replay = max(backward, replay_forward_bytes(shape, plan), replay_exit_backward_bytes(shape, plan))
    working = activation_bytes_per_layer(shape, plan, recompute="none") + replay
    if plan.recompute == "selective":
        # the replayed core makes again what selective recomputation does not keep (SDPA's output, K and V
        # expanded, the scores without flash attention); the block's kept tensors are among the rank's already,
        # and its gradients take the place of freed tensors, as under no recomputation
        working -= activation_bytes_per_layer(shape, plan)
    if plan.recompute in REPLAYS_BLOCK and not _cache_holds_copies(plan):
        working += replay_copy_bytes(shape, plan)  # not the ring exit's, which the replay stops before
    if plan.recompute == "selective" and not (plan.document_mask or plan.cp > 1):
        working += attention_bias_bytes(shape, plan)  # the band, [s, s] (0 without local layers)
    if plan.recompute == "op":
        # the replay makes again what op does not keep; the kept outputs are among the rank's activations
        working -= op_kept_bytes(shape, plan)
    return working


@_MEMO
def first_backward_gradient_bytes(shape: ModelShape, plan: Plan) -> float:
    """Under no or selective recomputation, how much more a block's fullest backward moment holds in its stage's
    first backward of the step (from the second on the stage's gradients exist whole), beyond
    `recompute_working_bytes`: the fp32 weight gradients the block's backward has made by each moment (0 under
    full and op recomputation, whose replay `tessera.memory._first_backward` prices; there is no other
    difference). By the MLP's activation backward and its sequence-parallel entry (or ring), the MLP output
    Linear's ([h, f/t]; its backward is the block's first); by the attention's entry, every Linear's but wq, wk
    and wv; by the replayed core of selective recomputation (the attention's backward), the same. The later
    blocks' gradients are not added: they take the place of those blocks' freed activations, which the walk
    still counts and which are larger at every shape priced here. Read off the dry run's live tensors:
    llama-tiny, dp2 × pp2 × tp2 + SP, ZeRO-1 (tests/distributed/test_dryrun.py's layout), rank 0's peak is its
    first backward's MLP activation backward with the output Linear's fp32 gradient ([32, 48]) beside it:
    −3.7 % under the dry run without it (docs/memory.md, "A stage's first backward")."""
    if plan.recompute in REPLAYS_BLOCK:
        return 0.0
    exit_ = _mlp_exit(shape)
    made = _FP32 * exit_.d_in * exit_.d_out / plan.tp
    attention_in = {f"attn.{n}" for n in shape.features.attention_in}
    others = _FP32 * sum(
        lin.d_in * lin.d_out for lin in shape.block_linears() if lin.name not in attention_in
    )
    others /= plan.tp
    moments = [mlp_backward_bytes(shape, plan) + made]
    if _gathered(plan):  # the MLP's entry (or the rings) after the exit; the attention's entry last
        moments += [entry_moment_bytes(shape, plan) + made, attention_entry_bytes(shape, plan) + others]
    if plan.recompute == "selective":
        moments.append(_replay_bytes(shape, plan) + others)
    return max(0.0, max(moments) - recompute_working_bytes(shape, plan))


def head_activation_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes one micro-batch keeps for backward in the head, besides its fp32 logits: the final norm's saved
    tensors (as in the blocks: its own, `_norm_bytes`, and the output projection's input, `_input_bytes`),
    split by the tensor degree where the sequence is (sequence parallel, 2D). The output projection's weight
    copy is one per step (`autocast_weight_bytes`). A final soft-cap (Gemma 2) keeps tanh's output, logits-sized
    in the compute dtype and split by the vocabulary like them."""
    if plan.cp > 1:  # a context rank's s/c tokens
        return head_activation_bytes(*context_local(shape, plan))
    sbh = shape.seq_len * plan.micro_batch * shape.d_model
    shard_all = plan.tp if (plan.tp_kind == "2d" or plan.sequence_parallel) else 1
    capped = 0.0
    if shape.final_softcap is not None:
        capped = shape.seq_len * plan.micro_batch * shape.vocab_size * plan.act_bytes / plan.tp
    return sbh * (_norm_bytes(shape, plan) + _input_bytes(plan, 1)) / shard_all + capped


@_MEMO
def head_transient_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes the loss and the output layer hold on the last stage for a moment, beyond what the micro-batch keeps
    for backward (`head_activation_bytes` and the loss's saved fp32 softmax, 4·N·V elements' worth, N = s·b tokens,
    V = the rank's vocabulary columns, s·b·V/t in all): the largest of the loss's forward and backward and the
    output layer's weight gradient, each tensor in its own dtype (c: the logits', `Plan.act_bytes`; an fp32 copy
    is made only when c < 4). Measured tensor by tensor with the dry run (docs/memory.md, "The head's moments"):

    - 1D vocabulary-parallel loss (`_VocabParallelCrossEntropy`): forward, the logits (c), their fp32 copy and the
      shifted logits x − max (4, which becomes the saved softmax in place): c + 4 beyond the softmax under bf16,
      c under fp32 (no copy); on the rank holding padding columns the copy is cloned first (c + 4 whatever c).
      Backward, the softmax's clone (4, the gradient) and its cast back to c: 4 + c under bf16, 4 under fp32;
    - one rank (`F.cross_entropy`): its backward holds the NLL's gradient and the log-softmax's (4 + 4) beside
      the saved log-softmax: 8;
    - 2D (`_VocabParallelCE`): its backward holds exp(z − lse) and its product with the upstream gradient (4 + 4),
      then their cast back to c: 8 + c under bf16, 8 under fp32;
    - the output layer's weight gradient (1D and one rank), after the loss's backward has freed its saved softmax
      (−4) and while the logits' gradient (c) is alive: the gradient [V/t, h] in c and its fp32 cast (c + 4 per
      element; 4 under fp32), which can exceed the loss's moment only where h is larger than about N. Under 1D
      sequence parallelism the output layer is the sequence-parallel entry (`tensor_1d._GatheredLinears`, or
      with `Plan.tp_comm_overlap` its ring) with one Linear [V_pad/t, h]: beside the logits' gradient its
      backward holds what a block's entry does (`_entry_turns_bytes`, `ring_entry_backward_bytes`): the input
      gathered again, the input gradient, its reduce-scatter's copy and slice, the weight gradient;
    - 2D, the output layer's backward (`tensor_2d._MatmulABT`) once the loss's has freed its saved softmax: the
      logits' gradient dC (c), the input gradient dA = dC·B ([N/q, h/q], made first), and at the weight
      gradient's last SUMMA step (`_summa_atb`) the two broadcast slots of dC ([N/q, V_pad/q] each) and the q
      partial products [V_pad/q, h/q], alive until their reduces are awaited, all in c (`_head_summa_bytes`).

    Before 2026-12-03 this was two fp32 logits and the weight gradient (8 + 4·h/N per logit) on every layout: under
    bf16 1D it summed tensors that are never alive together (Gemma 2 9B's last stage +3.3 %, docs/dryrun.md).
    The output layer's sequence-parallel entry and 2D SUMMA were left out until 2026-12-03: llama-tiny, dp2 ×
    pp2 × tp2 + SP, ZeRO-1 (tests/distributed/test_dryrun.py's layout), last rank −2.6 % under the dry run;
    llama-70b 2D 4×4 × pp4 breadth-first, ZeRO-1, last rank −2.2 % (docs/dryrun.md)."""
    # the rank's logit elements (a context rank's s/c tokens)
    logits = shape.seq_len // plan.cp * plan.micro_batch * shape.vocab_size / plan.tp
    c = plan.act_bytes
    cast = c if c < _FP32 else 0  # a copy in another dtype exists only when the dtypes differ
    if plan.tp_kind == "2d":
        # the saved softmax (4 per logit) is freed and the logits' gradient (c) alive at the output layer's moment
        return max((2 * _FP32 + cast) * logits, (c - _FP32) * logits + _head_summa_bytes(shape, plan))
    if plan.tp == 1:
        loss = 2 * _FP32
    else:
        padded = shape.vocab_size % plan.tp != 0  # the last rank's shard: padding columns, a masked clone
        loss = max(c + (_FP32 if (cast or padded) else 0), _FP32 + cast)
    weight_grad = shape.vocab_size * shape.d_model / plan.tp * (cast + _FP32)
    if _gathered(plan):  # the output layer is the sequence-parallel entry, one Linear of V_pad/t rows
        rows = -(-shape.vocab_size // plan.tp) * plan.tp  # `tensor_1d.padded_vocab`
        if plan.tp_comm_overlap:
            weight_grad = ring_entry_backward_bytes(shape, plan, [rows])
        else:
            weight_grad = _entry_turns_bytes(shape, plan, [rows / plan.tp * shape.d_model])
    return max(loss * logits, (c - _FP32) * logits + weight_grad)


def _head_summa_bytes(shape: ModelShape, plan: Plan) -> float:
    """2D: the output layer's backward (`tensor_2d._MatmulABT.backward`) at the weight gradient's last SUMMA step
    beyond the logits' gradient, all in the compute dtype c: the input gradient dA ([N/q, h/q], `_summa_ab`'s
    output, made first and alive until the node returns), the two broadcast slots of the logits' gradient
    ([N/q, V_pad/q] each, `_broadcast_blocks`) and the q partial products [V_pad/q, h/q] (`_summa_atb`; each is
    held by its asynchronous reduce until awaited, on a GPU and in the dry run, `tessera.fake._HeldWork`). Read
    off the dry run's live tensors: llama-70b, 2D 4×4, the last pipeline rank's peak (docs/dryrun.md)."""
    rows = shape.seq_len // plan.cp * plan.micro_batch / plan.q  # N/q: the tokens of this rank's grid row
    vocab, h = _table_rows(shape, plan) / plan.q, shape.d_model / plan.q
    if plan.q < 2:  # one grid rank: two plain products, dA and the weight gradient
        return plan.act_bytes * (rows * h + vocab * h)
    return plan.act_bytes * (rows * h + 2 * rows * vocab + plan.q * vocab * h)


def tied_gradient_bytes(shape: ModelShape, plan: Plan) -> float:
    """With the embedding tied to the output projection: the fp32 gradient of the rank's table shard ([V/t, h], V
    padded to a multiple of t; 2D: its [V_pad/q, h/q] block), which the embedding's backward makes beside the one
    the head's backward made (0 untied). In one autograd graph (the direct loop) autograd collects the two before
    accumulating them and sums them out of place (its input buffer): two tables beyond the gradient kept; with the
    head and the embedding in stages of their own (the schedule runtime), the head's is ``.grad`` already and the
    embedding's is added into it in place: one. Measured with the dry run: gpt2-774m, 2 layers, tensor 2 + SP,
    bf16, one micro-batch (the step's peak) and tests/unit/test_peak_vs_dryrun.py (docs/memory.md)."""
    if not shape.tied:
        return 0.0
    side = plan.q if plan.tp_kind == "2d" else plan.tp  # the vocabulary is padded to a multiple of this
    rows = -(-shape.vocab_size // side) * side
    return _FP32 * rows * shape.d_model / plan.tp


def boundary_bytes(shape: ModelShape, plan: Plan) -> float:
    """Bytes of one micro-batch's pipeline boundary tensor on one rank (a stage's output, sent forward and kept
    until sent; its gradient, sent back): b·s·h in the stream dtype (`Plan.stream_bytes`: fp32 under tessera's
    autocast, whose residual stream is fp32), divided by t when the sequence is split (sequence parallel, 2D)."""
    shard = plan.tp if (plan.sequence_parallel or plan.tp_kind == "2d") else 1
    return shape.seq_len // plan.cp * plan.micro_batch * shape.d_model * plan.stream_bytes / shard


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
    (`rank_layers`) × `inflight_microbatches` (from the schedule: 1F1B p − stage, GPipe/breadth-first m·v chunks ...)
    + the weight copies the Linears save; the copies only autocast's cache holds are ``cast_cache``. Working:
    one block's un-checkpointed activations when recomputing, on the last stage the larger of that and the head's
    moment (`head_transient_bytes`). Buffers:
    p2p send+recv (2 boundary tensors), ZeRO-3 gather of 2 blocks (prefetch), ZeRO-2/3 one block of full grads.
    """
    psi = params_per_rank(shape, plan, stage)
    params, grads, optimizer = model_state_bytes(psi, plan.zero_dp, plan.zero_stage, precision)
    w_b, g_b = (2, 2) if precision == "mixed" else (4, 4)
    z = plan.zero_stage
    acts = activation_bytes_per_layer(shape, plan) * rank_layers(shape, plan, stage) * inflight_microbatches
    cached = cached_weight_bytes(shape, plan, stage)  # alive, but saved by no backward: not an activation
    acts += autocast_weight_bytes(shape, plan, stage) - cached
    working = recompute_working_bytes(shape, plan)
    if stage == plan.pp - 1:  # the head's moment comes before any block is recomputed: never both at once
        working = max(working, head_transient_bytes(shape, plan))
    sbh = shape.seq_len * plan.micro_batch * shape.d_model * plan.stream_bytes
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
        cast_cache=cached,
    )
