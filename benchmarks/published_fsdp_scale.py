"""Published ZeRO-3 / FSDP throughput at 64-128 GPUs beyond MosaicML, as planner validation cases (issue #15).

    python benchmarks/published_fsdp_scale.py     # prints the cases and each row's step breakdown

`cases()` is read by `planner_published.py`; nothing here is fitted to any row. Every row is priced with FSDP's
gather unit, one block (`mosaic_table.fsdp_units`). The standalone output adds, per row, the StepBreakdown (with
the HSDP rows' cross-node all-reduce, whose exposed part and slowdown it includes) and the fms-fsdp rows' error
with the stated bandwidth read per GPU.

Sources
-------
- torchtitan (pytorch/torchtitan, commit 1ea476e9f24be439eda358aa864f45c1c37a8a88, 2024-04-24),
  `docs/performance.md`: Llama 2 13B / 70B and Llama 3 8B / 70B trained with FSDP2 alone (1D, no tensor or
  pipeline parallelism) on 64 A100 80GB, one table row per run: local batch, activation checkpointing, WPS
  (tokens/s per GPU) and MFU. The configuration is completed from the same commit: `train_configs/*.toml`
  (seq_len 4096 for Llama 2 and 8192 for Llama 3, no compile, no fp8, no gradient accumulation: global batch =
  local batch × 64), `torchtitan/parallelisms/parallelize_llama.py` (`fully_shard` on each block and the root,
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, full checkpointing with the non-reentrant
  wrapper), `torchtitan/models/llama/model.py` (causal `scaled_dot_product_attention`: flash attention).
  MFU convention (`train.py`, `torchtitan/utils.py` at that commit): 6·N + 12·L·H·Q·T FLOPs per token, N every
  parameter (embedding and output head included), H·Q = d_model, T = seq_len (no causal halving), peak 312
  TFLOP/s.
- IBM fms-fsdp (foundation-model-stack/fms-fsdp, commit 5e522b4c4f8a5f080717e714fee7622414dd6b63, 2024-03-13),
  `README.md` "Training throughput benchmarks", the eager-mode table (the same numbers as the PyTorch blog post
  "Maximizing training throughput using PyTorch FSDP", IBM and Meta, March 2024): Llama 2 7B / 13B / 70B and a
  34B (Code Llama's shape) at batch 2 per GPU on "A100 80G 128 GPUs with 400Gbps" and "H100 96 GPUs with
  800 Gbps", tokens/s per GPU, with sharding strategy (FSDP = FULL_SHARD, HSDP = HYBRID_SHARD) and activation
  checkpointing per row. Completed from the same commit: `fms_fsdp/config/training.py` (seq_length 4096, no
  compile), `fms_fsdp/policies/mixed_precision.py` (`bfSixteen`: bf16 parameters, gradient reduction and
  buffers), `fms_fsdp/policies/wrapping.py` (one FSDP unit per block), `fms_fsdp/policies/ac_handler.py`
  (non-reentrant checkpoint of a fraction p of the blocks; p = 1 is "Full AC"), `fms_fsdp/utils/config_utils.py`
  (the model shapes; fms's `LLaMAConfig` defaults: vocabulary 32,000, untied head, no biases).
  The README names its MFU convention (nanoGPT's, PaLM's: 6·N + 12·L·h·s per token).

Conventions and transcription checks
------------------------------------
Compared: tokens/s per GPU, the figure both sources measure (`Case.unit`); MFU follows from it by the source's
own convention (`palm_flops_per_token`), so the error is the same in either. Every shape reproduces its
checkpoint's parameter count exactly (`PARAMS`: the Hugging Face Llama 2, Code Llama 34B and Llama 3
checkpoints). torchtitan's WPS reproduces its MFU to 0.1 point in all eight rows of its table (the test). The
fms-fsdp columns agree less well: its MFU is what its tokens/s give in the convention it names +0.3 % (13B A100,
within the rounding), +2.5 to +4.1 % (7B; 13B H100) and −5.5 to −7.9 % (34B, 70B), so the columns come from
different measurements or a different count; the tokens/s column is compared, the MFU column is not used.
The fms-fsdp tokens/s are round numbers (3700, 700, 370, 7500, 1550, 800): read them as ±1-4 %.

Assumptions (what the sources do not state)
-------------------------------------------
- torchtitan's network: not stated. The shipped `a100-80gb` file (DGX A100: 8 × 200 Gb/s per node) is used.
- fms-fsdp's "400Gbps" / "800 Gbps" are read per node (8 GPUs): the BLOOM rows' convention, 400e9/8/8 =
  6.25 GB/s and 800e9/8/8 = 12.5 GB/s per GPU in `inter_node_bandwidth` (a ring across nodes still moves at the
  node's aggregate rate per rank, `network.bus_bandwidth`). Read per GPU, the network would be 8× faster; the
  standalone output prints that sensitivity. Everything else is the shipped `a100-80gb` / `h100` file.
- No row states gradient accumulation; none is assumed (each step is one micro-batch per GPU).
- Checkpointing replays the forward less the MLP's output GEMM (torch's non-reentrant checkpoint in 2024 stops
  early, as tessera's runtime does): `replays_last_exit=False`.
- fms-fsdp's HSDP rows (7B): HYBRID_SHARD shards within each 8-GPU node and replicates across nodes: per unit, a
  reduce-scatter and two all-gathers over NVLink, then an all-reduce of the node's 1/8 gradient shard across the
  16 (A100) or 12 (H100) nodes. Priced as tessera's hybrid sharding (`Plan.zero_shard` = 8 of dp 128 / 96,
  docs/zero.md): ZeRO-3 on the node and the bf16 all-reduce of each rank's 1/8 shard over its replica group, one
  rank per node (`cost.replica_reduce_time`: 2·(n−1)/n × 13.5 GB / 8 ≈ 3.2 GB per GPU per step, 0.5 s on the A100
  network, 0.25 s on the H100 one). tessera launches each block's all-reduce at the next block's reduction, under
  the rest of the backward (FSDP1's HYBRID_SHARD issues it right after the unit's reduce-scatter), so the planner
  exposes the last two blocks' and prices the rest as hidden, slowing the compute under it (+8.8 %, +15.1 %; with
  the whole all-reduce after the backward, as tessera ran it first: −8.8 %, −4.3 %; as in-node ZeRO-3 without it:
  +15.8 %, +23.0 %).
  They keep a group of their own.

Left out (each with its reason)
-------------------------------
- fms-fsdp 13B ("Selective AC": a fraction p of the blocks checkpointed; p is not stated, the HFU/MFU columns
  suggest p ≈ 1/2) and the torchtitan rows with "selective layer" (every k-th block, k not stated) or
  "selective op" checkpointing (per-op save list, every other matmul recomputed): a per-block fraction or an
  op-level policy is not a `Plan.recompute` mode here. (`published_torchtitan.py` prices the three A100
  "selective op" rows with tessera's `op` mode, torchtitan's policy, since 2026-12-03.)
- fms-fsdp's torch.compile table (README from commit ed74fd5, 2024-05-09): compiler fusion is not priced.
- fms-fsdp's table of 2024-02-28 (commit 6dc80d2): superseded two weeks later by the table used here, and its
  MFU column does not follow from its tokens/s (34B: 0.68 vs 0.55), so its transcription cannot be checked.
- torchtitan's later tables (docs/performance.md at commits 3faaa1a0d, 2024-08-23, and d4c86e375, 2025-01-30):
  Llama 3.1 405B with FSDP 16 × TP 8 on 128 H100, and Llama 3.1 8B with FSDP alone on 8 and 128 H100, on H100s
  with HBM2e at a lower power limit ("lower TDP"; 500 W in 2025) whose peak the source says it does not know, so
  no shipped file describes them; besides, the 8B rows use selective checkpointing and the other rows fp8,
  async TP or context parallelism, except one 405B row. (`published_torchtitan.py` prices the bf16 ones on the
  h100 file with the stated memory and HBM bandwidth, op-SAC as tessera's `op`, in groups of their own.)
- Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (arXiv 2304.11277): the
  paper itself was not reachable from our search tools (only second-hand summaries of it), so none of its
  GPT-175B / T5-11B measurements could be transcribed with a configuration.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from published_case import Case, case_table, summary  # noqa: E402

from tessera.planner.cost import ModelShape, Plan, palm_flops_per_token, replica_reduce_time  # noqa: E402
from tessera.planner.hardware import Hardware, load_hardware  # noqa: E402
from tessera.planner.mosaic_table import FSDP_SCHEDULE, fsdp_units  # noqa: E402
from tessera.planner.steptime import StepBreakdown, fast_step  # noqa: E402

LLAMA_SHAPES = {  # (layers, d_model, heads, kv heads, FFN, vocabulary); SwiGLU, RMSNorm, no biases, untied head
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000),
    "llama2-34b": (48, 8192, 64, 8, 22016, 32000),  # fms-fsdp's "34b": Code Llama 34B's shape
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000),
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256),
}

PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-34b": 33_743_970_304,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}
"""Parameter counts of the Hugging Face checkpoints (Llama-2-{7,13,70}b, CodeLlama-34b, Meta-Llama-3-{8,70}B):
the transcription check of `LLAMA_SHAPES`."""

A100_PEAK = 312e12
H100_PEAK = 989e12
"""The sources' MFU denominators (bf16 dense): torchtitan's `get_peak_flops`, fms-fsdp's README."""


