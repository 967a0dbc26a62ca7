"""`tessera --version`, `tessera config` and docs/config.md, all from the config dataclasses."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tessera import __version__, config_docs
from tessera.cli import main
from tessera.config import Config, key_name

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_config_md_is_generated_from_the_code() -> None:
    assert DOC.read_text() == config_docs.markdown() + "\n", (
        "docs/config.md is stale: run `tessera config --markdown > docs/config.md`"
    )


def test_every_key_is_listed_with_type_default_and_doc() -> None:
    listed = {(s.name, k.name): k for s in config_docs.sections() for k in s.keys}
    expected = {
        (f.name, key_name(g.name))  # the key: a field named after a Python keyword drops its "_"
        for f in dataclasses.fields(Config)
        for g in dataclasses.fields(f.default_factory)
    }
    assert set(listed) == expected
    assert all(k.doc and k.type and k.default for k in listed.values()), [
        n for n, k in listed.items() if not k.doc
    ]
    lr = listed[("train", "lr")]
    assert (lr.type, lr.default, lr.doc) == ("float", "0.0003", "Peak learning rate.")
    assert listed[("data", "path")].default == "unset" and listed[("log", "progress")].default == "true"


def test_cli_version_and_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"tessera {__version__}"
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert (
        "[train]  Optimisation" in out and "  eval_every: int = 0\n" in out and "Peak learning rate." in out
    )
