"""The example configs are valid at the world sizes they are written for (and say what is wrong at others)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WORLD = {"demo.toml": 2, "llama-8b-8gpu.toml": 8, "llama-70b-64gpu.toml": 64}


@pytest.mark.parametrize("name", sorted(WORLD))
def test_example_config_is_valid_at_its_world_size(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    assert cfg.check(WORLD[name]) == []
    assert cfg.check(WORLD[name] * 3) != []  # the checks do run: three times the ranks leaves a wrong layout


def test_large_examples_use_their_layouts() -> None:
    big = load_config(CONFIGS / "llama-70b-64gpu.toml")
    assert (big.parallel.tensor, big.parallel.schedule, big.parallel.pipeline) == ("2x2", "breadth_first", 8)
    assert big.model.n_layers == 80 and load_config(CONFIGS / "llama-8b-8gpu.toml").parallel.zero == 3