def llama_shape(model: str, seq_len: int) -> ModelShape:
    """The model of `LLAMA_SHAPES` at `seq_len`."""
    layers, h, heads, kv, ffn, vocab = LLAMA_SHAPES[model]
    return ModelShape(
        n_layers=layers,
        d_model=h,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_hidden=ffn,
        vocab_size=vocab,
        seq_len=seq_len,
        swiglu=True,
        tied=False,
    )


@dataclass(frozen=True)
class FsdpScaleRow:
    """One published run: source, model, sequence length, network (a key of `hardware`), GPUs, the ZeRO-3 group
    (all GPUs for FULL_SHARD, one node for HSDP), micro-batch per GPU, full checkpointing or none, published
    tokens/s per GPU and MFU (fraction)."""

    source: str
    model: str
    seq_len: int
    network: str
    gpus: int
    shard_group: int
    micro_batch: int
    checkpointing: bool
    tokens_per_gpu: float
    mfu: float

    @property
    def shape(self) -> ModelShape:
        return llama_shape(self.model, self.seq_len)

    @property
    def hybrid(self) -> bool:
        return self.shard_group < self.gpus


TORCHTITAN, FMS = "torchtitan", "fms-fsdp"

TORCHTITAN_ROWS = (
    FsdpScaleRow(TORCHTITAN, "llama3-70b", 8192, "a100-80gb", 64, 64, 1, True, 331, 0.517),
    FsdpScaleRow(TORCHTITAN, "llama2-13b", 4096, "a100-80gb", 64, 64, 2, False, 2162, 0.611),
    FsdpScaleRow(TORCHTITAN, "llama2-70b", 4096, "a100-80gb", 64, 64, 2, True, 353, 0.505),
)
"""torchtitan docs/performance.md (1ea476e9f): the rows with full or no activation checkpointing."""

