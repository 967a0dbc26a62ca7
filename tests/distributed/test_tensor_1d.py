"""Megatron 1D tensor parallelism: loss and every gradient equal the single-device model's; counted bytes equal
the analytical formula exactly. The ``_overlap`` cases run sequence parallelism's collectives as rings under the
GEMMs (``parallel.tp_comm_overlap``): same bytes, same formula, and the number of ring steps is checked too. The
``_lanes`` cases run those rings with the chunk GEMMs on S forced lanes of synchronous stand-in streams (the CUDA
path's bookkeeping, `tests.sync_streams`): same tolerances, every lane used, and bit for bit the one-lane run of
the same case where each lane sums one chunk (t ≤ S).

One spawn per world size runs a named matrix of layouts (spawning is the expensive part on 2 cores); a failure
names every failing case.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from unittest import mock

import pytest
import torch

from tessera import comm
from tessera.config import Config, ModelConfig, ParallelConfig
from tessera.errors import ConfigError
from tessera.groups import Groups, build_groups
from tessera.layout import Axis, Layout
from tessera.model.build import build_model
from tessera.parallel.data import GradSync
from tessera.parallel.model_1d import apply_tensor_1d, check_tensor_1d, tensor_1d_comm
from tessera.parallel.saved_activations import SavedActivationCounter
from tessera.parallel.tensor_1d import padded_vocab
from tests.harness import run_distributed
from tests.sync_streams import forced_lanes, lanes_entered

LOSS_RTOL = 1e-5
"""Relative tolerance of the loss against the single-device loss (fp32, reordered sums)."""
GRAD_TOL = 1e-5
"""Max |gradient error| / max |reference gradient|, per parameter tensor (fp32)..."""
ZERO_GRAD = 1e-4
"""...where the reference scale is at least ZERO_GRAD × the largest gradient of the model: the key bias gradient is
zero in theory (softmax ignores a shift shared by all scores), ~1e-11 of roundoff, so a purely relative test of it
would compare noise with noise."""
NORM_RTOL = 1e-5
"""Relative tolerance of grad_norm_sq against the single-device squared norm."""
SP_MEMORY_SLACK = 0.02
"""With sequence parallelism, t × the activation bytes a rank saves for backward may exceed the single-device
model's by at most this fraction (the vocabulary-parallel loss saves its softmax shard, the plain loss its own)."""
EXACT = 0.0
"""Cutting shards and gathering them back must give the full weights bit for bit."""

SEED = 7
BATCH, SEQ = 4, 8


@dataclass(frozen=True)
class Case:
    family: str
    tp: int
    dp: int = 1
    sp: bool = False
    vocab: int = 64
    tied: bool = True
    micro: int = 1  # gradient accumulation over this many micro-batches per rank
    overlap: bool = False  # tp_comm_overlap: SP's all-gathers / reduce-scatters as rings under the GEMMs
    lanes: int = 0  # with overlap: the rings' chunk GEMMs on this many forced lanes (0: CPU's one lane)
    head_dim: int | None = None  # None: d_model / n_heads; 6 makes the attention 8·6 = 48 wide, not 32
    d_model: int = 32  # with head_dim set, a width t need not divide: 1D never splits the residual stream


def _model_cfg(case: Case) -> ModelConfig:
    # Llama, Qwen2, Qwen3, Gemma 2 and 3: 8 query heads sharing 4 KV heads (GQA), so t = 4 still splits KV heads.
    heads, kv = (4, None) if case.family == "gpt" else (8, 4)
    # Gemma 2: soft-caps that bite (weights at std 0.3: scores and logits of order one), scalar ≠ head_dim;
    # Gemma 3: a window and local RoPE base on layer 0, layer 1 global (its per-head (1 + w) q/k norms)
    gemma = {"gemma2": GEMMA2_CAPS, "gemma3": GEMMA3_LOCAL}.get(case.family, {})
    return ModelConfig(
        **gemma,
        family=case.family,
        n_layers=2,
        d_model=case.d_model,
        n_heads=heads,
        n_kv_heads=kv,
        vocab_size=case.vocab,
        seq_len=SEQ,
        tie_embeddings=case.tied,
        head_dim=case.head_dim,
    )


GEMMA2_CAPS = {"attn_softcap": 1.5, "final_softcap": 2.0, "query_pre_attn_scalar": 10.0, "init_std": 0.3}
GEMMA3_LOCAL = {
    "sliding_window": 3,  # narrower than SEQ: layer 0 attends within the band
    "sliding_window_pattern": 2,
    "rope_local_theta": 10.0,
    "query_pre_attn_scalar": 10.0,
    "init_std": 0.3,
}

