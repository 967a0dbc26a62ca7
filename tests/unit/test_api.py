"""The Python API: `tessera.load_config`, `tessera.train` with a step hook, lazily exported by `tessera`."""

from __future__ import annotations

import subprocess
import sys

import tessera


def test_import_tessera_is_light_and_config_needs_no_torch() -> None:
    code = (
        "import sys, tessera; cfg = tessera.load_config(None, ['train.steps=3']); "
        "assert cfg.train.steps == 3 and isinstance(cfg, tessera.Config); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_train_is_callable_however_it_was_reached() -> None:
    import tessera.train.data  # binds the attribute tessera.train to the package
    from tessera.train.trainer import train

    assert callable(sys.modules["tessera.train"]) and callable(tessera.train)
    assert set(tessera.__all__) <= set(dir(tessera))
    assert tessera.StepHook is not None and tessera.TrainResult.__name__ == "TrainResult"
    assert train.__module__ == "tessera.train.trainer"


def test_train_with_a_step_hook(tmp_path) -> None:
    (tmp_path / "c.txt").write_text("a small corpus of words and more words. " * 200)
    from tessera.train.data import prepare

    prepare([tmp_path / "c.txt"], tmp_path / "t.bin")
    cfg = tessera.load_config(
        None,
        [
            "model.size=gpt2-tiny",
            "model.seq_len=16",
            "train.steps=2",
            "train.global_batch=2",
            "train.micro_batch=2",
            f"data.path={str(tmp_path / 't.bin')!r}",
            f"log.run_dir={str(tmp_path / 'run')!r}",
            "log.progress=false",
            "log.tensorboard=false",
        ],
    )
    seen: list[tuple[int, float]] = []

    def hook(step: int, model) -> None:  # sees the gradients before the update
        seen.append((step, sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)))

    result = tessera.train(cfg, hook)
    assert [s for s, _ in seen] == [0, 1] and all(norm > 0 for _, norm in seen)
    assert sorted(result.losses) == [0, 1] and len(tessera.read_metrics(tmp_path / "run")) == 2