TORCHTITAN_LEFT_OUT = (  # (model, seq_len, micro-batch, checkpointing as published, WPS, MFU)
    ("llama3-8b", 8192, 1, "selective layer", 2904, 0.568),
    ("llama3-8b", 8192, 1, "selective op", 2973, 0.582),
    ("llama2-13b", 4096, 2, "selective layer", 1914, 0.541),
    ("llama2-13b", 4096, 2, "selective op", 1904, 0.538),
    ("llama2-70b", 4096, 1, "selective op", 355, 0.508),
)
"""The same table's rows whose checkpointing no `Plan` expresses: kept for the MFU transcription check only."""

FMS_ROWS = (
    FsdpScaleRow(FMS, "llama2-34b", 4096, "ibm-a100", 128, 128, 2, True, 700, 0.47),
    FsdpScaleRow(FMS, "llama2-70b", 4096, "ibm-a100", 128, 128, 2, True, 370, 0.50),
    FsdpScaleRow(FMS, "llama2-34b", 4096, "ibm-h100", 96, 96, 2, True, 1550, 0.32),
    FsdpScaleRow(FMS, "llama2-70b", 4096, "ibm-h100", 96, 96, 2, True, 800, 0.34),
    FsdpScaleRow(FMS, "llama2-7b", 4096, "ibm-a100", 128, 8, 2, False, 3700, 0.57),
    FsdpScaleRow(FMS, "llama2-7b", 4096, "ibm-h100", 96, 8, 2, False, 7500, 0.37),
)
"""fms-fsdp README (5e522b4), eager table: 34B and 70B FULL_SHARD with full checkpointing, 7B HSDP without."""

