"""The ``StageComm`` family: what the pipeline runtime calls for a schedule's stage-level actions.

The engine (`tessera.pipeline.runtime`) interprets ``REDUCE``, ``GATHER`` and ``FREE`` by calling the hooks of a
`StageComm`; which data-parallel mechanism runs behind them is the implementation's business:

- `DataParallelStageComm`: ZeRO-0, an all-reduce of each stage's flattened gradients (``parallel.zero = 0``).
- `ZeroStageComm`: ZeRO-1/2/3 on `tessera.parallel.zero.FlatStage` buffers, a reduce-scatter into this rank's
  shard, and (ZeRO-3) the all-gather and release of the stage's parameters around its compute. Its optimizer
  is `tessera.parallel.zero.ShardedAdamW`; docs/zero.md explains the buffers. With ``overlap_param_gather``
  (ZeRO-1/2) the optimizer's all-gather of the updated parameters stays in flight until each stage's first
  compute of the next step (``wait_gather``), or `ZeroStageComm.finish_param_gathers` for other readers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from tessera import comm
from tessera.modes import ACCUMULATION
from tessera.parallel.data import GradBucket
from tessera.parallel.precision import clear_weight_casts
from tessera.parallel.zero import FlatStage

__all__ = ["DataParallelStageComm", "StageComm", "ZeroStageComm"]


class StageComm(Protocol):
    """Hooks the engine calls for the stage-level actions (see RUNTIME_CONTRACT / docs/pipeline-runtime.md)."""

    def gather(self, stage: int) -> None:
        """GATHER: start the ZeRO-3 all-gather of the stage's parameters (may be asynchronous)."""

    def wait_gather(self, stage: int) -> None:
        """Called before every compute of the stage: its parameters must be complete on return (a ZeRO-3
        GATHER's, or a ZeRO-1/2 post-step all-gather left in flight by ``overlap_param_gather``)."""

    def free(self, stage: int) -> None:
        """FREE: drop the gathered full parameters."""

    def reduce(self, stage: int) -> None:
        """REDUCE: the stage's gradients are final for this step; launch the data-parallel reduction."""

    def finish(self) -> None:
        """Before the optimizer step: wait for every reduction.

        Optional: ``expect_reductions(counts)``, the REDUCE actions per stage of one step's list, which the engine
        passes to a StageComm that has it (`ZeroStageComm`: when a stage's gradient shard is final)."""


class DataParallelStageComm:
    """Plain data parallelism: ``reduce(stage)`` launches an async all-reduce of the stage's flattened
    gradients over ``dp_group`` (None: no data parallelism); ``finish`` waits and writes back the average.
    gather/free are no-ops. Several calls per step (depth-first accumulation) reduce the gradient accumulated
    since the previous call each time and add the results. One reduction is in flight per rank, as with ZeRO:
    a call first waits for the previous one (of any stage) and adds it into that stage's running total, so the
    rank holds one reduced total per stage and one flat copy in flight, whatever the number of micro-batches.

    A Parameter held by two local stages (a tied embedding on one rank) is reduced with the lower-index stage,
    whose backward finishes last.
    """

    def __init__(self, stages: Mapping[int, nn.Module], dp_group: dist.ProcessGroup | None) -> None:
        self.group = dp_group
        self.size = comm.group_size(dp_group) if dp_group is not None else 1  # None: no data parallelism
        seen: set[int] = set()
        self.buckets: dict[int, GradBucket] = {}
        for index in sorted(stages):
            own = [p for p in stages[index].parameters() if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in own)
            self.buckets[index] = GradBucket(own, dp_group, self.size)
        self._inflight: GradBucket | None = None

    def gather(self, stage: int) -> None:
        pass

    def wait_gather(self, stage: int) -> None:
        pass

    def free(self, stage: int) -> None:
        pass

    def reduce(self, stage: int) -> None:
        bucket = self.buckets.get(stage)
        if self.size == 1 or bucket is None or not bucket.params:
            return
        if self._inflight is not None:  # it ran under this backward: waiting costs little, and frees its copy
            self._inflight.settle()
        bucket.launch(drop_grads=True)  # later micro-batches (depth-first: one reduce each) accumulate afresh
        self._inflight = bucket

    def finish(self) -> None:
        """Wait for every reduction; write each stage's reduced total back as the average."""
        if self._inflight is not None:  # first, so no flat copy is in flight while gradients are written back
            self._inflight.settle()
            self._inflight = None
        for bucket in self.buckets.values():
            bucket.finish()


