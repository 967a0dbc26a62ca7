"""What a resume may change (tessera/train/compat.py, docs/checkpoints.md "What a resume may change"): the data
order's seed, the held-out split and a schedule change that makes the learning rate jump are refused naming the
key, both values and the fix; a schedule change that leaves the run one of the two runs an expert expects is not.
Also where the decisions about checkpoints after the start step and the data position are made
(`set_aside_later`, `batch_indices`'s offset)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tessera.config import from_dict
from tessera.errors import CheckpointError
from tessera.train.checkpoint_files import latest_checkpoint, list_checkpoints, set_aside_later
from tessera.train.compat import check_compatible, run_settings
from tessera.train.data import DOCUMENT_WINDOWS, batch_indices

SCHEDULE = {"steps": 6, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1}
CKPT = Path("run/checkpoints/step_00000003")


def settings(train: dict[str, Any] | None = None, data: dict[str, Any] | None = None, **kw: Any) -> dict:
    raw = {"train": {**SCHEDULE, **(train or {})}, "data": data or {}}
    return run_settings(from_dict(raw), {"tokenizer": "byte", "vocab_size": 256}, **kw)


def refusal(saved: dict, now: dict, step: int = 3, **kw: Any) -> str:
    with pytest.raises(CheckpointError) as e:
        check_compatible(CKPT, saved, now, step, **kw)
    return str(e.value)


def test_the_data_orders_seed_is_refused_with_both_values_and_the_fix() -> None:
    """train.seed 1234 -> 7 on resume drew the remaining steps' samples and the validation windows of another run,
    so val_loss before and after the resume measured different data; it was accepted silently."""
    msg = refusal(settings(), settings({"seed": 7}))
    assert (
        "data.seed (the data order's seed: data.seed, or train.seed when data.seed is unset): 1234 in the "
        "checkpoint, 7 now" in msg
    )
    assert "fix: resume with the saved values" in msg
    assert "checkpoint.new_data_order = true" in msg
    # the order depends on the effective seed only: data.seed kept at the saved one, train.seed may change
    check_compatible(CKPT, settings(), settings({"seed": 7}, {"seed": 1234}), 3)
    # a new order asked for (e.g. past a loss spike) resumes; the opt-in covers the seed only
    check_compatible(CKPT, settings(), settings({"seed": 7}), 3, new_data_order=True)
    msg = refusal(settings(), settings({"seed": 7, "lr": 5e-3}), new_data_order=True)
    assert "train.lr" in msg and "data.seed" not in msg


def test_a_changed_window_rule_is_refused_unless_a_new_data_order_is_asked_for() -> None:
    """data.window_start "any" -> "document" on resume draws another window for every remaining sample index and
    for every validation window (the same reason a changed seed is refused); it was accepted silently."""
    doc = {"window_start": "document"}
    msg = refusal(settings(), settings(data=doc))
    assert "data.window_start: 'any' in the checkpoint, 'document' now" in msg
    assert "checkpoint.new_data_order = true" in msg
    check_compatible(CKPT, settings(data=doc), settings(data=doc), 3)
    check_compatible(CKPT, settings(), settings(data=doc), 3, new_data_order=True)
    # a checkpoint written before the rule was recorded drew its windows anywhere, and is not compared
    older = {k: v for k, v in settings().items() if k != "data.window_start"}
    check_compatible(CKPT, older, settings(data=doc), 3)


def test_a_checkpoint_of_the_earlier_document_windows_is_refused_unless_asked_for() -> None:
    """Windows at document starts used to open only at documents a whole window before the end; every document
    opens them now, so the same sample index draws another start. A checkpoint of the earlier rule records
    data.window_start = "document" and no data.document_windows: it resumed silently into another data order."""
    now = settings(data={"window_start": "document"})
    assert now["data.document_windows"] == DOCUMENT_WINDOWS
    earlier = {k: v for k, v in now.items() if k != "data.document_windows"}
    msg = refusal(earlier, now)
    assert (
        'data.document_windows (which documents open a window with data.window_start = "document"): \'documents '
        f"starting a whole window before the end' in the checkpoint, {DOCUMENT_WINDOWS!r} now" in msg
    )
    assert "checkpoint.new_data_order = true" in msg
    check_compatible(CKPT, earlier, now, 3, new_data_order=True)
    check_compatible(CKPT, now, now, 3)  # a checkpoint of this rule
    # windows anywhere record no document rule, and an earlier one of them resumes as before
    assert "data.document_windows" not in settings()
    check_compatible(CKPT, settings(), settings(), 3)
    msg = refusal(earlier, settings())  # document -> any: the rule itself changed
    assert "data.window_start: 'document' in the checkpoint, 'any' now" in msg


def test_a_changed_held_out_split_is_refused() -> None:
    """valid_fraction 0.05 -> 0.2 held out documents trained on before the resume, and moving from valid_path to a
    fraction measured val_loss on other data; both were accepted silently."""
    saved = settings(data={"valid_fraction": 0.05}, held_out_files=[("aa", 1.0)])
    msg = refusal(saved, settings(data={"valid_fraction": 0.2}, held_out_files=[("aa", 1.0)]))
    assert "data.valid_fraction: 0.05 in the checkpoint, 0.2 now" in msg
    # the same fraction of other files (or the same files in other shares) holds out other documents
    msg = refusal(saved, settings(data={"valid_fraction": 0.05}, held_out_files=[("bb", 1.0)]))
    assert "data.valid_files" in msg and "[['aa', 1.0]] in the checkpoint, [['bb', 1.0]] now" in msg
    # a separate validation file with other tokens
    msg = refusal(settings(valid_file="aa"), settings(valid_file="bb"))
    assert "data.valid_path (sha256 of the validation file's tokens): 'aa' in the checkpoint, 'bb' now" in msg
    # equal shares written differently are the same split
    two = [("aa", 1.0), ("bb", 0.5)]
    check_compatible(
        CKPT, settings(held_out_files=two), settings(held_out_files=[("aa", 2.0), ("bb", 1.0)]), 3
    )


def test_a_schedule_change_that_makes_the_lr_jump_is_refused_unless_asked_for() -> None:
    """train.lr halved at step 3 of a cosine run, or train.steps raised on a finished one, made the learning rate
    jump at the resume step (0.00186 -> 0.00614 measured for the finished run): accepted silently before."""
    msg = refusal(settings(), settings({"lr": 5e-3}))
    assert (
        "train.lr: 0.01 in the checkpoint, 0.005 now: the learning rate of step 3 would be 0.00361803 where "
        "the saved schedule gives 0.00689058" in msg
    )
    assert "checkpoint.new_schedule = true" in msg
    msg = refusal(settings(), settings({"steps": 12}), step=6)
    assert (
        "train.steps: 6 in the checkpoint, 12 now: the learning rate of step 6 would be 0.00614042 where "
        "the saved schedule gives 0.001" in msg
    )
    check_compatible(CKPT, settings(), settings({"steps": 12}), 6, new_schedule=True)


def test_a_schedule_change_that_leaves_an_expected_run_is_accepted() -> None:
    # the saved run continued: a constant learning rate extended
    constant = {"lr": 1e-3, "min_lr": 1e-3}
    check_compatible(CKPT, settings(constant), settings({**constant, "steps": 12}), 6)
    # the run the new settings make from the start: steps raised while still at the peak (warmup 1, step 1)
    check_compatible(CKPT, settings(), settings({"steps": 12}), 1)
    # a shorter run whose remaining steps keep their learning rates cannot exist, so: still at the peak
    check_compatible(CKPT, settings(), settings({"steps": 4}), 1)


def test_fewer_steps_than_the_checkpoint_is_refused_even_with_new_schedule() -> None:
    """train.steps 2 with a step-6 checkpoint trained nothing and exited 0."""
    msg = refusal(settings(), settings({"steps": 2}), step=6, new_schedule=True)
    assert "train.steps: 2 now, fewer than the checkpoint's 6 steps: nothing would be trained" in msg
    # a finished run started again: nothing to do, as before
    check_compatible(CKPT, settings(), settings(), 6)


def test_a_checkpoint_that_records_fewer_settings_is_compared_on_those_it_records() -> None:
    old = {k: v for k, v in settings().items() if k.startswith(("model.", "tokens.", "data.tokenizer"))}
    check_compatible(CKPT, old, settings({"seed": 7, "lr": 5e-3}, {"valid_fraction": 0.1}), 3)


def model_settings(**model: Any) -> dict:
    raw = {"model": {"family": "llama", "d_model": 64, "n_heads": 4, **model}, "train": SCHEDULE}
    return run_settings(from_dict(raw), {"tokenizer": "byte", "vocab_size": 256})


@pytest.mark.parametrize(
    ("key", "written"), [("head_dim", 16), ("n_kv_heads", 4), ("ffn_hidden", 192)], ids=lambda v: str(v)
)
def test_an_unset_shape_field_equals_the_value_it_stands_for(key: str, written: int) -> None:
    """A run saved with head_dim unset (d_model / n_heads = 16) and resumed with head_dim = 16 written out builds
    the same weights; it was refused as a changed model. Another value is still refused, by the value in use."""
    check_compatible(CKPT, model_settings(), model_settings(**{key: written}), 3)
    check_compatible(CKPT, model_settings(**{key: written}), model_settings(), 3)
    msg = refusal(model_settings(), model_settings(**{key: written * 2}))
    assert f"model.{key}: {written} in the checkpoint, {written * 2} now" in msg


def _folder(ckpt_dir: Path, step: int, complete: bool = True) -> None:
    path = ckpt_dir / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / "meta.json").write_text(json.dumps({"step": step, "complete": complete}))


def test_checkpoints_after_the_start_step_are_moved_aside(tmp_path: Path) -> None:
    """A run restarted at step 2 (load_step) left the replaced run's step 4 and 6 in place: pruning kept them over
    its own and the next resume took step 6 of the replaced run."""
    for step in (2, 4, 6):
        _folder(tmp_path, step)
    _folder(tmp_path, 8, complete=False)
    (tmp_path / "latest").write_text("step_00000006\n")
    aside = set_aside_later(tmp_path, 2, "T")
    assert aside == tmp_path / "superseded_T_from_step_00000002"
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000004", "step_00000006", "step_00000008"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert list_checkpoints(tmp_path) == ([tmp_path / "step_00000002"], [])
    assert (tmp_path / "latest").read_text() == "step_00000002\n"
    assert set_aside_later(tmp_path, 2, "U") is None  # nothing later: nothing moved, no folder made
    _folder(tmp_path, 3)  # restarted at step 2 again within the same second
    assert set_aside_later(tmp_path, 2, "T") == tmp_path / "superseded_T_2_from_step_00000002"
    # a run from scratch replaces every checkpoint, and `latest` names none of them any more
    assert set_aside_later(tmp_path, 0, "V") is not None
    assert latest_checkpoint(tmp_path) is None and not (tmp_path / "latest").exists()


def test_an_offset_moves_the_step_along_the_sample_stream() -> None:
    """The trainer's sample_offset after a resume that changed the global batch: step 3 of a batch-2 run resumed
    from a batch-4 checkpoint at sample 12 takes samples 12, 13 (without it, 6 and 7: trained at step 1)."""
    assert batch_indices(3, 2, 0, 1, 0, 2, offset=12 - 3 * 2) == [12, 13]
    assert batch_indices(3, 8, 1, 2, 1, 2, offset=12 - 3 * 8) == [18, 19]
    with pytest.raises(ValueError, match="precedes sample 0"):
        batch_indices(0, 8, 0, 1, 0, 8, offset=-4)
