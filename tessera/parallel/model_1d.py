"""`apply_tensor_1d`: turn a plain GPT or Llama into its Megatron 1D tensor-parallel shard on this rank.

Every rank builds the same plain model (same seed) and cuts its shard from the identical full weights:

- attention: wq, wk, wv column-parallel (n_heads/t query heads and n_kv_heads/t KV heads per rank, so grouped-query
  attention keeps each query head with its KV head), wo row-parallel;
- MLP: the family's `mlp_in` (fc / w_gate, w_up) column-parallel, its `mlp_out` (proj / w_down) row-parallel, the
  activation elementwise and local (tessera/model/family.py declares which is which);
- token embedding and output projection vocabulary-parallel (vocabulary padded to a multiple of t internally;
  tied embeddings share one shard); GPT's position table and all norms replicated (Qwen3's per-head q/k norms
  too, their gradients all-reduced since each rank normalises only its own heads);
- with sequence parallelism the residual stream between the regions is [b, s/t, h] (see tensor_1d.py); with
  ``tp_comm_overlap`` its all-gathers / reduce-scatters around the linears run as rings under their GEMMs.

The returned `TensorParallel1D` keeps the plain model's attribute and parameter names (`embed`, `blocks["i"]`,
`head`, `attn.wq`, ...), so `full_parameters()` is keyed like the plain model's `named_parameters()`.
`tensor_1d_comm` gives the exact bytes one forward + backward moves per rank (docs/tensor-1d.md derives it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.errors import ConfigError
from tessera.model.documents import AttentionMasks
from tessera.model.family import FamilyPlan
from tessera.model.layers import Block, TransformerLM, attend, embed_scale
from tessera.model.materialize import ShardSpec
from tessera.parallel.tensor_1d import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    VocabParallelOutput,
    check_overlap,
    column_parallel,
    group_rank,
)
from tessera.traffic import tensor_1d_comm  # the traffic formula, re-exported for the tests

__all__ = ["TensorParallel1D", "apply_tensor_1d", "check_tensor_1d", "tensor_1d_comm"]


class Regions(NamedTuple):
    """How the blocks' tensor regions are entered and left (one pair of settings, passed to every layer)."""

    sequence_parallel: bool
    tp_comm_overlap: bool  # SP's all-gathers / reduce-scatters as rings under their GEMMs (ring_1d.py)

    def options(self) -> dict[str, bool]:
        """The 1D layers' constructor keywords."""
        return self._asdict()


class ParallelAttention(nn.Module):
    """Attention on this rank's n_heads/t query heads and n_kv_heads/t KV heads; one region entry for q, k, v."""

    def __init__(self, attn: nn.Module, group: dist.ProcessGroup, regions: Regions) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.tp_comm_overlap = group, *regions
        self.head_dim = attn.head_dim
        opts = regions.options()
        self.wq = ColumnParallelLinear.from_linear(attn.wq, group, **opts)
        self.wk = ColumnParallelLinear.from_linear(attn.wk, group, **opts)
        self.wv = ColumnParallelLinear.from_linear(attn.wv, group, **opts)
        self.wo = RowParallelLinear.from_linear(attn.wo, group, **opts)
        # per-head q/k norms (Qwen3): replicated, each rank normalising its own heads, so the weights' gradients
        # are partial sums over heads: all-reduced, with or without sequence parallelism
        self.q_norm = _replicated(attn.q_norm, group)
        self.k_norm = _replicated(attn.k_norm, group)
        self.core = attn.core  # parameter-free: checkpointing may wrap it as in the plain model
        self.rope = attn.rope

    def forward(self, x: torch.Tensor, docs: AttentionMasks | None = None) -> torch.Tensor:
        linears = (self.wq, self.wk, self.wv)
        q, k, v = column_parallel(x, linears, self.group, self.sequence_parallel, self.tp_comm_overlap)
        b, s, _ = q.shape  # q: [b, s, nh·hd/t] (the full sequence, also with SP)
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)  # q: [b, nh/t, s, hd]
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)  # k: [b, nkv/t, s, hd]
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)  # v: [b, nkv/t, s, hd]
        # full sequence here, so the plain model's positions (and whole documents) with or without SP
        y = attend(self, q, k, v, docs)  # y: [b, nh/t, s, hd]
        y = y.transpose(1, 2).reshape(b, s, -1)  # y: [b, s, nh·hd/t]
        return self.wo(y)  # [b, s, h] or [b, s/t, h] with SP


