"""The pipeline runtime: execute this rank's lowered action list (the IR the validator and simulator see).

One engine runs every schedule — GPipe, 1F1B, interleaved, breadth-first (layered gradient accumulation, also
on one rank with p = 1) and hand-written CSV schedules — because it only interprets actions:

- ``F``: run the stage on its input (tokens, a received activation, or the previous local stage's output); the
  last stage returns the micro-batch loss, divided by m so the accumulated gradient is the batch mean. The
  stage's input is kept until its backward, and its output only until its one reader (``SEND_F`` or the next
  local stage's ``F``): the backward starts from the output's gradient edge, so an output sent to another rank
  is freed once the send completes, as Megatron's ``deallocate_output_tensor`` frees its data (docs/memory.md).
- ``B``: ``torch.autograd.backward(edge, grad)`` (the loss itself on the last stage); the input's ``.grad`` is
  what ``SEND_B`` sends or the previous local stage uses. ``I`` / ``W`` split it: ``I`` computes only the input
  gradient (graph kept), ``W`` then the weight gradients.
- ``SEND_*`` / ``RECV_*``: non-blocking P2P through the pipeline group (``tessera.comm.send/recv``, counted).
  Receives are posted ``recv_ahead`` compute actions early so the transfer overlaps compute; a ``RECV`` action
  waits for its data. Sends never block; they are waited for at the end of the step, their buffers dropped
  once complete (`_StepState.drop_completed_sends`).
- ``REDUCE`` / ``GATHER`` / ``FREE``: the ``StageComm`` hooks (data-parallel reduction, ZeRO-3 gather/free).
  Before every compute of a stage the engine calls ``wait_gather``: the one place where a stage's parameters
  must be complete (a ZeRO-3 GATHER, or ZeRO-1/2's post-step all-gather with ``overlap_param_gather``).
- ``EXCHANGE``: the gradient of a parameter two stages share across ranks (a tied embedding and head) is sent to
  and received from the peer rank, and both ranks keep the same sum; the lowering put it after the stage's last
  backward and before its one REDUCE (`tessera.pipeline.passes.add_tied_exchange`).

Deadlock freedom: the lowered lists are validated before anything runs, under exactly these rules (sends
buffered, receives blocking), and posting a receive early never blocks. Gloo matches messages by tag (each
message of a step has its own), NCCL by issue order per pair of ranks, which the engine checks for non-gloo
backends.

The hooks behind ``REDUCE`` / ``GATHER`` / ``FREE`` are `tessera.pipeline.stage_comm`; what the engine reads off
its list besides (early receives, depth-first reductions, the forward-only list, NCCL's order check) is the
torch-free `tessera.pipeline.run_order`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from tessera import comm
from tessera.errors import ConfigError
from tessera.layout import Axis
from tessera.model.documents import AttentionMasks, Batch, batch_parts
from tessera.model.materialize import materialize
from tessera.modes import reduces_every_microbatch
from tessera.parallel.clipping import squared_norm
from tessera.parallel.saved_activations import SavedActivationCounter, SavedStorages
from tessera.pipeline.build import lowered_schedule
from tessera.pipeline.ir import Action, ActionKind, Schedule, ScheduleError, infer_stage_ranks
from tessera.pipeline.passes import add_tied_exchange, tied_across
from tessera.pipeline.run_order import check_p2p_order, forward_only, recv_post_positions
from tessera.pipeline.stage import Stage, TiedParameter, split_stages, tied_parameters
from tessera.pipeline.stage_comm import DataParallelStageComm, StageComm
from tessera.pipeline.validate import validate

__all__ = ["PipelineEngine", "TimedAction", "build_pipeline"]

_K = ActionKind


class TimedAction(tuple):
    """(action, start, end) in seconds since the step began; recorded when ``record=True``."""

    __slots__ = ()

    def __new__(cls, action: Action, start: float, end: float) -> TimedAction:
        return super().__new__(cls, (action, start, end))

    action = property(lambda self: self[0])
    start = property(lambda self: self[1])
    end = property(lambda self: self[2])


@dataclass
class _StepState:
    """Tensors of one step, keyed by (stage, micro-batch) or by message; empty again at the end of a step."""

    batches: Sequence[Batch]
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """A stage's output until its one reader: the SEND_F to the next stage's rank, or that stage's F here."""
    roots: dict[tuple[int, int], GradientEdge] = field(default_factory=dict)
    """A stage's output's gradient edge, from its F to its B (or W): where the backward starts, without the
    output's data."""
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    split: dict[tuple[int, int], tuple[GradientEdge, torch.Tensor | None]] = field(default_factory=dict)
    posted: dict[tuple, tuple[torch.Tensor, list[dist.Work]]] = field(default_factory=dict)
    received: dict[tuple, torch.Tensor] = field(default_factory=dict)
    sends: list[tuple[torch.Tensor, list[dist.Work]]] = field(default_factory=list)
    sends_checked: int = 0  # sends left pending by the last `drop_completed_sends` sweep
    losses: list[torch.Tensor] = field(default_factory=list)
    loss_weight: float | None = None
    """None: each micro-batch's mean loss counts 1/m; else its loss summed over the targets a loss mask keeps
    counts ``loss_weight`` (the trainer's data-parallel size / the global batch's target count)."""
    saved: SavedStorages = field(default_factory=SavedStorages)  # what each F keeps until its backward
    documents: dict[int, AttentionMasks] = field(default_factory=dict)
    """Micro-batch → its attention masks (`Stage.masks`: its documents with document masking or context
    parallelism, else a sliding window's band), shared by this rank's stages, so their layers share one set of
    masks per micro-batch (docs/memory.md); released after the micro-batch's last forward here."""
    forwards: Counter = field(default_factory=Counter)  # micro-batch → its forwards run on this rank

    def drop_completed_sends(self) -> None:
        """Drop the completed sends and their buffers, sweeping the pending ones once their number has doubled
        since the last sweep rather than after every action: gloo reports a send complete only once it is waited
        for, so a step's sends all stay pending, and a sweep per action was quadratic (2,000 micro-batches on 4
        gloo ranks: 24 million checks, 246 s of a middle rank's 341 s step). Each sweep is paid for by the sends
        issued since, so it is linear; a buffer is dropped at the latest once the pending sends have doubled since
        it completed."""
        if len(self.sends) >= 2 * self.sends_checked:
            self.sends = [(t, w) for t, w in self.sends if not all(x.is_completed() for x in w)]
            self.sends_checked = len(self.sends)


