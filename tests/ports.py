"""A free TCP port for a rendezvous (test peers launched as subprocesses), so that concurrent test
runs on one machine never collide on a fixed port."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the OS reports free right now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
