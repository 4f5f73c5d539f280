"""Direct hand-overs as AF_UNIX datagrams (the default; ``BLOCKFLOW_TMQ_HANDOVER_DGRAM=0`` turns them off): a sender's socket and a
receiver instance's, beside the ZeroMQ sockets of ``handout.py`` and ``handover.py``, which stay the fallback. The
datagrams' layout and the fallback's rules are in ``wire.py``."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

from blockflow.backend.tensormq.wire import DGRAM_MAX, HandOverMessage, hand_over_dgram_path, pack_datagrams, unpack_datagram
from blockflow.core import env


def datagrams_on() -> bool:
    """Whether hand-overs go as datagrams first: unless ``BLOCKFLOW_TMQ_HANDOVER_DGRAM`` is ``0`` (wire.py)."""
    return os.environ.get(env.TMQ_HANDOVER_DGRAM) != "0"


class DatagramOut:
    """A sender's datagram socket, and the datagram socket of each receiver instance that has one."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)  # a full queue: ZeroMQ takes the call's hand-overs instead
        self.paths: dict[str, str] = {}  # receiver instance -> its datagram socket, where it has one
        self.by_zmq = 0  # calls whose hand-overs went over ZeroMQ to an instance that has a datagram socket

    def found(self, name: str, stream_path: Path) -> None:
        """A receiver instance ``name`` listening at ``stream_path``: its datagram socket, if it has one."""
        dgram = hand_over_dgram_path(stream_path)
        if dgram.exists():
            self.paths[name] = str(dgram)

    def gone(self, name: str) -> None:
        self.paths.pop(name, None)

    def pack(self, messages: list[list[bytes]]) -> list[bytes]:
        """A call's hand-overs as datagrams; none while no receiver instance has a datagram socket."""
        return pack_datagrams(messages) if self.paths else []

    def send(self, datagrams: list[bytes], name: str) -> bool:
        """Whether every datagram reached instance ``name``; if not (it has no datagram socket, its queue
        is full, or it stopped), the caller sends the call's hand-overs over ZeroMQ (the instance keeps
        the first copy)."""
        path = self.paths.get(name)
        if path is None:
            return False
        try:
            for d in datagrams:
                self.sock.sendto(d, path)
            return True
        except OSError:
            self.by_zmq += 1
            return False

    def close(self) -> None:
        self.sock.close()


class DatagramIn:
    """A receiver instance's datagram socket, bound at ``path`` (in the 0700 runtime directory: the
    server's user only)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.bind(str(path))

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> Iterator[HandOverMessage]:
        """``(key, status, ticket, origin)`` of each hand-over queued, datagram by datagram, until none is left."""
        while True:
            try:
                data = self.sock.recv(DGRAM_MAX)
            except BlockingIOError:
                return
            yield from unpack_datagram(data)

    def close(self) -> None:
        self.sock.close()