class PipelineEngine:
    """Runs rank ``rank_in_pp``'s list of a lowered schedule, one optimizer step per ``step`` call.

    ``stages`` are this rank's stages by global index. ``activation_shape(tokens_shape)`` gives the shape of a
    stage boundary tensor (default: the stage's ``boundary_shape``); ``dtype`` its type (default: the
    parameters' type). Every ``comm.reduce`` call is a REDUCE action of the lowered list (one per stage and
    step, or one per micro-batch for depth-first accumulation except ZeRO-1: `tessera.modes.reduces_every_microbatch`).
    ``tied`` lists parameters shared by two stages (``tied_parameters``): when the stages sit on different
    ranks, the list's EXCHANGE actions sum their gradients, before those stages' one REDUCE (a list lowered
    without them gets them here, from the same pass: `tessera.pipeline.passes.add_tied_exchange`).
    ``validated``: the lists are `tessera.pipeline.build.lowered_schedule`'s for these ``microbatches``, as it
    returned them (it validated them); `_validated_lists` decides whether they are validated again.
    """

    def __init__(
        self,
        stages: dict[int, Stage],
        lowered: Schedule,
        rank_in_pp: int,
        pp_group: dist.ProcessGroup | None,
        comm: StageComm,
        *,
        microbatches: int | None = None,
        activation_shape: Callable[[torch.Size], tuple[int, ...]] | None = None,
        dtype: torch.dtype | None = None,
        tied: Iterable[TiedParameter] = (),
        recv_ahead: int = 2,
        record: bool = False,
        validated: bool = False,
    ) -> None:
        p = len(lowered)
        tied = list(tied)
        owner = infer_stage_ranks(lowered)
        across = tied_across(((t.stage_a, t.stage_b) for t in tied), owner.__getitem__)
        lowered = _validated_lists(lowered, across, microbatches, validated)
        self.owner = owner
        self.n_stages = len(self.owner)
        local = sorted(s for s, r in self.owner.items() if r == rank_in_pp)
        if sorted(stages) != local:
            raise ScheduleError(
                f"pipeline rank {rank_in_pp} runs stages {local} in this schedule but was given stages "
                f"{sorted(stages)}; build the stages with the schedule's placement"
            )
        if pp_group is not None and _group_size(pp_group) != p:
            raise ScheduleError(
                f"the schedule has {p} pipeline ranks but the pipeline group has {_group_size(pp_group)}"
            )
        seen = [a.microbatch for actions in lowered for a in actions if a.microbatch is not None]
        self.m = microbatches if microbatches is not None else max(seen, default=-1) + 1
        self.stages, self.rank, self.p, self.group, self.comm = stages, rank_in_pp, p, pp_group, comm
        self.lowered, self.actions = lowered, lowered[rank_in_pp]
        self.dtype = dtype or _param_dtype(stages)
        self.recv_ahead, self.record = recv_ahead, record
        self.activation_shape = activation_shape or _default_activation_shape(stages)
        self.tied = [t for t in tied if (min(t.stage_a, t.stage_b), max(t.stage_a, t.stage_b)) in across]
        # this rank's stages reduced once, at the end of its list, after their EXCHANGE
        self.deferred = {a.stage for a in self.actions if a.kind.is_exchange}
        self.post_at = recv_post_positions(self.actions, recv_ahead)
        expect = getattr(comm, "expect_reductions", None)  # ZeroStageComm: when a stage's shard is final
        if expect is not None:
            expect(Counter(a.stage for a in self.actions if a.kind.is_reduce))
        self.loss_scale = 1.0  # set by the trainer for fp16 dynamic loss scaling
        self.peak_saved_bytes = 0
        self.track_saved = True  # count activation bytes held for backward (metrics: saved_activation_bytes)
        self.timeline: list[TimedAction] = []
        if pp_group is not None and dist.get_backend(pp_group) != "gloo":
            check_p2p_order(lowered)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once (a tied Parameter of two local stages counted once)."""
        unique = {
            id(p): p for s in sorted(self.stages) for p in self.stages[s].parameters() if p.requires_grad
        }
        return list(unique.values())

    def remote_tied_copies(self) -> set[int]:
        """ids of local Parameters that are copies of a tie whose lower stage lives on another rank."""
        skip = set()
        for tie in self.tied:
            if tie.stage_b in self.stages and tie.stage_a not in self.stages:
                skip.add(id(self.stages[tie.stage_b].get_parameter(tie.name_b)))
        return skip

    def grad_norm_sq(self, weights: dict[int, float] | None = None) -> torch.Tensor:
        """Sum of ``weight·‖grad‖²`` over ``parameters()`` (weight 1 by default), the copy of a Parameter tied
        across ranks counted only on the rank of its lower stage; sum it over the pipeline group (and the tensor
        group, with tensor-parallel weights) for the global norm."""
        skip = self.remote_tied_copies()
        weights = weights or {}
        held = [p for p in self.parameters() if p.grad is not None]
        pairs = ((p.grad, 0.0 if id(p) in skip else weights.get(id(p), 1.0)) for p in held)
        return squared_norm(pairs, _device(self.stages))  # type: ignore[arg-type]

    # --- one step ------------------------------------------------------------------------------------------

    def step(self, batches: Sequence[Batch], loss_weight: float | None = None) -> float | None:
        """Run this rank's actions for one optimizer step over ``m`` micro-batches ``(tokens, targets)``.

        Gradients accumulate in the stages' parameters (final and data-parallel reduced on return: the
        StageComm's ``finish`` has run). Returns the mean loss over micro-batches, broadcast to every pipeline
        rank (None only if this engine has no pipeline group and no last stage). With ``loss_weight`` (a loss
        mask) each micro-batch's loss is instead its sum over kept targets times ``loss_weight``, and the return
        is their sum.
        """
        if len(batches) != self.m:
            raise ValueError(f"the schedule has {self.m} micro-batches but step got {len(batches)} batches")
        state = _StepState(batches, loss_weight=loss_weight)
        self.timeline = []
        self.peak_saved_bytes = 0  # most activation bytes held for backward at once on this rank, this step
        t0 = time.perf_counter()
        for index, action in enumerate(self.actions):
            if index in self.post_at:
                self._post_recvs(state, self.post_at[index])
            start = time.perf_counter()
            self._run(state, action)
            if self.record:
                self.timeline.append(TimedAction(action, start - t0, time.perf_counter() - t0))
            state.drop_completed_sends()
        for _, works in state.sends:
            for work in works:
                work.wait()
        self.comm.finish()
        self._check_drained(state)
        return self._mean_loss(state)

    def evaluate(self, batches: Sequence[Batch], loss_weight: float | None = None) -> float | None:
        """The mean loss of ``batches`` from a forward-only pass (validation): this rank's forwards and their
        activation messages (`forward_only`), under no_grad; gradients, optimizer state and the StageComm's
        reductions are untouched. Returns what `step` would (broadcast over the pipeline group), ``loss_weight``
        as there."""
        if len(batches) != self.m:
            raise ValueError(
                f"the schedule has {self.m} micro-batches but evaluate got {len(batches)} batches"
            )
        actions = forward_only(self.actions)
        post_at = recv_post_positions(actions, self.recv_ahead)
        state, track = _StepState(batches, loss_weight=loss_weight), self.track_saved
        self.track_saved = False  # saved_activation_bytes describes training steps
        try:
            with torch.no_grad():
                for index, action in enumerate(actions):
                    if index in post_at:
                        self._post_recvs(state, post_at[index])
                    self._run(state, action)
                    state.drop_completed_sends()  # as `step`: a completed send's activation is freed
                for _, works in state.sends:
                    for work in works:
                        work.wait()
        finally:
            self.track_saved = track
        state.inputs.clear()  # no backward will consume them
        state.outputs.clear()
        self._check_drained(state)
        return self._mean_loss(state)

    def _run(self, state: _StepState, action: Action) -> None:
        kind = action.kind
        if kind is _K.FORWARD:
            self._forward(state, action.stage, action.microbatch)
        elif kind in (_K.BACKWARD, _K.BACKWARD_INPUT):
            self._backward(state, action.stage, action.microbatch, split=kind is _K.BACKWARD_INPUT)
        elif kind is _K.BACKWARD_WEIGHT:
            self._weight(state, action.stage, action.microbatch)
        elif kind.is_send:
            self._send(state, action)
        elif kind.is_recv:
            self._wait_recv(state, action)
        elif kind.is_reduce:  # the step's REDUCE, or one micro-batch's REDUCE_MB (depth-first)
            self.comm.reduce(action.stage)
        elif kind.is_exchange:
            self._exchange_tied(action.stage, action.peer)
        elif kind is _K.GATHER_PARAMS:
            self.comm.gather(action.stage)
        elif kind is _K.FREE_PARAMS:
            self.comm.free(action.stage)

    # --- compute -------------------------------------------------------------------------------------------

    def _ready(self, stage: int) -> None:
        """Before every compute of ``stage``: the StageComm completes whatever gather of its parameters is in
        flight (ZeRO-3's GATHER; ZeRO-1/2's post-step one with overlap_param_gather, at the first compute)."""
        self.comm.wait_gather(stage)

    def _forward(self, state: _StepState, s: int, j: int) -> None:
        self._ready(s)
        tokens, targets, positions = batch_parts(state.batches[j])
        if s == 0:
            x = tokens
        elif self.owner[s - 1] == self.rank:
            x = state.outputs.pop((s - 1, j)).detach().requires_grad_()
        else:
            x = state.received.pop(("act", s - 1, j)).requires_grad_()
        if not self.track_saved:  # e.g. a caller measuring with its own saved-tensor hooks (they do not nest)
            out = self._stage_forward(state, s, j, x, targets, positions)
        else:
            with SavedActivationCounter(self.stages[s]) as saved:
                out = self._stage_forward(state, s, j, x, targets, positions)
            state.saved.add((s, j), saved.storages)  # a storage several F's saved counts once
            self.peak_saved_bytes = max(self.peak_saved_bytes, state.saved.bytes)
        state.inputs[(s, j)] = x
        if out.requires_grad:  # not under evaluate's no_grad
            state.roots[(s, j)] = get_gradient_edge(out)
        if s != self.n_stages - 1:  # the loss has no reader
            state.outputs[(s, j)] = out
        state.forwards[j] += 1
        if j in state.documents and state.forwards[j] == len(self.stages):  # its last forward on this rank
            state.documents.pop(j).release()  # the masks live on in what the stages' layers saved

    def _documents(self, state: _StepState, s: int, j: int, positions: torch.Tensor | None) -> AttentionMasks:
        """Micro-batch ``j``'s attention masks on this rank (its documents, if ``positions``), made by its first
        stage to run it and shared by the rest, so that every layer of the rank shares one set of masks per
        micro-batch, not one per stage (ZeRO-3 runs a stage per block)."""
        if j not in state.documents:
            state.documents[j] = self.stages[s].masks(positions)
        return state.documents[j]

    def _stage_forward(
        self,
        state: _StepState,
        s: int,
        j: int,
        x: torch.Tensor,
        targets: torch.Tensor,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every stage gets the micro-batch's side inputs from the batch it was given (the targets to the last,
        the document positions, if any, to all): each pipeline rank holds every micro-batch's tokens."""
        side = {} if positions is None else {"positions": positions}
        if isinstance(self.stages[s], Stage):
            side["docs"] = self._documents(state, s, j, positions)
        if s == self.n_stages - 1 and state.loss_weight is not None:
            # a loss mask: the sum over kept targets, weighted so the step's sum over micro-batches and (after
            # the data-parallel mean) replicas is the sum over the global batch's targets / their count
            out = self.stages[s](x, targets, reduction="sum", **side) * state.loss_weight
            state.losses.append(out.detach())
            if self.loss_scale != 1.0:
                out = out * self.loss_scale  # fp16: backward runs on the scaled loss
        elif s == self.n_stages - 1:
            out = self.stages[s](x, targets, **side) / self.m  # mean over micro-batches = mean over the batch
            state.losses.append(out.detach())
            if self.loss_scale != 1.0:
                out = out * self.loss_scale  # fp16: backward runs on the scaled loss
        else:
            out = self.stages[s](x, **side)
        return out

    def _output_grad(self, state: _StepState, s: int, j: int) -> torch.Tensor | None:
        if s == self.n_stages - 1:
            return None  # the output is the loss
        if self.owner[s + 1] == self.rank:
            return state.input_grads.pop((s + 1, j))
        return state.received.pop(("grad", s + 1, j))

    def _backward(self, state: _StepState, s: int, j: int, split: bool) -> None:
        self._ready(s)
        out, grad = state.roots.pop((s, j)), self._output_grad(state, s, j)
        x = state.inputs.pop((s, j))
        if not split:
            torch.autograd.backward(out, grad)
            state.saved.release((s, j))  # autograd has freed what this F saved
        elif s > 0:  # input gradient only; the graph stays for W
            (x.grad,) = torch.autograd.grad(out, x, grad, retain_graph=True)
        if split:
            state.split[(s, j)] = (out, grad)
        if s > 0:
            if x.grad is None:
                raise RuntimeError(f"stage {s} produced no gradient for its input (micro-batch {j})")
            state.input_grads[(s, j)] = x.grad

    def _weight(self, state: _StepState, s: int, j: int) -> None:
        self._ready(s)
        out, grad = state.split.pop((s, j))
        params = [p for p in self.stages[s].parameters() if p.requires_grad]
        torch.autograd.backward(out, grad, inputs=params)
        state.saved.release((s, j))

    # --- point-to-point ------------------------------------------------------------------------------------

    def _tag(self, message: tuple) -> int:
        """A tag unique to each message of a step: (kind, producer stage, micro-batch)."""
        what, stage, mb = message
        return (stage * 2 + (what == "grad")) * self.m + mb

    def _post_recvs(self, state: _StepState, recvs: list[Action]) -> None:
        ops, keys = [], []
        for action in recvs:
            shape = self.activation_shape(state.batches[action.microbatch][0].shape)
            buffer = torch.empty(shape, dtype=self.dtype, device=_device(self.stages))
            ops.append(comm.recv(buffer, action.peer, self.group, self._tag(action.message)))
            keys.append((action.message, buffer))
        works = comm.batch_p2p(ops)
        for i, (message, buffer) in enumerate(keys):
            state.posted[message] = (buffer, [works[i]] if len(works) == len(ops) else works)

    def _wait_recv(self, state: _StepState, action: Action) -> None:
        buffer, works = state.posted.pop(action.message)
        for work in works:
            work.wait()
        state.received[action.message] = buffer

    def _send(self, state: _StepState, action: Action) -> None:
        key = (action.stage, action.microbatch)
        tensor = state.outputs.pop(key).detach() if action.kind is _K.SEND_F else state.input_grads.pop(key)
        tensor = tensor.to(self.dtype).contiguous()
        op = comm.send(tensor, action.peer, self.group, self._tag(action.message))
        state.sends.append((tensor, comm.batch_p2p([op])))

    def _exchange_tied(self, s: int, peer: int) -> None:
        """EXCHANGE: sum the two gradient contributions of every parameter stage ``s`` shares with a stage of
        rank ``peer``, on both ranks."""
        for index, tie in enumerate(self.tied):
            mine = [(tie.stage_a, tie.name_a, tie.stage_b), (tie.stage_b, tie.name_b, tie.stage_a)]
            for stage, name, other in mine:
                if stage != s or self.owner[other] != peer:
                    continue
                param = self.stages[stage].get_parameter(name)
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                theirs = torch.empty_like(grad)
                tag = 2 * self.n_stages * self.m + index  # above every activation/gradient tag
                works = comm.batch_p2p(
                    [
                        comm.send(grad.contiguous(), peer, self.group, tag),
                        comm.recv(theirs, peer, self.group, tag),
                    ]
                )
                for work in works:
                    work.wait()
                # Same two addends on both ranks (a + b == b + a exactly): the copies stay identical.
                param.grad = grad + theirs if stage < other else theirs + grad

    # --- end of step ---------------------------------------------------------------------------------------

    def _check_drained(self, state: _StepState) -> None:
        left = {
            "inputs": state.inputs,
            "outputs": state.outputs,
            "output gradient edges": state.roots,
            "input gradients": state.input_grads,
            "received": state.received,
            "posted receives": state.posted,
            "documents (masks not released)": state.documents,
        }
        leftover = {name: sorted(map(str, d)) for name, d in left.items() if d}
        if leftover:
            raise ScheduleError(
                f"pipeline step ended with unconsumed tensors {leftover}; the schedule is incomplete"
            )

    def _mean_loss(self, state: _StepState) -> float | None:
        last = self.n_stages - 1
        total = torch.stack(state.losses).sum() if state.losses else torch.zeros(())
        total = total.detach().to(device=_device(self.stages), dtype=torch.float32)
        if self.group is None or self.p == 1:
            return float(total) if last in self.stages else None
        comm.broadcast(total, self.owner[last], self.group)
        return float(total)