FMS_13B = (
    FsdpScaleRow(FMS, "llama2-13b", 4096, "ibm-a100", 128, 128, 2, True, 1800, 0.51),
    FsdpScaleRow(FMS, "llama2-13b", 4096, "ibm-h100", 96, 96, 2, True, 3800, 0.35),
)
"""The 13B rows ("Selective AC", fraction not stated): left out of `cases()`, kept for the MFU check."""


def hardware(network: str) -> Hardware:
    """The shipped file of the row's GPU, with the network its source states (module docstring)."""
    if network == "a100-80gb":
        return load_hardware("a100-80gb")
    if network == "ibm-a100":  # "A100 80G 128 GPUs with 400Gbps", read per 8-GPU node
        return dataclasses.replace(
            load_hardware("a100-80gb"), name=network, inter_node_bandwidth=400e9 / 8 / 8
        )
    if network == "ibm-h100":  # "H100 96 GPUs with 800 Gbps", read per 8-GPU node
        return dataclasses.replace(load_hardware("h100"), name=network, inter_node_bandwidth=800e9 / 8 / 8)
    raise ValueError(f"unknown network {network!r}: use a100-80gb, ibm-a100 or ibm-h100")


def peak(row: FsdpScaleRow) -> float:
    return H100_PEAK if "h100" in row.network else A100_PEAK


REDUCE_BYTES = {TORCHTITAN: 4, FMS: 0}
"""Gradient reduce-scatter width: torchtitan reduces in fp32 (`reduce_dtype=torch.float32`), fms-fsdp in bf16
(`bfSixteen`; 0 = as wide as the bf16 parameters)."""


def plan(row: FsdpScaleRow) -> Plan:
    """FSDP as ZeRO-3 over the row's GPUs, sharded within its shard group (HSDP: one node, hybrid sharding), one
    micro-batch per step, flash attention, bf16 gathers."""
    return Plan(
        dp=row.gpus,
        zero_stage=3,
        zero_shard=row.shard_group if row.hybrid else 0,
        micro_batch=row.micro_batch,
        n_microbatches=1,
        recompute="full" if row.checkpointing else "none",
        accumulation="depth_first",
        flash_attention=True,
        grad_reduce_bytes=REDUCE_BYTES[row.source],
    )


def step(row: FsdpScaleRow, hw: Hardware | None = None) -> StepBreakdown:
    """The row's step on `hw` (default: `hardware(row.network)`)."""
    return fast_step(row.shape, hw or hardware(row.network), fsdp_units(row.shape, plan(row)), FSDP_SCHEDULE)


def predict(row: FsdpScaleRow, hw: Hardware | None = None) -> float:
    """Predicted tokens/s per GPU."""
    return row.micro_batch * row.seq_len / step(row, hw).step_time


