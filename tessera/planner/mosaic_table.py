"""MosaicML's published FSDP throughput table (llm-foundry) as the cost model sees it, and the Hopper calibration.

Source: MosaicML llm-foundry, `scripts/train/benchmarking/README.md` (commit 8c8dd48): MPT models trained with
PyTorch FSDP (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2; depth-first gradient accumulation, one reduce-scatter
per micro-batch) and flash attention, one row per run: model, sequence length, GPUs, micro-batch, accumulation
steps, activation checkpointing, tokens/s/GPU and MFU. The row's NumParams is reproduced exactly by our GPT shape
(biases, learned positions, tied head), which checks each transcription.

The A100 rows are validation only (`benchmarks/planner_published.py`). Of the H100 BF16 rows, the single-node
ones with sequences up to 4096 (`HOPPER_CALIBRATION`) calibrate the H100 file's `gemm_framework_share`
(`fit_hopper_share`): the A100 value was fitted on Megatron's 2021 Table 1 and no published Hopper run of that
kind gives a full configuration in BF16. The multi-node H100 rows (16 to 512 GPUs) stay validation.
Pure Python: no torch import.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from tessera.config import Config
from tessera.config.sections import ModelConfig, ParallelConfig, TrainConfig
from tessera.execution import decide
from tessera.memory import MemoryEstimate, estimate_plan
from tessera.planner.cost import ModelShape, Plan
from tessera.planner.hardware import Hardware, load_hardware
from tessera.planner.steptime import StepBreakdown, fast_step

__all__ = [
    "FP32_REDUCTION",
    "FSDP_SCHEDULE",
    "HOPPER_CALIBRATION",
    "HOPPER_SHARE_GRID",
    "MPT_SHAPES",
    "WHOLE_FORWARD_REPLAY",
    "FsdpRow",
    "calibration_errors",
    "fit_hopper_share",
    "fsdp_held_bytes",
    "fsdp_memory",
    "fsdp_plan",
    "fsdp_run_config",
    "fsdp_step",
    "fsdp_units",
    "mpt_shape",
    "predict_fsdp",
    "tokens_per_gpu",
]

MPT_SHAPES = {  # (layers, d_model, heads), llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml; V = 50,368
    "760m": (24, 1536, 12),
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 20),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 56),
    "70b": (80, 8192, 64),
}


@dataclass(frozen=True)
class FsdpRow:
    """One MosaicML benchmark row: hardware, model, seq len, GPUs, micro-batch, grad accumulation, activation
    checkpointing, published tokens/s/GPU and MFU (%), NumParams, and the ZeRO stage of its sharding strategy
    (FULL_SHARD 3, SHARD_GRAD_OP 2)."""

    hardware: str
    model: str
    seq_len: int
    gpus: int
    micro_batch: int
    accumulation: int
    checkpointing: bool
    tokens_per_gpu: float
    mfu: float
    n_params: int
    zero_stage: int = 3


def mpt_shape(row: FsdpRow) -> ModelShape:
    """MPT as benchmarked: GPT blocks with biases, learned positions, tied head; checked against NumParams."""
    layers, h, heads = MPT_SHAPES[row.model]
    shape = ModelShape(
        n_layers=layers,
        d_model=h,
        n_heads=heads,
        n_kv_heads=heads,
        ffn_hidden=4 * h,
        vocab_size=50368,
        seq_len=row.seq_len,
    )
    if shape.n_params() != row.n_params:
        raise ValueError(
            f"MPT-{row.model}: our shape has {shape.n_params()} parameters, the row {row.n_params}"
        )
    return shape


WHOLE_FORWARD_REPLAY = frozenset({"a100-80gb", "a100-40gb"})
"""Tables whose checkpointing replays each block's whole forward: the A100 rows were published with llm-foundry
pinned to torch 1.13.1 (May 2023), before torch's non-reentrant checkpoint stopped early. The H100 rows (October
2023, January 2024; torch 2.1 pinned by the latter) stop once every saved tensor is rebuilt, as tessera does, so
the MLP's output GEMM is not replayed (`cost.compute.layer_time`)."""


