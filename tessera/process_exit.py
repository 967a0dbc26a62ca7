"""A command's process ends without the interpreter's final garbage collections over everything it imported.

With torch imported, CPython's teardown collections cost about 1 s of CPU per process, after the command's work
was done. One full collection at the start of the teardown finalizes the garbage that exists then, as the
first of those collections would; freezing the survivors (`gc.freeze`) lets the later ones skip them. Exit
handlers, the joining of threads and the release of every module's objects by reference counting are unchanged;
only a reference cycle that becomes garbage during the teardown is left to the operating system. Why that loses
nothing tessera relies on, and the figures: docs/launching.md, "How a command ends".
"""

from __future__ import annotations

import atexit
import gc

__all__ = ["finish_quickly_at_exit"]


def _collect_then_freeze() -> None:
    gc.collect()
    gc.freeze()


def finish_quickly_at_exit() -> None:
    """Register the collect-then-freeze exit handler. Call it first thing in a command: exit handlers run last
    registered first, so every handler registered while the command runs (torch's, a writer's) runs before it."""
    atexit.register(_collect_then_freeze)
