"""Megatron 1D tensor-parallel layers (Shoeybi et al. 2019) with optional sequence parallelism (Korthikanti 2022).

A tensor group of t ranks splits every weight matrix: a *column-parallel* linear keeps rows of W (output features),
a *row-parallel* linear keeps columns (input features). Pairing them (QKV then the output projection; fc then proj)
leaves one reduction per pair:

    residual [b, s, h] ──enter──► column-parallel ──► local heads / local ffn ──► row-parallel ──exit──► [b, s, h]

Without sequence parallelism the residual stream is replicated, ``enter`` is ``copy_to_region`` (identity forward,
all-reduce backward) and ``exit`` is ``reduce_from_region`` (all-reduce forward, identity backward). With sequence
parallelism the residual stream (norms, residual adds) is sharded along the sequence, [b, s/t, h]: ``enter`` is an
all-gather of the sequence (reduce-scatter backward) and ``exit`` a reduce-scatter (all-gather backward). Same
bytes on the wire (ring all-reduce = reduce-scatter + all-gather), but the norm-region activations shrink by t.

Parameters used inside the sequence-sharded region (norm weights, the bias of a row-parallel linear, GPT's position
table) are replicated, and each rank only sees its part of the sequence, so their gradients are partial sums: they
pass through ``copy_to_region`` so that backward all-reduces exactly this use's contribution (correct under
gradient accumulation, unlike a hook on the accumulated ``.grad``).

The vocabulary is split like a column-parallel linear (padded to a multiple of t; the padding rows are never looked
up and their logits are masked out), and the loss is computed without gathering logits.

With ``tp_comm_overlap`` (sequence parallelism only) the entry's all-gather and the row-parallel exit's
reduce-scatter run as rings of point-to-point steps under the GEMM chunks they feed (tessera/parallel/ring_1d.py);
the vocabulary-parallel embedding's exit has no GEMM to hide under and stays a reduce-scatter.

Shapes in comments: b batch, s sequence, h hidden, t tensor-group size, V vocabulary, Vl = padded V / t.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.model.layers import soft_cap
from tessera.model.targets import check_reduction, kept
from tessera.parallel.precision import cast_weight
from tessera.parallel.ring_1d import ring_gathered_linears, ring_row_parallel

__all__ = [
    "SEQ_DIM",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelNorm",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "check_overlap",
    "column_parallel",
    "exit_tensor_region",
    "group_rank",
    "padded_vocab",
    "row_parallel",
    "shard",
    "vocab_parallel_cross_entropy",
]

SEQ_DIM = 1
"""The sequence dimension of hidden states [b, s, h]: the one sequence parallelism shards."""


def padded_vocab(vocab_size: int, t: int) -> int:
    """The vocabulary rounded up to a multiple of t, so that every rank holds an equal shard."""
    return -(-vocab_size // t) * t


def shard(full: torch.Tensor, dim: int, group: dist.ProcessGroup, padded: int | None = None) -> torch.Tensor:
    """This rank's 1/t slice of ``full`` along ``dim`` (zero-padded to ``padded`` along dim first), a new tensor."""
    t, r = comm.group_size(group), group_rank(group)
    size = full.shape[dim] if padded is None else padded
    if size % t:
        raise ValueError(f"cannot split dim {dim} of size {size} over {t} tensor-parallel ranks")
    if size > full.shape[dim]:
        pad = list(full.shape)
        pad[dim] = size - full.shape[dim]
        full = torch.cat((full, full.new_zeros(pad)), dim=dim)
    return full.detach().chunk(t, dim=dim)[r].clone()


def group_rank(group: dist.ProcessGroup) -> int:
    """This rank's index in ``group`` (0 on a group of size 1, even without torch.distributed)."""
    return dist.get_rank(group) if comm.group_size(group) > 1 else 0


def check_overlap(sequence_parallel: bool, tp_comm_overlap: bool) -> None:
    """The ring overlap decomposes sequence parallelism's collectives: without them there is nothing to overlap."""
    if tp_comm_overlap and not sequence_parallel:
        raise ValueError(
            "tp_comm_overlap runs sequence parallelism's all-gather / reduce-scatter as rings under the GEMMs; "
            "it needs sequence_parallel=True (parallel.sequence_parallel = true), or set tp_comm_overlap=False"
        )


