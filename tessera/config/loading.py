"""Reading a config: a TOML file, then dotted command-line overrides, then the sections, with every unknown
section, unknown key, wrongly typed or oversized value reported at once; `model.size` and `model.init` fill in
the model's shape."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from tessera.config.sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    key_name,
)
from tessera.errors import ConfigError
from tessera.model.sizes import SIZES

__all__ = ["apply_overrides", "as_overrides", "from_dict", "load_config", "toml_value"]

# --- loading -------------------------------------------------------------------------------------------------

_SECTION_TYPES = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a TOML file (or the defaults), apply dotted overrides like ``train.lr=3e-4``, resolve model.size."""
    raw = _read_toml(Path(path)) if path is not None else {}
    apply_overrides(raw, overrides or [])
    return from_dict(raw)


def _read_toml(p: Path) -> dict[str, Any]:
    name = f"{str(p)[:80]!r}" + ("..." if len(str(p)) > 80 else "")
    try:
        data = p.read_bytes()
    except (OSError, ValueError) as e:  # missing, a directory, a name too long, a NUL byte
        reason = (
            "does not exist"
            if isinstance(e, FileNotFoundError)
            else f"cannot be read ({e.__class__.__name__})"
        )
        raise ConfigError(
            f"config file {name} {reason}; pass a TOML file such as configs/demo.toml"
        ) from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {name} is not UTF-8 text (byte {e.start}: {data[e.start : e.start + 1]!r}); "
            "TOML files must be UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {name} is not valid TOML: {e}") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> None:
    """Apply ``section.key=value`` overrides in place; values parse as TOML (3e-4, true, "2x2", [1,2]) or text,
    and ``null`` unsets an optional key (TOML has no null): e.g. ``model.final_softcap=null`` removes the soft-cap
    a ``model.size`` sets; a key that cannot be unset is then reported with its type."""
    for item in overrides:
        key, sep, text = item.lstrip("-").partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.lr=3e-4")
        section, name = key.split(".", 1)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {item[:80]!r}: [{section}] in the config file is not a table")
        table[name] = _parse_value(text)


def as_overrides(raw: dict[str, Any]) -> list[str]:
    """``raw``'s values as command-line overrides (``--train.lr=0.0003``), the inverse of `apply_overrides`:
    what a script passes to ``tessera train`` to run a config it built as dicts. None is written ``null``, which
    unsets the key, so a None that clears what a ``model.size`` sets (e.g. ``final_softcap``) reaches the run too
    (left out, the size's value would come back)."""
    return [
        f"--{section}.{key}={'null' if value is None else toml_value(value)}"
        for section, values in raw.items()
        for key, value in values.items()
    ]


def toml_value(value: Any) -> str:
    """``value`` (a bool, number, string, list or table) as TOML text, e.g. for a key of a written config."""
    if isinstance(value, bool):  # before int: bool is an int
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (same quotes and escapes)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return str(value)  # int, float (inf and nan are TOML's spellings too)


def _toml_key(key: str) -> str:
    """A table key: bare when TOML allows it (letters, digits, _ and -), else a quoted string."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _parse_value(text: str) -> Any:
    if text == "null":  # unset: no string key takes the word (e.g. checkpointing's "none" is spelled out)
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections and keys with the valid names."""
    unknown = set(raw) - set(_SECTION_TYPES)
    problems: list[str] = [
        f"unknown section [{s}]; valid sections: {', '.join(_SECTION_TYPES)}" for s in unknown
    ]
    sections: dict[str, Any] = {}
    for name, cls in _SECTION_TYPES.items():
        section = raw.get(name, {})
        if not isinstance(section, dict):
            problems.append(f"[{name}] must be a table of keys, got {name} = {section!r:.60}")
            section = {}
        values = dict(section)
        if name == "model":
            values = _resolve_init(_resolve_size(values, problems), problems)
        names = {key_name(f.name): f.name for f in dataclasses.fields(cls)}  # key -> field
        valid = set(names)
        for key in sorted(set(values) - valid):
            close = [k for k in valid if k.startswith(key[:3])]
            problems.append(
                f"unknown key {name}.{key}"
                + (
                    f"; did you mean {' or '.join(close)}?"
                    if close
                    else f"; valid keys: {', '.join(sorted(valid))}"
                )
            )
            values.pop(key)
        fields = {key_name(f.name): f.type for f in dataclasses.fields(cls)}
        for key, value in list(values.items()):
            if key in fields and not _type_ok(value, str(fields[key])):
                problems.append(f"{name}.{key} = {value!r:.60} should be of type {fields[key]}")
                values.pop(key)
            elif _too_big(value):
                problems.append(f"{name}.{key} = {value!r:.60} is outside TOML's 64-bit integer range")
                values.pop(key)
        sections[name] = cls(**{names[k]: v for k, v in values.items()})
    if problems:
        raise ConfigError("configuration problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return Config(**sections)


_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool, "None": type(None)}


def _type_ok(value: Any, annotation: str) -> bool:
    """Check a TOML value against a field annotation such as ``int | None`` or ``list[int] | None``."""
    for option in annotation.replace(" ", "").split("|"):
        if option.startswith("dict[") and isinstance(value, dict):
            return True  # a table: its keys are the section's check (e.g. model.rope_scaling)
        if option.startswith("list[") and isinstance(value, list):
            inner = _TYPES.get(option[5:-1], object)
            if all(isinstance(x, inner) and not isinstance(x, bool) for x in value):
                return True
        elif (
            option in _TYPES
            and isinstance(value, _TYPES[option])
            and (option == "bool" or not isinstance(value, bool))
        ):
            return True
    return False


def _too_big(value: Any) -> bool:
    """An integer TOML could not hold (tomllib accepts any size): it would overflow float() and torch."""
    items = value if isinstance(value, list) else [value]
    return any(isinstance(x, int) and not -(2**63) <= x < 2**63 for x in items)


def _resolve_size(values: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    size = values.get("size")
    if size is None:
        return values
    if not isinstance(size, str) or size not in SIZES:
        problems.append(f"unknown model.size {size!r:.60}; known sizes: {', '.join(SIZES)}")
        return {k: v for k, v in values.items() if k != "size"}
    return {**copy.deepcopy(SIZES[size]), **values}  # a copy: the run's tables are its own


def _resolve_init(values: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """Fill the model's shape from ``model.init = "hf:DIR"``; explicit keys that contradict it are problems."""
    init = values.get("init")
    if not isinstance(init, str):
        return values
    if values.get("size") is not None:
        problems.append("model.size and model.init both give the model's shape; set only one of them")
        return values
    from tessera.hf.config import derive_model  # torch-free

    derived, found = derive_model(init, values)
    problems.extend(found)
    return {**derived, **values}
