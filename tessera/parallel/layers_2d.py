"""Transformer layers on the Optimus q×q grid; activations are [b/q, s, h/q] blocks on P_ij.

Each layer is built from the matching plain layer's full weights (identical on every rank) by cutting this rank's
block, and records a `Shard` describing how to reassemble the full tensor (see model_2d.full_parameters).

Where the pieces live on P_ij:

- Linear2D weight W [h_in, h_out] (= nn.Linear.weight transposed): block (i, j), [h_in/q, h_out/q].
- Vocabulary table E [V_pad, h] (token embedding, and the output layer, tied or not): block (i, j),
  [V_pad/q, h/q] — vocabulary by i, hidden by j. V_pad = V rounded up to a multiple of q; the padding rows are
  zero, never looked up, masked out of the softmax and cut off again by full_parameters.
- Vectors of length n (biases, norm weights) and the position table [S, h]: the j-th 1/q slice, replicated over
  the column group (the q ranks that hold the same features for different batch rows). Their gradient is summed
  over the column group in backward (`copy_to_region`), which keeps the replicas identical.
- Per-head q/k norm weights [head_dim] (Qwen3): whole on every rank (each holds whole heads); their gradient is
  summed over the row group (the other heads) and the column group (the other batch rows).

Collectives per layer are listed in docs/tensor-2d.md and computed by model_2d.comm_bytes_2d.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tessera import comm
from tessera.model.layers import attend
from tessera.parallel.tensor_2d import Grid2D, matmul_ab_2d, matmul_abt_2d

if TYPE_CHECKING:
    from tessera.model.documents import AttentionMasks
    from tessera.model.family import FamilyPlan

__all__ = [
    "MLP2D",
    "Attention2D",
    "HeadNorm2D",
    "LayerNorm2D",
    "Linear2D",
    "PositionEmbedding2D",
    "RMSNorm2D",
    "Shard",
    "VocabEmbedding2D",
    "output_logits_2d",
    "shard_block",
    "vocab_parallel_cross_entropy_2d",
]


@dataclass(frozen=True, slots=True)
class Shard:
    """How a local parameter maps onto the plain model's full tensor.

    ``dim_j``: local dim split by the grid column j (gathered over the row group), None when the tensor is
    replicated over the row group (the per-head q/k norms); ``dim_i``: local dim split by the grid row i
    (gathered over the column group), None when the tensor is replicated over the column group.
    ``transpose``: the local tensor is a block of the plain tensor's transpose. ``rows``: keep only the first
    ``rows`` rows of the reassembled (plain-orientation) tensor (vocabulary padding), None for all.
    """

    dim_j: int | None
    dim_i: int | None
    transpose: bool = False
    rows: int | None = None


def _chunk(t: torch.Tensor, dim: int | None, n: int, k: int) -> torch.Tensor:
    return t if dim is None or n == 1 else t.chunk(n, dim=dim)[k]


def shard_block(full: torch.Tensor, grid: Grid2D, dim_j: int | None, dim_i: int | None) -> torch.Tensor:
    """This rank's block of ``full``: 1/q along ``dim_j`` picked by j, 1/q along ``dim_i`` picked by i."""
    block = _chunk(_chunk(full, dim_j, grid.q, grid.j), dim_i, grid.q, grid.i)
    return block.detach().clone().contiguous()


def _param(full: torch.Tensor, grid: Grid2D, shard: Shard) -> nn.Parameter:
    src = full.t() if shard.transpose else full
    return nn.Parameter(shard_block(src, grid, shard.dim_j, shard.dim_i))


def _need(n: int, q: int, what: str) -> None:
    if n % q:
        raise ValueError(f"2D tensor parallelism needs {what} = {n} divisible by q = {q}")