def exit_tensor_region(x: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """Partial sums [b, s, h] of a row-parallel layer → residual stream [b, s, h] (or [b, s/t, h] with SP)."""
    if sequence_parallel:
        return comm.reduce_scatter_to_region(x, SEQ_DIM, group)  # backward: all-gather
    return comm.reduce_from_region(x, group)  # backward: identity


class _GatheredLinears(torch.autograd.Function):
    """Sequence-parallel entry fused with the column-parallel linears reading it (Korthikanti et al. §4.2.2).

    Forward all-gathers x [b, s/t, h] → [b, s, h] and applies each linear. Only the shard is saved: backward
    all-gathers it again for the weight gradients, then reduce-scatters the input gradient. Saving the gathered
    input instead would keep a full [b, s, h] per region and undo sequence parallelism's memory saving.
    """

    @staticmethod
    def forward(ctx, x, group, *params):  # params: w0, b0, w1, b1, ... (a bias may be None)
        full = comm.all_gather(x, SEQ_DIM, group)  # full: [b, s, h]
        outs = tuple(F.linear(full, params[i], params[i + 1]) for i in range(0, len(params), 2))
        ctx.save_for_backward(x, *params)
        ctx.group = group
        return outs  # each [b, s, out_i/t]

    @staticmethod
    def backward(ctx, *grads):
        x, *params = ctx.saved_tensors
        full = comm.all_gather(x, SEQ_DIM, ctx.group)  # full: [b, s, h], gathered again
        gx, gparams = None, []
        for g, w, b in zip(grads, params[0::2], params[1::2], strict=True):
            if g is None:  # this output did not reach the loss
                gparams += [None, None]
                continue
            g = g.contiguous()  # g: [b, s, out/t]
            part = g.matmul(w.to(g.dtype))  # part: [b, s, h]
            gx = part if gx is None else gx + part
            g2 = g.flatten(0, -2)  # g2: [b·s, out/t]
            gw = g2.t().matmul(full.flatten(0, -2).to(g.dtype)).to(w.dtype)  # gw: [out/t, h]
            gparams += [gw, None if b is None else g2.sum(0).to(b.dtype)]
        if gx is None:
            gx = torch.zeros_like(full)
        return comm.reduce_scatter(gx, SEQ_DIM, ctx.group).to(x.dtype), None, *gparams


def column_parallel(
    x: torch.Tensor,
    linears: Sequence[nn.Module],
    group: dist.ProcessGroup,
    sequence_parallel: bool,
    tp_comm_overlap: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Enter the tensor region once and apply column-parallel linears (``.weight`` [out/t, in], ``.bias``) to it.

    Several linears reading one input (wq, wk, wv; w_gate, w_up) share one entry, so their input gradients are
    summed before one collective. x: [b, s, h] (replicated) or [b, s/t, h] (SP) → outputs [b, s, out_i/t].
    ``tp_comm_overlap`` (SP only): the all-gather runs as a ring under the linears' sequence chunks.
    """
    if sequence_parallel and comm.group_size(group) > 1:
        params = [p for lin in linears for p in (lin.weight, lin.bias)]
        if tp_comm_overlap:
            return ring_gathered_linears(x, SEQ_DIM, group, params)
        return _GatheredLinears.apply(x, group, *params)
    x = comm.copy_to_region(x, group)  # backward: all-reduce
    # a cast node per call (precision.cast_weight): each weight's bf16 gradient is consumed after its backward
    return tuple(F.linear(x, cast_weight(lin.weight), cast_weight(lin.bias)) for lin in linears)


class ColumnParallelLinear(nn.Module):
    """y_r = x W_rᵀ + b_r, with W_r the r-th block of rows (output features) of W: output [.., out/t].

    Calling it enters the region on its own; to share one entry between several linears use `column_parallel`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: dist.ProcessGroup,
        *,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
    ) -> None:
        super().__init__()
        check_overlap(sequence_parallel, tp_comm_overlap)
        t = comm.group_size(group)
        if out_features % t:
            raise ValueError(
                f"column-parallel linear: {out_features} output features not divisible by t = {t}"
            )
        self.group, self.sequence_parallel, self.tp_comm_overlap = group, sequence_parallel, tp_comm_overlap
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features))  # [out/t, in]
        self.bias = nn.Parameter(torch.zeros(out_features // t)) if bias else None  # [out/t]

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup, **kwargs) -> ColumnParallelLinear:
        """The shard of a full ``nn.Linear`` (identical on every rank) held by this rank."""
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, group, **kwargs)
        mod.weight = nn.Parameter(shard(linear.weight, 0, group))
        if linear.bias is not None:
            mod.bias = nn.Parameter(shard(linear.bias, 0, group))
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = column_parallel(x, (self,), self.group, self.sequence_parallel, self.tp_comm_overlap)
        return out[0]  # [b, s, out/t]


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r W_rᵀ + b, with W_r the r-th block of columns (input features) of W; input [.., in/t].

    The sum over ranks is the region's exit (all-reduce, or reduce-scatter along the sequence with SP); the bias is
    replicated and added after it, once.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: dist.ProcessGroup,
        *,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
    ) -> None:
        super().__init__()
        check_overlap(sequence_parallel, tp_comm_overlap)
        t = comm.group_size(group)
        if in_features % t:
            raise ValueError(f"row-parallel linear: {in_features} input features not divisible by t = {t}")
        self.group, self.sequence_parallel, self.tp_comm_overlap = group, sequence_parallel, tp_comm_overlap
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t))  # [out, in/t]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # [out], replicated

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup, **kwargs) -> RowParallelLinear:
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, group, **kwargs)
        mod.weight = nn.Parameter(shard(linear.weight, 1, group))
        if linear.bias is not None:
            mod.bias = nn.Parameter(linear.bias.detach().clone())
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = row_parallel(x, self.weight, self.group, self.sequence_parallel, self.tp_comm_overlap)
        if self.bias is None:
            return y
        # With SP each rank adds the bias to its own tokens only: its gradient is partial, all-reduce it.
        bias = comm.copy_to_region(self.bias, self.group) if self.sequence_parallel else self.bias
        return y + bias


