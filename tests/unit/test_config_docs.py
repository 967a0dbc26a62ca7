"""`tessera --version`, `tessera config` and docs/config.md, all from the config dataclasses."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from tessera import __version__, config_docs
from tessera.cli import main
from tessera.config import Config, key_name
from tessera.errors import EXIT_OUTPUT_CLOSED

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


def test_a_closed_output_pipe_stops_quietly_not_as_a_lost_rank() -> None:
    """`tessera config | head`: the reader leaves before the command has written; the command exits as a Unix
    tool killed by SIGPIPE would (141), with nothing on stderr (it used to say it lost contact with a rank)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tessera", "config"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()  # before the first write: the print meets a pipe with no reader
    err = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=60) == EXIT_OUTPUT_CLOSED, err
    assert err == ""
