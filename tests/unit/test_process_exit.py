"""The `tessera` command's exit (docs/launching.md, "How a command ends"): one collection, then a freeze.

Each case runs a fresh interpreter, since what is checked happens after its last line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    assert out.stderr == "", out.stderr
    return out.stdout.splitlines()


def test_garbage_at_exit_is_finalized_then_the_survivors_are_frozen() -> None:
    lines = _run(
        """
        import atexit, gc
        from tessera.process_exit import finish_quickly_at_exit

        atexit.register(lambda: print("after the handler: frozen", gc.get_freeze_count() > 0))
        finish_quickly_at_exit()

        class Finalized:
            def __del__(self):
                print("cycle finalized")

        def during_the_command():
            cycle = Finalized()
            cycle.me = cycle  # garbage only a collection frees
            del cycle
            print("handler of the command: frozen", gc.get_freeze_count() > 0)

        gc.disable()  # no collection before the exit's own
        atexit.register(during_the_command)
        """
    )
    # A handler registered during the command runs first, on unfrozen objects; the cycle it leaves is finalized
    # by the one collection (a freeze alone would leave it uncollected: no line); only then are objects frozen.
    assert lines == [
        "handler of the command: frozen False",
        "cycle finalized",
        "after the handler: frozen True",
    ]


def test_the_command_ends_through_the_handler() -> None:
    lines = _run(
        """
        import atexit, gc, sys
        atexit.register(lambda: print("frozen at the end", gc.get_freeze_count() > 0))
        from tessera.cli import main

        sys.argv = ["tessera", "plan", "--help"]
        try:
            main()
        except SystemExit as e:
            assert e.code == 0, e.code
        """
    )
    assert lines[-1] == "frozen at the end True"


def test_a_library_call_leaves_the_interpreter_alone() -> None:
    """`main(argv)` is a call inside someone else's program: its exit is not ours to change."""
    lines = _run(
        """
        import atexit, gc
        atexit.register(lambda: print("frozen at the end", gc.get_freeze_count() > 0))
        from tessera.cli import main

        try:
            main(["plan", "--help"])
        except SystemExit as e:
            assert e.code == 0, e.code
        """
    )
    assert lines[-1] == "frozen at the end False"