def row_parallel(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup,
    sequence_parallel: bool,
    tp_comm_overlap: bool = False,
) -> torch.Tensor:
    """Σ_r x_r W_rᵀ leaving the region: x [b, s, in/t], weight [out, in/t] → [b, s, out] ([b, s/t, out] with SP).

    ``tp_comm_overlap`` (SP only): the reduce-scatter runs as a ring under the GEMM's sequence chunks.
    """
    if tp_comm_overlap and sequence_parallel and comm.group_size(group) > 1:
        return ring_row_parallel(x, weight, SEQ_DIM, group)  # [b, s/t, out]
    y = F.linear(x, cast_weight(weight))  # y: [b, s, out], a partial sum
    return exit_tensor_region(y, group, sequence_parallel)  # [b, s, out] or [b, s/t, out]


class VocabParallelEmbedding(nn.Module):
    """Token lookup in this rank's vocabulary rows [start, start + V_pad/t); the partial sums leave the region.

    Tokens outside the shard look up zeros; the exit (all-reduce, or reduce-scatter along the sequence with SP)
    adds the shards. ``weight`` [V_pad/t, h] may be shared with the output projection (tied embeddings).
    """

    def __init__(
        self, vocab_size: int, dim: int, group: dist.ProcessGroup, *, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        t = comm.group_size(group)
        self.vocab_size, self.group, self.sequence_parallel = vocab_size, group, sequence_parallel
        self.rows = padded_vocab(vocab_size, t) // t
        self.start = group_rank(group) * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))  # [Vl, h]

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: dist.ProcessGroup, **kwargs) -> VocabParallelEmbedding:
        mod = cls(emb.num_embeddings, emb.embedding_dim, group, **kwargs)
        padded = padded_vocab(emb.num_embeddings, comm.group_size(group))
        mod.weight = nn.Parameter(shard(emb.weight, 0, group, padded))  # [Vl, h]
        return mod

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start  # tokens: [b, s]
        outside = (local < 0) | (local >= self.rows)  # outside: [b, s]
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # x: [b, s, h]
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # zero rows for tokens held by other ranks
        return exit_tensor_region(x, self.group, self.sequence_parallel)  # [b, s, h] or [b, s/t, h]


