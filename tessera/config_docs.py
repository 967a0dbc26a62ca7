"""The configuration reference, read from the dataclasses themselves: `tessera config` and docs/config.md.

A field's documentation is the string literal under it in tessera/config/sections.py (an attribute docstring,
which Python does not keep at run time), so the source is parsed with `ast`. One function renders text for the
terminal and another Markdown; a test keeps docs/config.md equal to `markdown()`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
from dataclasses import dataclass

from tessera import config as _config
from tessera.config import key_name

__all__ = ["Key", "Section", "markdown", "sections", "text"]


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    type: str
    default: str
    doc: str


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    doc: str
    keys: tuple[Key, ...]


def _field_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal right after its annotated assignment} of a class."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and is_doc:
            docs[stmt.target.id] = inspect.cleandoc(str(nxt.value.value))  # type: ignore[attr-defined]
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def sections() -> list[Section]:
    """Every section of `tessera.config.Config` with every key: type, default and documentation."""
    out = []
    for section in dataclasses.fields(_config.Config):
        name, cls = section.name, section.default_factory  # e.g. "train", TrainConfig
        docs = _field_docs(cls)
        keys = tuple(
            Key(key_name(f.name), str(f.type), _default(f), docs.get(f.name, ""))
            for f in dataclasses.fields(cls)
        )
        out.append(Section(name, inspect.cleandoc(cls.__doc__ or ""), keys))
    return out


def text() -> str:
    """The reference for a terminal: ``[section]`` then ``key: type = default`` and the indented doc."""
    lines = []
    for s in sections():
        lines += [f"[{s.name}]  {s.doc}"]
        for k in s.keys:
            lines.append(f"  {k.name}: {k.type} = {k.default}")
            lines += [f"      {line}" for line in k.doc.splitlines()]
        lines.append("")
    return "\n".join(lines)


def markdown() -> str:
    """docs/config.md: one table per section."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the dataclasses in `tessera/config/sections.py` by",
        "`tessera config --markdown > docs/config.md`; `tests/unit/test_config_docs.py` fails when this file and",
        "the code disagree. Set keys in a TOML file (`[train]` then `lr = 3e-4`) or on the command line",
        "(`--train.lr=3e-4`); `tessera validate CONFIG --world-size N` lists every problem at once. TOML has no",
        "null: `--model.final_softcap=null` on the command line unsets an optional key (one a `size` fills in).",
        "",
    ]
    for s in sections():
        out += [f"## [{s.name}]", "", s.doc, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in s.keys:
            doc = " ".join(k.doc.split()).replace("|", "\\|")
            kind = k.type.replace("|", "\\|")  # a bare | would end the table cell
            out.append(f"| `{k.name}` | `{kind}` | `{k.default}` | {doc} |")
        out.append("")
    return "\n".join(out)
