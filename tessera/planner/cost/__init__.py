"""Analytical cost model: FLOPs, compute time, collective time, communication volume and memory per rank.

Every formula is written in the docstring of the function that computes it, with its source; the derivations and
the validation against published measurements are in docs/cost-model.md. Symbols: L layers, h hidden size, a query
heads, g key/value heads, f MLP hidden size, V vocabulary, s sequence length, b micro-batch (sequences), t 1D tensor
degree, q×q the 2D (Optimus/SUMMA) grid, p pipeline stages, v model chunks per pipeline rank, d data-parallel
degree, m micro-batches per step per pipeline.

Step-time pieces are separately callable so a pipeline simulator can place them on a timeline:
`layer_time` (per-layer forward/backward/recompute compute), `stage_time` (one pipeline stage, one micro-batch,
including exposed tensor-parallel communication), `p2p_time_per_microbatch` (one stage boundary, one direction),
`dp_time` (per-stage data-parallel reduction), `tp_comm_time_per_layer` (exposed tensor-parallel time),
`cp_comm_time_per_layer` (exposed context-parallel K/V gathers). c is the context-parallel degree: a rank holds
b·s/c tokens (`local_tokens`).
Pure Python: no torch import.

The package holds one job per module: `shape` (ModelShape, FLOPs), `plan` (Plan), `compute` (compute seconds),
`collectives` (seconds of one collective, group placement), `tp_overlap` (tensor-parallel collectives as rings
under their GEMM chunks), `volume` (bytes per collective kind), `comm_time`
(exposed communication seconds of the step pieces), `rank_memory` (bytes per rank). Import from here.
"""

from __future__ import annotations

from tessera.planner.cost.collectives import (
    all_gather_time,
    all_reduce_time,
    broadcast_time,
    group_bandwidth,
    group_placement,
    p2p_time,
    reduce_scatter_time,
)
from tessera.planner.cost.comm_time import (
    context_calls,
    cp_comm_time_per_layer,
    dp_collective_times,
    dp_time,
    p2p_time_per_microbatch,
    replica_reduce_time,
    stage_time,
    tied_exchange_time,
    tp_comm_time_per_layer,
)
from tessera.planner.cost.compute import (
    LOGIT_UPCAST_BYTES,
    OPTIMIZER_BYTES_PER_PARAM,
    LayerTime,
    elementwise_bytes_per_layer,
    embedding_time,
    gemm_time,
    layer_time,
    layers_per_stage,
    linear_gemm_times,
    local_tokens,
    logit_bytes,
    logits_time,
    rank_layers,
    score_bytes,
    weight_cast_bytes_per_layer,
)
from tessera.planner.cost.plan import Plan, per_microbatch_reduction
from tessera.planner.cost.rank_memory import (
    MemoryBreakdown,
    activation_bytes_per_layer,
    attention_bias_bytes,
    autocast_weight_bytes,
    autocast_weight_bytes_per_layer,
    boundary_bytes,
    cached_weight_bytes,
    head_activation_bytes,
    head_transient_bytes,
    memory_per_rank,
    model_state_bytes,
    params_per_rank,
    recompute_working_bytes,
    replay_exit_backward_bytes,
    replay_forward_bytes,
    replay_gradient_bytes,
    replay_mask_bytes,
    shared_mask_bytes,
    stage_params_per_rank,
    tied_gradient_bytes,
    zero3_block_copies_bytes,
    zero3_cached_head_bytes,
)
from tessera.planner.cost.shape import (
    RECOMPUTE,
    ModelShape,
    hardware_flops_per_token,
    layer_forward_flops,
    logits_forward_flops,
    model_flops_per_token,
    narayanan_flops_per_iteration,
    narayanan_params,
    palm_flops_per_token,
)
from tessera.planner.cost.tp_overlap import (
    RingCost,
    overlaps_tensor_comm,
    ring_added_time,
    ring_cost,
    ring_lanes,
    ring_step_time,
    tensor_traffic_time,
)
from tessera.planner.cost.volume import (
    CommVolume,
    dp_volume,
    pp_p2p_volume,
    tied_exchange_bytes,
    tp1d_layer_volume,
    tp2d_layer_volume,
)

__all__ = [
    "LOGIT_UPCAST_BYTES",
    "OPTIMIZER_BYTES_PER_PARAM",
    "RECOMPUTE",
    "CommVolume",
    "LayerTime",
    "MemoryBreakdown",
    "ModelShape",
    "Plan",
    "RingCost",
    "activation_bytes_per_layer",
    "all_gather_time",
    "all_reduce_time",
    "attention_bias_bytes",
    "autocast_weight_bytes",
    "autocast_weight_bytes_per_layer",
    "boundary_bytes",
    "broadcast_time",
    "cached_weight_bytes",
    "context_calls",
    "cp_comm_time_per_layer",
    "dp_collective_times",
    "dp_time",
    "dp_volume",
    "elementwise_bytes_per_layer",
    "embedding_time",
    "gemm_time",
    "group_bandwidth",
    "group_placement",
    "hardware_flops_per_token",
    "head_activation_bytes",
    "head_transient_bytes",
    "layer_forward_flops",
    "layer_time",
    "layers_per_stage",
    "linear_gemm_times",
    "local_tokens",
    "logit_bytes",
    "logits_forward_flops",
    "logits_time",
    "memory_per_rank",
    "model_flops_per_token",
    "model_state_bytes",
    "narayanan_flops_per_iteration",
    "narayanan_params",
    "overlaps_tensor_comm",
    "p2p_time",
    "p2p_time_per_microbatch",
    "palm_flops_per_token",
    "params_per_rank",
    "per_microbatch_reduction",
    "pp_p2p_volume",
    "rank_layers",
    "recompute_working_bytes",
    "reduce_scatter_time",
    "replay_exit_backward_bytes",
    "replay_forward_bytes",
    "replay_gradient_bytes",
    "replay_mask_bytes",
    "replica_reduce_time",
    "ring_added_time",
    "ring_cost",
    "ring_lanes",
    "ring_step_time",
    "score_bytes",
    "shared_mask_bytes",
    "stage_params_per_rank",
    "stage_time",
    "tensor_traffic_time",
    "tied_exchange_bytes",
    "tied_exchange_time",
    "tied_gradient_bytes",
    "tp1d_layer_volume",
    "tp2d_layer_volume",
    "tp_comm_time_per_layer",
    "weight_cast_bytes_per_layer",
    "zero3_block_copies_bytes",
    "zero3_cached_head_bytes",
]
