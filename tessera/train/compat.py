"""What a checkpoint must agree with to be resumed: the settings a resume cannot change without a silently
wrong run.

Each checkpoint records these settings (meta.json ``extra.settings``); resuming with any of them changed is
refused naming the key, the saved value and the new one, and the fix. The table of every setting and what a
resume does with it is docs/checkpoints.md ("What a resume may change").

- The model's shape and the tokenizer (``model.*``, ``data.tokenizer``, ``tokens.*``): the weights would load
  into the wrong places or not at all (a block dropped, heads reinterpreted) without an error. ``model.init_std``
  (used only before the first step) and ``model.size`` (a name for the other fields, compared one by one) may
  change. The optional shape fields (``n_kv_heads``, ``head_dim``, ``ffn_hidden``) are compared by the value
  the model uses: unset on one side and that value written out on the other is the same model.
- The data order's seed (``data.seed``, or ``train.seed`` when it is unset): the samples of the remaining steps
  and the validation windows would be those of another run, so the validation loss before and after the resume
  would measure different data, unless ``checkpoint.new_data_order`` says so (e.g. to step past the data around
  a loss spike). The same holds for the rule that places the windows (``data.window_start``): another rule draws
  other windows for the same sample indices, the validation windows included; and, with windows at document
  starts, for which documents may open one (``data.document_windows``: since every document does, a checkpoint
  of the earlier rule, where only those a whole window before the end did, records none and is taken to be of it).
- The held-out split (``data.valid_fraction``, the token file ``data.valid_path`` names, and with a fraction the
  files it holds the tails of): a larger fraction, other files or another validation file would hold out
  documents the run has trained on, or measure ``val_loss`` on other data than before the resume.
- The learning-rate schedule (``train.lr``, ``min_lr``, ``warmup_steps``, ``steps``), when the new values give
  a remaining step another learning rate than the saved ones and a trained step too (so the resumed run is
  neither the saved run continued nor the run the new settings make), unless ``checkpoint.new_schedule`` says
  so: it is a function of the step, so such a change makes it jump at the resume step (extending a finished
  cosine run lifts the learning rate from ``min_lr`` back towards the middle of the cosine). Megatron-LM's
  ``OptimizerParamScheduler`` refuses such changes the same way unless told to override them (its
  ``--override-opt_param-scheduler``). ``train.steps`` below the checkpoint's step is refused in any case: the
  run would train nothing and report success.
- The skipped steps (``train.skip_steps``) before the checkpoint's step: those steps were trained, or not, when
  the checkpoint was written, so a resume whose ranges say otherwise would record a run that never happened (and a
  rerun of its config would train other data). Ranges at or after the resume step are free: adding one when
  resuming from a checkpoint before a loss spike is what the key is for (docs/data.md). Compared as sets of steps
  (`tessera.train.skips.skipped_before`); a checkpoint that does not record the key skipped none.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tessera.config import Config
from tessera.config.sections import ModelConfig
from tessera.errors import CheckpointError
from tessera.train.data import DOCUMENT_WINDOWS
from tessera.train.schedule import SCHEDULE_KEYS, lr_at
from tessera.train.skips import skipped_before, steps_text

__all__ = ["check_compatible", "run_settings"]

_MAY_CHANGE = frozenset({"model.size", "model.init_std"})
_SCHEDULE = tuple(f"train.{k}" for k in SCHEDULE_KEYS)
_SKIPS = "train.skip_steps"  # compared by the steps before the checkpoint only (`_skips_rewritten`)
_WHAT = {  # what a recorded value stands for, where it is not the setting's own value
    "data.seed": "the data order's seed: data.seed, or train.seed when data.seed is unset",
    "data.document_windows": 'which documents open a window with data.window_start = "document"',
    "data.valid_path": "sha256 of the validation file's tokens",
    "data.valid_files": "sha256 of the tokens and the share of each data.path file that data.valid_fraction "
    "holds the last documents of",
}


def run_settings(
    cfg: Config,
    tokenizer: dict[str, Any] | None = None,
    *,
    valid_file: str | None = None,
    held_out_files: list[tuple[str | None, float]] | None = None,
) -> dict[str, Any]:
    """{"model.n_layers": 12, ..., "data.tokenizer": "byte", "tokens.tokenizer": ..., "tokens.vocab_size": ...,
    "data.seed": 1234, "data.valid_fraction": 0.0, "train.lr": ..., ...} as JSON values; ``tokenizer`` is what the
    token file says about the tokenizer that wrote it, ``valid_file`` the sha256 of data.valid_path's tokens and
    ``held_out_files`` (sha256, weight) of every training file when data.valid_fraction holds out their tails."""
    settings = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model).items()}
    settings["data.tokenizer"] = cfg.data.tokenizer
    settings |= {f"tokens.{k}": v for k, v in (tokenizer or {}).items()}
    settings["data.seed"] = cfg.data.seed if cfg.data.seed is not None else cfg.train.seed
    settings["data.window_start"] = cfg.data.window_start
    if cfg.data.window_start == "document":
        settings[_DOCUMENT_WINDOWS] = DOCUMENT_WINDOWS
    settings["data.valid_fraction"] = cfg.data.valid_fraction
    settings["data.valid_path"] = valid_file
    if held_out_files:
        total = sum(w for _, w in held_out_files)
        settings["data.valid_files"] = [[sha, round(w / total, 12)] for sha, w in held_out_files]
    settings |= {f"train.{k}": getattr(cfg.train, k) for k in SCHEDULE_KEYS}
    settings[_SKIPS] = cfg.train.skip_steps
    return json.loads(json.dumps(settings))  # as they come back from meta.json (tuples become lists)


_DOCUMENT_WINDOWS = "data.document_windows"
_EARLIER_DOCUMENT_WINDOWS = "documents starting a whole window before the end"
"""What a checkpoint with data.window_start = "document" that records no data.document_windows drew windows by."""
# what checkpoint.new_data_order lets change
_DATA_ORDER = frozenset({"data.seed", "data.window_start", _DOCUMENT_WINDOWS})
_NEW_RULE = (
    " (to draw the remaining steps' windows and the validation windows by the new rule on purpose: "
    "checkpoint.new_data_order = true)"
)
_OPT_IN = {  # what a user who means the change sets
    "data.seed": " (to draw the remaining steps' samples and the validation windows with the new seed on purpose: "
    "checkpoint.new_data_order = true)",
    "data.window_start": _NEW_RULE,
    _DOCUMENT_WINDOWS: _NEW_RULE,
}


def check_compatible(
    path: Path,
    saved: dict[str, Any] | None,
    now: dict[str, Any],
    step: int = 0,
    *,
    new_schedule: bool = False,
    new_data_order: bool = False,
) -> None:
    """Refuse to resume ``path`` at ``step`` when a recorded setting changed (the schedule's only where it changes
    a remaining step's learning rate, and not with ``new_schedule``; the data order's seed and window rule not
    with ``new_data_order``); checkpoints without settings pass, and a setting an older checkpoint does not record is
    not compared."""
    if not isinstance(saved, dict):
        return
    saved, now = _document_windows(_shape_resolved(saved)), _shape_resolved(now)
    may_change = _MAY_CHANGE | (_DATA_ORDER if new_data_order else set())
    changed = [
        _changed(k, saved[k], now[k])
        for k in sorted(now)
        if k in saved and saved[k] != now[k] and k not in may_change and k not in _SCHEDULE and k != _SKIPS
    ]
    rewritten = _skips_rewritten(saved, now, step)
    if rewritten:
        changed.append(rewritten)
    jump = None if new_schedule else _schedule_jump(saved, now, step)
    if jump:
        changed.append(jump)
    if now.get("train.steps", step) < step:  # the loop would run no step and report success
        changed.append(
            f"train.steps: {now['train.steps']} now, fewer than the checkpoint's {step} steps: nothing would be "
            "trained (to go back, name an earlier checkpoint with checkpoint.load_step)"
        )
    if changed:
        raise CheckpointError(
            f"checkpoint {path} was trained with other settings: {'; '.join(changed)}\n    fix: resume with "
            "the saved values (RUN_DIR/config.json holds them), or start a new run in a fresh run directory"
        )


def _shape_resolved(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with each optional model shape field that is unset (None) replaced by the value the model
    then uses, as `ModelConfig` decides it: a run resumed with ``head_dim = 128`` written out where the saved one
    left it to d_model / n_heads = 128 builds the same weights."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    given = {k.removeprefix("model."): v for k, v in settings.items() if k.startswith("model.")}
    if not {"d_model", "n_heads", "family"} <= given.keys():  # a checkpoint recording fewer settings
        return settings
    model = ModelConfig(**{k: v for k, v in given.items() if k in fields})
    used = {
        "model.n_kv_heads": model.kv_heads,
        "model.head_dim": model.head_size,
        "model.ffn_hidden": model.ffn,
    }
    return settings | {k: v for k, v in used.items() if k in settings and settings[k] is None}


def _document_windows(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` with the rule its windows at document starts were drawn by: a checkpoint that records windows at
    document starts but not which documents opened them was written before every document did, so the same
    sample index drew another start (only those a whole window before the end were counted)."""
    if saved.get("data.window_start") != "document" or _DOCUMENT_WINDOWS in saved:
        return saved
    return saved | {_DOCUMENT_WINDOWS: _EARLIER_DOCUMENT_WINDOWS}


