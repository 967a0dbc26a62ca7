"""The draws of the two correctness searches (benchmarks/layout_search.py, benchmarks/hf_search.py), without
training: focus entries joined by ``+`` draw accepted configs that have every named feature, the plain draw
still makes the choices of the seeds recorded in benchmarks/results/layout_search.jsonl (the gemma2 and
window_start features' extra draws included), hf_search's head_dim folders have heads other than hidden / heads
wide, and its gemma2 folders draw every Gemma 2 setting both ways."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tessera.config import from_dict
from tessera.execution import resolve, violations

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


layout_search = _load("layout_search")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("corpora")
    return layout_search.corpus(root), layout_search.masked_corpus(root), layout_search.short_corpus(root)


def test_focus_entries_join_features_with_plus() -> None:
    assert layout_search.parse_focus("qwen3, loss_mask+2d,head_dim+2d") == [
        "qwen3",
        "loss_mask+2d",
        "head_dim+2d",
    ]
    assert layout_search.focus_features("loss_mask+hybrid") == ["loss_mask", "hybrid"]
    assert layout_search.focus_features(None) == []
    with pytest.raises(ValueError, match=r"\['3d'\]"):
        layout_search.parse_focus("loss_mask+3d")


FOCUSES = [
    "head_dim",
    "head_dim+2d",
    "loss_mask+2d",
    "loss_mask+hybrid",
    "qwen3+2d",
    "gemma2+pp",
    "gemma2+sp",
    "gemma2+2d",
    "gemma2+zero3+loss_mask",
    "gemma2+window_start+hybrid",
    "window_start+loss_mask",
    "gemma3+pp",
    "gemma3+sp",
    "gemma3+2d",
    "gemma3+zero3+document_mask",
    "gemma3+hybrid+loss_mask",
    "op+tp1d",
    "op+sp+pp",
    "op+zero",
    "op+pp+zero",
]


@pytest.mark.parametrize("focus", FOCUSES)
def test_a_combined_focus_draws_accepted_configs_with_every_feature(
    focus: str, corpora: tuple[Path, Path, Path]
) -> None:
    tokens, masked, short = corpora
    rng, op = random.Random(7), random.Random("7-op")
    for _ in range(3):
        world, raw = layout_search.draw_case(rng, tokens, 1, focus, masked, short, op)
        cfg = from_dict(raw)
        assert not violations(cfg, world)
        plan = resolve(cfg, world)
        m = raw["model"]
        if "2d" in focus:
            assert plan.q == 2 and world == 4
        if "hybrid" in focus:
            assert plan.zero_replicas > 1
        if "loss_mask" in focus:
            assert raw["data"]["loss_mask"] and raw["data"]["path"] == str(masked)
        if "window_start" in focus:
            assert raw["data"]["window_start"] == "document" and raw["data"]["document_mask"]
            assert raw["data"]["path"] == str(masked if "loss_mask" in focus else short)
        if "gemma2" in focus:
            assert m["family"] == "gemma2"
        elif "gemma3" in focus:
            assert m["family"] == "gemma3"
            assert 2 <= m["sliding_window"] < m["seq_len"]
            assert 2 <= m["sliding_window_pattern"] <= m["n_layers"] + 1
            assert m["rope_local_theta"] != m.get("rope_theta", 10000.0)
        else:
            assert not {"query_pre_attn_scalar", "attn_softcap", "final_softcap"} & set(m)
            assert not {"sliding_window", "sliding_window_pattern", "rope_local_theta"} & set(m)
        if "document_mask" in focus:
            assert raw["data"]["document_mask"]
        if "pp" in focus.split("+"):
            assert plan.pp > 1
        if "sp" in focus.split("+"):
            assert plan.sequence_parallel and plan.tp > 1
        if "zero3" in focus:
            assert plan.zero == 3 and plan.dp > 1
        if "qwen3" in focus:
            assert m["family"] == "qwen3"
        if "op" in focus.split("+"):
            assert raw["parallel"]["checkpointing"] == plan.checkpointing == "op"
            assert plan.q == 1 and not plan.tp_comm_overlap  # where op runs
        if "tp1d" in focus:
            assert plan.tp > 1 and plan.q == 1
        if "zero" in focus.split("+"):
            assert plan.zero > 0 and plan.dp > 1
        if "head_dim" in focus:
            assert m["family"] != "gpt" and m["head_dim"] * m["n_heads"] != m["d_model"]
            assert layout_search.features(world, raw)["head_dim"] == m["head_dim"]


def test_gemma2_draws_every_setting_both_ways(corpora: tuple[Path, Path, Path]) -> None:
    """Caps on and off, the score scale at and other than head_dim, heads other than d_model / n_heads wide,
    tied and untied: each is drawn among 40 gemma2 cases."""
    rng = random.Random(1)
    models = [layout_search.draw_case(rng, corpora[0], 1, "gemma2")[1]["model"] for _ in range(40)]
    assert all(m["family"] == "gemma2" for m in models)
    for key in ("attn_softcap", "final_softcap"):
        assert {key in m for m in models} == {True, False}
        assert {m[key] for m in models if key in m} >= {
            0.02 if key == "attn_softcap" else 0.1
        }  # caps that bite
    widths = [m.get("head_dim") or m["d_model"] // m["n_heads"] for m in models]
    scalars = [m.get("query_pre_attn_scalar") for m in models]
    assert {s is None or s == w for s, w in zip(scalars, widths, strict=True)} == {True, False}
    assert any(layout_search._free_head_dim({"model": m}) for m in models)
    assert {m["tie_embeddings"] for m in models} == {True, False}


def test_gemma3_draws_every_setting_both_ways(corpora: tuple[Path, Path, Path]) -> None:
    """Windows from 2 to seq_len - 1, patterns from 2 (every other layer global) to n_layers + 1 (all local), a
    local RoPE base other than the global one either side of it, caps on and off (an attention cap never
    `ATTN_SOFTCAPS`' 0.02, which the q/k-normed scores saturate), head widths, ties: among 60 gemma3 cases."""
    rng = random.Random(2)
    models = [layout_search.draw_case(rng, corpora[0], 1, "gemma3")[1]["model"] for _ in range(60)]
    assert all(m["family"] == "gemma3" for m in models)
    assert {m["sliding_window"] for m in models} >= {2} and any(
        m["sliding_window"] == m["seq_len"] - 1 for m in models
    )
    patterns = [m["sliding_window_pattern"] for m in models]
    assert 2 in patterns and any(p == m["n_layers"] + 1 for p, m in zip(patterns, models, strict=True))
    bases = [(m.get("rope_theta", 10000.0), m["rope_local_theta"]) for m in models]
    assert {local < theta for theta, local in bases} == {True, False}
    assert {"attn_softcap" in m for m in models} == {True, False}
    assert {m["attn_softcap"] for m in models if "attn_softcap" in m} <= set(
        layout_search.GEMMA3_ATTN_SOFTCAPS
    )
    assert {"final_softcap" in m for m in models} == {True, False}
    assert any(layout_search._free_head_dim({"model": m}) for m in models)
    assert {m["tie_embeddings"] for m in models} == {True, False}


def test_short_corpus_windows_span_documents(corpora: tuple[Path, Path, Path]) -> None:
    """window_start's corpus: documents (each with its end-of-text token) mostly shorter than the drawn windows
    (8 to 16 tokens), so a window that starts at a document start holds document boundaries to mask."""
    texts = [json.loads(x)["text"] for x in (corpora[2].parent / "short.jsonl").read_text().splitlines()]
    lengths = [len(t.encode()) + 1 for t in texts]
    assert sum(n < 8 for n in lengths) > len(lengths) / 4
    assert sum(n < 16 for n in lengths) > 0.8 * len(lengths)


def test_an_impossible_combination_stops_with_a_message(
    corpora: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(layout_search, "MAX_DRAWS", 50)
    with pytest.raises(RuntimeError, match="w8\\+pp3"):  # w8 doubles only pipeline-1 2x2 draws
        layout_search.draw_case(random.Random(0), corpora[0], 1, "w8+pp3", corpora[1])


RECORDED = ((5, 1), (6, 2), (7, 3), (8, 5), (10, 5), (13, 8))
"""Recorded seeds and how many of their first cases to draw again: qwen3; loss_mask twice (hybrid_depth_first's
rejection sampling: slow); head_dim, head_dim+2d, loss_mask+2d; gemma2 with a pipeline, with 1D+SP, on 2x2, with
ZeRO-3 and the loss mask, with document windows and hybrid; gemma3's five; seed 13's zero3 ... ckpt_pp, w8 (its
checkpointing filter: an op draw must not change which draws ckpt_pp keeps)."""

RECORDED_WITH_OP = ((15, 2), (16, 2))
"""Seeds recorded with op checkpointing's own generator (after 115e11f), drawn again with it, checkpointing
included: op with 1D tensor and with SP (seed 15), breadth-first and a checkpointed pipeline (seed 16)."""


def _redraws(
    corpora: tuple[Path, Path, Path], op: bool, recorded: tuple[tuple[int, int], ...] = RECORDED
) -> list[tuple[str, tuple[int, dict], tuple[int, dict]]]:
    """Per case of ``recorded``: its label, (world, raw) drawn again by its seed's command (op checkpointing's own
    generator ``Random(f"{seed}-op")`` as `layout_search.search` makes it, if ``op``), and as recorded."""
    tokens, masked, short = corpora
    records = [
        json.loads(line)
        for line in (ROOT / "benchmarks/results/layout_search.jsonl").read_text().splitlines()
    ]
    out = []
    for seed, n in recorded:
        cases = [r for r in records if r["seed"] == seed][:n]
        args = cases[0]["command"].split()
        focus = layout_search.parse_focus(args[args.index("--focus") + 1])
        min_world = int(args[args.index("--min-world") + 1]) if "--min-world" in args else 1
        rng, op_rng = random.Random(seed), random.Random(f"{seed}-op") if op else None
        for r in cases:
            world, raw = layout_search.draw_case(
                rng, tokens, min_world, focus[r["case"] % len(focus)], masked, short, op_rng
            )
            raw["data"]["path"] = "<corpus>"
            out.append((f"seed {seed} case {r['case']}", (world, raw), (r["features"]["world"], r["raw"])))
    return out


def test_recorded_seeds_draw_their_cases_again(corpora: tuple[Path, Path, Path]) -> None:
    """Seeds 5 and 6 (drawn before model.head_dim existed): the plain and one-feature draws must make the same
    choices, so a recorded seed is rerun by its command (the head_dim draw is left out of them); seeds 7 (head_dim
    and combined entries), 8 (gemma2 and window_start combinations), 10 (gemma3 combinations) and 13 likewise."""
    for label, drawn, recorded in _redraws(corpora, op=False):
        assert drawn == recorded, label


def test_the_op_draw_changes_only_the_checkpointing_of_recorded_seeds(
    corpora: tuple[Path, Path, Path],
) -> None:
    """With op checkpointing drawn from its own generator (`tests.config_space.draw_op_checkpointing`), the
        recorded seeds' cases are drawn again but for their checkpointing, which is the recorded one or op in place of
        full or selective (never of none: the ckpt_pp focus keeps the same draws); some are op (6 of these 24 when
    written)."""
    ops = 0
    for label, (world, raw), (rec_world, rec_raw) in _redraws(corpora, op=True):
        drawn, recorded = raw["parallel"].pop("checkpointing"), rec_raw["parallel"].pop("checkpointing")
        assert (world, raw) == (rec_world, rec_raw), label
        assert drawn == recorded or (drawn == "op" and recorded in ("full", "selective")), label
        ops += drawn == "op"
    assert ops > 0


def test_seeds_recorded_with_the_op_generator_draw_their_cases_again(
    corpora: tuple[Path, Path, Path],
) -> None:
    for label, drawn, recorded in _redraws(corpora, op=True, recorded=RECORDED_WITH_OP):
        assert drawn == recorded, label


def test_op_is_drawn_only_where_it_runs_and_in_place_of_checkpointing() -> None:
    """Over 2000 draws of the config space with and without the op generator: the same choices but for
    checkpointing; op replaces only full or selective, never on the 2D grid nor with the tensor rings (the
    rule `checkpointing.op` never fires on a draw), and a fair share of the draws that could take it do."""
    from tests.config_space import RandomPick, draw_run_config, op_runs

    could = ops = 0
    for seed in range(2000):
        _, plain = draw_run_config(RandomPick(random.Random(seed)))
        world, raw = draw_run_config(
            RandomPick(random.Random(seed)), op=RandomPick(random.Random(f"{seed}-op"))
        )
        before, after = plain["parallel"].pop("checkpointing"), raw["parallel"].pop("checkpointing")
        assert raw == plain
        raw["parallel"]["checkpointing"] = after
        could += before != "none" and op_runs(raw["parallel"])
        if after != before:
            assert after == "op" and before in ("full", "selective") and op_runs(raw["parallel"])
            ops += 1
            rules = {v.rule for v in violations(from_dict(raw), world)}
            assert "checkpointing.op" not in rules
    assert 0.25 < ops / could < 0.42, (
        ops,
        could,
    )  # a third of them (binomial, n ~ 10^3: 0.33 +- 0.045 at 3 sd)


def test_hf_search_head_dim_folders_have_their_own_head_width() -> None:
    pytest.importorskip("transformers")
    hf_search = _load("hf_search")
    rng = random.Random(0)
    cases = [hf_search.hf_head_dim_case(rng) for _ in range(200)]
    assert {c["kind"] for c in cases} == set(hf_search.HEAD_DIM_KINDS)
    assert all(hf_search.free_head_dim(c) for c in cases)
    absent = [c for c in cases if "head_dim" not in c]
    assert absent and all(c["kind"] == "qwen3" for c in absent)  # transformers reads Qwen3Config's 128
    assert all(
        c["num_attention_heads"] * c.get("head_dim", 128) <= 1024 for c in cases
    )  # tiny: q ≤ 128 × 1024
    plain = hf_search.hf_case(random.Random(0))
    assert not hf_search.free_head_dim({**plain, "kind": "gpt2"})


def test_hf_search_gemma2_folders_draw_every_setting() -> None:
    pytest.importorskip("transformers")
    hf_search = _load("hf_search")
    rng = random.Random(0)
    cases = [hf_search.hf_gemma2_case(rng) for _ in range(200)]
    assert {c["kind"] for c in cases} == {"gemma2"}
    assert all(c["pad_token_id"] is None and "llama3" not in c for c in cases)
    assert {c["attn_logit_softcapping"] for c in cases} == set(hf_search.GEMMA2_ATTN_CAPS)
    assert {c["final_logit_softcapping"] for c in cases} == set(hf_search.GEMMA2_FINAL_CAPS)
    assert {c["query_pre_attn_scalar"] == c["head_dim"] for c in cases} == {True, False}
    assert {hf_search.free_head_dim(c) for c in cases} == {True, False}
    assert {c["tie_word_embeddings"] for c in cases} == {True, False}
    assert {c["sliding_window"] >= c["max_position_embeddings"] for c in cases} == {True, False}
    kinds = {tuple(sorted(set(c["layer_types"]))) if "layer_types" in c else None for c in cases}
    assert kinds == {
        None,
        ("full_attention",),
        ("sliding_attention",),
        ("full_attention", "sliding_attention"),
    }
    assert all(
        len(c.get("layer_types", [0] * c["num_hidden_layers"])) == c["num_hidden_layers"] for c in cases
    )
    # the explicit [model] keys and the spread's features: Gemma 2's only for Gemma 2 folders
    names = [k for k, _ in hf_search.explicit_keys(cases[0])]
    assert "query_pre_attn_scalar" in names
    plain = hf_search.hf_case(random.Random(0))
    assert not {"query_pre_attn_scalar", "attn_softcap"} & {k for k, _ in hf_search.explicit_keys(plain)}


def test_hf_search_gemma3_folders_draw_every_setting() -> None:
    pytest.importorskip("transformers")
    hf_search = _load("hf_search")
    rng = random.Random(0)
    cases = [hf_search.hf_gemma3_case(rng) for _ in range(200)]
    assert {c["kind"] for c in cases} == {"gemma3"}
    assert {c["sliding_window"] < c["max_position_embeddings"] for c in cases} == {True, False}
    assert {c["rope_local"] == c["rope_theta"] for c in cases} == {True, False}
    assert {c["query_pre_attn_scalar"] == c["head_dim"] for c in cases} == {True, False}
    assert {hf_search.free_head_dim(c) for c in cases} == {True, False}
    assert {c["tie_word_embeddings"] for c in cases} == {True, False}
    assert {c["attn_logit_softcapping"] is None for c in cases} == {True, False}
    assert {"layer_types" in c for c in cases} == {True, False}
    unpatterned = [c for c in cases if hf_search.gemma3_unpatterned(c)]
    assert unpatterned and all(c["num_hidden_layers"] >= 2 for c in unpatterned)
    patterns = {tuple(c["layer_types"]) for c in cases if "layer_types" in c and c not in unpatterned}
    assert ("sliding_attention", "full_attention") in patterns  # pattern 2
    assert any(set(t) == {"sliding_attention"} for t in patterns)  # pattern layers + 1
    # rope_parameters per layer type; Gemma 3's explicit [model] keys only for its folders
    kw = hf_search.hf_kwargs(cases[0])
    assert set(kw["rope_parameters"]) == {"full_attention", "sliding_attention"} and "rope_local" not in kw
    names = {k for k, _ in hf_search.explicit_keys(cases[0])}
    assert {"sliding_window", "rope_local_theta"} <= names
    assert not {"sliding_window", "rope_local_theta"} & {
        k for k, _ in hf_search.explicit_keys(hf_search.hf_gemma2_case(random.Random(0)))
    }
