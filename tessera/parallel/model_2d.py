"""`apply_tensor_2d`: turn a plain GPT/Llama into its Optimus 2D (q×q SUMMA) version, and its comm formula.

The 2D model keeps the plain model's shape — `embed`, `blocks` ("0".."L-1", each a plain `Block` of 2D layers),
`head` — and the plain parameter names, so `named_parameters()` lines up with the plain model's (local blocks
instead of full tensors). Its forward takes the full micro-batch [b, s] on every rank of the grid, works on
P_ij's [b/q, s, h/q] block and returns the mean loss over the whole micro-batch on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tessera import comm
from tessera.errors import ConfigError
from tessera.model.documents import Documents
from tessera.model.layers import Block, TransformerLM, embed_scale, soft_cap
from tessera.model.materialize import ShardSpec
from tessera.model.targets import check_reduction, kept
from tessera.parallel.layers_2d import (
    MLP2D,
    Attention2D,
    LayerNorm2D,
    PositionEmbedding2D,
    RMSNorm2D,
    Shard,
    VocabEmbedding2D,
    output_logits_2d,
    vocab_parallel_cross_entropy_2d,
)
from tessera.parallel.tensor_2d import Grid2D
from tessera.traffic import comm_bytes_2d  # the traffic formula, re-exported for the tests

if TYPE_CHECKING:
    from tessera.config import ModelConfig
    from tessera.groups import Groups
    from tessera.model.family import FamilyPlan

__all__ = ["Model2D", "apply_tensor_2d", "check_2d", "comm_bytes_2d"]


def check_2d(cfg: ModelConfig, q: int) -> list[str]:
    """Every divisibility rule the model breaks on a q×q grid, each with the fix (empty when it fits)."""
    rules = [
        ("model.d_model", cfg.d_model),
        ("model.n_heads", cfg.n_heads),
        ("model.n_kv_heads", cfg.kv_heads),
        ("the MLP hidden size (model.ffn_hidden)", cfg.ffn),
    ]
    return [
        f"{name} = {n} is not divisible by q = {q}; choose a multiple of {q} or a grid side dividing {n}"
        for name, n in rules
        if n % q
    ]


def _norm(norm: nn.Module | None, plan: FamilyPlan, grid: Grid2D) -> nn.Module | None:
    if norm is None:  # a post-norm the family does not declare
        return None
    return LayerNorm2D(norm, grid) if plan.norm_bias else RMSNorm2D(norm, grid)


class _Embed2D(nn.Module):
    """tokens [b, s] → x [b/q, s, h/q]: vocabulary-parallel token lookup (+ learned positions if the family
    declares them, GPT's `wpe`); scaled by sqrt(h) if the family declares it (Gemma)."""

    def __init__(self, embed: nn.Module, plan: FamilyPlan, grid: Grid2D) -> None:
        super().__init__()
        self.token_name, self.position_name = plan.token_embedding, plan.position_embedding
        self.width, self.scaled = getattr(embed, self.token_name).embedding_dim, plan.embed_scale
        setattr(self, self.token_name, VocabEmbedding2D(getattr(embed, self.token_name).weight, grid))
        if self.position_name is not None:
            setattr(self, self.position_name, PositionEmbedding2D(getattr(embed, self.position_name), grid))

    def forward(self, tokens: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        """tokens [b, s] → x [b/q, s, h/q]; ``docs``: this grid row's documents (their positions)."""
        tok = getattr(self, self.token_name)
        x = tok(tokens)  # x: [b/q, s, h/q]
        if self.scaled:  # sqrt of the full width h, not of this rank's h/q
            x = x * embed_scale(self.width, tok.weight.dtype)
        if self.position_name is None:
            return x
        return getattr(self, self.position_name)(x, None if docs is None else docs.positions)


class _Out2D(nn.Module):
    """Output layer holding (or, tied, sharing) the [V_pad/q, h/q] vocabulary block."""

    def __init__(self, weight: nn.Parameter | torch.Tensor, grid: Grid2D, table: VocabEmbedding2D | None):
        super().__init__()
        if table is not None:
            self.weight = table.weight  # tied: the same Parameter object as the embedding's block
            self.shards = dict(table.shards)
        else:
            own = VocabEmbedding2D(weight, grid)
            self.weight, self.shards = own.weight, own.shards


class _Head2D(nn.Module):
    def __init__(
        self, head: nn.Module, plan: FamilyPlan, grid: Grid2D, table: VocabEmbedding2D | None
    ) -> None:
        super().__init__()
        self.grid, self.softcap = grid, head.softcap
        self.norm = _norm(head.norm, plan, grid)
        self.out = _Out2D(head.out.weight, grid, table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = output_logits_2d(self.norm(x), self.out.weight, self.grid)  # logits: [b/q, s, V_pad/q]
        return soft_cap(logits, self.softcap)  # elementwise: this block of the capped logits (Gemma 2)


class Model2D(nn.Module):
    """The Optimus 2D model; see module docstring. Build with `apply_tensor_2d`."""

    def __init__(self, model: TransformerLM, grid: Grid2D) -> None:
        super().__init__()
        cfg = model.cfg
        problems = check_2d(cfg, grid.q)
        if problems:
            raise ConfigError("2D tensor parallelism does not fit the model:\n" + "\n".join(problems))
        self.grid, self.plain_config, self.plan = grid, cfg, model.plan
        plan = self.plan
        self.embed = _Embed2D(model.embed, plan, grid) if model.embed else None
        blocks = {
            name: Block(
                _norm(blk.attn_norm, plan, grid),
                Attention2D(blk.attn, grid, cfg.n_heads, cfg.kv_heads),
                _norm(blk.mlp_norm, plan, grid),
                MLP2D(blk.mlp, plan, grid),
                _norm(blk.attn_post_norm, plan, grid),
                _norm(blk.mlp_post_norm, plan, grid),
            )
            for name, blk in model.blocks.items()
        }
        self.blocks = nn.ModuleDict(blocks)
        self.head = None
        if model.head is not None:
            tied = cfg.tie_embeddings and self.embed is not None
            table = getattr(self.embed, plan.token_embedding) if tied else None
            self.head = _Head2D(model.head, plan, grid, table)
        if plan.rope:
            self.rope = model.rope  # keep the shared RoPE tables registered (device moves)
        self.vocab = cfg.vocab_size
        self.per_rank = -(-cfg.vocab_size // grid.q)
        self._shards = self._collect_shards()

    def _collect_shards(self) -> dict[str, Shard]:
        by_id: dict[int, Shard] = {}
        for module in self.modules():
            for pname, shard in getattr(module, "shards", {}).items():
                by_id[id(getattr(module, pname))] = shard
        return {name: by_id[id(p)] for name, p in self.named_parameters()}

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Which block of the plain model's parameter each local parameter is, from its `Shard`: 1/q by the
        grid column j along ``dim_j``, 1/q by the grid row i along ``dim_i`` (vocabulary padded to a multiple
        of q), transposed for Linear weights; dims are local ones, mapped to the plain orientation here."""
        q, grid = self.grid.q, self.grid
        specs = {}
        for name, p in self.named_parameters():
            shard = self._shards[name]
            flip = 1 if shard.transpose else 0  # a transposed block's local dim d is plain dim 1 - d
            parts = {} if shard.dim_j is None else {shard.dim_j ^ flip: (q, grid.j)}
            if shard.dim_i is not None:
                parts[shard.dim_i ^ flip] = (q, grid.i)
            local = tuple(p.shape[::-1] if shard.transpose else p.shape)
            shape = [n * parts[d][0] if d in parts else n for d, n in enumerate(local)]
            if shard.rows is not None:
                shape[0] = shard.rows  # the vocabulary, before padding
            specs[name] = ShardSpec.split(name, shape, parts, transpose=shard.transpose)
        return specs

    # --- forward ---------------------------------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Full micro-batch tokens/targets [b, s] → mean loss over all b·s tokens (same on every grid rank), or
        with ``reduction="sum"`` the loss summed over the targets that are not `IGNORE_INDEX` (loss masks).

        Pipeline parts: without `embed`, ``tokens`` is already the hidden block [b/q, s, h/q]; without `head`,
        the hidden block is returned. ``positions`` [b, s] (the full micro-batch's): document masking
        (`tessera.model.documents`); this rank uses its grid row's sequences.
        """
        docs = self.masks(positions)  # the micro-batch's masks, one per kind for all the blocks
        q, i = self.grid.q, self.grid.i
        if self.embed is not None:
            if tokens.shape[0] % q:
                raise ValueError(
                    f"2D tensor parallelism splits the micro-batch over q = {q} grid rows, but it has "
                    f"{tokens.shape[0]} sequences; use a micro-batch size divisible by {q}"
                )
            x = self.embed(tokens) if positions is None else self.embed(tokens, docs)  # x: [b/q, s, h/q]
        else:
            x = tokens
        for block in self.blocks.values():
            x = block(x, docs=docs)  # x: [b/q, s, h/q]
        docs.release()  # the masks live on in what the layers saved (full recomputation: rebuilt once)
        if self.head is None:
            return x
        if targets is None:
            raise ValueError("the 2D model never gathers full logits; call it with targets to get the loss")
        logits = self.head(x)  # logits: [b/q, s, V_pad/q]
        rows = targets.shape[0] // q
        mine = targets[i * rows : (i + 1) * rows]  # mine: [b/q, s]
        tok_loss = vocab_parallel_cross_entropy_2d(logits, mine, self.grid, self.per_rank, self.vocab)
        check_reduction(reduction)
        if reduction == "sum":  # an ignored target's loss (finite: its log-sum-exp) × 0, and so its gradient
            tok_loss = tok_loss * kept(mine)  # tok_loss: [b/q, s]
        total = tok_loss.sum()  # this grid row's share of the batch loss
        if q > 1:
            total = comm.reduce_from_region(total, self.grid.col)  # sum over the q grid rows
        return total if reduction == "sum" else total / targets.numel()

    def documents(self, positions: torch.Tensor) -> Documents:
        """The documents of this rank's batch rows: positions [b, s] of the full micro-batch → grid row i's
        b/q sequences, the rows its [b/q, s, h/q] activations hold."""
        rows = positions.shape[0] // self.grid.q
        return Documents(positions[self.grid.i * rows : (self.grid.i + 1) * rows])  # positions: [b/q, s]

    masks = TransformerLM.masks

    # --- the contract with the trainer, tests and checkpoints ------------------------------------------------

    def full_parameters(self, grad: bool = False) -> dict[str, torch.Tensor]:
        """Full, unpadded parameters (or gradients) by plain name; collective over the grid (row then column).

        Parameters released on this rank (stages other pipeline ranks own: empty tensors) are left out."""
        return {name: self.full_parameter(name, grad) for name, p in self.named_parameters() if p.numel() > 0}

    def full_parameter(self, name: str, grad: bool = False) -> torch.Tensor:
        """One full, unpadded parameter (or gradient) by plain name; collective over the grid."""
        p = self.get_parameter(name)
        t = p.detach() if not grad else (p.grad if p.grad is not None else torch.zeros_like(p))
        return self._unshard(t, self._shards[name])

    def _unshard(self, t: torch.Tensor, shard: Shard) -> torch.Tensor:
        if self.grid.q > 1:
            if shard.dim_j is not None:
                t = comm.all_gather(t.contiguous(), shard.dim_j, self.grid.row)
            if shard.dim_i is not None:
                t = comm.all_gather(t.contiguous(), shard.dim_i, self.grid.col)
        t = t.t() if shard.transpose else t
        t = t[: shard.rows] if shard.rows is not None else t
        return t.contiguous().clone()

    def grad_norm_sq(self) -> torch.Tensor:
        """Squared global gradient norm over the grid; column-replicated tensors counted once (grid row 0),
        row-replicated ones (the per-head q/k norms) once too (grid column 0)."""
        total = torch.zeros((), dtype=torch.float32, device=next(self.parameters()).device)
        for name, p in self.named_parameters():
            shard = self._shards[name]
            copy = (shard.dim_i is None and self.grid.i != 0) or (shard.dim_j is None and self.grid.j != 0)
            if p.grad is None or copy:
                continue
            total += p.grad.detach().float().pow(2).sum()
        if self.grid.q > 1:
            comm.all_reduce(total, self.grid.row)
            comm.all_reduce(total, self.grid.col)
        return total


def apply_tensor_2d(model: TransformerLM, groups: Groups, cfg: object | None = None) -> Model2D:
    """The Optimus 2D version of ``model`` on this rank's q×q grid (from ``groups.layout.q``).

    ``model`` must be built with the same seed on every rank (its full weights are cut into blocks here).
    ``cfg`` (the run Config) is accepted for symmetry with the other `apply_*` steps and not needed.
    """
    del cfg
    return Model2D(model, Grid2D.from_groups(groups))