def _validated_lists(
    lowered: Schedule, across: tuple[tuple[int, int], ...], microbatches: int | None, validated: bool
) -> Schedule:
    """``lowered`` with the EXCHANGEs of the tied pairs ``across`` (`add_tied_exchange`), proven deadlock-free.

    The one place that decides whether to run `validate`: always, unless the caller says the lists are
    `lowered_schedule`'s (``validated``: it validated them, with the same micro-batch count) and the exchange
    pass left them as they were. Validating them again proved nothing new and cost seconds on every rank (20,000
    micro-batches on 4 pipeline ranks: 5 s); hand-made lists, and lists this pass changed, are validated.
    """
    exchanged = add_tied_exchange(lowered, across)  # kept as it is when it exchanges them already
    if not (validated and exchanged == lowered):  # equal lists hold the same actions: compared by identity
        validate(exchanged, len(exchanged), microbatches=microbatches)
    return exchanged


def _group_size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _param_dtype(stages: dict[int, Stage]) -> torch.dtype:
    """The type of the tensors between stages by default: the stages' floating parameter type (fp32 under
    autocast, bf16 for a model cast to bf16)."""
    for stage in stages.values():
        for tensor in stage.parameters():
            if tensor.is_floating_point():
                return tensor.dtype
    return torch.float32


