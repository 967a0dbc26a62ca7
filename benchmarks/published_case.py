"""One validation case of `planner_published.py`: a published figure and the planner's prediction of it, in the
source's own unit. Each source's rows live in their own module (`published_*.py`), which returns `Case`s."""

from __future__ import annotations

import statistics
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


def summary(cases: list[Case]) -> str:
    """ "n cases, median |error| x, worst y" over `cases`."""
    errors = [abs(c.error) for c in cases]
    return f"{len(errors)} cases, median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}"


def group_table(cases: list[Case]) -> list[str]:
    """Markdown table of each group's case count, median and worst |error|, groups in their first case's order."""
    lines = ["| group | cases | median abs. error | worst |", "|---|---|---|---|"]
    for group in dict.fromkeys(c.group for c in cases):
        errors = [abs(c.error) for c in cases if c.group == group]
        lines.append(f"| {group} | {len(errors)} | {statistics.median(errors):.1%} | {max(errors):.1%} |")
    return lines


def case_table(cases: list[Case], decimals: int = 1) -> list[str]:
    """Markdown table of every case: group, label, published, predicted (`decimals` places), unit, error."""
    lines = ["| group | case | published | predicted | unit | error |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {c.group} | {c.label} | {c.published:,.{decimals}f} | {c.predicted:,.{decimals}f} | {c.unit} | "
        f"{c.error:+.1%} |"
        for c in cases
    ]
    return lines
