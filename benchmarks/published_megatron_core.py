"""Planner validation against NVIDIA's published Megatron-Core H100 throughput (issue #15): predicted vs
published, in the source's own unit and FLOP convention, nothing fitted to any row.

    python benchmarks/published_megatron_core.py   # writes benchmarks/results/published_megatron_core.md

Source (rows used)
------------------
NVIDIA/Megatron-LM, README.md section "Training Speed and Scalability", added by commit f2e5db402c ("New
scaling figures on H100 GPUs", 2024-07-15) and unchanged since (the table image `images/model_table.png` has
not changed in the repository's history up to its newest commit). The table is an image; its nine rows are
transcribed here: GPT models of 1.7B-462B parameters, Megatron-Core r0.8.0, H100 GPUs, vocabulary 131,072,
sequence 4,096; per row attention heads, hidden size, layers, tensor / pipeline / data-parallel sizes, GPUs,
global batch (sequences), achieved TFLOP/s per GPU, MFU and aggregate PFLOP/s. The README's text adds the
strong-scaling study: "the standard GPT-3 model (... slightly more than 175 billion parameters due to larger
vocabulary size) from 96 H100 GPUs to 4608 GPUs, using the same batch size of 1152 sequences throughout ... a
reduction in MFU from 47% to 42%" (the figure `images/strong_scaling.png` labels it 177B; only the two end
points have stated numbers).

Convention. Megatron-LM logs TFLOP/s per GPU = `num_floating_point_operations(args, batch) / (iteration time ·
world size)` (megatron/training/training.py at f2e5db402c): 12·B·s·L·h²·[(1 + g/a + s/h)·(a·d_head/h) +
(f/h)·(gated ? 3/2 : 1) + V/(2·L·h)], i.e. model FLOPs (no recompute), attention counted over the full s×s (no
causal halving), logits with the padded vocabulary. `megatron_flops_per_iteration` transcribes it; MFU =
TFLOP/s / 989 (H100 SXM dense BF16; the table's MFU column is reproduced from its TFLOP/s column with that
denominator, and its aggregate column from TFLOP/s × GPUs: `tests/unit/test_published_megatron_core.py`).

What the source states about execution: "fine-grained overlapping of data-parallel (--overlap-grad-reduce
--overlap-param-gather), tensor-parallel (--tp-comm-overlap) and pipeline-parallel communication (enabled by
default) with computation"; throughput "measured for end-to-end training" (data loading, optimizer, logging).

Assumptions (not stated by the source; one global rule each, nothing per row)
-------------------------------------------------------------------------------
- Shape: GPT (LayerNorm, biases, GELU MLP with f = 4h: Megatron's default without --ffn-hidden-size),
  multi-head attention (g = a), untied embedding and output head (the stated sizes are reproduced only untied:
  e.g. 177.2B untied vs 175.6B tied, "slightly more than 175 billion"), learned positions, dropout 0.1
  (Megatron's defaults).
- Precision BF16 (the MFU column divides by the BF16 peak; no FP8 is mentioned). bf16 parameters, gradients
  reduced in fp32 (Megatron forces `accumulate_allreduce_grads_in_fp32` under bf16: arguments.py).
- Distributed optimizer = ZeRO-1 (required by --overlap-param-gather: arguments.py asserts it).
- Sequence parallelism on whenever TP > 1 (--tp-comm-overlap asserts --sequence-parallel).
- The two overlaps the README states are priced as tessera runs them (`Plan.tp_comm_overlap` on every row with
  TP > 1, `Plan.overlap_param_gather` on every row; docs/cost-model.md §6): sequence parallelism's all-gathers /
  reduce-scatters as rings of point-to-point steps under their GEMM chunks of s/t rows (each chunk priced by
  shape, so it pays its wave quantization), the ZeRO-1 gather deferred to the next step with its first stage's
  share exposed. Rows without PP are priced as tessera runs a pipeline-free ZeRO layout: one stage per block,
  breadth-first (`execution.decide`; the FSDP rows of `published_fsdp_scale` likewise), so the deferred gather's
  unit is one block (Megatron's is one DDP bucket, of similar size).
- Micro-batch 1: the table keeps sequences per pipeline at 4·PP for every PP > 1 row (m = 4p at b = 1).
  Checked, not reported as a table: b = 2 or 4 moves the rows without PP by +0.1 to +9.5 points (32B) and
  the PP rows mostly the other way (up to -19 points at 4608 GPUs), so b = 1 is not what makes them low.
- Interleaved 1F1B for PP > 1: the README overlaps pipeline communication "by default", which Megatron does
  only in the interleaved schedule (arguments.py turns overlap_p2p_comm off otherwise). Virtual stages v = the
  smallest divisor > 1 of the layers per stage (`megatron_table`'s rule for Narayanan 2021, the same team's
  convention): 70B v 2, 119B v 23, 177B v 2, 314B v 2, 462B v 7. The report shows v = 1 and v = layers per
  stage too.
- No activation recomputation (Megatron's default); fused (flash) attention (Transformer Engine's).
- Strong scaling: the 177B weak-scaling row's layout (TP 8, PP 6) at every size, DP = GPUs / 48 (96 GPUs: DP
  2, 4608 GPUs: DP 96; the 2304-GPU point is the weak-scaling row); global batch 1152.
- Network: the shipped h100 file (DGX H100, 8 × 400 Gb/s NDR per node, full bisection); the README names none.
- Stack: Megatron-Core + Transformer Engine, `tessera.planner.stacks.with_stack(h100, "megatron-te")`: the h100
  file's framework share replaced by the one fitted on NVIDIA/dgxc-benchmarking's BF16 DGX H100 rows (Llama 3.1
  8B / 70B, GPT-3 175B; `stacks.MEGATRON_TE_CALIBRATION`, none of them in this table). The report's stack table
  shows every row on the default stack too (the prediction before the stack existed).

Timed with `steptime.fast_step` (the stages are even; the simulator, `simulate_step`, agrees within 0.2 % with
both overlaps on, on the 7.1B, 32B, 70B, 119B, 462B and 4608-GPU rows).

What the planner prices differently from Megatron-Core (say so in every reading)
--------------------------------------------------------------------------------
- Transformer Engine's userbuffers move the ring's chunks with copy engines; tessera's ring moves them with
  NCCL point-to-point, so the hidden transfer slows the GEMMs by the GPU file's `overlap_slowdown` (measured for
  NCCL kernels: an upper bound for copy-engine transfers). Both launch the chunk GEMMs round robin on 3 streams
  (TE's default pool; `traffic.RING_GEMM_LANES`), priced as the t chunks' tiles filling waves together
  (`gemm.lanes_call_time`). `StepBreakdown.tp_comm` is what the rings add (chunk losses, exposed transfer,
  slowdown). The "overlaps off" column of the what-ifs is the prediction before the flags were priced.

Left out
--------
- NeMo Framework "performance summary" pages (docs.nvidia.com/nemo-framework/user-guide/latest/performance/
  performance_summary.html and archive/25.04-performance-summary.html: containers 25.02, 25.04, 25.07 as
  stored by the search tool; NVIDIA/NeMo docs/source/performance/performance_summary.md at commit 8e3d65dcfe:
  24.07; NVIDIA-NeMo/Megatron-Bridge docs/performance-summary*.md at 4ab94dfad: 25.09-26.08): every
  dense-model DGX-H100 pre-training row is FP8 (GPT3-175B, LLAMA2/3 8B-405B, Nemotron 8B-340B); tessera has no
  FP8. Their BF16 H100 rows are MoE (GPT-OSS 120B, DeepSeek-V3, Qwen3 MoE; no MoE in tessera); LLAMA3 rows
  with CP 2 (8B, 70B, 405B) also need context parallelism. NeMo AutoModel's table (NVIDIA-NeMo/Automodel
  docs/performance-summary.mdx): BF16 H100 rows are MoE, LoRA fine-tuning (frozen weights, not modelled), or
  Llama3 70B with CP 2.
- The strong-scaling figure's intermediate points: read only from a log-scale plot, no stated numbers.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from published_case import Case, case_table, summary  # noqa: E402

from tessera.planner.cost import ModelShape, Plan, params_per_rank  # noqa: E402
from tessera.planner.cost.compute import attention_core_time  # noqa: E402
from tessera.planner.hardware import Hardware, load_hardware  # noqa: E402
from tessera.planner.megatron_table import MegatronRow  # noqa: E402
from tessera.planner.megatron_table import _shape as megatron_shape  # noqa: E402
from tessera.planner.megatron_table import _virtual_stages as megatron_virtual_stages  # noqa: E402
from tessera.planner.stacks import MEGATRON_TE_CALIBRATION, stack_row_step, with_stack  # noqa: E402
from tessera.planner.steptime import StepBreakdown, dp_parts, fast_step  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "published_megatron_core.md"

SEQ_LEN = 4096
VOCAB = 131072
PEAK_BF16 = 989e12
"""H100 SXM dense BF16: the denominator of the table's MFU column (reproduced by the unit test)."""
SOURCE = "NVIDIA/Megatron-LM README @ f2e5db402c, images/model_table.png"
STACK = "megatron-te"
"""The software stack these rows ran: Megatron-Core + Transformer Engine (`tessera.planner.stacks`, its framework
share calibrated on NVIDIA's DGX Cloud benchmarking rows, none of them in this table)."""


