"""Software stacks the planner prices: the one tessera runs (the default) and Megatron-Core + Transformer Engine.

A hardware file's `gemm_framework_share` is the share of the best GEMM kernel's rate (and of the fused-attention
kernel's) a training stack keeps end to end. It is fitted per GPU on runs of one stack: on the H100, MosaicML's
8-GPU FSDP runs (`tessera.planner.mosaic_table.fit_hopper_share`), an eager PyTorch stack like tessera's. NVIDIA's
Megatron-Core with Transformer Engine runs its kernels faster than that, so one share cannot describe both.
A stack is the same cost model with another framework share; this module is the one place that decides it.

- ``default``: the hardware file as shipped (what tessera runs). `with_stack` returns the file unchanged.
- ``megatron-te``: Megatron-Core + Transformer Engine, as NVIDIA's NeMo recipes run it. Its share is FITTED on
  `MEGATRON_TE_CALIBRATION`: NVIDIA's DGX Cloud benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking), BF16
  rows on DGX H100 with every configuration stated. None of them is a validation row (the Megatron-LM README's
  tables, `benchmarks/published_megatron_core.py`, stay validation). Calibrated for the H100 only.

Calibration rows are priced as the validation rows of Megatron-Core are, with what the NeMo launcher's model
configs state (`StackRow.settings`: `ub_tp_comm_overlap` when TP > 1, `overlap_grad_sync`/`overlap_param_sync`,
a distributed optimizer, sequence parallelism, flash attention, recomputation): ZeRO-1 with the parameter gather
deferred (`overlap_param_gather`), sequence parallelism and the tensor-parallel rings under their GEMM chunks when
TP > 1 (`tp_comm_overlap`), fp32 gradient reduction (Megatron's default for bf16; not stated by the recipes),
fused attention, the config's recomputation, depth-first accumulation; interleaved 1F1B with the stated VP, and
pipeline-free rows as tessera runs pipeline-free ZeRO (one stage per block, breadth-first). The 8B config's
document-reset attention mask is not priced (full causal attention, as the recipe's FLOP notes count it). The fit compares step times, so the
source's FLOP convention does not enter. Pure Python: no torch import.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from tessera.planner.cost import ModelShape, Plan
from tessera.planner.hardware import Hardware
from tessera.planner.steptime import StepBreakdown, fast_step

__all__ = [
    "DEFAULT_STACK",
    "MEGATRON_TE_CALIBRATION",
    "STACKS",
    "STACK_SHARES",
    "STACK_SHARE_GRID",
    "StackRow",
    "calibration_errors",
    "fit_stack_share",
    "stack_plan",
    "stack_row_step",
    "with_stack",
]

DEFAULT_STACK = "default"
STACKS = (DEFAULT_STACK, "megatron-te")
"""Names `tessera plan --stack` accepts."""

STACK_SHARES: dict[str, dict[str, float]] = {"megatron-te": {"h100": 0.86}}
"""Per stack, per hardware-file name: the framework share that replaces the file's `gemm_framework_share`. The
value is `fit_stack_share()`'s on `MEGATRON_TE_CALIBRATION` (tests/unit/test_planner_stacks.py checks it)."""

STACK_SHARE_GRID = tuple(i / 200 for i in range(80, 201))
"""Framework shares tried by `fit_stack_share`: 0.400, 0.405, …, 1.000 (the grid of the H100 file's own fit)."""

DGXC = "NVIDIA/dgxc-benchmarking"
LAUNCHER = "NVIDIA/NeMo-Framework-Launcher"
LLAMA31_COMMIT = "143b90dd91f9be958fed4773ae95d941a3356a82"
GPT3_COMMIT = "0b71cfda5163540778e2a3d2db59858bf62f96f7"

MEGATRON_CP_ORDER = ("pipe", "data", "context", "tensor")
"""Megatron-Core's default rank order, outermost first (`order="tp-cp-ep-dp-pp"` in megatron/core/
parallel_state.py, innermost first): context ranks next to the tensor ranks."""


