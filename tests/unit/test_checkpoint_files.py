"""The commit protocol without torch (tessera/train/checkpoint_files.py): re-saving a step that is already
published replaces it whole, as `tessera export` does when RUN/export/step_N exists."""

from __future__ import annotations

import json
from pathlib import Path

from tessera.train.checkpoint_files import (
    META,
    checkpoint_meta,
    commit,
    latest_checkpoint,
    remove_stale_tmp,
    step_dirs,
)


def _save(ckpt_dir: Path, step: int, files: dict[str, str], tag: str) -> Path:
    """Write ``files`` (and DCP's .metadata) into step ``step``'s tmp folder and commit it, as a save does."""
    final, tmp = step_dirs(ckpt_dir, step)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(ckpt_dir)
    tmp.mkdir()
    for name, text in {".metadata": tag, **files}.items():
        (tmp / name).write_text(text)
    commit(tmp, final, {"complete": True, "step": step, "tag": tag})
    return final


def test_resaving_a_published_step_replaces_it_whole(tmp_path: Path) -> None:
    first = _save(tmp_path, 2, {"a.distcp": "old", "only_in_first.distcp": "old"}, "first")
    second = _save(tmp_path, 2, {"a.distcp": "new"}, "second")
    assert second == first and latest_checkpoint(tmp_path) == second
    # the first's files are gone, not merged with the second's
    assert sorted(p.name for p in second.iterdir()) == [".metadata", "a.distcp", META]
    assert (second / "a.distcp").read_text() == "new" and checkpoint_meta(tmp_path)["tag"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", second.name]  # no tmp or .old left behind
    assert (tmp_path / "latest").read_text() == f"{second.name}\n"
    assert json.loads((second / META).read_text())["complete"] is True
