"""Op-level selective checkpointing (`parallel.checkpointing = "op"`, torchtitan's `_save_list` policy) on one
process: what its backward replays, that it changes no number, the layouts it refuses. Layouts:
tests/distributed/test_op_checkpointing.py.

What is replayed is counted at the dispatcher (below autograd), where a replayed matmul runs and a kept one is
handed back without running: a module forward hook would fire for both."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from tessera.cli import main
from tessera.config import load_config
from tessera.config.sections import ModelConfig
from tessera.execution import violations
from tessera.model.build import build_model
from tessera.model.documents import document_positions
from tessera.parallel.checkpointing import SAVED_ATTENTION_OPS, apply_checkpointing, op_contexts

DEMO = "configs/demo.toml"


EXPLICIT_ATTENTION_OPS = {torch.ops.aten._softmax.default: "softmax", torch.ops.aten.tanh.default: "softcap"}
"""The forward ops of the explicit attention core (`AttentionCore`'s soft-capped path, not SDPA) that a backward
runs only to replay it: a backward's own are _softmax_backward_data and tanh_backward."""


class _Replayed(TorchDispatchMode):
    """Counts, while active, each Linear's forward matmuls (by the Linear's name: the matmul's weight operand is
    that Linear's weight transposed, as F.linear passes it; a backward matmul takes it untransposed or not at all),
    SDPA's forward kernels and the explicit attention core's forward softmax and soft-cap tanh."""

    def __init__(self, linears: dict[str, nn.Linear]) -> None:
        super().__init__()
        self.weights = {name: m.weight for name, m in linears.items()}
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, op: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        operand = {torch.ops.aten.mm.default: 1, torch.ops.aten.addmm.default: 2}.get(op)
        if operand is not None:
            b = args[operand]
            for name, w in self.weights.items():
                same = b.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
                if same and b.shape == w.t().shape and b.stride() == w.t().stride():
                    self.calls[name] += 1
        if op in SAVED_ATTENTION_OPS:
            self.calls["sdpa"] += 1
        if op in EXPLICIT_ATTENTION_OPS:
            self.calls[EXPLICIT_ATTENTION_OPS[op]] += 1
        return op(*args, **(kwargs or {}))


def _backward_replays(family: str, mode: str, docs: bool = False, **model: Any) -> Counter[str]:
    """What the backward of a two-block model's step runs again under checkpointing ``mode``: block 0's Linears
    and both blocks' SDPA kernels or explicit attention cores (``model``: more ModelConfig fields)."""
    cfg = ModelConfig(family=family, n_layers=2, d_model=32, n_heads=4, seq_len=16, **model)
    model = build_model(cfg, seed=0)
    apply_checkpointing(model, mode)
    linears = {n: m for n, m in model.blocks["0"].named_modules() if isinstance(m, nn.Linear)}
    tokens = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    tokens[:, 5] = 0  # an end-of-text token: with ``docs``, each sequence is two documents
    positions = document_positions(tokens, eot=0) if docs else None
    loss = model(tokens, tokens, positions=positions)
    with _Replayed(linears) as seen:
        loss.backward()
    return seen.calls


@pytest.mark.parametrize(
    "family, replayed",
    [
        # wq wk wv wo w_gate w_up w_down: the 2nd, 4th and 6th matmuls
        ("llama", {"attn.wk", "attn.wo", "mlp.w_up"}),
        ("qwen3", {"attn.wk", "attn.wo", "mlp.w_up"}),
        # wq wk wv wo fc proj (addmm, biased): proj is the 6th, but nothing the backward needs comes after it, so
        # torch's early-stopping replay never reaches it (as under full checkpointing)
        ("gpt", {"attn.wk", "attn.wo"}),
    ],
)
@pytest.mark.parametrize("docs", [False, True])
def test_op_replays_every_second_matmul_and_not_attention(
    family: str, replayed: set[str], docs: bool
) -> None:
    calls = _backward_replays(family, "op", docs)
    assert calls == Counter(dict.fromkeys(replayed, 1)), calls  # no SDPA kernel among them
    full = _backward_replays(family, "full", docs)
    assert (
        full["sdpa"] == 2 and set(full) > replayed
    )  # the counter sees what full replays (SDPA: both blocks)


@pytest.mark.parametrize("docs", [False, True])
def test_op_replays_gemma2s_capped_attention_whole(docs: bool) -> None:
    """Gemma 2's soft-capped attention is not SDPA: op mode keeps no attention output, so each block's replay runs
    its core whole (softmax and cap), as full does, while keeping wq, wv, w_gate and w_down as Llama's blocks
    (docs/memory.md prices it so: `rank_memory.op_kept_bytes`)."""
    calls = _backward_replays("gemma2", "op", docs, attn_softcap=50.0)
    replayed = dict.fromkeys(("attn.wk", "attn.wo", "mlp.w_up"), 1)
    assert calls == Counter(replayed | {"softmax": 2, "softcap": 2}), calls  # both blocks' cores
    full = _backward_replays("gemma2", "full", docs, attn_softcap=50.0)
    assert full["softmax"] == full["softcap"] == 2 and full["attn.wq"] == full["mlp.w_down"] == 1
    assert not {"softmax", "softcap"} & set(_backward_replays("gemma2", "none", docs, attn_softcap=50.0))


@pytest.mark.parametrize("family", ["llama", "gpt"])
@pytest.mark.parametrize("docs", [False, True])
def test_op_changes_no_number(family: str, docs: bool) -> None:
    """Loss and every gradient bit for bit equal to the step without checkpointing (fp32, one process): the
    replay recomputes the same ops on the same inputs, and the kept outputs are the forward's own."""

    def step(mode: str) -> tuple[float, dict[str, torch.Tensor]]:
        model = build_model(ModelConfig(family=family, n_layers=2, d_model=32, n_heads=4, seq_len=16), seed=0)
        apply_checkpointing(model, mode)
        tokens = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        tokens[:, 7] = 0
        loss = model(tokens, tokens, positions=document_positions(tokens, 0) if docs else None)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    (loss, grads), (ref_loss, ref_grads) = step("op"), step("none")
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


class _Flaky(nn.Module):
    """A block whose first forward adds its bias in the matmul (addmm) and later ones after it (mm): its replay
    reaches a matmul other than the one its forward kept."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.calls = nn.Linear(4, 4), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.a(x) if self.calls == 1 else x @ self.a.weight.t() + self.a.bias
        return torch.tanh(y).sum()


def test_a_replay_that_differs_from_its_forward_is_an_error_naming_the_fix() -> None:
    block = _Flaky()
    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=False, context_fn=op_contexts)
    with pytest.raises(RuntimeError, match="checkpointing = 'full'"):
        out.backward()


@pytest.mark.parametrize(
    "overrides, what",
    [
        (["parallel.tensor='2x2'", "parallel.data=1", "train.micro_batch=2"], "2D"),
        (
            [
                "parallel.tensor=2",
                "parallel.data=1",
                "parallel.sequence_parallel=true",
                "parallel.tp_comm_overlap=true",
            ],
            "tp_comm_overlap",
        ),
    ],
)
def test_op_is_refused_where_a_linear_is_several_matmuls_by_validate_and_train(
    overrides: list[str], what: str, capsys: pytest.CaptureFixture
) -> None:
    world = 4 if what == "2D" else 2
    overrides = [*overrides, "parallel.checkpointing='op'"]
    assert [v.rule for v in violations(load_config(DEMO, overrides[:-1]), world)] == []  # op alone is refused
    (v,) = violations(load_config(DEMO, overrides), world)
    assert v.rule == "checkpointing.op" and what in v.problem and '"selective" or "full"' in v.fix
    assert main(["validate", DEMO, "--world-size", str(world), *overrides]) == 1
    assert str(v) in capsys.readouterr().out
    assert main(["train", DEMO, "--nproc", str(world), *(f"--{o}" for o in overrides)]) == 2
    assert str(v) in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.data=2"],
        ["parallel.data=2", "parallel.zero=3"],
        ["parallel.tensor=2", "parallel.data=1", "parallel.sequence_parallel=true"],
        ["parallel.pipeline=2", "parallel.data=1", "parallel.schedule='1f1b'"],
        ["parallel.context=2", "parallel.data=1"],
    ],
)
def test_op_is_accepted_on_the_layouts_it_runs(overrides: list[str]) -> None:
    assert violations(load_config(DEMO, [*overrides, "parallel.checkpointing='op'"]), 2) == []


def test_the_planner_proposes_op_only_where_it_runs() -> None:
    """The search tries op checkpointing (`search.SEARCHED_CHECKPOINTING`) but not on the 2D grid, and never with
    the rings (`search.tessera_runs_rings`): every candidate's config passes `validate`."""
    from tessera.planner.hardware import load_hardware
    from tessera.planner.search import SearchSpace, search

    space = SearchSpace(
        checkpointing=("op", "selective"), pipeline=(1,), zero_stages=(0,), schedules=("1f1b",)
    )
    result = search("gpt2-124m", 4, load_hardware("a100-80gb"), 16, space=space, keep=10_000)
    op = [c for c in result.candidates if c.plan.recompute == "op"]
    assert op and any(c.plan.sequence_parallel for c in op)
    assert any(c.plan.tp_kind == "2d" for c in result.candidates)  # 2D was searched ...
    assert not any(c.plan.tp_kind == "2d" or c.plan.tp_comm_overlap for c in op)  # ... but not with op
    for c in op:
        assert violations(c.config, 4) == [], c.label
