"""The rendezvous port of the megatron-core test peers (``tests/ports.py``): free, and outside the
kernel's ephemeral range, from which outgoing connections of concurrent tests take their ports."""

from __future__ import annotations

import socket

from tests.ports import ephemeral_range, free_port


def test_free_port_is_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # random picks, not one fixed port
    for port in ports:
        assert not low <= port <= high and 1024 < port < 65536
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
