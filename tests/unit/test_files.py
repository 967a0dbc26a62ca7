"""Files tessera writes whole (token files, pictures) get the permissions of any new file: 0o666 less the umask,
not the private 0o600 of a `tempfile.mkstemp` file, so a team's shared data folder stays readable."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.files import temp_beside
from tessera.train.data import prepare


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_prepared_token_file_is_as_readable_as_any_new_file(tmp_path: Path, umask: int) -> None:
    (tmp_path / "a.txt").write_text("hello world\n" * 10)
    out = tmp_path / "shared" / "tokens.bin"
    prepare([tmp_path / "a.txt"], out)
    assert _mode(out) == 0o666 & ~umask
    assert _mode(out.with_suffix(".json")) == 0o666 & ~umask
    assert sorted(p.name for p in out.parent.iterdir()) == ["tokens.bin", "tokens.json"]  # no temp file left


def test_a_picture_is_as_readable_as_any_new_file(tmp_path: Path, umask: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tessera.figures import save_figure

    fig, _ = plt.subplots()
    out = save_figure(fig, tmp_path / "loss.png", "png")
    plt.close(fig)
    assert _mode(out) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]


def test_temp_files_beside_the_same_output_are_distinct(tmp_path: Path) -> None:
    made = [temp_beside(tmp_path / "x.bin") for _ in range(50)]
    for fd, _ in made:
        os.close(fd)
    assert len({path for _, path in made}) == 50
    assert all(path.parent == tmp_path and path.name.startswith(".x.bin.") for _, path in made)