LAYOUTS: dict[int, dict[str, Case]] = {
    2: {
        "gpt_tp1d_2": Case("gpt", 2),
        "llama_tp1d_2": Case("llama", 2),
        "gpt_tp1d_2_sp": Case("gpt", 2, sp=True),
        "llama_tp1d_2_sp": Case("llama", 2, sp=True),
        "gpt_tp1d_2_vocab257": Case("gpt", 2, vocab=257),
        "gpt_tp1d_2_sp_accumulate2": Case("gpt", 2, sp=True, micro=2),
        "llama_tp1d_2_sp_vocab257_untied": Case("llama", 2, sp=True, vocab=257, tied=False),
        "qwen2_tp1d_2_sp_vocab257_untied": Case("qwen2", 2, sp=True, vocab=257, tied=False),
        "qwen3_tp1d_2_sp_vocab257_untied": Case("qwen3", 2, sp=True, vocab=257, tied=False),
        # head_dim 6 ≠ 32 / 8 (Qwen3-0.6B's kind of shape): wq/wk/wv column shards and wo's row shard 48 wide
        "qwen3_hd6_tp1d_2_sp_vocab257_untied": Case("qwen3", 2, sp=True, vocab=257, tied=False, head_dim=6),
        "llama_hd6_tp1d_2_sp_overlap": Case("llama", 2, sp=True, overlap=True, head_dim=6),
        # d_model 31, odd (Qwen2 and Qwen3 take a head width free of it): 1D splits heads and the MLP, never the
        # residual stream (norms, embedding width), so t need not divide d_model
        "qwen3_d31_hd6_tp1d_2_sp_overlap_untied": Case(
            "qwen3", 2, sp=True, overlap=True, head_dim=6, d_model=31, tied=False
        ),
        "qwen2_d31_hd6_tp1d_2_vocab257": Case("qwen2", 2, vocab=257, head_dim=6, d_model=31),
        # Gemma 2: post-norms on the sequence shards (their gradients all-reduced), the final cap on vocabulary
        # shards, scaled embedding; tied, vocabulary 257 padded to 258
        "gemma2_hd6_tp1d_2_sp_vocab257": Case("gemma2", 2, sp=True, vocab=257, head_dim=6),
        "gemma2_tp1d_2_sp_overlap_untied": Case("gemma2", 2, sp=True, tied=False, overlap=True),
        # Gemma 3: Gemma 2's block plus per-head (1 + w) q/k norms (their gradients all-reduced), a local layer
        # with its window and RoPE base on the gathered sequence
        "gemma3_hd6_tp1d_2_sp_vocab257": Case("gemma3", 2, sp=True, vocab=257, head_dim=6),
        "gemma3_tp1d_2_sp_overlap_untied": Case("gemma3", 2, sp=True, tied=False, overlap=True),
        "gpt_tp1d_2_sp_overlap": Case("gpt", 2, sp=True, overlap=True),
        "gpt_tp1d_2_sp_overlap_accumulate2": Case("gpt", 2, sp=True, micro=2, overlap=True),
        "llama_tp1d_2_sp_overlap_vocab257_untied": Case(
            "llama", 2, sp=True, vocab=257, tied=False, overlap=True
        ),
        "gpt_tp1d_2_sp_overlap_lanes3": Case("gpt", 2, sp=True, overlap=True, lanes=3),
        "llama_tp1d_2_sp_overlap_vocab257_untied_lanes2": Case(
            "llama", 2, sp=True, vocab=257, tied=False, overlap=True, lanes=2
        ),
    },
    4: {
        "gpt_tp1d_4": Case("gpt", 4),
        "llama_tp1d_4": Case("llama", 4, tied=False),
        "gpt_tp1d_4_sp_vocab257": Case("gpt", 4, sp=True, vocab=257),
        "llama_tp1d_4_vocab257": Case("llama", 4, vocab=257),
        "gpt_dp2_tp1d_2": Case("gpt", 2, dp=2),
        "llama_dp2_tp1d_2_sp": Case("llama", 2, dp=2, sp=True),
        "qwen2_tp1d_4_vocab257": Case("qwen2", 4, vocab=257),
        # no SP: the q/k norm gradients still all-reduce (each rank normalises its own heads)
        "qwen3_tp1d_4_vocab257": Case("qwen3", 4, vocab=257),
        "qwen3_hd6_tp1d_4_vocab257": Case("qwen3", 4, vocab=257, head_dim=6),
        "qwen3_d30_hd6_tp1d_4_sp_vocab257": Case("qwen3", 4, sp=True, vocab=257, head_dim=6, d_model=30),
        "gemma2_tp1d_4_vocab257": Case("gemma2", 4, vocab=257),  # no SP: post-norms replicated whole
        "gemma3_tp1d_4_vocab257": Case("gemma3", 4, vocab=257),  # no SP: q/k norms on each rank's heads
        "gpt_tp1d_4_sp_overlap_vocab257": Case("gpt", 4, sp=True, vocab=257, overlap=True),
        "llama_tp1d_4_sp_overlap_untied": Case("llama", 4, sp=True, tied=False, overlap=True),
        "llama_dp2_tp1d_2_sp_overlap": Case("llama", 2, dp=2, sp=True, overlap=True),
        "gpt_tp1d_4_sp_overlap_vocab257_lanes3": Case("gpt", 4, sp=True, vocab=257, overlap=True, lanes=3),
        "llama_tp1d_4_sp_overlap_untied_lanes2": Case("llama", 4, sp=True, tied=False, overlap=True, lanes=2),
    },
}


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    tokens[0, :4] = vocab - 1  # the last word: lives in the last (padded) vocabulary shard
    return tokens[:, :-1], tokens[:, 1:]


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-30) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(floor)).item()


