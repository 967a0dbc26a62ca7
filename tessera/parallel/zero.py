"""ZeRO-1/2/3 over the data-parallel group, driven per pipeline stage by the schedule's GATHER/FREE/REDUCE actions.

Every stage's parameters live in one flat fp32 buffer, padded to a multiple of the data-parallel size d and cut
into d equal shards; rank r owns shard r (`FlatStage`); `ShardedAdamW` updates the shards. The buffer maps 1:1
onto the IR (docs/zero.md explains why this and not FSDP2) through the runtime's hooks, which
`tessera.pipeline.stage_comm.ZeroStageComm` implements:

- ``reduce(s)`` (REDUCE): flatten stage s's gradients, reduce-scatter them asynchronously and keep only this rank's
  shard (ZeRO-2/3 drop the full gradients at once; ZeRO-1 keeps them, as its memory formula says).
- ``gather(s)`` / ``wait_gather(s)`` (GATHER, ZeRO-3): re-allocate the flat buffer's storage and all-gather the
  shards into it; the module's parameters are views of that buffer, so they come back to life in place.
- ``free(s)`` (FREE, ZeRO-3): resize the storage to 0 bytes. Tensors saved for backward keep referring to the same
  storage, which the backward phase's GATHER refills before use (FSDP1's trick).
- ``finish()``: wait for every reduction; the averaged gradient shards are ready for `ShardedAdamW`. With hybrid
  sharding (HSDP: ``dp_group`` is the shard group, ``replica_group`` the ranks holding the same shard in the
  other shard groups) each stage's accumulated gradient shard is also all-reduced over the replica group, once
  per step whatever the accumulation (a sum of all-reduces is the all-reduce of the sum), so only 1/s of the
  gradients crosses between shard groups; replicas then update identical shards identically. It is launched as
  soon as the shard is final, at the rank's next REDUCE after the stage's last (under the backwards still to
  run), and ``finish`` launches only the last reduced stage's before waiting for all (docs/zero.md, "Hybrid
  sharding").
- ``wait_gather(s)`` also completes ZeRO-1/2's post-step all-gather, which `ShardedAdamW.step` leaves in flight
  with ``overlap_param_gather`` (`FlatStage.launch_param_gather`): the runtime calls it before every compute.

Accumulation order decides how often the collectives run. Layered: REDUCE once per stage per step. Depth-first:
the runtime calls ``reduce`` after each micro-batch group; ZeRO-2/3 reduce-scatter every time into an accumulating
shard (volume × m), ZeRO-1 keeps full gradients and reduce-scatters once, at the stage's last REDUCE of the step
(`ZeroStageComm.reduce`; in ``finish`` where the REDUCE count is unknown): volume independent of m.

Collectives are counted in ``tessera.comm.STATS`` with comm's byte rules (all-gather: output bytes,
reduce-scatter: input bytes). They are issued here with ``async_op=True`` because comm.py's helpers are
synchronous; the counting is identical.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.model.materialize import forget_pending, pending, read_flat
from tessera.modes import ACCUMULATION
from tessera.parallel.clipping import clip_grads_, global_norm, squared_norm

if TYPE_CHECKING:
    from tessera.pipeline.stage_comm import ZeroStageComm

__all__ = ["ACCUMULATION", "FlatStage", "ShardedAdamW"]


def _device_of(params: list[nn.Parameter]) -> torch.device:
    """Where the flat buffers live: the parameters' device (declared, for a parameter not yet allocated)."""
    if not params:
        return torch.device("cpu")
    origin = pending(params[0])
    return origin.device if origin is not None else params[0].device


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _size(group: dist.ProcessGroup | None) -> int:
    return comm.group_size(group) if dist.is_initialized() else 1