def h100(stack: str = STACK) -> Hardware:
    """The shipped h100 file as `stack` runs on it (`stacks.with_stack`; "default": as tessera runs)."""
    return with_stack(load_hardware("h100"), stack)


def _row(
    size_b: float,
    heads: int,
    hidden: int,
    layers: int,
    tp: int,
    pp: int,
    gpus: int,
    batch: int,
    tflops: float,
):
    """One row of the table as the Narayanan-table record (`megatron_table.MegatronRow`, which derives DP =
    GPUs / (TP·PP)): here TFLOP/s are model FLOPs (no recompute happens), s = 4096, V = 131,072, micro-batch
    1."""
    return MegatronRow(
        params_b=size_b,
        heads=heads,
        hidden=hidden,
        layers=layers,
        tp=tp,
        pp=pp,
        gpus=gpus,
        batch=batch,
        tflops_per_gpu=tflops,
        seq_len=SEQ_LEN,
        vocab=VOCAB,
    )


WEAK_SCALING = (
    _row(1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _row(7.1, 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _row(16, 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _row(32, 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _row(70, 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _row(119, 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _row(177, 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _row(314, 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _row(462, 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
)
"""Columns model size, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU; the data-parallel column
(48 in every row) is derived, and the table's derived columns are in `DERIVED_COLUMNS`."""

DERIVED_COLUMNS = (
    (48, 41, 19.6),
    (48, 47, 44.7),
    (48, 49, 93.9),
    (48, 46, 176.5),
    (48, 42, 322.3),
    (48, 43, 645.9),
    (48, 44, 997.2),
    (48, 48, 1457.4),
    (48, 47, 2825.6),
)
"""(data-parallel size, MFU %, aggregate PFLOP/s) of each `WEAK_SCALING` row, as published: the transcription
test reproduces them from the other columns."""

GPT3 = WEAK_SCALING[6]
STRONG_SCALING = ((96, 47.0), (4608, 42.0))
"""(GPUs, MFU %) stated in the README's text for GPT-3 177B at a fixed batch of 1152 sequences."""


def strong_row(gpus: int) -> MegatronRow:
    """The 177B row's layout (TP 8, PP 6) at `gpus` GPUs, the fixed batch: DP = gpus / 48 (an assumption)."""
    return dataclasses.replace(GPT3, gpus=gpus, tflops_per_gpu=0.0)


def shape(row: MegatronRow) -> ModelShape:
    """The Narayanan table's GPT shape (f = 4h, MHA, learned positions, dropout), its output head untied."""
    return dataclasses.replace(megatron_shape(row), tied=False)


def megatron_flops_per_iteration(s: ModelShape, batch: int) -> float:
    """Megatron-LM's `num_floating_point_operations` (training.py at f2e5db402c) for a dense GPT: 12·B·s·L·h²·
    [(1 + g/a + s/h)·(a·d/h) + (f/h)·(3/2 if gated) + V/(2Lh)], model FLOPs over the full s×s attention."""
    h, L = s.d_model, s.n_layers
    q_ratio = s.n_heads * s.head_dim / h
    attention = (1 + s.n_kv_heads / s.n_heads + s.seq_len / h) * q_ratio
    mlp = s.ffn_hidden / h * (1.5 if s.swiglu else 1.0)
    logits = s.vocab_size / (2 * L * h)
    return 12 * batch * s.seq_len * L * h * h * (attention + mlp + logits)


def plan(row: MegatronRow, virtual_stages: int | None = None, *, overlaps: bool = True) -> Plan:
    """The layout of `row` as the docstring's assumptions state it: without PP one stage per block (tessera's
    pipeline-free ZeRO), with PP `megatron_virtual_stages`; `overlaps` the README's --tp-comm-overlap and
    --overlap-param-gather (False: both off, the diagnostic column)."""
    if virtual_stages is None:
        virtual_stages = row.layers if row.pp == 1 else megatron_virtual_stages(row)
    return Plan(
        dp=row.dp,
        pp=row.pp,
        tp=row.tp,
        sequence_parallel=row.tp > 1,
        tp_comm_overlap=overlaps and row.tp > 1,
        overlap_param_gather=overlaps,
        virtual_stages=virtual_stages,
        zero_stage=1,
        micro_batch=1,
        n_microbatches=row.batch // row.dp,
        recompute="none",
        accumulation="depth_first",
        flash_attention=True,
        grad_reduce_bytes=4,  # Megatron reduces bf16 runs' gradients in fp32
    )


def step(
    row: MegatronRow, hw: Hardware | None = None, virtual_stages: int | None = None, *, overlaps: bool = True
) -> StepBreakdown:
    """The planner's step for `row` (closed form; even stages, so it equals the simulator's): one stage per block
    breadth-first without PP, interleaved with v > 1, else 1F1B."""
    p = plan(row, virtual_stages, overlaps=overlaps)
    schedule = "1f1b" if p.virtual_stages == 1 else "breadth_first" if p.pp == 1 else "interleaved"
    return fast_step(shape(row), hw or h100(), p, schedule)


def tflops_per_gpu(row: MegatronRow, step_time: float) -> float:
    """TFLOP/s per GPU in Megatron's convention for one iteration of `step_time` seconds."""
    return megatron_flops_per_iteration(shape(row), row.batch) / (step_time * row.gpus) / 1e12


def published_step(row: MegatronRow, tflops: float) -> float:
    """The iteration time implied by a published TFLOP/s per GPU (Megatron's convention)."""
    return megatron_flops_per_iteration(shape(row), row.batch) / (tflops * 1e12 * row.gpus)


WEAK_GROUP = "Megatron-Core weak scaling: TP + interleaved PP + ZeRO-1 DP (48-6144 H100)"
STRONG_GROUP = "Megatron-Core DP strong scaling at fixed batch 1152 (GPT-3 177B, 96-4608 H100)"


def _label(row: MegatronRow) -> str:
    v = megatron_virtual_stages(row)
    return f"Megatron-Core {row.params_b:g}B {row.gpus}×H100 t{row.tp} p{row.pp} v{v} d{row.dp} B{row.batch}"


def cases() -> list[Case]:
    out = [
        Case(
            WEAK_GROUP,
            _label(r),
            r.tflops_per_gpu,
            tflops_per_gpu(r, step(r).step_time),
            "TFLOP/s/GPU (Megatron)",
        )
        for r in WEAK_SCALING
    ]
    for gpus, mfu in STRONG_SCALING:
        r = strong_row(gpus)
        predicted = 100 * tflops_per_gpu(r, step(r).step_time) * 1e12 / PEAK_BF16
        out.append(Case(STRONG_GROUP, _label(r), mfu, predicted, "MFU % (Megatron)"))
    return out


STACK_CALIBRATION_GROUP = (
    "Megatron-Core + TE on DGX H100, BF16 (the megatron-te stack's calibration, not validation)"
)


def calibration_cases() -> list[Case]:
    """The megatron-te stack's calibration rows (`stacks.MEGATRON_TE_CALIBRATION`, NVIDIA/dgxc-benchmarking) as
    priced on the stack: tokens/s per GPU, published (global batch · sequence / step) and predicted."""
    hw = h100()
    out = []
    for r in MEGATRON_TE_CALIBRATION:
        tokens = r.global_batch * r.shape.seq_len / r.gpus
        predicted = tokens / stack_row_step(r, hw).step_time
        out.append(Case(STACK_CALIBRATION_GROUP, r.label, tokens / r.step_time, predicted, "tokens/s/GPU"))
    return out


# --- diagnosis ----------------------------------------------------------------------------------------------


def _rows_with_published() -> list[tuple[MegatronRow, float]]:
    """Every row with its published TFLOP/s per GPU (strong-scaling MFU converted with the BF16 peak)."""
    strong = [(strong_row(g), mfu / 100 * PEAK_BF16 / 1e12) for g, mfu in STRONG_SCALING]
    return [(r, r.tflops_per_gpu) for r in WEAK_SCALING] + strong


def zero1_gather(row: MegatronRow, hw: Hardware) -> float:
    """Seconds of ZeRO-1's parameter all-gather per step on the busiest rank (deferred: its first stage's share
    is exposed, the rest queued under the forward), one call per block as `fast_step` prices it."""
    p, s = plan(row), shape(row)
    psi = max(params_per_rank(s, p, 0), params_per_rank(s, p, p.pp - 1))
    return dp_parts(psi, hw, p, buckets=row.layers // row.pp)[1]


def attention_seconds(row: MegatronRow, hw: Hardware) -> float:
    """Seconds of the fused-attention kernels (forward + backward) on one rank per step, inside `compute`."""
    p = plan(row)
    fwd, bwd = attention_core_time(shape(row), hw, p)
    return (fwd + bwd) * row.layers / row.pp * p.n_microbatches


def breakdown_lines() -> list[str]:
    """Per row: the planner's step parts as shares of the PUBLISHED iteration time (from its TFLOP/s)."""
    hw = h100()
    lines = [
        "| row | published step s | predicted step s | compute | of which attention | tp_comm | bubble "
        "| pp_comm | dp_comm (ZeRO-1 gather, deferred) | optimizer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, tflops in _rows_with_published():
        bd, pub = step(r, hw), published_step(r, tflops)

        def pct(x: float, pub: float = pub) -> str:
            return f"{x / pub:.0%}"

        lines.append(
            f"| {r.params_b:g}B {r.gpus} GPUs | {pub:.3f} | {bd.step_time:.3f} | {pct(bd.compute)} | "
            f"{pct(attention_seconds(r, hw))} | {pct(bd.tp_comm)} | {pct(bd.bubble)} | {pct(bd.pp_comm)} | "
            f"{pct(bd.dp_comm)} ({pct(zero1_gather(r, hw))}) | {pct(bd.optimizer)} |"
        )
    return lines


def what_if_lines() -> list[str]:
    """Error of each row with the overlaps off (the prediction before they were priced), with both hidden
    entirely (perfect overlap, an upper bound: the flags-off step less its tp_comm and ZeRO-1 gather), and under
    the other virtual-stage choices (overlaps on). Diagnostics only: the first column is the prediction."""
    hw = h100()
    lines = [
        "| row | as priced (both overlaps) | overlaps off | both hidden entirely (bound) | v = 1 "
        "| v = layers per stage |",
        "|---|---|---|---|---|---|",
    ]
    for r, tflops in _rows_with_published():
        off = step(r, hw, overlaps=False)
        bound = off.step_time - off.tp_comm - min(off.dp_comm, zero1_gather(r, hw))
        errors = [tflops_per_gpu(r, t) / tflops - 1 for t in (step(r, hw).step_time, off.step_time, bound)]
        for v in (1, r.layers // r.pp):
            errors.append(tflops_per_gpu(r, step(r, hw, v).step_time) / tflops - 1)
        lines.append(f"| {r.params_b:g}B {r.gpus} GPUs | " + " | ".join(f"{e:+.1%}" for e in errors) + " |")
    return lines


def stack_lines() -> list[str]:
    """Each row's error on the default stack (the h100 file as tessera runs) and on Megatron-Core + TE's."""
    lines = [
        f"| row | default stack (share {DEFAULT_SHARE:g}) | {STACK} (share {H100_SHARE:g}) |",
        "|---|---|---|",
    ]
    for r, tflops in _rows_with_published():
        errs = [tflops_per_gpu(r, step(r, h100(st)).step_time) / tflops - 1 for st in ("default", STACK)]
        lines.append(f"| {r.params_b:g}B {r.gpus} GPUs | {errs[0]:+.1%} | {errs[1]:+.1%} |")
    return lines


H100_SHARE = h100().gemm_framework_share
DEFAULT_SHARE = h100("default").gemm_framework_share

SENSITIVITIES = (
    ("gemm_framework_share", (DEFAULT_SHARE / H100_SHARE, 1.0, 1.0 / H100_SHARE)),
    ("flash_attention_flops", (1.0, 1.5, 2.0)),
)
"""h100-file fields scaled for the sensitivity tables (illustrations of how much of the error is the compute
rate; nothing is fitted or applied): the file's GEMM framework share (fitted on MosaicML's FSDP runs) raised to
0.72 and 0.80, and the fused-attention rate (FlashAttention-2's) × 1.5 and × 2, FlashAttention-3's stated
speed-up over FlashAttention-2 on H100 in BF16/FP16 (arXiv 2407.08608: 1.5-2.0×), the class of kernel
Transformer Engine's fused attention is."""


def sensitivity_lines(field: str, scales: tuple[float, ...]) -> list[str]:
    """Median and worst |error| of all rows with the h100 file's `field` × each scale, as priced (both overlaps)
    and with TP communication and ZeRO-1's gather hidden entirely (perfect overlap, an upper bound)."""
    base = h100()
    lines = [
        f"| {field} | as priced: median / worst | overlaps hidden entirely: median / worst |",
        "|---|---|---|",
    ]
    for scale in scales:
        hw = dataclasses.replace(base, **{field: getattr(base, field) * scale})
        priced, hidden = [], []
        for r, tflops in _rows_with_published():
            bd, off = step(r, hw), step(r, hw, overlaps=False)
            hidden_step = off.step_time - off.tp_comm - min(off.dp_comm, zero1_gather(r, hw))
            priced.append(abs(tflops_per_gpu(r, bd.step_time) / tflops - 1))
            hidden.append(abs(tflops_per_gpu(r, hidden_step) / tflops - 1))
        lines.append(
            f"| {getattr(hw, field):.3g} | {statistics.median(priced):.1%} / {max(priced):.1%} | "
            f"{statistics.median(hidden):.1%} / {max(hidden):.1%} |"
        )
    return lines


READING = [
    "Reading it. The rows are priced on the megatron-te stack (`tessera.planner.stacks`): the h100 file with",
    "Megatron-Core + Transformer Engine's framework share, 0.86, fitted on NVIDIA's DGX Cloud benchmarking BF16",
    "rows (Llama 3.1 8B on 8 GPUs, 70B on 64, GPT-3 175B on 128; mean |error| 5.6 %, rows -9.0 %, -0.3 %,",
    "+7.6 %), none of them a row of this table; the default stack (the file's 0.65, fitted on MosaicML's eager",
    "PyTorch FSDP runs) is the first column of the stack table. On the default stack every row was",
    "under-predicted (-6..-31 %, median 14.0 %); on megatron-te the rows span -20..+20 % (median 13.4 %, worst",
    "19.8 %, the 32B row). One share lifts every row's compute alike (now 70-83 % of the published step), so",
    "what separates the rows is left: the calibration recipes run at 53-59 % MFU in their own FLOP convention,",
    "this README's rows at 41-49 %. The small rows without PP (1.7B, 7.1B), the 119B and 462B rows and the",
    "96-GPU strong-scaling row are now over-predicted by 13-20 %, while the 32B row (TP 8 without PP: tp_comm",
    "17 %, its ZeRO-1 gather 20 % of the published step) stays 20 % low. The residual on the calibration rows",
    "runs with attention's share of the step (Llama 8B at s = 8192 -9 %, GPT-3 at s = 2048 +8 %): Transformer",
    "Engine's fused attention above FlashAttention-2's rate, a second factor one share cannot carry. The two",
    "overlaps the README states are priced as tessera runs them (docstring): tensor-parallel rings under their",
    "GEMM chunks on 3 streams, as Transformer Engine's userbuffers overlap runs them (docs/cost-model.md section",
    "6), and ZeRO-1's gather deferred to the next step. For the PP rows, the unstated virtual-stage count: the",
    "what-ifs show v = 1 and one block per chunk. DP strong scaling at fixed batch: published MFU falls 47 -> 42 %",
    "from 96 to 4608 GPUs (-11 %), predicted 55.1 -> 41.8 % (-24 %; the bubble is 15 % of the published step at",
    "4608 GPUs). The sensitivity tables scale one field of the stack's h100 file at a time; none is applied",
    "(fitting them here would use validation rows).",
]


def report() -> str:
    all_cases = cases()
    lines = [
        "# Planner vs Megatron-Core's published H100 scaling runs",
        "",
        "Generated by `python benchmarks/published_megatron_core.py`; source, convention, assumptions and",
        f"the rows left out in its docstring ({SOURCE}). Nothing is fitted to these rows; they are priced",
        "on the megatron-te stack, whose framework share is fitted on other rows (tessera.planner.stacks).",
        "",
        f"**All: {summary(all_cases)}.**",
        "",
        *case_table(all_cases),
    ]
    lines.append("")
    for g in dict.fromkeys(c.group for c in all_cases):
        lines.append(f"- {g}: {summary([c for c in all_cases if c.group == g])}")
    lines += [
        "",
        *READING,
        "",
        "## The stack: default (as tessera runs) vs Megatron-Core + Transformer Engine (as priced)",
        "",
        *stack_lines(),
        "",
        "## Where the time goes (planner's parts as shares of the published iteration time)",
        "",
        *breakdown_lines(),
        "",
        "## What-ifs (diagnostics, not predictions): overlaps off, overlaps perfect, other v",
        "",
        *what_if_lines(),
        "",
        "## Sensitivity to the compute rate (illustrations, not fits; the model keeps the megatron-te stack)",
    ]
    for field, scales in SENSITIVITIES:
        lines += ["", *sensitivity_lines(field, scales)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = report()
    OUT.write_text(text)
    print(text)
