"""The run configuration's sections: every key with its type, default and documentation, and what it derives.

Each section's field rules are `tessera.config.checks`; reading TOML and overrides into these is
`tessera.config.loading`. A key's documentation is the string under it (`tessera config` and docs/config.md read
it with `tessera.config_docs`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tessera.axes import DIMS
from tessera.config import checks
from tessera.config.checks import Violation
from tessera.errors import ConfigError
from tessera.model.family import family_plan, head_dim_of

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LogConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "even_split",
    "key_name",
    "parse_tensor",
]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The model's shape. `size` names a registry entry whose fields fill in anything not set explicitly."""

    size: str | None = None
    """Registry name (see `tessera.model.sizes`), e.g. "gpt2-124m" or "llama-8b"."""
    family: str = "gpt"
    """"gpt" (LayerNorm, GELU MLP, learned positions), "llama" (RMSNorm, SwiGLU, RoPE, grouped-query attention),
    "qwen2" (Llama with q/k/v biases), "qwen3" (Llama with an RMSNorm on each query and key head), "gemma2"
    (Gemma 2: norms before and after each sublayer, GeGLU, soft-capped logits) or "gemma3" (Gemma 3 text: Gemma 2
    with q/k norms and sliding-window local layers); each family is declared in tessera/model/family.py."""
    n_layers: int = 2
    """Number of transformer blocks."""
    d_model: int = 64
    """Hidden size h."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (multi-head attention)."""
    head_dim: int | None = None
    """Features per attention head; None means d_model / n_heads. Set when a model's heads are wider or narrower
    than that (Qwen3-0.6B: d_model 1024, 16 heads, head_dim 128): wq is then d_model → n_heads·head_dim, wk and
    wv d_model → n_kv_heads·head_dim, wo n_heads·head_dim → d_model, as transformers' Llama. Families with RoPE
    only (GPT-2 has no head_dim); even with RoPE."""
    ffn_hidden: int | None = None
    """MLP hidden size; None means the family's rule: 4·d_model for GPT, 8/3·d rounded up to 64 for SwiGLU."""
    vocab_size: int = 256
    """Vocabulary size; must cover the tokenizer's."""
    seq_len: int = 64
    """Training context length s."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base of the families with RoPE (all but gpt); gemma3: its global layers (local: rope_local_theta)."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE frequency scaling (families with RoPE): {type = "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}, as Hugging Face's rope_scaling, e.g. Llama 3.1's factor 8.0, 1.0, 4.0,
    8192, or {type = "linear", factor} (tessera/model/rope_scaling.py). Family gemma3 scales its global layers
    only, its local ones stay unscaled (Gemma 3 4B/12B/27B: linear, factor 8.0). None: unscaled RoPE."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by query_pre_attn_scalar^-0.5 instead of head_dim^-0.5 (Gemma 2: 256, and 144 in
    the 27B, whose head_dim is 128). None: head_dim^-0.5. Families gemma2 and gemma3."""
    attn_softcap: float | None = None
    """Attention logit soft-capping (Gemma 2: 50.0): scores = cap·tanh(scores / cap) before the causal mask and
    the softmax. Attention is then computed explicitly rather than by SDPA, holding the [b, heads, s, s] scores
    (docs/huggingface.md, "Gemma 2"). None: no cap. Families gemma2 and gemma3."""
    final_softcap: float | None = None
    """Final logit soft-capping (Gemma 2: 30.0): logits = cap·tanh(logits / cap) before the loss. None: no cap.
    Families gemma2 and gemma3."""
    sliding_window: int | None = None
    """Gemma 3's local attention: on its sliding layers a query at position i sees the keys j with
    i - sliding_window < j <= i (transformers' sliding_window_overlay). None: every layer attends to every earlier
    position. Family gemma3 only."""
    sliding_window_pattern: int = 6
    """With ``sliding_window``: layer i (from 0) is global, full attention with RoPE base ``rope_theta``, when
    (i + 1) is a multiple of it, else local (windowed, RoPE base ``rope_local_theta``); Gemma 3's 5 local : 1
    global is 6. Family gemma3 only."""
    rope_local_theta: float = 10000.0
    """RoPE base of Gemma 3's local (sliding) layers (its rope_local_base_freq); ``rope_theta`` is the global
    layers'. Family gemma3 only."""
    init_std: float = 0.02
    """Std of the normal initialisation of weights."""
    init: str | None = None
    """Initial weights: "hf:DIR", a Hugging Face `save_pretrained` folder; the shape fields are then derived
    from DIR/config.json (tessera/hf/config.py). None: random initialisation."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return family_plan(self).default_ffn(self.d_model)

    @property
    def head_size(self) -> int:
        """The per-head width in use: ``head_dim``, or d_model / n_heads when unset (`family.head_dim_of`)."""
        return head_dim_of(self.d_model, self.n_heads, self.head_dim)

    @property
    def attn_dim(self) -> int:
        """The attention's inner width n_heads · head_size: wq's outputs, wo's inputs."""
        return self.n_heads * self.head_size

    def check(self) -> list[Violation]:
        return checks.check_model(self)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How ranks are laid out: data × pipeline × context × tensor (1D size t, or a 2D grid "qxq"), tensor innermost."""

    data: int | None = None
    """Data-parallel size; None means whatever is left: world_size / (pipeline · tensor ranks)."""
    tensor: int | str = 1
    """Megatron 1D tensor parallelism of size t (an int), or Optimus 2D on a q×q grid (a string such as "2x2")."""
    sequence_parallel: bool = False
    """1D only: shard norm/dropout regions along the sequence (all-gather/reduce-scatter instead of all-reduce)."""
    tp_comm_overlap: bool = False
    """1D with sequence parallelism only: split each tensor-parallel all-gather / reduce-scatter next to a GEMM into
    a ring of point-to-point steps run under the GEMM's chunks (Megatron's --tp-comm-overlap; docs/tensor-1d.md)."""
    pipeline: int = 1
    """Pipeline-parallel size p."""
    context: int = 1
    """Context-parallel size c: each micro-batch's sequence is cut into 2c chunks, rank i holding chunks i and
    2c-1-i; attention all-gathers K and V over the c ranks (Llama 3's all-gather CP; docs/context-parallel.md).
    seq_len must divide by 2c (2c·t with sequence parallelism). Not with pipeline or 2D tensor parallelism."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved, breadth_first, or a CSV file of your own (pipeline/csvio.py)."""
    stages_per_rank: int = 1
    """Virtual stages per pipeline rank v (interleaved and breadth_first)."""
    stage_layers: list[int] | None = None
    """Explicit layers per stage (p·v entries summing to n_layers), e.g. lighter first and last stages."""
    zero: int = 0
    """ZeRO stage over the data-parallel group: 0 (plain all-reduce), 1, 2 or 3."""
    zero_shard_size: int | None = None
    """Hybrid sharding (HSDP): ZeRO shards over groups of this many consecutive data-parallel ranks (e.g. the GPUs
    of one node) and replicates across the data / zero_shard_size groups, which all-reduce the gradient shards.
    Unset: one shard group of the whole data-parallel size (plain ZeRO). Must divide the data-parallel size;
    needs zero >= 1 (docs/zero.md, "Hybrid sharding")."""
    overlap_param_gather: bool = False
    """ZeRO-1/2 only: all-gather the updated parameters asynchronously after the optimizer step and wait for each
    stage's only before its first compute of the next step (Megatron's --overlap-param-gather)."""
    accumulation: str = "layered"
    """Gradient accumulation order: layered (breadth-first) or depth_first."""
    checkpointing: str = "none"
    """Activation checkpointing: none, full (per block), selective (attention core only) or op (torchtitan's
    selective op policy: every second matmul of a block and its non-matmul ops replayed, attention kept)."""

    def tensor_shape(self) -> tuple[int, int]:
        """(t, q): the 1D size t, or the 2D grid side q; the other is 1."""
        t, q = parse_tensor(self.tensor)
        return t, q

    @property
    def tensor_ranks(self) -> int:
        t, q = self.tensor_shape()
        return t * q * q

    def layout_sizes(self, world_size: int) -> dict[str, int]:
        """Every size field of `tessera.layout.Layout` (the registry `tessera.axes.DIMS`): a dimension's key holds
        its size, except ``tensor`` (t, or "qxq" for the 2D grid side q) and ``data`` (None: what is left)."""
        return {**self._fixed_sizes(), "dp": self.data_size(world_size)}

    def _fixed_sizes(self) -> dict[str, int]:
        """The sizes the config states outright: every dimension's but data's."""
        t, q = self.tensor_shape()
        sizes = {"tp": t, "q": q}
        for d in DIMS:
            if d.key not in ("data", "tensor"):
                sizes[d.plan_field] = getattr(self, d.key)
        return sizes

    def data_size(self, world_size: int) -> int:
        if self.data is not None:
            return self.data
        sizes = self._fixed_sizes()
        others = math.prod(d.ranks(sizes) for d in DIMS if d.key != "data")
        return max(1, world_size // max(1, others))  # max(1, ...): defined while check() reports a zero size

    def check(self) -> list[Violation]:
        return checks.check_parallel(self)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimisation: AdamW with linear warmup and cosine decay, clipping and gradient accumulation."""

    steps: int = 100
    """Optimizer steps to run."""
    global_batch: int = 8
    """Sequences per optimizer step = micro_batch × micro-batches × data-parallel size."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (applied to matrices only, not to norms and biases)."""
    beta1: float = 0.9
    """AdamW's decay rate of the first-moment (mean) estimate."""
    beta2: float = 0.95
    """AdamW's decay rate of the second-moment (uncentred variance) estimate."""
    eps: float = 1e-8
    """AdamW's term added to the denominator for numerical stability."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 1234
    """Seeds initialisation and data order."""
    dtype: str = "fp32"
    """Compute dtype: fp32, bf16 (autocast where supported) or fp16."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    grad_reduce_dtype: str = "fp32"
    """dtype of the ZeRO gradient reduce-scatter, and of hybrid sharding's all-reduce of the gradient shards across
    shard groups: fp32 (exact accumulation) or bf16 (half the traffic; the shards still accumulate in fp32). bf16
    needs parallel.zero >= 1: plain data parallelism all-reduces fp32 gradients."""
    fp16_init_scale: float = 65536.0
    """Initial dynamic loss scale for train.dtype = 'fp16' (halved on overflow, doubled every 2000 good steps)."""
    bucket_mb: float = 25.0
    """Size of data-parallel gradient all-reduce buckets, in MiB."""
    eval_every: int = 0
    """Compute the validation loss every this many steps and at the end (0: never); needs data.valid_path or
    data.valid_fraction."""
    eval_batches: int = 4
    """Global batches of validation data per evaluation (always the same ones)."""
    nonfinite: str = "stop"
    """A NaN/inf loss or gradient norm: "stop" (save nothing, exit naming the step) or "skip" the update."""
    max_skips: int = 3
    """train.nonfinite = "skip": stop after this many consecutive skipped steps."""
    fp16_max_overflows: int = 32
    """fp16: stop after this many consecutive overflowing steps (the loss scale cannot recover)."""
    hang_timeout_s: float = 1800.0
    """A rank that finishes no step for this long (saves excluded) dumps its stack to RUN_DIR/stacks/ and
    exits 4 naming the ranks that stopped responding; 0 disables the watchdog."""
    collective_timeout_s: float = 0.0
    """Timeout of every collective, passed to torch.distributed.init_process_group; 0 keeps torch's (30 min)."""
    skip_steps: list[list[int]] = field(default_factory=list)
    """Steps not trained on, as [first, last] ranges of step numbers (metrics.jsonl's, both ends included), e.g.
    [[1200, 1499]] after a loss spike: their global batches are passed over (the next step draws the samples
    after them) and the learning rate schedule moves on, with no forward, backward or update. May be added when
    resuming from a checkpoint before the range (docs/data.md, "Skipping batches after a loss spike")."""
    stop_signal: str = "SIGUSR1"
    """Signal that, like SIGTERM and SIGINT, makes every rank checkpoint at the next step and exit 75
    (pre-emption: Slurm's `--signal=USR1@120`); "" for none."""

    def micro_batches(self, dp: int) -> int:
        return self.global_batch // max(1, self.micro_batch * dp)

    def check(self) -> list[Violation]:
        return checks.check_train(self)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Training data: prepared token files (one, or a weighted blend), or the embedded default corpus."""

    path: str | list[Any] | None = None
    """Token file written by `tessera prepare`, or a blend: a list of files and/or {path, weight} tables
    (weight 1 when omitted); None prepares the default corpus (the Python standard library)."""
    valid_path: str | None = None
    """A separate token file for the validation loss."""
    valid_fraction: float = 0.0
    """Hold out this fraction of every training file (its last whole documents) for the validation loss."""
    tokenizer: str = "byte"
    """"byte" (no files needed), a Hugging Face tokenizers JSON file, or a `save_pretrained` folder holding one
    (its EOS token separates documents)."""
    seed: int | None = None
    """Seed of the sample order; None means train.seed."""
    default_corpus_mb: float = 8.0
    """How many MiB of standard-library sources the default corpus takes (a deterministic subset)."""
    document_mask: bool = False
    """Attend within documents only: a training window spanning several documents (each ended by the data's
    end-of-text token) has its positions restart at every document and attention masked block-diagonally
    (causal within each document), as if each were a sequence of its own. Needs token files that record their
    end-of-text token (`tessera prepare` does). Off: the window is one sequence, as in GPT-2 training."""
    window_start: str = "any"
    """Where training and validation windows start: "any" token (a window may open mid-document, as in
    pre-training), or "document": only at a document start (a file's first token or the one after an end-of-text
    token), each document equally likely, so a fine-tuning window holds its record's prompt before its reply (a
    window that reaches the file's end reads on from its first token, so the last documents open windows too).
    Documents longer than model.seq_len + 1 tokens then lose their tail (the trainer and `tessera validate` warn
    how much). Needs token files that record their end-of-text token (`tessera prepare` does); their index of
    document starts is cached beside them (FILE.doc-starts)."""
    loss_mask: bool = False
    """Train only on the targets the data's loss mask marks (`tessera prepare --prompt-key KEY --completion-key
    KEY`: a record's completion and its end-of-text token, not its prompt; `--messages-key KEY`: a conversation's
    assistant turns and their end-of-turn tokens). The loss is the cross-entropy summed
    over those targets divided by their number in the whole global batch (every micro-batch, every data-parallel
    rank), so every layout computes the same gradient; the validation loss likewise. Needs every token file to
    have a mask. Off: every token is a target."""

    def sources(self) -> list[tuple[str, float]]:
        """(path, weight) of every training file; empty for the default corpus. Assumes `check` passed."""
        if self.path is None:
            return []
        entries = [self.path] if isinstance(self.path, str) else self.path
        return [(e, 1.0) if isinstance(e, str) else (e["path"], float(e.get("weight", 1.0))) for e in entries]

    def check(self, *, files: bool = True) -> list[Violation]:
        return checks.check_data(self, files=files)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When and where to save; saves are atomic and resumable."""

    dir: str | None = None
    """Checkpoint directory; None means RUN_DIR/checkpoints."""
    every: int = 0
    """Save every this many steps (0: only at the end)."""
    keep: int = 2
    """How many most recent checkpoints to keep."""
    resume: bool = True
    """Resume from the newest checkpoint in dir that verifies against its checksums, if there is one."""
    load_step: int | None = None
    """Resume from exactly this step's checkpoint instead (it must exist and verify); needs resume = true."""
    new_schedule: bool = False
    """Resume even though train.lr, min_lr, warmup_steps or steps give the remaining steps other learning rates
    than the checkpoint's schedule (refused otherwise): the new schedule takes effect at the resume step, at its
    value there (no new warmup)."""
    new_data_order: bool = False
    """Resume even though the data order's seed (data.seed, or train.seed when it is unset) or data.window_start
    changed (refused otherwise): the remaining steps draw their samples, and val_loss its windows, with the new seed
    or rule, e.g. to step past the data around a loss spike (train.skip_steps skips given steps' batches
    instead)."""
    async_: bool = False
    """Write checkpoints in the background (DCP's async save): training waits only for a copy of the state in
    CPU memory; a checkpoint counts once committed, as ever, and the next save or the end of the run waits for
    it. Costs one more copy of the state in host memory."""

    def check(self) -> list[Violation]:
        return checks.check_checkpoint(self)


@dataclass(kw_only=True, slots=True)
class LogConfig:
    """Metrics and progress display."""

    run_dir: str = "runs/default"
    """Where metrics.jsonl, the resolved config, checkpoints and plots go."""
    every: int = 1
    """Log metrics every this many steps."""
    progress: bool = True
    """Live progress display on rank 0 (rich)."""
    tensorboard: bool = True
    """Also write TensorBoard events to RUN_DIR/tensorboard."""
    wandb: bool = False
    """Also log the same scalars to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "tessera"
    """W&B project name."""
    wandb_mode: str = "offline"
    """W&B mode: offline (files under RUN_DIR/wandb, `wandb sync` later), online or disabled."""

    def check(self, *, packages: bool = True) -> list[Violation]:
        return checks.check_log(self, packages=packages)


@dataclass(kw_only=True, slots=True)
class Config:
    """A whole run: model, layout, optimisation, data, checkpointing and logging."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, Any]:
        """{section: {key: value}} under the config's key names (``checkpoint.async``), as `from_dict` reads."""
        return {
            section: {key_name(k): v for k, v in values.items()}
            for section, values in dataclasses.asdict(self).items()
        }

    def check(self, world_size: int) -> list[Violation]:
        """Every violated rule, for this world size; an empty list means the config is valid.

        The per-section field rules live in each section's ``check``; the rules across sections (world size,
        divisibility, batch arithmetic, the schedule that will run) in `tessera.execution`, which resolves the
        config into the plan a run executes."""
        from tessera.execution import violations

        return violations(self, world_size)

    def validate(self, world_size: int) -> None:
        """Raise ConfigError listing every violation at once (`tessera.execution.resolve`)."""
        from tessera.execution import resolve

        resolve(self, world_size)


def key_name(field_name: str) -> str:
    """A section field's key in config files and overrides: its name less the trailing underscore that a Python
    keyword needs (field ``async_`` is the key ``checkpoint.async``)."""
    return field_name.removesuffix("_")


def parse_tensor(value: int | str) -> tuple[int, int]:
    """Parse parallel.tensor into (t, q): 4 → (4, 1) for 1D; "2x2" → (1, 2) for 2D."""
    if isinstance(value, bool):
        raise ConfigError(f"parallel.tensor = {value!r} is not a size")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"parallel.tensor = {value} must be at least 1")
        return value, 1
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", str(value))
    if m is None:
        if str(value).strip().isdigit():
            return parse_tensor(int(value))
        raise ConfigError(f'parallel.tensor = {value!r} is neither an int nor a grid like "2x2"')
    rows, cols = int(m.group(1)), int(m.group(2))
    if rows != cols or rows < 1:
        raise ConfigError(f"parallel.tensor = {value!r}: the 2D grid must be square (q×q), got {rows}×{cols}")
    return 1, rows


def even_split(n_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage for an even split; the first ``n_layers % n_stages`` stages get one more."""
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]