FP32_REDUCTION = frozenset({"h100"})
"""Tables run with Composer's "DEFAULT" FSDP mixed precision: bf16 parameters and gathers, gradients reduced in
fp32 (mosaicml/composer `get_mixed_precision`); the A100 tables' "PURE" reduces in bf16 too."""


def fsdp_plan(row: FsdpRow) -> Plan:
    """FSDP as ZeRO-`row.zero_stage` with depth-first accumulation, flash attention, bf16 gathers, and reduce-
    scatters in bf16 ("PURE", the A100 rows) or fp32 ("DEFAULT", the H100 rows: `FP32_REDUCTION`)."""
    return Plan(
        dp=row.gpus,
        zero_stage=row.zero_stage,
        micro_batch=row.micro_batch,
        n_microbatches=row.accumulation,
        recompute="full" if row.checkpointing else "none",
        accumulation="depth_first",
        flash_attention=True,
        replays_last_exit=row.hardware in WHOLE_FORWARD_REPLAY,
        grad_reduce_bytes=4 if row.hardware in FP32_REDUCTION else 0,
    )


FSDP_SCHEDULE = "breadth_first"
"""How an FSDP run is timed: FSDP wraps each transformer block as its own unit (llm-foundry, torchtitan and
fms-fsdp all do), gathered just before it runs and freed after, so one block's gather is exposed at the step's
start and the rest run under the previous block's compute. tessera runs the same thing for a pipeline-free ZeRO
layout (`execution.decide` switches it to one stage per block), so it is priced as that: `fsdp_units`."""


def fsdp_units(shape: ModelShape, plan: Plan) -> Plan:
    """`plan` (pipeline-free, FSDP's sharding as a ZeRO stage) with one stage per block: FSDP's gather unit."""
    return replace(plan, virtual_stages=shape.n_layers)


def fsdp_step(row: FsdpRow, hw: Hardware | None = None) -> StepBreakdown:
    """The row's step on `hw` (default: the shipped file of its GPU), one FSDP unit per block."""
    shape = mpt_shape(row)
    plan = fsdp_units(shape, fsdp_plan(row))
    return fast_step(shape, hw or load_hardware(row.hardware), plan, FSDP_SCHEDULE)


def tokens_per_gpu(row: FsdpRow, step_time: float) -> float:
    return row.micro_batch * row.accumulation * row.seq_len / step_time


def predict_fsdp(row: FsdpRow, hw: Hardware | None = None) -> float:
    """Tokens/s/GPU of the row (`fsdp_step`)."""
    return tokens_per_gpu(row, fsdp_step(row, hw).step_time)


def fsdp_run_config(row: FsdpRow) -> Config:
    """The row as a tessera run: the MPT shape (GPT family: biases, learned positions, tied head), the row's
    GPUs all data-parallel with its ZeRO stage, depth-first accumulation, full checkpointing when the row
    checkpoints, bf16 (tessera's autocast: fp32 master weights)."""
    layers, h, heads = MPT_SHAPES[row.model]
    model = ModelConfig(
        family="gpt", n_layers=layers, d_model=h, n_heads=heads, vocab_size=50368, seq_len=row.seq_len
    )
    parallel = ParallelConfig(
        data=row.gpus,
        zero=row.zero_stage,
        accumulation="depth_first",
        checkpointing="full" if row.checkpointing else "none",
    )
    batch = row.gpus * row.micro_batch * row.accumulation
    train = TrainConfig(dtype="bf16", global_batch=batch, micro_batch=row.micro_batch)
    return Config(model=model, train=train, parallel=parallel)


def fsdp_memory(row: FsdpRow) -> MemoryEstimate:
    """tessera's own peak-memory estimate (`tessera.memory.estimate_plan`, what `tessera memory` prints) of the
    row's run as tessera would execute it (`fsdp_run_config`). It models tessera's runtime (fp32 master weights
    and residual stream under autocast), not Composer's FSDP: a yardstick of how full the device is, compared
    across rows, not a prediction of MosaicML's peak."""
    cfg = fsdp_run_config(row)
    shape = mpt_shape(row)
    return estimate_plan(shape, decide(cfg, row.gpus), load_hardware(row.hardware).memory_bytes)


