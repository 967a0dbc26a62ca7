"""Pipeline simulator on the lowered schedule IR, plus text and image renderings.

Pure Python (matplotlib is imported only when a picture is written); never imports torch.distributed.
"""

from __future__ import annotations

from tessera.sim.render import KIND_COLORS, render_image, render_text, show_schedule
from tessera.sim.simulator import CostTable, SimResult, TimelineEntry, simulate

__all__ = [
    "KIND_COLORS",
    "CostTable",
    "SimResult",
    "TimelineEntry",
    "render_image",
    "render_text",
    "show_schedule",
    "simulate",
]