@dataclass(frozen=True)
class StackRow:
    """One published run used to calibrate a stack: where it is stated (repository, path, commit, container),
    its precision, model shape, layout (GPUs, TP, PP, CP, VP, micro-batch, global batch), the published
    iteration time in seconds, and its recomputation with the config that states it."""

    label: str
    repo: str
    path: str
    commit: str
    container: str
    precision: str
    shape: ModelShape
    gpus: int
    tp: int
    pp: int
    cp: int
    vp: int
    micro_batch: int
    global_batch: int
    step_time: float
    recompute: str
    """Activation recomputation of the recipe's model config (`settings`): "none" or Megatron's "selective"."""
    settings: str
    """Where the run's settings the recipe does not restate are (the NeMo launcher's model config: overlaps,
    recomputation, dropout, head count), as repository, path and commit."""

    @property
    def dp(self) -> int:
        """Data-parallel size: GPUs / (TP · PP · CP)."""
        return self.gpus // (self.tp * self.pp * self.cp)


def _llama31(layers: int, hidden: int, heads: int, ffn: int) -> ModelShape:
    """Llama 3.1 as the recipe's notes state it: 8 query groups, FFN size, vocabulary 128,256, sequence 8192,
    SwiGLU (the notes' 18·L·f·h MLP FLOPs), untied head, no dropout."""
    return ModelShape(
        n_layers=layers,
        d_model=hidden,
        n_heads=heads,
        n_kv_heads=8,
        ffn_hidden=ffn,
        vocab_size=128256,
        seq_len=8192,
        swiglu=True,
        tied=False,
    )


GPT3_175B = ModelShape(
    n_layers=96,
    d_model=12288,
    n_heads=96,  # the launcher's gpt3/175b.yaml (the recipe's notes state L, h, V, s only)
    n_kv_heads=96,
    ffn_hidden=4 * 12288,  # the notes' 48·L·h² MLP FLOPs: f = 4h
    vocab_size=51200,
    seq_len=2048,
    swiglu=False,
    tied=True,
    dropout=True,  # the launcher's gpt3/175b.yaml: hidden_dropout 0.1
)

MEGATRON_TE_CALIBRATION = (
    StackRow(
        "Llama 3.1 8B 8×H100 t1 p1 c2 d4 B128",
        DGXC,
        "llama3.1/README_8b.md",
        LLAMA31_COMMIT,
        "nvcr.io/nvidia/nemo:24.09",
        "bf16",
        _llama31(32, 4096, 32, 14336),
        gpus=8,
        tp=1,
        pp=1,
        cp=2,
        vp=1,
        micro_batch=1,
        global_batch=128,
        step_time=12.91,
        recompute="none",
        settings=f"{LAUNCHER} launcher_scripts/conf/training/llama/llama3_1_8b.yaml @ 2ac7cee8bb07",
    ),
    StackRow(
        "Llama 3.1 70B 64×H100 t4 p4 c2 v5 d2 B128",
        DGXC,
        "llama3.1/README_70b.md",
        LLAMA31_COMMIT,
        "nvcr.io/nvidia/nemo:24.09",
        "bf16",
        _llama31(80, 8192, 64, 28672),
        gpus=64,
        tp=4,
        pp=4,
        cp=2,
        vp=5,
        micro_batch=1,
        global_batch=128,
        step_time=14.72,
        recompute="none",
        settings=f"{LAUNCHER} launcher_scripts/conf/training/llama/llama3_1_70b.yaml @ 1ab2c781b50b",
    ),
    StackRow(
        "GPT-3 175B 128×H100 t4 p8 v12 d4 B256",
        DGXC,
        "nemo_megatron/README_175b.md",
        GPT3_COMMIT,
        "NeMo (version not stated in the file)",
        "bf16",
        GPT3_175B,
        gpus=128,
        tp=4,
        pp=8,
        cp=1,
        vp=12,
        micro_batch=1,
        global_batch=256,
        step_time=8.309,
        recompute="selective",
        settings=f"{LAUNCHER} launcher_scripts/conf/training/gpt3/175b.yaml @ 056a90edf914",
    ),
)
"""The BF16 DGX H100 rows of NVIDIA's DGX Cloud benchmarking recipes (Megatron-Core + Transformer Engine through
NeMo), each at its smallest stated GPU count (the fewest nodes: the network matters least). Every field is stated
in the file at `path` (`commit`) but the settings it leaves to the NeMo launcher's model config (`settings`: GPT-3's
96 heads, dropout and selective recomputation; every row's overlaps). Left out: the larger GPU counts of
the same tables (weak scaling of the same per-GPU work, step times within 2 % of these), FP8 rows (tessera has no
FP8), Llama 3.1 405B (its notes count 16 query groups and a GPT-2 tokenizer as proxy: not the model's stated
shape), Nemotron 4 (its squared-ReLU / GQA shape is not stated in the file) and Grok-1 (mixture of experts)."""


