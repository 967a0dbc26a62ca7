"""Start-up memory per rank: the peak of building (or loading) a rank's model, before the first step. No torch.

Construction is sharded (docs/sharded-init.md): a rank allocates only the tensors it holds — its tensor-parallel
blocks of its pipeline stages; with ZeRO-3 only its 1/d of each stage's flat buffer (ZeRO-1/2: the whole flat
buffer, which *is* the parameters) — and fills them one parameter at a time from the value source. So

    build = held parameter bytes + the largest tensor it holds + 2 × one init row block

Each local tensor is allocated once and filled one row block at a time (the drawn block and the slice cut from
it are the two row blocks); with ZeRO a parameter's value is made whole once more before it is copied into the
flat buffer (the largest tensor). Loading a checkpoint (`tessera train` resuming) reads into those same tensors after torch's state-dict
helpers have created the optimizer state and zero gradients, with one tensor buffered at a time:

    load = params + grads + optimizer state (as in training, sharded by ZeRO) + the largest tensor held

Neither needs activations, so the training peak binds unless the run is tiny; `tessera memory` shows all three.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config import Config
from tessera.execution import ExecutionPlan, resolve
from tessera.model import INIT_BLOCK_ELEMENTS
from tessera.planner.cost import ModelShape, Plan, model_state_bytes

__all__ = ["StartupEstimate", "startup_memory"]

_FP32 = 4


@dataclass(frozen=True, slots=True)
class StartupEstimate:
    """Start-up peak bytes of the fullest pipeline rank ``stage`` (beyond the process's baseline)."""

    build: float
    """Building the model on this rank: held parameters (ZeRO-3: flat shards) + one parameter in flight."""
    load: float
    """Loading a checkpoint into it: model state (params, grads, optimizer) + one tensor buffer."""
    held_params: float
    """Parameter bytes this rank holds after construction."""
    largest_tensor: float
    """The largest tensor this rank holds (its block of it), in bytes."""
    stage: int

    @property
    def peak(self) -> float:
        return max(self.build, self.load)

    def describe(self) -> str:
        return (
            f"start-up (pipeline rank {self.stage}): build {_fmt(self.build)}, checkpoint load "
            f"{_fmt(self.load)} (holds {_fmt(self.held_params)} of parameters; largest tensor "
            f"{_fmt(self.largest_tensor)})"
        )


def _fmt(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _largest(shape: ModelShape, plan: Plan, holds_table: bool) -> float:
    """Elements of the largest tensor block a rank holds: every matrix is split by the tensor degree (the
    vocabulary padded to it); GPT's position table stays whole under 1D tensor parallelism."""
    tp, h = plan.tp, shape.d_model
    q = plan.q
    candidates = [h * shape.ffn_hidden / tp, h * max(h, shape.q_dim, shape.kv_dim) / tp]
    if holds_table:
        candidates.append(
            -(-shape.vocab_size // tp) * h if plan.tp_kind == "1d" else -(-shape.vocab_size // q) * h / q
        )
        if shape.features.has_position_embedding:
            candidates.append(shape.seq_len * h / q)  # positions: replicated in 1D, j-th slice in 2D
    return max(candidates)


def startup_memory(cfg: Config, world_size: int, plan: ExecutionPlan | None = None) -> StartupEstimate:
    """The start-up peak of the pipeline rank that needs most, for ``cfg`` on ``world_size`` ranks (its stages
    and their blocks from the execution plan, `tessera.execution.resolve`)."""
    from tessera.memory import cost_plan, stage_params

    plan = plan or resolve(cfg, world_size, training=False)
    cost = cost_plan(plan)
    shape = ModelShape.from_config(cfg.model)
    per_stage = stage_params(shape, cost, plan.stage_layers)
    block = INIT_BLOCK_ELEMENTS * _FP32
    best: StartupEstimate | None = None
    for rank in range(plan.pp):
        mine = plan.rank_stages(rank)
        psi = sum(per_stage[s] for s in mine)
        largest = _largest(shape, cost, holds_table=0 in mine or plan.n_stages - 1 in mine) * _FP32
        held = psi * _FP32 / (plan.zero_shard if plan.zero >= 3 else 1)
        build = held + largest + 2 * block
        load = sum(model_state_bytes(psi, plan.zero_shard, plan.zero, "fp32")) + largest
        candidate = StartupEstimate(build, load, held, largest, rank)
        if best is None or candidate.peak > best.peak:
            best = candidate
    assert best is not None  # pp >= 1
    return best
