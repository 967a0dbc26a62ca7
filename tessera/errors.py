"""Errors that explain themselves: every user-facing failure names the problem and the fix."""

from __future__ import annotations

__all__ = ["CheckpointError", "ConfigError", "DataError", "TesseraError"]


class TesseraError(Exception):
    """Base class for errors shown to the user as a message, never as a traceback."""


class ConfigError(TesseraError):
    """A configuration is invalid; the message lists every violated rule with a suggested fix."""


class DataError(TesseraError):
    """A data file is missing, malformed or too small for the requested sequence length."""


class CheckpointError(TesseraError):
    """A checkpoint is missing, incomplete or incompatible with the current run."""
