"""Other processes, read from Linux's /proc: what the fault tests and the fault benchmark use to find a launcher's
workers and check they are gone."""

from __future__ import annotations

from pathlib import Path

__all__ = ["alive", "children", "environ"]


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may itself hold spaces or parentheses)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat_fields(entry.name)[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue  # the process ended while we looked
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def environ(pid: int) -> dict[str, str]:
    """``pid``'s environment, or {} when it cannot be read."""
    try:
        items = Path(f"/proc/{pid}/environ").read_text().split("\0")
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in items if "=" in x)