def _device(stages: dict[int, Stage]) -> torch.device:
    for stage in stages.values():
        for tensor in stage.parameters():
            return tensor.device
    return torch.device("cpu")


def _default_activation_shape(stages: dict[int, Stage]) -> Callable[[torch.Size], tuple[int, ...]]:
    shape = next(iter(stages.values())).boundary_shape
    if shape is None:
        raise ConfigError(
            "cannot infer the shape of the tensors between stages (the model has no .cfg.d_model); pass "
            "activation_shape= to PipelineEngine"
        )
    return shape


# --- building a pipeline from a plain model ----------------------------------------------------------------


def build_pipeline(
    model: nn.Module,
    layout: Any,
    groups: Any,
    cfg: Any,
    schedule_name: str | None = None,
    m: int | None = None,
    *,
    plan: Any = None,
    stage_comm: Callable[[dict[int, Stage]], StageComm] | None = None,
    record: bool = False,
    **schedule_options: Any,
) -> PipelineEngine:
    """A ``PipelineEngine`` for this rank from a plain (or tensor-parallel) ``model`` built identically on
    every rank: split into ``p·v`` stages, keep this rank's, lower and validate the schedule, attach the StageComm
    (``stage_comm(stages)``, default ``DataParallelStageComm`` over the data-parallel group).

    ``plan`` (a `tessera.execution.ExecutionPlan`, what the trainer passes) decides the schedule, stages per rank,
    stage layers, checkpointing, ZeRO stage, accumulation and micro-batches. Without it they are read from the run
    Config ``cfg`` as written (``cfg.parallel``; ``schedule_name`` and ``m`` override the schedule and the
    micro-batch count): a test's way to run one schedule directly.
    """
    par = cfg.parallel
    if plan is not None:
        name, v, m = plan.schedule, plan.stages_per_rank, plan.micro_batches
        stage_layers, checkpointing = list(plan.stage_layers), plan.checkpointing
        zero, accumulation = plan.zero, plan.accumulation
    else:
        name, v = schedule_name or par.schedule, par.stages_per_rank
        m = m if m is not None else cfg.train.micro_batches(layout.dp)
        stage_layers, checkpointing = par.stage_layers, par.checkpointing
        zero, accumulation = par.zero, par.accumulation
    p = layout.pp
    all_stages = split_stages(model, p * v, stage_layers, checkpointing)
    tied = tied_parameters(all_stages)  # before materialising: it finds ties by Parameter identity
    lowered, _ = lowered_schedule(
        name,
        p,
        m,
        v,
        zero3=zero == 3,
        accumulation=accumulation,
        reduce_every_microbatch=reduces_every_microbatch(accumulation, zero),
        tied=[(t.stage_a, t.stage_b) for t in tied],
        **schedule_options,
    )
    rank = groups.coord(Axis.PIPE) if groups is not None else 0
    owner = infer_stage_ranks(lowered)
    stages = {s.index: s for s in all_stages if owner[s.index] == rank}
    # Only this rank's stages get storage, replaced model-wide to keep ties. With ZeRO the flat buffers are
    # the storage (ZeRO-3: only this rank's shard of them): FlatStage fills them from the declared values.
    local = {id(param) for stage in stages.values() for param in stage.parameters()}
    materialize(model, only=local, defer=zero > 0)
    pp_group = groups.pp if groups is not None and p > 1 else None
    dp_group = groups.batch if groups is not None and layout.batch_ranks > 1 else None  # data × context
    hooks = stage_comm(stages) if stage_comm is not None else DataParallelStageComm(stages, dp_group)
    return PipelineEngine(
        stages,
        lowered,
        rank,
        pp_group,
        hooks,
        microbatches=m,
        tied=tied,
        record=record,
        validated=True,  # lowered_schedule's lists, for m micro-batches, untouched
    )