class SequenceParallelNorm(nn.Module):
    """A replicated norm (LayerNorm or RMSNorm) run on a part of its input, a sequence shard (or, for Qwen3's
    per-head q/k norms, this rank's heads): its parameters' gradients are all-reduced.

    The parameters are registered here under the plain module's names (``weight``, ``bias``) so parameter names
    match the plain model; the forward is the plain module's own, called with the wrapped parameters.
    """

    def __init__(self, norm: nn.Module, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self._plain = [norm]  # a list hides it from module registration: its parameters are ours
        for name, p in norm.named_parameters(recurse=False):
            self.register_parameter(name, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = {n: comm.copy_to_region(p, self.group) for n, p in self.named_parameters(recurse=False)}
        return torch.func.functional_call(self._plain[0], params, (x,))  # x: [b, s/t, h] -> [b, s/t, h]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over tokens whose logits are split along the vocabulary, never gathering them: the mean over
    every token, or (``total``) the sum over the targets that are not `IGNORE_INDEX`.

    Megatron's trick: all-reduce(MAX) the per-token maximum, then one all-reduce(SUM) of [Σ exp, target logit]
    (the target logit is nonzero only on the rank holding that word). Backward is local: (softmax − onehot) / N,
    or (softmax − onehot) · kept for the sum (an ignored target lies in no rank's slice, so its one-hot is zero
    and its row is zeroed by ``kept``, as Megatron's ``loss_mask`` zeroes it).
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, total=False):
        x = logits.float().flatten(0, -2)  # x: [N, Vl]
        rows = x.shape[1]
        valid = max(0, min(rows, vocab_size - vocab_start))  # padding columns past the real vocabulary
        if valid < rows:
            x = x.clone()
            x[:, valid:] = float("-inf")
        m = x.max(dim=1).values  # m: [N]
        comm.all_reduce_max(m, group)
        x = x - m.unsqueeze(1)  # x: [N, Vl], ≤ 0
        local = targets.flatten() - vocab_start  # local: [N]
        mine = (local >= 0) & (local < valid)  # mine: [N]
        idx = local.clamp(0, rows - 1)
        target = x.gather(1, idx.unsqueeze(1)).squeeze(1) * mine  # target: [N]
        e = x.exp_()  # e: [N, Vl]
        stats = torch.stack((e.sum(dim=1), target))  # stats: [2, N]
        comm.all_reduce(stats, group)
        softmax = e.div_(stats[0].unsqueeze(1))  # softmax: [N, Vl]
        if total:
            keep = kept(targets.flatten()).to(
                stats.dtype
            )  # keep: [N], 0 where the loss mask drops the target
            loss = ((stats[0].log() - stats[1]) * keep).sum()
            ctx.save_for_backward(softmax, idx, mine, keep)
        else:
            loss = (stats[0].log() - stats[1]).mean()
            ctx.save_for_backward(softmax, idx, mine)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, mine, *keep = ctx.saved_tensors
        grad = softmax.clone()  # grad: [N, Vl]
        grad[torch.arange(grad.shape[0], device=grad.device), idx] -= mine.to(grad.dtype)
        if keep:
            grad.mul_(keep[0].unsqueeze(1) * g)  # the sum: each kept token's own gradient
        else:
            grad.mul_(g / grad.shape[0])
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup,
    vocab_start: int,
    vocab_size: int,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of local logits [.., Vl] (vocabulary columns [vocab_start, vocab_start + Vl)) against
    targets [..] over the full vocabulary of ``vocab_size`` words; the same scalar on every rank of ``group``:
    the mean over every token, or (``reduction="sum"``) the sum over the targets that are not `IGNORE_INDEX`.

    Columns at or past ``vocab_size`` (padding) are excluded from the softmax.
    """
    check_reduction(reduction)
    if comm.group_size(group) == 1 and logits.shape[-1] == vocab_size:
        if reduction == "sum":
            return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
    return _VocabParallelCrossEntropy.apply(
        logits, targets, group, vocab_start, vocab_size, reduction == "sum"
    )


class VocabParallelOutput(nn.Module):
    """Output projection split along the vocabulary, fused with the vocabulary-parallel loss.

    ``weight`` [V_pad/t, h] is this rank's rows (the same Parameter as the embedding's when tied). With targets the
    forward returns the mean loss without gathering logits; without, the full logits [b, s, V] (generation only).
    ``softcap`` (Gemma 2's final logit soft-cap) caps this rank's logit columns before the loss, as the plain
    `Head` caps all of them (the padding columns are masked out of the loss either way).
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        group: dist.ProcessGroup,
        *,
        sequence_parallel: bool = False,
        tp_comm_overlap: bool = False,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        check_overlap(sequence_parallel, tp_comm_overlap)
        t = comm.group_size(group)
        self.vocab_size, self.group, self.sequence_parallel = vocab_size, group, sequence_parallel
        self.tp_comm_overlap, self.softcap = tp_comm_overlap, softcap
        self.rows = padded_vocab(vocab_size, t) // t
        self.start = group_rank(group) * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim))  # [Vl, h]
        self.bias = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup, **kwargs) -> VocabParallelOutput:
        mod = cls(linear.out_features, linear.in_features, group, **kwargs)
        padded = padded_vocab(linear.out_features, comm.group_size(group))
        mod.weight = nn.Parameter(shard(linear.weight, 0, group, padded))  # [Vl, h]
        return mod

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        # logits: [b, s, Vl]
        (logits,) = column_parallel(x, (self,), self.group, self.sequence_parallel, self.tp_comm_overlap)
        logits = soft_cap(logits, self.softcap)  # elementwise: the shard of the capped logits (Gemma 2)
        if targets is not None:
            return vocab_parallel_cross_entropy(
                logits, targets, self.group, self.start, self.vocab_size, reduction
            )
        full = comm.gather_from_region(logits, -1, self.group)  # full: [b, s, V_pad]
        return full[..., : self.vocab_size]  # [b, s, V]