def mfu(row: FsdpScaleRow, tokens_per_gpu: float) -> float:
    """MFU of `tokens_per_gpu` in the sources' convention (`palm_flops_per_token`)."""
    return tokens_per_gpu * palm_flops_per_token(row.shape) / peak(row)


def _group(row: FsdpScaleRow) -> str:
    if row.source == TORCHTITAN:
        return "ZeRO-3 at scale (torchtitan FSDP2, 64 A100)"
    if row.hybrid:
        return "HSDP (fms-fsdp 7B, 96-128 GPUs; cross-node all-reduce under the backward, as tessera runs it)"
    return "ZeRO-3 at scale (fms-fsdp FSDP, 128 A100 / 96 H100, 400-800 Gb/s nodes)"


def _label(row: FsdpScaleRow) -> str:
    gpu = "H100" if "h100" in row.network else "A100"
    kind = f"HSDP {row.gpus // row.shard_group}×{row.shard_group}" if row.hybrid else f"FSDP {row.gpus}"
    ckpt = " ckpt" if row.checkpointing else ""
    return f"{row.source} {row.model} s{row.seq_len} {row.gpus}×{gpu} {kind} b{row.micro_batch}{ckpt}"


def cases() -> list[Case]:
    return [
        Case(_group(r), _label(r), r.tokens_per_gpu, predict(r), "tokens/s/GPU")
        for r in (*TORCHTITAN_ROWS, *FMS_ROWS)
    ]


def hsdp_all_reduce(row: FsdpScaleRow) -> float:
    """Seconds of the HSDP rows' all-reduce of each rank's 1/8 gradient shard (bf16) across the nodes, one rank per
    node (stride 8), on the row's network (`cost.replica_reduce_time`, part of the step's dp_comm). 0 for
    FULL_SHARD rows."""
    return replica_reduce_time(row.shape.n_params(), hardware(row.network), fsdp_units(row.shape, plan(row)))


def _breakdown_lines() -> list[str]:
    """Each row's StepBreakdown (tp, pp and bubble are 0 here), the HSDP all-reduce's seconds (mostly hidden),
    the published step and the error."""
    lines = [
        "| case | compute s | dp_comm s | HSDP all-reduce s (all but 2 blocks' hidden) | optimizer s | step s | published s "
        "| error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in (*TORCHTITAN_ROWS, *FMS_ROWS):
        bd, published = step(r), r.micro_batch * r.seq_len / r.tokens_per_gpu
        lines.append(
            f"| {_label(r)} | {bd.compute:.2f} | {bd.dp_comm:.2f} | {hsdp_all_reduce(r):.2f} | {bd.optimizer:.3f} | "
            f"{bd.step_time:.2f} | {published:.2f} | {published / bd.step_time - 1:+.1%} |"
        )
    return lines


def _network_lines() -> list[str]:
    """fms-fsdp's stated bandwidth read per GPU instead of per node (8× faster network)."""
    lines = ["| fms-fsdp case | per node (the cases) | per GPU |", "|---|---|---|"]
    for r in FMS_ROWS:
        hw = hardware(r.network)
        fast = dataclasses.replace(hw, inter_node_bandwidth=hw.inter_node_bandwidth * 8)
        lines.append(
            f"| {_label(r)} | {predict(r) / r.tokens_per_gpu - 1:+.1%} | {predict(r, fast) / r.tokens_per_gpu - 1:+.1%} |"
        )
    return lines


def report() -> str:
    all_cases = cases()
    lines = [*case_table(all_cases, decimals=0), ""]
    lines += [
        f"- {g}: {summary([c for c in all_cases if c.group == g])}"
        for g in dict.fromkeys(c.group for c in all_cases)
    ]
    lines.append(f"- all: {summary(all_cases)}")
    return "\n".join([*lines, "", *_breakdown_lines(), "", *_network_lines()])


if __name__ == "__main__":
    print(report())