def stack_plan(row: StackRow) -> Plan:
    """The row's layout priced as the module docstring states (Megatron-Core as NVIDIA's recipes run it)."""
    return Plan(
        dp=row.dp,
        pp=row.pp,
        cp=row.cp,
        tp=row.tp,
        sequence_parallel=row.tp > 1,
        tp_comm_overlap=row.tp > 1,
        overlap_param_gather=True,
        virtual_stages=row.vp if row.pp > 1 else row.shape.n_layers,
        zero_stage=1,
        micro_batch=row.micro_batch,
        n_microbatches=row.global_batch // (row.dp * row.micro_batch),
        recompute=row.recompute,
        accumulation="depth_first",
        flash_attention=True,
        grad_reduce_bytes=4,  # Megatron reduces bf16 runs' gradients in fp32
        rank_order=MEGATRON_CP_ORDER,
    )


def stack_row_step(row: StackRow, hw: Hardware) -> StepBreakdown:
    """The planner's step for `row` on `hw` (closed form; the stages are even)."""
    p = stack_plan(row)
    schedule = "breadth_first" if p.pp == 1 else "interleaved" if p.virtual_stages > 1 else "1f1b"
    return fast_step(row.shape, hw, p, schedule)


def calibration_errors(hw: Hardware, rows: tuple[StackRow, ...] = MEGATRON_TE_CALIBRATION) -> list[float]:
    """predicted / published − 1 of each row's throughput (published step / predicted step − 1) on `hw`."""
    return [r.step_time / stack_row_step(r, hw).step_time - 1 for r in rows]


def fit_stack_share(
    hw: Hardware, rows: tuple[StackRow, ...] = MEGATRON_TE_CALIBRATION
) -> tuple[float, float]:
    """(framework share, mean |error|): the `STACK_SHARE_GRID` value with the smallest mean |error| over `rows`,
    every other field of `hw` as shipped. The mean, not the median: of three rows the median is one row."""
    best: tuple[float, float] | None = None
    for share in STACK_SHARE_GRID:
        errs = calibration_errors(replace(hw, gemm_framework_share=share), rows)
        mean = statistics.fmean(abs(e) for e in errs)
        if best is None or mean < best[1]:
            best = (share, mean)
    assert best is not None
    return best


def with_stack(hw: Hardware, stack: str = DEFAULT_STACK) -> Hardware:
    """`hw` as `stack` runs on it: the default stack returns `hw` itself; another stack replaces the framework
    share with its calibrated value for this hardware file (by name). Unknown stacks and hardware the stack was
    not calibrated for are errors that say which are available."""
    if stack == DEFAULT_STACK:
        return hw
    if stack not in STACK_SHARES:
        raise ValueError(f"unknown software stack {stack!r}: choose one of {', '.join(STACKS)}")
    shares = STACK_SHARES[stack]
    if hw.name not in shares:
        raise ValueError(
            f"stack {stack!r} is calibrated only for {', '.join(sorted(shares))} (hardware {hw.name!r} has no "
            f"calibration): use --stack {DEFAULT_STACK}, or --hardware {sorted(shares)[0]}"
        )
    return replace(hw, gemm_framework_share=shares[hw.name])
