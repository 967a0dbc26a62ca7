"""One parallel layout + execution choice as the cost model sees it (`Plan`). Pure Python: no torch import."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.axes import DIMS
from tessera.modes import reduces_every_microbatch
from tessera.planner.hardware import DTYPE_BYTES
from tessera.planner.network import MEGATRON_ORDER

__all__ = ["Plan"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """One parallel layout + execution choice, as the cost model sees it (no ranks, no groups).

    Rank order for topology: `rank_order`, outermost first; tensor is innermost in both orders used (1D stride 1;
    2D rows stride 1, columns stride q). Default: Megatron's order (data stride t, pipeline stride t·d); the
    search plans tessera runs with `network.TESSERA_ORDER` (`tessera.layout`: pipeline stride t, data t·p).
    """

    dp: int = 1
    pp: int = 1
    cp: int = 1
    """Context-parallel ranks (tessera's `parallel.context`): each holds 1/cp of every sequence. The search tries
    cp > 1 at long context (`tessera.planner.search`, docs/planner.md); the step time prices a rank's s/c tokens
    (`cost.compute`) and the K/V gathers (`cost.cp_comm_time_per_layer`), `tessera memory` its memory."""
    tp: int = 1
    """Tensor ranks per replica: t for 1D, q² for 2D. (One rank-count field per dimension of `tessera.axes.DIMS`,
    named by its `plan_field`.)"""
    tp_kind: str = "1d"
    """"1d" (Megatron) or "2d" (Optimus/SUMMA on a q×q grid, tp = q²)."""
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    """1D + SP: each tensor-parallel all-gather / reduce-scatter runs as a ring under the GEMM chunks it feeds
    (tessera's `parallel.tp_comm_overlap`, Megatron's --tp-comm-overlap). Only where `rings_fit_layout` holds
    (`__post_init__` refuses it elsewhere), so this flag alone says whether the cost model prices the rings."""
    overlap_param_gather: bool = False
    """ZeRO-1/2: the post-step parameter all-gather runs under the next step's forward (`parallel.
    overlap_param_gather`, Megatron's --overlap-param-gather) instead of after the optimizer step."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved / looped schedules)."""
    zero_stage: int = 0
    zero_shard: int = 0
    """Hybrid sharding (HSDP): ZeRO shards over groups of this many data-parallel ranks and replicates across
    dp / zero_shard of them (tessera's `parallel.zero_shard_size`); 0: over all dp ranks. Read it through
    `zero_dp`."""
    micro_batch: int = 1
    n_microbatches: int = 1
    recompute: str = "none"
    accumulation: str = "layered"
    """"layered" (breadth-first: one DP reduction per layer per step) or "depth_first"."""
    dtype: str = "bf16"
    autocast: bool = False
    """How `dtype` is applied. False: the published accounting (Korthikanti 2022; Megatron, FSDP with
    low-precision parameters): every activation, boundary tensor and collective on activations is in `dtype`.
    True: tessera's mixed precision, fp32 master weights under torch.autocast: only matmul inputs and outputs
    (and what is computed from them: attention, the MLP activation) are in `dtype`; the residual stream, the
    norms, the embedding's output, the pipeline's boundary tensors and the collectives on them stay fp32
    (`stream_bytes`), and each Linear saves its own cast of its input and of its weight (docs/memory.md,
    "Mixed precision"). The same as False in fp32."""
    flash_attention: bool = False
    """Fused attention: no s×s score tensor in HBM (drops the 5as/h activation term and its traffic)."""
    rank_order: tuple[str, ...] = MEGATRON_ORDER
    """Parallel axes outermost first ("data", "pipe", "tensor"): decides which groups share a node."""
    stage_layers: tuple[int, ...] | None = None
    """Blocks per global stage (p·v entries, 0 allowed), as the trainer's `parallel.stage_layers`; None: an
    even split, which requires p·v to divide the layer count (`layers_per_stage`)."""
    document_mask: bool = False
    """Document masking (tessera's data.document_mask, from `tessera.memory.cost_plan`): every attention call
    gets the micro-batch's additive [b, 1, s, s] mask in the compute dtype, one tensor per kind shared by the
    layers, which keep it for backward (`rank_memory.shared_mask_bytes`), and RoPE gathers its tables at each
    token's position per layer."""
    grad_reduce_bytes: int = 0
    """Bytes per element of the data-parallel gradient reduction (tessera's `train.grad_reduce_dtype`: 2 for a
    bf16 ZeRO reduce-scatter); 0: as wide as the parameters (`param_bytes`). Read it through
    `grad_reduce_width`."""
    replays_last_exit: bool = False
    """Full recompute replays each block's whole forward, its last exit (the MLP's output GEMM and collective)
    included, as Megatron-LM's checkpointing does (it re-runs the checkpointed layers' forward) and torch's
    non-reentrant checkpoint did before it stopped early; the published Megatron runs are priced with it. False
    (tessera's runtime, torch's non-reentrant checkpoint): recomputation stops once every saved tensor is rebuilt,
    so the last exit is not replayed unless a post-norm saves its output (Gemma 2/3:
    `tessera.traffic.replays_mlp_exit`; `cost.compute.layer_time`, `tessera.traffic.replayed_1d`)."""

    def __post_init__(self) -> None:
        if self.tp_comm_overlap and not self.rings_fit_layout:
            raise ValueError(
                "tp_comm_overlap overlaps sequence parallelism's all-gather / reduce-scatter with the GEMMs; it needs "
                f"1D tensor parallelism with sequence_parallel (tp = {self.tp}, tp_kind = {self.tp_kind!r}, "
                f"sequence_parallel = {self.sequence_parallel}); set tp_comm_overlap = False"
            )

    @property
    def rings_fit_layout(self) -> bool:
        """Whether this layout's tensor-parallel collectives can run as rings (`tp_comm_overlap`): 1D with sequence
        parallelism over t > 1 ranks (tessera's config rule `tensor.tp_comm_overlap`, Megatron's assertion). The
        one predicate the cost model and the memory estimate need: a Plan with the flag set always has them.
        Context parallelism is allowed here (Megatron-Core runs the rings with it, `planner.stacks`); tessera's
        runtime refuses that pair, which the search adds (`search.tessera_runs_rings`)."""
        return self.tp_kind == "1d" and self.sequence_parallel and self.tp > 1

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

    def sizes(self) -> dict[str, int]:
        """Ranks per group of each dimension of `tessera.axes.DIMS`, by name ("data", "pipe", "tensor")."""
        return {d.name: getattr(self, d.plan_field) for d in DIMS}

    @property
    def zero_dp(self) -> int:
        """The ranks ZeRO shards the model state over: the shard group (hybrid sharding), else all dp ranks."""
        return self.zero_shard or self.dp

    @property
    def zero_replicas(self) -> int:
        """Shard groups replicating each other (1 without hybrid sharding)."""
        return max(1, self.dp * self.cp // self.zero_dp)  # context: ZeRO shards over dp·cp (1 replica)

    @property
    def replica_reduce_width(self) -> int:
        """Bytes per element of hybrid sharding's all-reduce of the gradient shards over the replica group: the
        gradient-reduction width (`grad_reduce_width`), as the reduce-scatter's — tessera reduces the fp32
        accumulated shard in place, or a copy in ``train.grad_reduce_dtype`` (docs/zero.md); the published
        accounting reduces in the gradient dtype."""
        return self.grad_reduce_width

    @property
    def batch_ranks(self) -> int:
        """Ranks that split the batch and reduce gradients together: data × context (`tessera.groups.Groups.
        batch`; ZeRO shards over them with context parallelism)."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes().values())

    @property
    def act_bytes(self) -> int:
        """Bytes per element of matmul inputs and outputs (the compute dtype)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def stream_bytes(self) -> int:
        """Bytes per element of the residual stream, the norms and the pipeline's boundary tensors: fp32 under
        tessera's autocast, else the compute dtype."""
        return 4 if self.autocast else self.act_bytes

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the parameters and gradients that the optimizer updates and the data-parallel
        collectives move: fp32 under tessera's autocast (fp32 master weights are the parameters; their
        gradients are fp32 and reduced as they are unless `grad_reduce_bytes` narrows the reduction), else the
        compute dtype (the published runs keep bf16 parameters and gradients)."""
        return 4 if self.autocast else self.act_bytes

    @property
    def grad_reduce_width(self) -> int:
        """Bytes per element of the gradients the data-parallel collectives reduce (all-reduce or ZeRO's
        reduce-scatter): `grad_reduce_bytes` when set, else `param_bytes`. Parameters' all-gathers keep
        `param_bytes`."""
        return self.grad_reduce_bytes or self.param_bytes

    @property
    def casts(self) -> bool:
        """Whether each matmul casts its operands (autocast with a compute dtype narrower than fp32): the casts
        are separate tensors, saved for backward."""
        return self.autocast and self.act_bytes != 4


def per_microbatch_reduction(plan: Plan) -> bool:
    """Whether the run reduces every micro-batch's gradient on its own (the lowered schedule's REDUCE_MB):
    `tessera.modes.reduces_every_microbatch`, except plain data parallelism without a pipeline, which the trainer
    runs as its direct loop (one bucketed all-reduce per step, `tessera.execution`)."""
    if plan.zero_stage == 0 and plan.pp == 1:
        return False
    return reduces_every_microbatch(plan.accumulation, plan.zero_stage)
