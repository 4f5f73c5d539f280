"""Ports handed to a Triton server's three listeners and BlockFlow's control API."""

from __future__ import annotations

import socket

from blockflow.triton.options import _ephemeral_range, free_port


def test_free_port_never_returns_a_port_twice_in_one_process() -> None:
    # 2000 draws from the ~22000 candidates collide almost surely without the record of
    # ports handed out; one collision starts a server whose gRPC and metrics ports are equal.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    low, high = _ephemeral_range()
    port = free_port()
    assert not low <= port <= high
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