def _stage_items(stages: Mapping[int, nn.Module] | Sequence[nn.Module]) -> list[tuple[int, nn.Module]]:
    if isinstance(stages, Mapping):
        return sorted(stages.items())
    return list(enumerate(stages))


class ZeroStageComm:
    """The StageComm of the pipeline runtime for ZeRO stage 1, 2 or 3 over ``dp_group`` (see module doc).

    ``stages``: this rank's stages, ``{global_stage: module}`` or a list indexed by stage. A parameter shared by
    several stages (tied embedding and head on one rank) belongs to the lowest stage, whose backward finishes
    last in every schedule; gathering any stage that uses it gathers the owner's buffer too (reference-counted).
    ``reduce_dtype``: dtype of the gradient reduce-scatter (fp32 default; bf16 halves the traffic).
    ``overlap_param_gather`` (ZeRO-1/2): `gather_updated_params` leaves each stage's all-gather in flight, to be
    waited for at the stage's first compute of the next step; until then every module holding its parameters
    refuses to run ``forward`` or ``state_dict`` outside the runtime (`finish_param_gathers` first).
    ``replica_group`` (hybrid sharding): ``dp_group`` is then the shard group, and each stage's gradient shard is
    all-reduced over this group once per step, launched at the rank's first REDUCE after the stage's last one
    (`_launch`), the last reduced stage's in `finish` (docs/zero.md, "Hybrid sharding"), in ``reduce_dtype`` on
    the wire.
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module] | Sequence[nn.Module],
        dp_group: dist.ProcessGroup | None,
        zero_stage: int,
        accumulation: str = "layered",
        *,
        reduce_dtype: torch.dtype = torch.float32,
        overlap_param_gather: bool = False,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        if zero_stage not in (1, 2, 3):
            raise ValueError(
                f"ZeroStageComm needs zero_stage 1, 2 or 3, got {zero_stage}; for parallel.zero = 0 use "
                "DataParallelStageComm"
            )
        if overlap_param_gather and zero_stage == 3:
            raise ValueError(
                "overlap_param_gather defers ZeRO-1/2's post-step all-gather; ZeRO-3 has none (its GATHERs "
                "already run ahead of each compute): pass overlap_param_gather=False"
            )
        if accumulation not in ACCUMULATION:
            raise ValueError(f"accumulation must be one of {ACCUMULATION}, got {accumulation!r}")
        self.group, self.zero_stage, self.accumulation = dp_group, zero_stage, accumulation
        self.reduce_dtype = reduce_dtype
        self.world = comm.group_size(dp_group) if dist.is_initialized() else 1
        owner: dict[int, int] = {}
        self.uses: dict[int, list[int]] = {}
        items = _stage_items(stages)
        by_stage: dict[int, list[nn.Parameter]] = {s: [] for s, _ in items}
        for s, module in items:
            self.uses[s] = []
            for p in module.parameters():
                if not p.requires_grad:
                    continue
                if id(p) not in owner:
                    owner[id(p)] = s
                    by_stage[s].append(p)
                if owner[id(p)] not in self.uses[s]:
                    self.uses[s].append(owner[id(p)])
        self.flats: dict[int, FlatStage] = {
            s: FlatStage(ps, dp_group, zero_stage, replica_group) for s, ps in by_stage.items() if ps
        }
        self.uses = {s: [o for o in owners if o in self.flats] for s, owners in self.uses.items()}
        self._pending_reduce: set[int] = set()
        self._inflight: list[FlatStage] = []
        # Hybrid sharding: a stage's shard is final once the reduce-scatter of its last REDUCE of the step
        # completes (layered: its one REDUCE; depth-first ZeRO-2/3: the last micro-batch's; depth-first ZeRO-1:
        # its one reduce-scatter, launched at its last REDUCE), so its replica all-reduce is launched at the
        # rank's next REDUCE, where `_launch` waits for that reduce-scatter anyway, and runs under the backwards
        # after it; only those still owed at `finish` run after the last compute.
        # REDUCEs per stage and step: the engine's list says (`expect_reductions`); unknown, layered means one.
        self._replicated = replica_group is not None
        self._expected: dict[int, int] | None = None
        self._reduced: dict[int, int] = dict.fromkeys(self.flats, 0)
        self._stage_of = {id(flat): s for s, flat in self.flats.items()}
        self._shard_module: nn.Module | None = None
        self.overlap_param_gather = overlap_param_gather
        self._guards = self._guard_stale_reads(items) if overlap_param_gather else []

    # --- StageComm protocol -------------------------------------------------------------------------------

    def gather(self, stage: int) -> None:
        """GATHER: start all-gathering the parameters stage ``stage`` computes with (ZeRO-3; else a no-op)."""
        if self.zero_stage < 3:
            return
        for owner in self.uses.get(stage, []):
            flat = self.flats[owner]
            flat.users += 1
            flat.launch_gather()

    def wait_gather(self, stage: int) -> None:
        """Before every compute of ``stage``: complete the all-gathers in flight of the buffers it computes with
        (ZeRO-3's GATHER, or with ``overlap_param_gather`` the post-step one); nothing in flight, nothing to do."""
        for owner in self.uses.get(stage, []):
            self.flats[owner].wait_gather()

    def free(self, stage: int) -> None:
        """FREE: release gathered parameters no stage in a running phase still uses (ZeRO-3)."""
        if self.zero_stage < 3:
            return
        for owner in self.uses.get(stage, []):
            flat = self.flats[owner]
            flat.users = max(0, flat.users - 1)
            if flat.users == 0:
                flat.wait_gather()
                flat.release()
                # Autocast (and 2D's SUMMA, `precision.cast_operand`) keeps the low-precision copy of every
                # weight it cast until its region exits, and the step is one region: without this every
                # gathered stage's bf16 copy would outlive its FREE (2 bytes per parameter of the whole
                # model). Others still gathered are just cast again.
                clear_weight_casts()

    def expect_reductions(self, counts: Mapping[int, int]) -> None:
        """The engine's REDUCE actions per stage in one step (its lowered list): a stage's shard is final after
        the last of them, when its replica all-reduce may start (hybrid sharding)."""
        self._expected = {s: counts.get(s, 0) for s in self.flats}

    def _final(self, flat: FlatStage) -> bool:
        """Whether ``flat``'s last reduction of the step has been launched (its shard is then final once waited
        for)."""
        stage = self._stage_of[id(flat)]
        if self._expected is not None:
            return self._reduced[stage] == self._expected[stage]
        return self.accumulation == "layered"  # one REDUCE per stage and step

    def reduce(self, stage: int) -> None:
        """REDUCE: stage ``stage``'s gradients of this sweep are complete; launch their reduce-scatter."""
        if stage not in self.flats:
            return
        self._reduced[stage] += 1
        if self.zero_stage == 1 and self.accumulation == "depth_first":
            # ZeRO-1 keeps full gradients and reduce-scatters them once per step: at the stage's last REDUCE,
            # when they are final, so the reduction runs under the backwards of the stages below (Megatron's
            # distributed optimizer launches each bucket's reduce-scatter once its last micro-batch's gradients
            # are in). Which REDUCE is the last is fixed by the action list (`expect_reductions`), the same on
            # every rank of the shard and replica groups (they share pipeline and tensor coordinates), so every
            # rank of a group issues the same reduce-scatters in the same order. Counts unknown: in `finish`.
            if self._expected is None:
                self._pending_reduce.add(stage)
            elif self._final(self.flats[stage]):
                self._launch(self.flats[stage], drop_grads=False)
            return
        self._launch(self.flats[stage], drop_grads=self.zero_stage >= 2)

    def _launch(self, flat: FlatStage, drop_grads: bool) -> None:
        # One reduction in flight: it overlaps the next stage's backward, and only one flattened gradient copy
        # exists at a time (the memory estimate's communication buffer).
        for earlier in self._inflight:
            earlier.wait_reduce()
            # Sum a final shard over the replicas under the next backwards. ``earlier is flat``: the stage is
            # being reduced again (a rank holding one stage, depth-first: one REDUCE per micro-batch), so the
            # counts `_final` reads already include this launch and the shard in hand is not yet final.
            if self._replicated and earlier is not flat and self._final(earlier):
                earlier.launch_replica_reduce(self.reduce_dtype)
        flat.launch_reduce(self.reduce_dtype, drop_grads=drop_grads)
        self._inflight = [flat]

    def finish(self) -> None:
        """Before the optimizer step: launch the reductions held back (ZeRO-1 depth-first where the engine did not
        say how many REDUCEs a step has: `reduce`) and wait for every one; with hybrid sharding launch the replica
        all-reduces still owed (the last reduced stage's; every stage's where the engine did not say how many
        REDUCEs a step has and accumulation is depth-first) and wait for all.

        Every launch point is fixed by the rank's action list, never by a collective's progress: the ranks of a
        shard or replica group share their pipeline and tensor coordinates, so they run the same list and issue
        the same collectives in the same order on every group (NCCL's requirement)."""
        for stage in sorted(self._pending_reduce, reverse=True):
            self._launch(self.flats[stage], drop_grads=False)
        self._pending_reduce.clear()
        last = self._inflight
        self._inflight = []
        for flat in last:  # the reduction in flight first: its replica all-reduce goes next on the wire
            flat.wait_reduce()
            if self._replicated:
                flat.launch_replica_reduce(self.reduce_dtype)
        for s in sorted(self.flats):  # those not launched yet: all in flight together, ascending stage
            flat = self.flats[s]
            flat.wait_reduce()
            if self._replicated and not flat.replica_pending:
                flat.launch_replica_reduce(self.reduce_dtype)
        for flat in self.flats.values():
            flat.wait_replica_reduce()
        self._reduced = dict.fromkeys(self.flats, 0)

    # --- the updated parameters (ZeRO-1/2) -------------------------------------------------------------------

    def gather_updated_params(self) -> None:
        """After `ShardedAdamW` updated the shards (ZeRO-1/2): all-gather every stage's buffer, in ascending
        stage order, which is the order this rank's list first computes them (a stage's first forward needs the
        same micro-batch's forward of every lower local stage before it). Without ``overlap_param_gather`` each
        is waited for at once (one shard copy at a time); with it they stay in flight until `wait_gather`."""
        for s in sorted(self.flats):
            flat = self.flats[s]
            flat.launch_param_gather()
            if not self.overlap_param_gather:
                flat.wait_gather()

    def finish_param_gathers(self) -> None:
        """Wait for every post-step all-gather still in flight (ZeRO-1/2): what reads or writes the parameters
        or the shards outside the runtime calls this first (checkpoints, export, evaluation outside the
        runtime, the end of training). ZeRO-3's gathers between a GATHER and its compute are the runtime's."""
        if self.zero_stage < 3:
            for s in sorted(self.flats):
                self.flats[s].wait_gather()

    def _guard_stale_reads(self, items: list[tuple[int, nn.Module]]) -> list[RemovableHandle]:
        """Hooks on every module that holds a parameter of a flat buffer: its ``forward`` and ``state_dict``
        raise while that buffer's post-step gather is in flight. The runtime waits before each compute, so
        they fire only for a reader that forgot `finish_param_gathers`: a loud error, not stale weights."""
        flat_of = {id(p): flat for flat in self.flats.values() for p in flat.params}
        handles: list[RemovableHandle] = []
        seen: set[int] = set()
        for s, stage in items:
            for name, module in stage.named_modules():
                held = [flat_of[id(p)] for p in module.parameters(recurse=False) if id(p) in flat_of]
                if not held or id(module) in seen:
                    continue
                seen.add(id(module))
                check = _stale_read_check(list(dict.fromkeys(held)), f"stage {s}'s {name or 'module'}")
                handles.append(module.register_forward_pre_hook(check))
                handles.append(module.register_state_dict_pre_hook(check))
        return handles

    def close(self) -> None:
        """Wait for the gathers in flight and remove the stale-read guards (the end of training)."""
        self.finish_param_gathers()
        for handle in self._guards:
            handle.remove()
        self._guards = []

    # --- helpers for the trainer --------------------------------------------------------------------------

    def params(self) -> list[nn.Parameter]:
        """Every parameter this object manages, each once."""
        return [p for flat in self.flats.values() for p in flat.params]

    def grad_shards(self) -> list[torch.Tensor]:
        return [f.grad_shard for f in self.flats.values() if f.grad_shard is not None]

    def zero_grad(self) -> None:
        """Drop gradient shards and any full gradients left (ZeRO-1)."""
        for flat in self.flats.values():
            flat.grad_shard = None
            for p in flat.params:
                p.grad = None

    def gather_all(self) -> None:
        """Materialise every stage's full parameters (ZeRO-3; ZeRO-1/2: wait for the post-step gathers), e.g. to
        evaluate or export; undo with free_all."""
        self.finish_param_gathers()
        for s in self.flats:
            self.gather(s)
        for s in self.flats:
            self.wait_gather(s)

    def free_all(self) -> None:
        for s in self.flats:
            self.free(s)

    def refresh_params(self) -> None:
        """Rebuild the parameters from the shards after the shards were overwritten (a checkpoint load);
        collective. ZeRO-1/2 keep full copies between steps: without this every rank would train on its own
        fresh shard and the other ranks' stale slices. ZeRO-3 re-gathers only what is currently gathered."""
        self.finish_param_gathers()
        for flat in self.flats.values():
            if not flat.sharded_params:
                flat.all_gather_params()
            elif flat.gathered:
                flat.gathered = False
                flat.launch_gather()
                flat.wait_gather()

    def shard_module(self) -> nn.Module:
        """An ``nn.Module`` whose parameters are this rank's shards (``stage{s}``), for rank-local checkpoints;
        built once, its parameters share storage with the live shards."""
        if self._shard_module is None:
            self._shard_module = _ShardModule(self)
        return self._shard_module


def _stale_read_check(flats: list[FlatStage], what: str) -> Callable[..., None]:
    def check(*_: Any) -> None:
        if any(flat.gather_pending for flat in flats):
            raise RuntimeError(
                f"{what} was run or saved while its parameters' post-step all-gather "
                "(parallel.overlap_param_gather) was still in flight: it would read the other data-parallel "
                "ranks' slices from before the optimizer step. The pipeline runtime waits before each stage's "
                "compute; any other reader must call ZeroStageComm.finish_param_gathers() first"
            )

    return check


class _ShardModule(nn.Module):
    def __init__(self, zero: ZeroStageComm) -> None:
        super().__init__()
        self.shards = nn.ParameterDict(
            {f"stage{s}": nn.Parameter(flat.shard, requires_grad=True) for s, flat in zero.flats.items()}
        )
        for s, flat in zero.flats.items():  # share storage: the optimizer updates the live shard
            flat.shard_param = self.shards[f"stage{s}"]
        # loading a checkpoint writes the shards only; the parameters must follow on every rank
        self.register_load_state_dict_post_hook(lambda module, keys: zero.refresh_params())
