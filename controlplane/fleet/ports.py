"""Whether a replica's port is free on this host."""

from __future__ import annotations

import socket

HOST = "127.0.0.1"


def port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now. SO_REUSEADDR as uvicorn sets it: connections in
    TIME_WAIT from a replica that just exited do not count as taken, a listening socket does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True