def _all_gather_async(out: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    comm.STATS.record("all_gather", comm.group_name(group), out.numel() * out.element_size())
    return comm.all_gather_into(out, shard, group=group, async_op=True)


def _reduce_scatter_async(out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    comm.STATS.record("reduce_scatter", comm.group_name(group), full.numel() * full.element_size())
    return comm.reduce_scatter_into(out, full, group=group, async_op=True)


class FlatStage:
    """One stage's parameters as a flat padded fp32 buffer and this rank's shard of it.

    ``full``: the padded flat buffer; every parameter's ``.data`` is a view of it (ZeRO-3: from the first
    GATHER, which first gives it storage; until then each parameter is a shape without storage). ``shard``: this rank's
    ``[rank·n, (rank+1)·n)`` slice — a view of ``full`` (ZeRO-1/2, or d = 1), or its own tensor (ZeRO-3, d > 1,
    when ``full``'s storage is released between phases). ``grad_shard``: the reduced gradient shard (fp32).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup | None,
        zero_stage: int,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.params, self.group, self.zero_stage = params, group, zero_stage
        self.world, self.rank = _size(group), _group_rank(group)
        # hybrid sharding: the ranks holding this same shard in the other shard groups (None: no replicas)
        self.replica_group = replica_group
        self.replicas = _size(replica_group) if replica_group is not None else 1
        self._replica_work: Any = None
        self.numel = sum(p.numel() for p in params)
        self.padded = math.ceil(max(self.numel, 1) / self.world) * self.world
        self.shard_numel = self.padded // self.world
        for p in params:
            if p.dtype != torch.float32:
                raise TypeError(
                    f"ZeRO keeps fp32 master weights in the parameters; got a {p.dtype} parameter. Build the model "
                    "in fp32 and use train.dtype = 'bf16'/'fp16' (autocast) for lower-precision compute"
                )
        self.offsets = list(itertools.accumulate((p.numel() for p in params), initial=0))[:-1]
        self.sharded_params = zero_stage >= 3 and self.world > 1
        device = _device_of(params)
        lo = self.rank * self.shard_numel
        if self.sharded_params:
            # ZeRO-3: only this rank's shard gets storage, filled parameter by parameter (one in memory at a
            # time). The full buffer gets none until the first GATHER: allocating it here, even for an instant,
            # is a whole stage per rank on a GPU (the caching allocator reserves what `empty` asks for).
            self.full = torch.empty(0, dtype=torch.float32, device=device)
            self.shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
            self._fill(self.shard, lo)
            for p in params:
                _drop_storage(p)
        else:
            self.full = torch.zeros(self.padded, dtype=torch.float32, device=device)
            self._fill(self.full, 0)
            self.shard = self.full[lo : lo + self.shard_numel]
            self._point_params()
        self.gathered = not self.sharded_params
        self.grad_shard: torch.Tensor | None = None
        # (work, its output, its input): the flattened gradients stay referenced until `wait_reduce`, as a real
        # backend's work keeps them (NCCL stashes a collective's inputs until it completes); the dry run's fake
        # work keeps nothing, so without this reference its peak left out the reduction in flight
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        self._gather_work: Any = None
        self._gather_input: torch.Tensor | None = None
        self.users = 0
        self.shard_param: nn.Parameter | None = None

    def _point_params(self) -> None:
        """Make every parameter's ``.data`` its view of ``full`` (slicing needs ``full``'s storage allocated)."""
        for p, offset in zip(self.params, self.offsets, strict=True):
            p.data = self.full[offset : offset + p.numel()].view_as(p)
            forget_pending(p)

    def _fill(self, out: torch.Tensor, lo: int) -> None:
        """Write each parameter's initial (or current) values into ``out``, the flat range [lo, lo + len(out))."""
        hi = lo + out.numel()
        for p, off in zip(self.params, self.offsets, strict=True):
            start, end = max(lo, off), min(hi, off + p.numel())
            if start >= end:
                continue
            origin = pending(p)
            if origin is None:  # a real parameter: its current values
                out[start - lo : end - lo].copy_(p.detach().reshape(-1)[start - off : end - off])
            else:  # read straight into the buffer, never the whole parameter (ZeRO-3: only this shard's part)
                read_flat(origin.spec, origin.source, out[start - lo : end - lo], start - off)

    @property
    def nbytes(self) -> int:
        """Bytes of the padded full buffer (what one all-gather produces / one reduce-scatter consumes)."""
        return self.padded * 4

    def segments(self) -> list[tuple[nn.Parameter, int, int]]:
        """(parameter, start, end) of each parameter's part inside this rank's shard (empty parts left out)."""
        lo, hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        out = []
        for p, off in zip(self.params, self.offsets, strict=True):
            start, end = max(lo, off), min(hi, off + p.numel())
            if start < end:
                out.append((p, start - lo, end - lo))
        return out

    def owned(self) -> list[tuple[nn.Parameter, int, int, int]]:
        """(parameter, start, end, first) for each parameter's part of this rank's shard: ``shard[start:end]``
        holds the parameter's flat (row-major) elements from ``first`` on. A checkpoint saves them under the
        parameter's global name from this (tessera/train/checkpoint/state.py), never as a flat buffer."""
        lo = self.rank * self.shard_numel
        offset = {id(p): off for p, off in zip(self.params, self.offsets, strict=True)}
        return [(p, a, b, lo + a - offset[id(p)]) for p, a, b in self.segments()]

    # --- parameters (ZeRO-3) ------------------------------------------------------------------------------

    def _release(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    @property
    def gather_pending(self) -> bool:
        """An all-gather into ``full`` was launched and not yet waited for: the parameters are incomplete."""
        return self._gather_work is not None

    def launch_gather(self) -> None:
        if self.gathered or self._gather_work is not None:
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.padded * self.full.element_size())
        if self.full.numel() != self.padded:  # the first GATHER: shape the buffer, point the parameters at it
            self.full.set_(storage, 0, (self.padded,), (1,))
            self._point_params()
        self._gather_work = _all_gather_async(self.full, self.shard, self.group)

    def wait_gather(self) -> None:
        """Complete a launched all-gather (ZeRO-3's GATHER, or ZeRO-1/2's post-step one); else nothing."""
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
            self._gather_input = None
            self.gathered = True

    def release(self) -> None:
        if self.sharded_params and self.gathered:
            self._release()

    def launch_param_gather(self) -> None:
        """After the optimizer updated ``shard`` in place (ZeRO-1/2): start refreshing every rank's full copy
        (asynchronous; `wait_gather` completes it). Until then the parameters mix this rank's updated slice with
        the other ranks' old ones."""
        if self.world == 1 or self.sharded_params:
            return
        self.wait_gather()  # one in flight: a second launch must not race the first one's writes into full
        self._gather_input = self.shard.clone()  # the input must not alias the output (kept until the wait)
        self._gather_work = _all_gather_async(self.full, self._gather_input, self.group)
        self.gathered = False

    def all_gather_params(self) -> None:
        """`launch_param_gather` and wait for it."""
        self.launch_param_gather()
        self.wait_gather()

    # --- gradients ----------------------------------------------------------------------------------------

    def flat_grads(self, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=dtype, device=self.full.device)
        for p, off in zip(self.params, self.offsets, strict=True):
            if p.grad is not None:
                flat[off : off + p.numel()].copy_(p.grad.reshape(-1))
        return flat

    def launch_reduce(self, dtype: torch.dtype, drop_grads: bool) -> None:
        """Reduce-scatter the current gradients (async); with ``drop_grads`` free the full gradients now."""
        if self._replica_work is not None:  # it sums grad_shard, into which this reduction would add
            raise RuntimeError("a stage reduced again after its replica all-reduce was launched this step")
        flat = self.flat_grads(dtype)
        if drop_grads:
            for p in self.params:
                p.grad = None
        if self.world == 1:
            self._pending.append((None, flat, flat))
            return
        out = torch.empty(self.shard_numel, dtype=dtype, device=flat.device)
        self._pending.append((_reduce_scatter_async(out, flat, self.group), out, flat))

    def wait_reduce(self) -> None:
        """Wait for launched reductions; add their average over the group into ``grad_shard`` (fp32)."""
        for work, out, _ in self._pending:
            if work is not None:
                work.wait()
            part = out.float()
            if self.world > 1:
                part.div_(self.world)
            if self.grad_shard is None:
                self.grad_shard = part  # a fresh buffer (the flattened copy or the collective's output)
            else:
                self.grad_shard.add_(part)
        self._pending.clear()

    @property
    def replica_pending(self) -> bool:
        """The replica all-reduce of this step's gradient shard was launched and not yet waited for."""
        return self._replica_work is not None

    def launch_replica_reduce(self, dtype: torch.dtype = torch.float32) -> None:
        """Hybrid sharding, once per step after the stage's last `wait_reduce`: sum the step's gradient shard
        over the replica group (async). fp32: in place on the accumulated shard, no second buffer. A narrower
        ``dtype`` (``train.grad_reduce_dtype``, as the reduce-scatter): a copy of the shard in that dtype goes on
        the wire and `wait_replica_reduce` writes the sum back into the fp32 shard, so accumulation stays fp32
        and only the cross-group sum is rounded (FSDP's ``MixedPrecision.reduce_dtype`` does the same for both
        of HYBRID_SHARD's collectives)."""
        if self.replicas == 1 or self.grad_shard is None:
            return
        if self._replica_work is not None:
            raise RuntimeError("a stage's replica all-reduce launched twice in one step")
        wire = self.grad_shard if dtype == self.grad_shard.dtype else self.grad_shard.to(dtype)
        self._replica_work = (comm.all_reduce(wire, self.replica_group, async_op=True), wire)

    def wait_replica_reduce(self) -> None:
        """Complete `launch_replica_reduce`: the shard becomes the mean over all s·r data-parallel ranks."""
        if self._replica_work is not None:
            work, wire = self._replica_work
            work.wait()
            self._replica_work = None
            if wire is not self.grad_shard:
                self.grad_shard.copy_(wire)
            self.grad_shard.div_(self.replicas)


def _drop_storage(p: nn.Parameter) -> None:
    """Free a parameter's own storage and keep its shape (ZeRO-3 keeps its value in the flat shard); one built
    with deferred storage (`materialize(defer=True)`) has none to free."""
    if p.untyped_storage().nbytes():
        p.data = torch.empty_like(p)  # a storage of its own: the old one may be shared with its builder
        p.untyped_storage().resize_(0)
    forget_pending(p)


def _default_decay(p: nn.Parameter) -> bool:
    """Weight decay on matrices only (as the trainer's make_optimizer): norms, biases, 1-D tensors are not."""
    return p.dim() >= 2


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW on this rank's shards of every stage's flat buffer, then (ZeRO-1/2) an all-gather of the params.

    The per-element maths are those of ``torch.optim.AdamW(foreach=False)``, applied in the same order on the
    shard (weight decay per parameter segment), so with one data-parallel rank the update equals torch's
    exactly. The optimizer's parameters are the shard tensors (``zero.shard_module().parameters()``), so its
    ``state`` holds only this rank's flat moments; checkpoints store them per parameter under global names
    (`FlatStage.owned`, tessera/train/checkpoint/state.py), never as flat buffers.
    """

    def __init__(
        self,
        zero: ZeroStageComm,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        decay: Callable[[nn.Parameter], bool] = _default_decay,
        norm_groups: Iterable[dist.ProcessGroup] = (),
        norm_weights: dict[int, float] | None = None,
    ) -> None:
        self.zero = zero
        self.module = zero.shard_module()
        self.norm_groups = list(norm_groups)
        self.norm_weights = norm_weights or {}
        self._decay = {id(p): decay(p) for p in zero.params()}
        # one group, possibly empty: a pipeline rank whose stages hold no parameters (stages of no blocks, neither
        # embedding nor head) has no shards; torch refuses an empty parameter list but not an empty group
        shards = [{"params": list(self.module.parameters())}]
        super().__init__(shards, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self._flat_of = {id(flat.shard_param): flat for flat in zero.flats.values()}

    def _attach_grads(self) -> None:
        for flat in self.zero.flats.values():
            g = flat.grad_shard
            flat.shard_param.grad = g if g is not None else torch.zeros_like(flat.shard)

    def grad_norm(self) -> float:
        """Global L2 norm of the reduced gradients: sum of squares over shards, all-reduced over the shard group
        (the data-parallel group without hybrid sharding; its replicas hold the same shards, counted once) and
        ``norm_groups`` (e.g. the pipeline group whose ranks hold other stages)."""
        pairs: list[tuple[torch.Tensor, float]] = []
        for flat in self.zero.flats.values():
            g = flat.grad_shard
            if g is None:
                continue
            if not self.norm_weights:
                pairs.append((g, 1.0))
                continue
            for p, a, b in flat.segments():  # replicated tensors weighted 1/r, so each is counted once
                pairs.append((g[a:b], self.norm_weights.get(id(p), 1.0)))
        dp = self.zero.group if self.zero.world > 1 else None
        return global_norm(squared_norm(pairs, self._device()), [dp, *self.norm_groups])

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradient shards so the global norm is at most ``max_norm`` (`clip_grads_`, torch's rule);
        returns the norm before clipping."""
        return clip_grads_(self.zero.grad_shards(), self.grad_norm(), max_norm)

    def _device(self) -> torch.device:
        flats = list(self.zero.flats.values())
        return flats[0].shard.device if flats else torch.device("cpu")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """One AdamW update of the shards from ``zero``'s reduced gradient shards, then refresh the params
        (ZeRO-1/2; with ``overlap_param_gather`` the all-gathers are left in flight: `ZeroStageComm`)."""
        if closure is not None:
            raise ValueError("ShardedAdamW.step takes no closure")
        self.zero.finish_param_gathers()  # the update writes the shards, which a gather in flight writes too
        self._attach_grads()
        for group in self.param_groups:
            for shard in group["params"]:
                self._update(shard, group)
        self.zero.gather_updated_params()

    def _update(self, shard: torch.Tensor, group: dict[str, Any]) -> None:
        flat = self._flat_of[id(shard)]
        grad = shard.grad
        state = self.state[shard]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(shard, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(shard, memory_format=torch.preserve_format)
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        step = state["step"].item()
        for p, start, end in flat.segments():  # decoupled decay, per parameter like torch's param groups
            if wd != 0 and self._decay[id(p)]:
                shard[start:end].mul_(1 - lr * wd)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
        shard.addcdiv_(m, denom, value=-step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad()
        for p in self.module.parameters():
            p.grad = None