def fsdp_held_bytes(row: FsdpRow) -> float:
    """Bytes per GPU that the row's own run (Composer FSDP, "PURE" bf16 mixed precision) holds for the whole
    step, counted by hand: the sharded model state, 16 B per parameter over the GPUs (fp32 parameter and
    gradient shards: FSDP keeps the flat parameter in its original fp32 and casts the reduced bf16 gradient
    back; AdamW's two fp32 moments), plus one bf16 b·s·h checkpoint per block when the row checkpoints
    (non-reentrant checkpointing saves each block's input). Gathered blocks, recompute and logits come on top."""
    layers, h, _ = MPT_SHAPES[row.model]
    state = 16 * mpt_shape(row).n_params() / row.gpus
    checkpoints = layers * row.micro_batch * row.seq_len * h * 2 if row.checkpointing else 0
    return state + checkpoints


def _h100(model: str, s: int, b: int, m: int, ckpt: bool, tokens: float, mfu: float, n: int) -> FsdpRow:
    return FsdpRow("h100", model, s, 8, b, m, ckpt, tokens, mfu, n)


HOPPER_CALIBRATION = (
    _h100("30b", 4096, 1, 21, True, 1802, 35.86, 29989894144),
    _h100("30b", 2048, 3, 21, True, 2002, 38.11, 29975214080),
    _h100("30b", 1024, 6, 21, True, 2084, 38.76, 29967874048),
    _h100("13b", 4096, 10, 3, True, 4717, 41.6, 12864440320),
    _h100("13b", 2048, 2, 1, False, 4792, 39.79, 12853954560),
    _h100("13b", 1024, 40, 3, True, 5502, 44.27, 12848711680),
    _h100("7b", 4096, 16, 2, True, 8611, 40.42, 6667247616),
    _h100("7b", 2048, 6, 1, False, 10643, 46.44, 6658859008),
    _h100("7b", 1024, 64, 2, True, 10203, 42.83, 6654664704),
    _h100("3b", 4096, 5, 6, False, 20964, 42.31, 2657080320),
    _h100("3b", 1024, 20, 6, False, 27046, 46.2, 2649216000),
    _h100("3b", 512, 40, 6, False, 27965, 46.32, 2647905280),
    _h100("1b", 4096, 7, 4, False, 38535, 40.26, 1320144896),
    _h100("1b", 2048, 14, 1, False, 45455, 41.82, 1315950592),
    _h100("1b", 1024, 18, 4, False, 48910, 41.95, 1313853440),
    _h100("1b", 512, 56, 4, False, 52275, 43.21, 1312804864),
    _h100("760m", 4096, 12, 2, False, 55459, 35.83, 763616256),
    _h100("760m", 2048, 24, 2, False, 63147, 34.9, 760470528),
    _h100("760m", 1024, 48, 2, False, 78581, 39.76, 758897664),
    _h100("760m", 512, 96, 2, False, 83749, 40.42, 758111232),
)
"""The H100 BF16 table's 8-GPU rows (one node: NVLink only) with sequences up to 4096: the Hopper calibration."""

HOPPER_SHARE_GRID = tuple(i / 200 for i in range(80, 201))
"""Framework shares tried by `fit_hopper_share`: 0.400, 0.405, …, 1.000."""


def calibration_errors(hw: Hardware, rows: tuple[FsdpRow, ...] = HOPPER_CALIBRATION) -> list[float]:
    """predicted / published − 1 of each row's tokens/s/GPU on `hw`."""
    return [predict_fsdp(r, hw) / r.tokens_per_gpu - 1 for r in rows]


def fit_hopper_share(hw: Hardware | None = None) -> tuple[float, float]:
    """(framework share, median |error|) of the H100 file: the `HOPPER_SHARE_GRID` value with the smallest median
    |error| over `HOPPER_CALIBRATION`, every other constant as shipped (the tile is A100's, the kernel fraction
    comes from the file's measured GEMM, the flash-attention rate from FlashAttention-2's H100 benchmark)."""
    hw = hw or load_hardware("h100")
    best: tuple[float, float] | None = None
    for share in HOPPER_SHARE_GRID:
        med = statistics.median(abs(e) for e in calibration_errors(replace(hw, gemm_framework_share=share)))
        if best is None or med < best[1]:
            best = (share, med)
    assert best is not None
    return best
