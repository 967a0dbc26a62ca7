"""`tessera compare` as a user runs it: one gradient of B 1% off (``--scale-grad``) on a dp2 ZeRO-3 layout must
exit 1 with that tensor named in the table and the verdict, and no other tensor's gradient may diverge (the
layouts' parity itself: test_parity.py)."""

from __future__ import annotations

import re
from pathlib import Path

from tessera.cli import main
from tessera.config import as_overrides
from tests.distributed.test_parity import _raw

WRONG = "blocks.0.mlp.w_up.weight"


def test_command_exits_1_naming_a_wrong_gradient(token_file: Path, tmp_path: Path, capsys) -> None:
    raw = _raw(token_file, tmp_path / "run", {})
    config = tmp_path / "a.toml"
    config.write_text("")  # everything as overrides, as a user may pass them
    argv = ["compare", str(config), *as_overrides(raw), "--nproc-b", "2", "--b.parallel.data=2"]
    code = main([*argv, "--b.parallel.zero=3", "--scale-grad", f"{WRONG}=1.01"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(rf"grad\s+{re.escape(WRONG)}\s.*DIVERGED", out), out
    assert WRONG in out.strip().splitlines()[-1], out  # the verdict names it
    diverged = [line for line in out.splitlines() if "DIVERGED" in line and " grad " in line]
    assert diverged and all(WRONG in line for line in diverged), out
