"""A free TCP port for a rendezvous (test peers launched as subprocesses), so that concurrent test
runs on one machine never collide on a fixed port.

The port is picked outside the kernel's ephemeral range. Between the pick and the rendezvous
binding it (seconds, while the peers import megatron-core) the port is free, and a port from the
ephemeral range can meanwhile be handed to any outgoing connection: the gloo groups of tests
running beside this one open many (a CI run once failed on ``EADDRINUSE`` that way). Outside the
range only another explicit bind can take it, and picks are random among about 20 000 ports.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below: ports services commonly listen on


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where the file cannot be read)."""
    try:
        low, high = (int(v) for v in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return low, high


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free right now and outside the ephemeral range (see the module docstring); the
    OS's choice (bound to port 0, then released) if no such port is found."""
    low, high = ephemeral_range()
    outside = [*range(_LOWEST, min(low, 65536)), *range(max(high + 1, _LOWEST), 65536)]
    picker = random.Random()  # seeded from the OS: independent of the tests' random.seed
    for _ in range(64):
        port = picker.choice(outside) if outside else 0
        if port and _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
