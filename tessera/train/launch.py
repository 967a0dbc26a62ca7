"""Small helpers for starting local ranks (``tessera train --nproc N``)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A free TCP port on localhost for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