class ParallelMLP(nn.Module):
    """The family's MLP: its ``mlp_in`` Linears column-parallel (one region entry for all), the plain MLP's
    elementwise ``activate`` on ffn/t features, its ``mlp_out`` row-parallel (GELU: fc → proj; SwiGLU:
    w_gate, w_up → w_down)."""

    def __init__(self, mlp: nn.Module, plan: FamilyPlan, group: dist.ProcessGroup, regions: Regions) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.tp_comm_overlap = group, *regions
        self.inputs, self.output = plan.mlp_in, plan.mlp_out
        self.activate = type(mlp).activate  # a staticmethod of the plain MLP: elementwise, so local
        opts = regions.options()
        for name in plan.mlp_in:
            setattr(self, name, ColumnParallelLinear.from_linear(getattr(mlp, name), group, **opts))
        setattr(self, plan.mlp_out, RowParallelLinear.from_linear(getattr(mlp, plan.mlp_out), group, **opts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linears = tuple(getattr(self, name) for name in self.inputs)
        # each [b, s, ffn/t]
        hidden = column_parallel(x, linears, self.group, self.sequence_parallel, self.tp_comm_overlap)
        x = self.activate(*hidden)  # x: [b, s, ffn/t]
        return getattr(self, self.output)(x)  # [b, s, h] or [b, s/t, h]


class ParallelEmbedding(nn.Module):
    """Vocabulary-parallel token embedding (`wte` / `tok`), plus a replicated learned position table (GPT's
    `wpe`) if the family declares one; scaled by sqrt(h) if the family declares it (Gemma: the partial lookups
    are summed first, exactly, as one rank's row is the whole lookup)."""

    def __init__(self, embed: nn.Module, plan: FamilyPlan, group: dist.ProcessGroup, sp: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.token_name = group, sp, plan.token_embedding
        tok = VocabParallelEmbedding.from_embedding(
            getattr(embed, self.token_name), group, sequence_parallel=sp
        )
        setattr(self, self.token_name, tok)
        self.scaled = plan.embed_scale
        self.position_name = plan.position_embedding
        if self.position_name is not None:
            setattr(self, self.position_name, getattr(embed, self.position_name))  # replicated, not sharded

    def forward(self, tokens: torch.Tensor, docs: AttentionMasks | None = None) -> torch.Tensor:
        """tokens [b, s] → x [b, s, h] ([b, s/t, h] with SP); learned positions 0..s-1, or ``docs.positions``."""
        tok = getattr(self, self.token_name)
        x = tok(tokens)  # x: [b, s, h] or [b, s/t, h] with SP
        if self.scaled:
            x = x * embed_scale(x.shape[-1], tok.weight.dtype)
        if self.position_name is None:
            return x
        table = getattr(self, self.position_name)
        s = tokens.shape[1]
        if s > table.num_embeddings:
            raise ValueError(f"sequence length {s} exceeds model.seq_len = {table.num_embeddings}")
        if not self.sequence_parallel:
            return x + (table.weight[:s] if docs is None else table(docs.positions))  # [b, s, h]
        # This rank holds sequence indices [r·s/t, (r+1)·s/t): the table's gradient is partial, all-reduce it.
        n, r = x.shape[1], group_rank(self.group)
        weight = comm.copy_to_region(table.weight, self.group)  # weight: [seq_len, h]
        if docs is None:
            return x + weight[r * n : (r + 1) * n]  # [b, s/t, h]
        return x + F.embedding(docs.positions[:, r * n : (r + 1) * n], weight)  # [b, s/t, h]


class ParallelHead(nn.Module):
    """Final norm (on the sequence shard with SP) then the vocabulary-parallel output and loss."""

    def __init__(self, norm: nn.Module, out: VocabParallelOutput) -> None:
        super().__init__()
        self.norm, self.out = norm, out

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        return self.out(self.norm(x), targets, reduction)  # loss, or logits [b, s, V]


class TensorParallel1D(nn.Module):
    """This rank's Megatron 1D shard of a plain `TransformerLM`; `forward(tokens, targets) -> loss`.

    tokens and targets are the full micro-batch [b, s] on every rank of the tensor group; the loss is the mean
    over all of it, identical on every rank, and backward leaves each rank its shard of the single-device
    gradients (replicated parameters get the full gradient on every rank).
    """

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup,
        sequence_parallel: bool = False,
        *,
        tp_comm_overlap: bool = False,
    ) -> None:
        super().__init__()
        cfg = model.cfg
        check_tensor_1d(cfg, comm.group_size(group))
        check_overlap(sequence_parallel, tp_comm_overlap)
        self.cfg = self.plain_config = cfg
        self.group, self.sequence_parallel, self.tp_comm_overlap = group, sequence_parallel, tp_comm_overlap
        self.tp = comm.group_size(group)
        sp, plan = sequence_parallel, model.plan
        regions = Regions(sequence_parallel, tp_comm_overlap)
        self.plan = plan
        token_name = plan.token_embedding
        self.embed = None if model.embed is None else ParallelEmbedding(model.embed, plan, group, sp)
        self.blocks = nn.ModuleDict(
            {name: _parallel_block(blk, plan, group, regions) for name, blk in model.blocks.items()}
        )
        self.head = None
        if model.head is not None:
            # the final soft-cap (Gemma 2) is elementwise: each rank caps its vocabulary shard of the logits
            softcap = model.head.softcap
            out = VocabParallelOutput.from_linear(model.head.out, group, softcap=softcap, **regions.options())
            if cfg.tie_embeddings and self.embed is not None:
                out.weight = getattr(self.embed, token_name).weight  # one shard, two uses
            self.head = ParallelHead(_norm(model.head.norm, group, sp), out)
        if plan.rope:
            self.rope = model.rope  # shared RoPE tables, as in the plain Llama
        self._split = self._split_dims(model)

    def _split_dims(self, model: nn.Module) -> dict[str, tuple[int, int]]:
        """For each sharded parameter name: (split dim, full size along it); names match the plain model."""
        plain = dict(model.named_parameters())
        mine = dict(self.named_parameters())
        if set(plain) != set(mine):
            raise RuntimeError(
                f"tensor-1d parameter names drifted from the plain model: {set(plain) ^ set(mine)}"
            )
        dims = {}
        for mod in self.modules():
            if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding, VocabParallelOutput)):
                dims[id(mod.weight)] = 0
                if getattr(mod, "bias", None) is not None:
                    dims[id(mod.bias)] = 0
            elif isinstance(mod, RowParallelLinear):
                dims[id(mod.weight)] = 1  # its bias is replicated
        return {n: (dims[id(p)], plain[n].shape[dims[id(p)]]) for n, p in mine.items() if id(p) in dims}

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Which block of the plain model's parameter each local parameter is: rank r's 1/t of the split dim
        (the vocabulary padded to a multiple of t first), everything else replicated."""
        r = group_rank(self.group)
        specs = {}
        for name, p in self.named_parameters():
            if name not in self._split:
                specs[name] = ShardSpec.replicated(name, p.shape)
                continue
            dim, size = self._split[name]
            shape = tuple(size if d == dim else n for d, n in enumerate(p.shape))
            specs[name] = ShardSpec.split(name, shape, {dim: (self.tp, r)})
        return specs

    def tie_weights(self) -> None:
        """Re-share the output projection with the token embedding shard (if tied and both present)."""
        if self.cfg.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.out.weight = getattr(self.embed, self.plan.token_embedding).weight

    def tied_parameters(self) -> list[tuple[str, str]]:
        if not self.cfg.tie_embeddings:
            return []
        return [("head.out.weight", f"embed.{self.plan.token_embedding}.weight")]

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Loss over the full micro-batch (or full logits without targets), reduced by ``reduction``
        (`tessera.model.targets`); hidden states in/out for a stage without embed/head ([b, s/t, h] with
        sequence parallelism). ``positions`` [b, s]: document masking (`tessera.model.documents`), the full
        micro-batch's on every rank."""
        # Only a stage that embeds tokens splits the sequence; later stages get [b, s/t, h] already split.
        if self.sequence_parallel and self.embed is not None and tokens.shape[1] % self.tp:
            raise ValueError(
                f"sequence parallelism splits the sequence over the {self.tp} tensor ranks, but the sequence "
                f"length is {tokens.shape[1]}; use a seq_len divisible by {self.tp} or turn "
                "parallel.sequence_parallel off"
            )
        docs = self.masks(positions)  # the micro-batch's masks, one per kind for all the blocks
        if self.embed is None:
            x = tokens  # x: [b, s, h] or [b, s/t, h]
        elif positions is None:
            x = self.embed(tokens)  # x: [b, s, h] or [b, s/t, h]
        else:
            x = self.embed(tokens, docs)  # learned positions read the documents'
        for block in self.blocks.values():
            x = block(x, docs=docs)
        docs.release()  # the masks live on in what the layers saved (full recomputation: rebuilt once)
        if self.head is None:
            if targets is not None:
                raise ValueError(
                    "this model part has no head, so it cannot compute a loss; pass targets=None"
                )
            return x
        return self.head(x, targets, reduction)

    documents = staticmethod(TransformerLM.documents)
    """Attention sees the whole sequence on every tensor rank (gathered with SP): the documents of all of it."""
    masks = TransformerLM.masks

    def full_parameters(self, grad: bool = False) -> dict[str, torch.Tensor]:
        """Full, unpadded parameters (or gradients) keyed like the plain model; collective over the tensor group.

        Parameters released on this rank (stages other pipeline ranks own: empty tensors) are left out."""
        return {name: self.full_parameter(name, grad) for name, p in self.named_parameters() if p.numel() > 0}

    def full_parameter(self, name: str, grad: bool = False) -> torch.Tensor:
        """One full, unpadded parameter (or gradient) by plain name; collective over the tensor group."""
        p = self.get_parameter(name)
        x = p.grad if grad else p.detach()
        if x is None:
            x = torch.zeros_like(p)
        if name in self._split:
            dim, size = self._split[name]
            x = comm.all_gather(x.contiguous(), dim, self.group).narrow(dim, 0, size)
        return x.detach().clone()

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared global gradient norm over the tensor group, each replicated parameter counted once."""
        device = next(self.parameters()).device
        sharded = torch.zeros((), dtype=torch.float32, device=device)
        replicated = torch.zeros((), dtype=torch.float32, device=device)
        for name, p in self.named_parameters():
            if p.grad is not None:
                sq = p.grad.detach().float().pow(2).sum()
                if name in self._split:
                    sharded += sq  # padding rows have zero gradient: they add nothing
                else:
                    replicated += sq
        comm.all_reduce(sharded, self.group)
        return sharded + replicated


def _norm(norm: nn.Module, group: dist.ProcessGroup, sp: bool) -> nn.Module:
    return SequenceParallelNorm(norm, group) if sp and comm.group_size(group) > 1 else norm


def _replicated(norm: nn.Module | None, group: dist.ProcessGroup) -> nn.Module | None:
    """A norm every tensor rank holds whole but runs on its part of the input (its heads): gradients summed."""
    return _norm(norm, group, True) if norm is not None else None


def _parallel_block(block: nn.Module, plan: FamilyPlan, group: dist.ProcessGroup, regions: Regions) -> Block:
    sp = regions.sequence_parallel
    # post-norms (Gemma 2) run on the row-parallel outputs: [b, s, h] replicated, or the sequence shard with SP
    post = [None if n is None else _norm(n, group, sp) for n in (block.attn_post_norm, block.mlp_post_norm)]
    return Block(
        attn_norm=_norm(block.attn_norm, group, sp),
        attn=ParallelAttention(block.attn, group, regions),
        mlp_norm=_norm(block.mlp_norm, group, sp),
        mlp=ParallelMLP(block.mlp, plan, group, regions),
        attn_post_norm=post[0],
        mlp_post_norm=post[1],
    )


def check_tensor_1d(cfg: Any, t: int) -> None:
    """Raise ConfigError naming every model dimension that t does not divide (and the fix)."""
    problems = []
    for what, n in (
        ("model.n_heads", cfg.n_heads),
        ("model.n_kv_heads", cfg.kv_heads),
        ("ffn size", cfg.ffn),
    ):
        if n % t:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            problems.append(
                f"{what} = {n} is not divisible by tensor size {t}; use parallel.tensor in {divisors}"
            )
    if problems:
        raise ConfigError("Megatron 1D tensor parallelism:\n" + "\n".join(f"  - {p}" for p in problems))


def apply_tensor_1d(model: nn.Module, groups: Any, cfg: Any) -> TensorParallel1D:
    """This rank's Megatron 1D shard of ``model`` over ``groups.tp``.

    ``cfg`` is the run `Config` (or its `ParallelConfig`); only ``parallel.sequence_parallel`` and
    ``parallel.tp_comm_overlap`` are read. The plain model must be identical on every rank of the tensor group
    (build it with the same seed).
    """
    parallel = getattr(cfg, "parallel", cfg)
    return TensorParallel1D(
        model,
        groups.tp,
        bool(getattr(parallel, "sequence_parallel", False)),
        tp_comm_overlap=bool(getattr(parallel, "tp_comm_overlap", False)),
    )
