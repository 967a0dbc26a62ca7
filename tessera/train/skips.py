"""``train.skip_steps``: the steps whose global batches are passed over, not trained on (loss-spike recovery).

A range ``[start, end]`` names steps by their number in metrics.jsonl, both ends included. A skipped step is still
a step: its global batch (samples ``[o + k·B, o + (k+1)·B)``, `tessera.train.data.batch_indices`) is passed over
because the next step draws the samples after it, and the learning rate, a function of the step, moves on
(`tessera.train.schedule.lr_at`); only the forward, backward and optimizer update are not run. So which samples a
step trains on, and at which learning rate, does not depend on where a run was resumed or at which layout.

No torch: the config checks and the resume check (tessera/train/compat.py) use these too.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["is_skipped", "skipped_before", "steps_text"]


def is_skipped(step: int, ranges: Sequence[Sequence[int]]) -> bool:
    """Whether ``step`` lies in one of the ``[start, end]`` ranges (ends included)."""
    return any(start <= step <= end for start, end in ranges)


def skipped_before(ranges: Sequence[Sequence[int]], step: int) -> list[list[int]]:
    """The steps before ``step`` that ``ranges`` skip, as sorted ``[start, end]`` ranges with touching ones merged:
    what a checkpoint of ``step`` was trained without. Two spellings of the same steps (``[[1, 2], [3, 4]]`` and
    ``[[1, 4]]``) give the same list, so a resume compares steps, not spellings."""
    merged: list[list[int]] = []
    for start, end in sorted((int(s), min(int(e), step - 1)) for s, e in ranges if s < step):
        if merged and start <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def steps_text(ranges: Sequence[Sequence[int]]) -> str:
    """``"2-3, 7"``: the ranges as a reader writes them; ``"none"`` when empty."""
    parts = [f"{s}" if s == e else f"{s}-{e}" for s, e in ranges]
    return ", ".join(parts) or "none"
