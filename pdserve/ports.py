"""Ports that a process picks for a child to bind later."""

from __future__ import annotations

import socket


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A free port held by a bound, never listening ``SO_REUSEADDR`` socket; its number is
    ``getsockname()[1]``. A port merely picked and let go lies in the ephemeral range, where any
    outgoing connection made while the child starts (seconds of imports) may take it; held, no
    connection can, and the child's own ``SO_REUSEADDR`` bind (uvicorn's, torch's TCP store)
    still succeeds, since neither socket listens before. Close it once the child has bound."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s