_GROUPS: dict[Layout, Groups] = {}


def _groups(layout: Layout) -> Groups:
    """One DeviceMesh per layout per process: creating process groups is the slow part of a case."""
    if layout not in _GROUPS:
        _GROUPS[layout] = build_groups(layout)
    return _GROUPS[layout]


Run = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""A case's loss and full parameter gradients on this rank."""


def _run_case(name: str, case: Case) -> tuple[list[str], Run]:
    """Errors of one case on this rank (empty when everything matches), and what it computed."""
    cfg = _model_cfg(case)
    tokens, targets = _batch(case.vocab)
    torch.manual_seed(SEED)
    ref = build_model(cfg)
    with SavedActivationCounter(ref) as ref_saved:
        ref_loss = ref(tokens, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    ref_norm = sum(g.pow(2).sum() for g in ref_grads.values())

    groups = _groups(Layout(dp=case.dp, tp=case.tp))
    torch.manual_seed(SEED)
    parallel = ParallelConfig(tensor=case.tp, sequence_parallel=case.sp, tp_comm_overlap=case.overlap)
    pmodel = apply_tensor_1d(build_model(cfg), groups, Config(parallel=parallel))
    sync = GradSync(pmodel.parameters(), groups.dp)
    d, rows = groups.coord(Axis.DATA), BATCH // case.dp
    mine = slice(d * rows, (d + 1) * rows)  # this data-parallel rank's rows of the batch

    comm.STATS.reset()
    loss, rows = torch.zeros(()), rows // case.micro
    lanes = forced_lanes(case.lanes) if case.lanes else nullcontext([])
    with mock.patch.object(comm, "ring_shift", wraps=comm.ring_shift) as ring_steps, lanes as lane_log:
        for m in range(case.micro):
            part = slice(mine.start + m * rows, mine.start + (m + 1) * rows)
            if m == case.micro - 1:
                sync.arm()  # the last micro-batch's backward makes the step's gradients final
            with SavedActivationCounter(pmodel) as saved:
                micro_loss = pmodel(tokens[part], targets[part]) / case.micro
            micro_loss.backward()
            loss += micro_loss.detach()
    tensor_stats = {k: (comm.STATS.calls[k], b) for k, b in comm.STATS.bytes.items() if k[1] == "tensor"}
    others = {g for (_, g) in comm.STATS.bytes if g not in ("tensor", "data")}
    sync.finish()
    comm.all_reduce(loss, groups.dp)
    loss /= case.dp

    errors = []
    expected = tensor_1d_comm(cfg, rows, SEQ, case.tp, case.sp)  # one micro-batch
    if tensor_stats != {(k, "tensor"): (c * case.micro, b * case.micro) for k, (c, b) in expected.items()}:
        errors.append(f"{name}: comm {tensor_stats} != formula {expected}")
    if others:
        errors.append(f"{name}: unexpected groups {others}")
    if ring_steps.call_count != _ring_steps(case, expected):
        errors.append(f"{name}: {ring_steps.call_count} ring steps, expected {_ring_steps(case, expected)}")
    if case.lanes and lanes_entered(lane_log) != set(range(min(case.lanes, case.tp))):
        errors.append(f"{name}: chunk GEMMs ran on lanes {lanes_entered(lane_log)} of {case.lanes}")
    if abs(loss.item() - ref_loss.item()) > LOSS_RTOL * abs(ref_loss.item()):
        errors.append(f"{name}: loss {loss.item()} != {ref_loss.item()}")
    grads = pmodel.full_parameters(grad=True)
    if set(grads) != set(ref_grads):
        errors.append(f"{name}: parameter names {set(grads) ^ set(ref_grads)}")
    floor = ZERO_GRAD * max(g.abs().max().item() for g in ref_grads.values())
    errors += [
        f"{name}: grad {n} rel err {_rel(grads[n], g, floor):.2e}"
        for n, g in ref_grads.items()
        if n in grads and _rel(grads[n], g, floor) > GRAD_TOL
    ]
    full = pmodel.full_parameters()
    errors += [
        f"{name}: weight {n} not restored"
        for n, p in ref.named_parameters()
        if n in full and (full[n] - p).abs().max().item() > EXACT
    ]
    norm = pmodel.grad_norm_sq()  # after the data-parallel average: the full batch's gradients
    if abs(norm.item() - ref_norm.item()) > NORM_RTOL * ref_norm.item():
        errors.append(f"{name}: grad_norm_sq {norm.item()} != {ref_norm.item()}")
    if case.sp and saved.bytes * case.tp * case.dp * case.micro > ref_saved.bytes * (1 + SP_MEMORY_SLACK):
        errors.append(f"{name}: saved {saved.bytes} B per rank, single device {ref_saved.bytes} B")
    if case.sp:
        try:
            pmodel(tokens[:, : SEQ - 1], targets[:, : SEQ - 1])
            errors.append(f"{name}: a sequence length not divisible by t was accepted with SP")
        except ValueError as e:
            if "sequence_parallel" not in str(e):
                errors.append(f"{name}: unclear error {e}")
    sync.remove()
    return errors, (loss, grads)


def _ring_steps(case: Case, expected: dict[str, tuple[int, int]]) -> int:
    """Ring steps the overlap takes: t − 1 per all-gather / reduce-scatter of the formula, except the token
    embedding's (a reduce-scatter forward, an all-gather backward per micro-batch: no GEMM to hide under)."""
    if not case.overlap:
        return 0
    collectives = sum(expected.get(kind, (0, 0))[0] for kind in ("all_gather", "reduce_scatter"))
    return (case.tp - 1) * (collectives - 2) * case.micro


def _worker(rank: int, world: int) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    runs: dict[Case, Run] = {}
    for name, case in LAYOUTS[world].items():
        errors[name], runs[case] = _run_case(name, case)
        one_lane = replace(case, lanes=0)
        if case.tp <= case.lanes:  # one chunk per lane: the one-lane sums' order
            errors[name] += (
                _differences(name, runs[case], runs[one_lane])
                if one_lane in runs
                else [f"{name}: no one-lane case before it to compare with"]
            )
    return errors


def _differences(name: str, run: Run, one_lane: Run) -> list[str]:
    """Where a forced-lane run differs at all from the one-lane run of the same case."""
    (loss, grads), (loss1, grads1) = run, one_lane
    errors = [] if torch.equal(loss, loss1) else [f"{name}: loss {loss.item()} != one lane's {loss1.item()}"]
    return errors + [
        f"{name}: grad {n} differs from one lane's" for n, g in grads.items() if not torch.equal(g, grads1[n])
    ]


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_matches_single_device(world: int) -> None:
    results = run_distributed(_worker, world, timeout=240)
    errors = sorted({e for r in results for errs in r.values() for e in errs})
    assert not errors, "\n".join(errors)


def test_formula_shape() -> None:
    """The formula's structure: SP trades each all-reduce of X for an all-gather plus a reduce-scatter of X, and
    re-gathers the saved shard in backward at each of the 2L + 1 region entries."""
    cfg = ModelConfig(family="llama", n_layers=3, d_model=16, n_heads=4, seq_len=8)
    plain = tensor_1d_comm(cfg, 2, 8, 4, False)
    sp = tensor_1d_comm(cfg, 2, 8, 4, True)
    x, n = 2 * 8 * 16 * 4, 2 * 8
    assert plain == {"all_reduce": (4 * 3 + 4, (4 * 3 + 2) * x + 3 * n * 4)}
    assert sp["reduce_scatter"] == (4 * 3 + 2, (4 * 3 + 2) * x)
    assert sp["all_gather"] == (6 * 3 + 3, (6 * 3 + 3) * x)
    assert sp["all_reduce"] == (2 + 2 * 3 + 1, 3 * n * 4 + (2 * 3 + 1) * 16 * 4)
    assert tensor_1d_comm(cfg, 2, 8, 1, True) == {}


def test_padded_vocab() -> None:
    assert [padded_vocab(257, t) for t in (1, 2, 4)] == [257, 258, 260]


def test_kv_heads_not_divisible_is_a_clear_error() -> None:
    cfg = ModelConfig(family="llama", d_model=32, n_heads=8, n_kv_heads=2, seq_len=SEQ)
    with pytest.raises(ConfigError, match=r"n_kv_heads = 2 is not divisible by tensor size 4"):
        check_tensor_1d(cfg, 4)
    check_tensor_1d(cfg, 2)  # divides everything: no error
