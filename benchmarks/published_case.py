"""One validation case of `planner_published.py`: a published figure and the planner's prediction of it, in the
source's own unit. Each source's rows live in their own module (`published_*.py`), which returns `Case`s."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    group: str
    label: str
    published: float
    predicted: float
    unit: str

    @property
    def error(self) -> float:
        """predicted / published − 1 (positive: the planner is optimistic)."""
        return self.predicted / self.published - 1
