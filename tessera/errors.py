"""Errors that explain themselves: every user-facing failure names the problem and the fix.

Exit statuses of `tessera` (docs/launching.md lists them too):

    0    done
    1    `validate` / `memory` found problems; `compare` found a difference beyond its tolerances
    2    a user error: config, data, checkpoint, usage (the message names the fix)
    3    training diverged: a non-finite loss or gradient norm (NonFiniteError); nothing was saved
    4    a rank stopped making progress (the watchdog); stacks are in RUN_DIR/stacks/
    5    this rank lost contact with another rank, which failed first (the launcher names that one)
    75   stopped cleanly on a signal after writing a checkpoint: resumable (EX_TEMPFAIL, "try again")
    130  interrupted before a checkpoint could be written
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_HANG",
    "EXIT_OUTPUT_CLOSED",
    "EXIT_PEER_LOST",
    "EXIT_RESUMABLE",
    "EXIT_USER_ERROR",
    "CheckpointError",
    "CheckpointWriteError",
    "ConfigError",
    "DataError",
    "NonFiniteError",
    "TesseraError",
    "why_unwritable",
]

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_HANG = 4
EXIT_PEER_LOST = 5
EXIT_RESUMABLE = 75
EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a Unix tool whose reader closed the pipe


class TesseraError(Exception):
    """Base class for errors shown to the user as a message, never as a traceback."""

    exit_code = EXIT_USER_ERROR
    same_on_every_rank = False
    """Set where every rank makes this decision alike from the same inputs (`tessera.rank_errors`): then one
    rank's message stands for all of them."""


class ConfigError(TesseraError):
    """A configuration is invalid; the message lists every violated rule with a suggested fix."""


class DataError(TesseraError):
    """A data file is missing, malformed or too small for the requested sequence length."""


class CheckpointError(TesseraError):
    """A checkpoint is missing, incomplete or incompatible with the current run."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint could not be written (disk full, quota, permissions); still an OSError for callers that
    catch those."""


class NonFiniteError(TesseraError):
    """Training produced a NaN or infinite loss or gradient norm and the policy says stop."""

    exit_code = EXIT_DIVERGED


def why_unwritable(path: str | Path, e: OSError) -> str:
    """Why ``path`` could not be written, in words: a file where a folder of its path should be (the OS says
    only "File exists" or "Not a directory"), else the OS's reason (no permission, disk full, ...)."""
    for parent in Path(path).parents:
        if parent.exists():
            return f"{parent} is a file, not a folder" if not parent.is_dir() else e.strerror or str(e)
    return e.strerror or str(e)
