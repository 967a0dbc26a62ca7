"""Optimus 2D tensor parallelism: the SUMMA matrix products as autograd operations on a q×q grid.

Every distributed matrix is cut into q×q blocks and device P_ij holds block (i, j). For activations the rows are
tokens (the batch is split by the grid row i) and the columns are features (split by the grid column j), so a
hidden state [b, s, h] lives on P_ij as a [b/q, s, h/q] block. A weight W [h_in, h_out] lives on P_ij as the
[h_in/q, h_out/q] block (i, j). The three products close under differentiation:

    C = A·B    (AB):   forward of a linear layer;       dA = dC·Bᵀ (ABᵀ),  dB = Aᵀ·dC (AᵀB)
    C = A·Bᵀ   (ABᵀ):  logits against a [V, h] table;   dA = dC·B  (AB),   dB = dCᵀ·A (AᵀB)
    C = Aᵀ·B   (AᵀB):  weight gradients;                dA = B·dCᵀ (ABᵀ),  dB = A·dC  (AB)

Each runs q steps. The *row group* of P_ij (same i, every j; group rank j) broadcasts or reduces activation-sized
blocks; the *column group* (same j, every i; group rank i) weight-sized blocks. Broadcasts are double-buffered:
block t+1's asynchronous broadcast is issued before block t's GEMM runs, so communication overlaps compute; the
reductions of ABᵀ and AᵀB are issued asynchronously after each partial product and awaited at the end.

The ops take a `Grid2D` (q, i, j and the two groups) built once per model; they never compute global ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tessera import comm
from tessera.parallel.checkpointing import save_early, saved_early
from tessera.parallel.precision import cast_operand
from tessera.traffic import summa_bytes  # the SUMMA byte formula, re-exported for the tests

if TYPE_CHECKING:
    from tessera.groups import Groups

__all__ = [
    "Grid2D",
    "matmul_ab_2d",
    "matmul_abt_2d",
    "matmul_atb_2d",
    "summa_bytes",
]


@dataclass(frozen=True, slots=True)
class Grid2D:
    """This rank's place P_ij on the q×q grid and the two groups SUMMA talks over.

    ``row`` is the Optimus row group (same i, every j; this rank's group rank is j); ``col`` the column group
    (same j, every i; group rank i). With q = 1 both may be None and every op is a local matmul.
    """

    q: int
    i: int
    j: int
    row: dist.ProcessGroup | None = None
    col: dist.ProcessGroup | None = None

    @classmethod
    def from_groups(cls, groups: Groups) -> Grid2D:
        """Read q, i, j and the row/column groups from tessera's ``Groups`` (checks the group ranks agree)."""
        from tessera.layout import Axis

        q = groups.layout.q
        i, j = groups.coord(Axis.TENSOR_ROW), groups.coord(Axis.TENSOR_COL)
        if q == 1:
            return cls(q=1, i=0, j=0)
        row, col = groups.same_row, groups.same_col
        if dist.get_rank(row) != j or dist.get_rank(col) != i:
            raise RuntimeError(
                f"2D grid mismatch on P_{i}{j}: row-group rank {dist.get_rank(row)} should be j = {j} and "
                f"column-group rank {dist.get_rank(col)} should be i = {i}; groups.py and layout.py disagree"
            )
        return cls(q=q, i=i, j=j, row=row, col=col)


def _broadcast_blocks(local: torch.Tensor, group, q: int, own: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (t, the block held by group rank t) for t = 0..q-1 over ``group``, double-buffered.

    The broadcast of block t+1 is issued (asynchronously) before block t is handed to the caller, so it is in
    flight while the caller's GEMM on block t runs. Two slots suffice: slot t%2 is rewritten only when block t+2 is
    issued, after the caller has finished with block t. The owner broadcasts straight from ``local``.
    """
    slots = [torch.empty_like(local), torch.empty_like(local)]

    def issue(t: int):
        buf = local if t == own else slots[t % 2]
        return buf, comm.broadcast(buf, t, group, async_op=True)

    pending = issue(0)
    for t in range(q):
        buf, work = pending
        if t + 1 < q:
            pending = issue(t + 1)
        if work is not None:
            work.wait()
        yield t, buf


def _summa_ab(a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """C_ij = Σ_t A_it · B_tj.  a: [m, K/q] block of A [M, K]; b: [K/q, N/q] block of B [K, N] → [m, N/q]."""
    if grid.q == 1:
        return a @ b
    out = a.new_zeros(a.shape[0], b.shape[1])  # out: [m, N/q]
    rows = _broadcast_blocks(a, grid.row, grid.q, grid.j)  # A_it from P_it along row i
    cols = _broadcast_blocks(b, grid.col, grid.q, grid.i)  # B_tj from P_tj down column j
    for (_, a_t), (_, b_t) in zip(rows, cols, strict=True):
        out.addmm_(a_t, b_t)  # [m, K/q] · [K/q, N/q]
    return out


def _summa_abt(a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """C_ij = Σ_t A_it · B_jtᵀ.  a: [m, N/q] block of A [M, N]; b: [K/q, N/q] block of B [K, N] → [m, K/q].

    Step t: B_tj goes down column j; P_ij forms A_ij · B_tjᵀ, its share of C_it, reduced along row i onto P_it.
    """
    if grid.q == 1:
        return a @ b.t()
    result, works = None, []
    for t, b_t in _broadcast_blocks(b, grid.col, grid.q, grid.i):
        part = a @ b_t.t()  # part: [m, K/q], this rank's share of C_it
        works.append(comm.reduce(part, t, grid.row, async_op=True))
        if t == grid.j:
            result = part
    for w in works:
        w.wait()
    return result


def _summa_atb(a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """C_ij = Σ_t A_tiᵀ · B_tj.  a: [m, K/q] block of A [M, K]; b: [m, N/q] block of B [M, N] → [K/q, N/q].

    Step t: A_it goes along row i; P_ij forms A_itᵀ · B_ij, its share of C_tj, reduced down column j onto P_tj.
    """
    if grid.q == 1:
        return a.t() @ b
    result, works = None, []
    for t, a_t in _broadcast_blocks(a, grid.row, grid.q, grid.j):
        part = a_t.t() @ b  # part: [K/q, N/q], this rank's share of C_tj
        works.append(comm.reduce(part, t, grid.col, async_op=True))
        if t == grid.i:
            result = part
    for w in works:
        w.wait()
    return result


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[..., n] → contiguous [m, n] (the token dims flattened into matrix rows)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


class _MatmulAB(torch.autograd.Function):
    """A·B by SUMMA; A and B are saved by ``token``'s node (`checkpointing.save_early`), not here: saved here, after
    the SUMMA, full checkpointing's replay of each block ran the MLP output Linear's broadcasts and GEMMs and threw
    the product away."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, token: torch.Tensor, grid: Grid2D) -> torch.Tensor:
        ctx.saved = token.grad_fn  # save_early's node (None without autograd): holds A and B
        ctx.grid = grid
        b = b.contiguous()
        return _summa_ab(_flat(a), b, grid).view(*a.shape[:-1], b.shape[1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, b = saved_early(ctx.saved)
        g2 = _flat(g)  # g2: [m, N/q]
        da = _summa_abt(g2, b.contiguous(), ctx.grid).view(a.shape) if ctx.needs_input_grad[0] else None
        db = _summa_atb(_flat(a), g2, ctx.grid) if ctx.needs_input_grad[1] else None
        return da, db, None, None


class _MatmulABT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.grid = grid
        b = b.contiguous()
        return _summa_abt(_flat(a), b, grid).view(*a.shape[:-1], b.shape[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, b = ctx.saved_tensors
        g2 = _flat(g)  # g2: [m, K/q]
        da = _summa_ab(g2, b.contiguous(), ctx.grid).view(a.shape) if ctx.needs_input_grad[0] else None
        db = _summa_atb(g2, _flat(a), ctx.grid) if ctx.needs_input_grad[1] else None
        return da, db, None


class _MatmulATB(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.grid = grid
        return _summa_atb(_flat(a), _flat(b), grid)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, b = ctx.saved_tensors
        g = g.contiguous()  # g: [K/q, N/q]
        da = _summa_abt(_flat(b), g, ctx.grid).view(a.shape) if ctx.needs_input_grad[0] else None
        db = _summa_ab(_flat(a), g, ctx.grid).view(b.shape) if ctx.needs_input_grad[1] else None
        return da, db, None


def _same_dtype(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast both operands as autocast would cast a matmul's (differentiably), else to their common dtype.

    The blocks travel in this dtype, so under bf16 autocast SUMMA moves bf16 blocks, like F.linear computes in it.
    A weight block is cast once per autocast region (`precision.cast_operand`, autocast's caching rule): every
    micro-batch's SUMMA broadcasts and saves the same bf16 copy, so a rank keeps one per step, not one per
    micro-batch in flight.
    """
    device = a.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(a.dtype, b.dtype)
    return cast_operand(a, dtype), cast_operand(b, dtype)


def matmul_ab_2d(a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Block (i, j) of A·B.  a: [..., K/q] block of A [M, K] (tokens by i); b: [K/q, N/q] → [..., N/q]. A and B
    are saved for backward before the SUMMA runs (`checkpointing.save_early`), so full checkpointing's replay of a block stops
    before its MLP output Linear's broadcasts and GEMMs."""
    a, b = _same_dtype(a, b)
    return _MatmulAB.apply(a, b, save_early(a, b), grid)


def matmul_abt_2d(a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Block (i, j) of A·Bᵀ.  a: [..., N/q] block of A [M, N]; b: [K/q, N/q] block of B [K, N] → [..., K/q]."""
    return _MatmulABT.apply(*_same_dtype(a, b), grid)


def matmul_atb_2d(a: torch.Tensor, b: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Block (i, j) of Aᵀ·B.  a: [..., K/q] block of A [M, K]; b: [..., N/q] block of B [M, N] → [K/q, N/q]."""
    return _MatmulATB.apply(*_same_dtype(a, b), grid)