def _skips_rewritten(saved: dict[str, Any], now: dict[str, Any], step: int) -> str | None:
    """What ``train.skip_steps`` now says about the steps before ``step`` where that differs from what the
    checkpoint's run skipped; None when it agrees (ranges at or after ``step`` may be added, removed or moved)."""
    if _SKIPS not in now:
        return None
    before = skipped_before(saved.get(_SKIPS) or [], step)  # older checkpoints: no tessera could skip then
    claimed = skipped_before(now[_SKIPS], step)
    if before == claimed:
        return None
    return (
        f"{_SKIPS}: the checkpoint's run skipped steps {steps_text(before)} of its steps 0-{step - 1}, the new value "
        f"says {steps_text(claimed)}; a resume cannot change what those steps trained on (to skip from the resume "
        f"step: ranges starting at {step} or later, with the earlier ones kept as they were; to skip earlier steps: "
        "resume from a checkpoint before them with checkpoint.load_step)"
    )


def _changed(key: str, saved: Any, now: Any) -> str:
    what = f" ({_WHAT[key]})" if key in _WHAT else ""
    opt_in = _OPT_IN.get(key, "")
    return f"{key}{what}: {saved!r} in the checkpoint, {now!r} now{opt_in}"


def _schedule_jump(saved: dict[str, Any], now: dict[str, Any], step: int) -> str | None:
    """The changed schedule settings and the first remaining step whose learning rate they change, or None when
    the resumed run is one of the two an expert expects: the saved run continued (every remaining step keeps its
    saved learning rate) or the run the new settings make from the start (every trained step had the new one:
    e.g. ``train.steps`` raised before the cosine began)."""
    if not all(k in saved for k in _SCHEDULE):
        return None
    keys = [k for k in _SCHEDULE if saved[k] != now[k]]
    if not keys:
        return None
    old = SimpleNamespace(**{k.split(".")[1]: saved[k] for k in _SCHEDULE})
    new = SimpleNamespace(**{k.split(".")[1]: now[k] for k in _SCHEDULE})
    jump = next((k for k in range(step, new.steps) if not _same(lr_at(k, old), lr_at(k, new))), None)
    if jump is None or all(_same(lr_at(k, old), lr_at(k, new)) for k in range(step)):
        return None
    changes = "; ".join(_changed(key, saved[key], now[key]) for key in keys)
    return (
        f"{changes}: the learning rate of step {jump} would be {lr_at(jump, new):.6g} where the saved schedule "
        f"gives {lr_at(jump, old):.6g}, and steps before {step} were trained with the saved one (the schedule is a "
        "function of the step, so it would jump; checkpoint.new_schedule = true takes the new one from the resume "
        "step)"
    )


def _same(a: float, b: float) -> bool:
    # equal but for rounding: other, equivalent settings give the same rate by another sum
    return math.isclose(a, b, rel_tol=1e-12)