def _to_col(x: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Use a column-replicated tensor in a batch-partitioned computation: backward sums over the column group."""
    return x if grid.q == 1 else comm.copy_to_region(x, grid.col)


class Linear2D(nn.Module):
    """y = x·W + b with SUMMA.  x: [b/q, s, h_in/q] → [b/q, s, h_out/q]; W block [h_in/q, h_out/q]."""

    def __init__(self, linear: nn.Linear, grid: Grid2D) -> None:
        super().__init__()
        _need(linear.in_features, grid.q, "Linear in_features")
        _need(linear.out_features, grid.q, "Linear out_features")
        self.grid = grid
        self.shards = {"weight": Shard(dim_j=1, dim_i=0, transpose=True)}
        self.weight = _param(linear.weight, grid, self.shards["weight"])  # [h_in/q, h_out/q]
        self.bias = None
        if linear.bias is not None:
            self.shards["bias"] = Shard(dim_j=0, dim_i=None)
            self.bias = _param(linear.bias, grid, self.shards["bias"])  # [h_out/q]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul_ab_2d(x, self.weight, self.grid)  # y: [b/q, s, h_out/q]
        return y if self.bias is None else y + _to_col(self.bias, self.grid)


class _Norm2D(torch.autograd.Function):
    """LayerNorm (``centre=True``) or RMSNorm over features split across the row group, with weight (and bias).

    Forward: row all-reduces of per-token sums [b/q, s, 1] (LayerNorm: Σx, then Σ(x−mean)² — two-pass, as
    accurate as the fused kernel; RMSNorm: Σx²). Saves only x̂ and 1/σ. Backward needs the full-width means of
    ĝ = g·w and ĝ·x̂ (LayerNorm) or of ĝ·x̂ (RMSNorm): one row all-reduce of the stacked sums; the weight/bias
    gradients (this grid row's tokens only) are summed over the column group in one all-reduce. ``offset``
    (Gemma's RMSNorm: 1) scales by offset + w in fp32 instead of w, as the plain `RMSNorm` does.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dim, eps, centre, grid, offset=0.0):
        xf = x.float()  # xf: [b/q, s, h/q]
        if centre:
            xf = xf - _all_reduce(xf.sum(-1, keepdim=True), grid.row, grid.q) / dim  # centred
        var = _all_reduce(xf.pow(2).sum(-1, keepdim=True), grid.row, grid.q) / dim  # var: [b/q, s, 1]
        rstd = torch.rsqrt(var + eps)
        xhat = xf * rstd  # xhat: [b/q, s, h/q]
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.dim, ctx.centre, ctx.grid, ctx.has_bias = dim, centre, grid, bias is not None
        ctx.offset = offset
        if offset:
            return (xhat * (offset + weight.float())).to(x.dtype)
        y = xhat.to(x.dtype) * weight
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        xhat, rstd, weight = ctx.saved_tensors
        grid, gf = ctx.grid, g.float()
        gxhat = gf * (ctx.offset + weight.float())  # gxhat: [b/q, s, h/q]
        sums = [(gxhat * xhat).sum(-1, keepdim=True)] + ([gxhat.sum(-1, keepdim=True)] if ctx.centre else [])
        sums = _all_reduce(torch.cat(sums, dim=-1), grid.row, grid.q) / ctx.dim  # sums: [b/q, s, 1 or 2]
        dx = gxhat - xhat * sums[..., :1]
        if ctx.centre:
            dx = dx - sums[..., 1:]
        dx = (dx * rstd).to(g.dtype)
        flat_g, flat_x = gf.reshape(-1, gf.shape[-1]), xhat.reshape(-1, xhat.shape[-1])
        params = [(flat_g * flat_x).sum(0)] + ([flat_g.sum(0)] if ctx.has_bias else [])  # [h/q] each
        params = _all_reduce(torch.stack(params), grid.col, grid.q).to(weight.dtype)  # this grid column's sum
        return dx, params[0], params[1] if ctx.has_bias else None, None, None, None, None, None


def _all_reduce(t: torch.Tensor, group, q: int) -> torch.Tensor:
    t = t.contiguous()
    if q > 1:
        comm.all_reduce(t, group)
    return t


class LayerNorm2D(nn.Module):
    """LayerNorm over the hidden dim split across the row group.  x: [b/q, s, h/q] → [b/q, s, h/q]."""

    def __init__(self, norm: nn.LayerNorm, grid: Grid2D) -> None:
        super().__init__()
        self.grid, self.dim, self.eps = grid, norm.normalized_shape[0], norm.eps
        _need(self.dim, grid.q, "d_model")
        self.shards = {"weight": Shard(dim_j=0, dim_i=None), "bias": Shard(dim_j=0, dim_i=None)}
        self.weight = _param(norm.weight, grid, self.shards["weight"])  # [h/q]
        self.bias = _param(norm.bias, grid, self.shards["bias"])  # [h/q]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Norm2D.apply(x, self.weight, self.bias, self.dim, self.eps, True, self.grid)


class RMSNorm2D(nn.Module):
    """RMSNorm over the hidden dim split across the row group.  x: [b/q, s, h/q] → [b/q, s, h/q]; the plain
    norm's ``offset`` too (Gemma's x̂·(1 + w))."""

    def __init__(self, norm: nn.Module, grid: Grid2D) -> None:
        super().__init__()
        self.grid, self.dim, self.eps = grid, norm.weight.shape[0], norm.eps
        self.offset = norm.offset
        _need(self.dim, grid.q, "d_model")
        self.shards = {"weight": Shard(dim_j=0, dim_i=None)}
        self.weight = _param(norm.weight, grid, self.shards["weight"])  # [h/q]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Norm2D.apply(x, self.weight, None, self.dim, self.eps, False, self.grid, self.offset)


class HeadNorm2D(nn.Module):
    """A per-head norm (Qwen3's q/k RMSNorm over head_dim) on this rank's whole heads: the plain norm, run locally
    with its whole weight [hd], which every grid rank holds; backward sums the weight's gradient (this rank's
    heads of its batch rows) over the row group (the other heads) and the column group (the other batch rows)."""

    def __init__(self, norm: nn.Module, grid: Grid2D) -> None:
        super().__init__()
        self.grid = grid
        self._plain = [norm]  # a list hides it from module registration: the weight is ours
        self.shards = {"weight": Shard(dim_j=None, dim_i=None)}
        self.weight = _param(norm.weight, grid, self.shards["weight"])  # [hd]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.grid.q > 1:
            weight = _to_col(comm.copy_to_region(weight, self.grid.row), self.grid)
        return torch.func.functional_call(self._plain[0], {"weight": weight}, (x,))  # x: [b/q, n/q, s, hd]


def _head_norm(norm: nn.Module | None, grid: Grid2D) -> HeadNorm2D | None:
    return None if norm is None else HeadNorm2D(norm, grid)


class Attention2D(nn.Module):
    """Self-attention on b/q sequences × (heads/q) heads per rank, full sequence length; GQA and RoPE local.

    Column block j of wq/wk/wv's output is heads [j·nh/q, (j+1)·nh/q) (resp. KV heads [j·nkv/q, ...)), so with
    q | nkv each rank's query heads find their shared KV head locally. Scores and softmax need no communication,
    nor do the per-head q/k norms (Qwen3): each rank holds whole heads (`HeadNorm2D`).
    """

    def __init__(self, attn: nn.Module, grid: Grid2D, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        _need(n_heads, grid.q, "n_heads")
        _need(n_kv_heads, grid.q, "n_kv_heads (grouped-query KV heads are split over q too)")
        self.head_dim = attn.head_dim
        self.wq, self.wk = Linear2D(attn.wq, grid), Linear2D(attn.wk, grid)
        self.wv, self.wo = Linear2D(attn.wv, grid), Linear2D(attn.wo, grid)
        self.q_norm, self.k_norm = _head_norm(attn.q_norm, grid), _head_norm(attn.k_norm, grid)
        self.core, self.rope = attn.core, attn.rope  # parameter-free; the Rope tables are shared

    def forward(self, x: torch.Tensor, docs: AttentionMasks | None = None) -> torch.Tensor:
        """x [b/q, s, h/q] → [b/q, s, h/q]; ``docs``: the micro-batch's masks (`Model2D.masks`: with documents this
        grid row's sequences')."""
        b, s, _ = x.shape  # x: [b/q, s, h/q]
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # q: [b/q, nh/q, s, hd]
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # k: [b/q, nkv/q, s, hd]
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # v: [b/q, nkv/q, s, hd]
        y = attend(self, q, k, v, docs)  # y: [b/q, nh/q, s, hd]
        y = y.transpose(1, 2).reshape(b, s, -1)  # y: [b/q, s, nh·hd/q]
        return self.wo(y)  # [b/q, s, h/q]


class MLP2D(nn.Module):
    """The family's MLP, all SUMMA: its ``mlp_in`` Linears (GPT fc; Llama w_gate, w_up), the plain MLP's
    elementwise ``activate`` on the local [b/q, s, ffn/q] blocks, its ``mlp_out`` (proj; w_down)."""

    def __init__(self, mlp: nn.Module, plan: FamilyPlan, grid: Grid2D) -> None:
        super().__init__()
        self.inputs, self.output = plan.mlp_in, plan.mlp_out
        self.activate = type(mlp).activate  # a staticmethod of the plain MLP: elementwise, so local
        for name in (*plan.mlp_in, plan.mlp_out):
            setattr(self, name, Linear2D(getattr(mlp, name), grid))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.activate(*(getattr(self, name)(x) for name in self.inputs))  # x: [b/q, s, ffn/q]
        return getattr(self, self.output)(x)  # [b/q, s, h/q]


class VocabEmbedding2D(nn.Module):
    """Token lookup from the [V_pad/q, h/q] block (i, j): vocabulary by i, hidden by j.

    Every rank looks up the whole micro-batch in its vocabulary slice, giving a partial [b, s, h/q]; one
    reduce-scatter over the column group sums the q vocabulary slices and keeps batch rows i: [b/q, s, h/q].
    Backward is the conjugate all-gather. The same block serves as the (tied) output layer's weight.
    """

    def __init__(self, weight: torch.Tensor, grid: Grid2D) -> None:
        super().__init__()
        vocab, h = weight.shape
        _need(h, grid.q, "d_model")
        self.grid, self.vocab = grid, vocab
        self.padded = -(-vocab // grid.q) * grid.q
        self.per_rank = self.padded // grid.q
        full = torch.cat((weight.detach(), weight.new_zeros(self.padded - vocab, h)))  # full: [V_pad, h]
        self.shards = {"weight": Shard(dim_j=1, dim_i=0, rows=vocab)}
        self.weight = _param(full, grid, self.shards["weight"])  # [V_pad/q, h/q]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.grid.i * self.per_rank  # local: [b, s]
        outside = (local < 0) | (local >= self.per_rank)
        part = F.embedding(local.masked_fill(outside, 0), self.weight)  # part: [b, s, h/q]
        part = part.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.grid.q == 1:
            return part
        return comm.reduce_scatter_to_region(part, 0, self.grid.col)  # [b/q, s, h/q]


class PositionEmbedding2D(nn.Module):
    """Learned positions [S, h/q] (slice j, replicated over the column group) added to x [b/q, s, h/q]."""

    def __init__(self, emb: nn.Embedding, grid: Grid2D) -> None:
        super().__init__()
        self.grid = grid
        self.shards = {"weight": Shard(dim_j=1, dim_i=None)}
        self.weight = _param(emb.weight, grid, self.shards["weight"])  # [S, h/q]

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [b/q, s, h/q] plus positions 0..s-1, or ``positions`` [b/q, s] (this grid row's, per document)."""
        s = x.shape[1]
        if s > self.weight.shape[0]:
            raise ValueError(f"sequence length {s} exceeds model.seq_len = {self.weight.shape[0]}")
        if positions is None:
            return x + _to_col(self.weight[:s], self.grid)  # [b/q, s, h/q]
        return x + F.embedding(positions, _to_col(self.weight, self.grid))  # [b/q, s, h/q]


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from logits split over the row group, never gathering them.

    Each rank computes its slice's log-sum-exp and its share of the target logit; one all-gather of these
    [2, m] pairs over the row group combines them (a log-sum-exp of log-sum-exps is stable with no max pass).
    Backward is local: (softmax − one-hot) · upstream gradient.
    """

    @staticmethod
    def forward(ctx, logits, targets, start, vocab, group):
        z = logits.float()  # z: [m, V_pad/q]
        cols = torch.arange(start, start + z.shape[-1], device=z.device)  # cols: [V_pad/q] global ids
        z = z.masked_fill(cols >= vocab, float("-inf"))  # padding never wins probability
        local = targets - start  # local: [m], the target's column in this slice if it falls here
        mine = (local >= 0) & (local < z.shape[-1])
        local = local.masked_fill(~mine, 0)
        lse = torch.logsumexp(z, dim=-1)  # lse: [m]
        tgt = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)  # tgt: [m]
        pair = torch.stack((lse, tgt)).unsqueeze(0)  # pair: [1, 2, m]
        if group is not None:
            pair = comm.all_gather(pair, 0, group)  # pair: [q, 2, m]
        lse_all = torch.logsumexp(pair[:, 0], dim=0)  # [m]
        ctx.save_for_backward(z, local.masked_fill(~mine, -1), lse_all)  # [m] ids, not an [m, V_pad/q] mask
        ctx.dtype = logits.dtype
        return lse_all - pair[:, 1].sum(0)  # [m]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        z, local, lse = ctx.saved_tensors
        grad = (z - lse.unsqueeze(-1)).exp()  # grad: [m, V_pad/q], the softmax slice
        # minus the one-hot of targets in this slice; a scatter of 0 or 1 per row instead of indexing the rows
        # that hit, so the shapes do not depend on the data (no host sync; fake tensors can run it)
        hit = (local >= 0).to(grad.dtype).unsqueeze(-1)  # hit: [m, 1]
        grad.scatter_add_(-1, local.clamp(min=0).unsqueeze(-1), -hit)
        return (grad * g.unsqueeze(-1)).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy_2d(
    logits: torch.Tensor, targets: torch.Tensor, grid: Grid2D, per_rank: int, vocab: int
) -> torch.Tensor:
    """Per-token loss [b/q, s] from logits [b/q, s, V_pad/q] (vocabulary slice j) and targets [b/q, s]."""
    group = grid.row if grid.q > 1 else None
    m = targets.numel()
    loss = _VocabParallelCE.apply(logits.reshape(m, -1), targets.reshape(m), grid.j * per_rank, vocab, group)
    return loss.view(targets.shape)


def output_logits_2d(x: torch.Tensor, table: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Logits block [b/q, s, V_pad/q] = x [b/q, s, h/q] · Eᵀ with E's [V_pad/q, h/q] block (SUMMA ABᵀ)."""
    return matmul_abt_2d(x, table, grid)
