"""A chain's answers (plan option ``chain_answers: head``): its tail sends each sample's answer back to
the head instance that took the sample's request, which answers the request with it.

``AnswerOut`` is the tail's side, ``AnswerIn`` the head instance's socket; the head's table of the
requests that wait is ``backend/chain_answers.py``. The rules are in the package note
(``backend/tensormq/__init__.py``, "Chains"); the messages and the socket in ``wire.py``.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

from blockflow.backend.tensormq.wire import (
    ANSWER_SEND_S,
    DGRAM_MAX,
    NO_ORIGIN,
    ORIGIN,
    Answer,
    answer_path,
    pack_answers,
    unpack_answers,
)

# Head instances a tail keeps a socket for at most.
MAX_HEADS = 64


class AnswerOut:
    """A tail's side: each sample's answer to the head instance its hand-over names as the origin."""

    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        # A socket per head instance: a datagram the head has not read yet counts against its sender's
        # send buffer, so one head that stops reading must not hold up the answers to the others.
        self._socks: dict[bytes, socket.socket] = {}
        self.lost = 0  # answers no head took: its instance stopped, or its queue stayed full

    def _sock(self, origin: bytes) -> socket.socket:
        sock = self._socks.get(origin)
        if sock is None:
            if len(self._socks) >= MAX_HEADS:  # heads come and go with reloads; opening again is cheap
                self.close()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            # Blocking, up to ANSWER_SEND_S, while the head's queue is full: the kernel waits for room
            # (a timeout set through Python would poll this unconnected socket, always writable, in a loop).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(ANSWER_SEND_S),
                                                                          int(ANSWER_SEND_S % 1 * 1e6)))
            self._socks[origin] = sock
        return sock

    def send(self, by_origin: Mapping[bytes, Sequence[Answer]]) -> None:
        """Each origin's answers, in datagrams; an origin whose instance is gone loses its own only."""
        for origin, answers in by_origin.items():
            if origin == NO_ORIGIN or len(origin) != ORIGIN.size:
                self.lost += len(answers)  # a hand-over from no answering head: nobody to answer
                continue
            path = str(answer_path(self.runtime_dir, ORIGIN.unpack(origin)[0]))
            datagrams = pack_answers(list(answers))
            try:
                sock = self._sock(origin)  # a socket that cannot be opened (no descriptors left) loses them all
            except OSError:
                self.lost += len(answers)
                continue
            for i, datagram in enumerate(datagrams):
                try:
                    sock.sendto(datagram, path)
                except OSError:
                    self.lost += len(unpack_answers(b"".join(datagrams[i:])))
                    break

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks = {}


class AnswerIn:
    """A chain head instance's datagram socket for its tail's answers, bound in the 0700 runtime
    directory (the server's user only)."""

    def __init__(self, runtime_dir: Path, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        self.origin = ORIGIN.pack(pid)  # what its hand-overs name as their origin
        self.path = answer_path(runtime_dir, pid)
        self.path.unlink(missing_ok=True)  # left by a killed process that had this pid
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.bind(str(self.path))
        self._poll = select.poll()  # not select.select: a CUDA and ZeroMQ process may hold descriptors past 1024
        self._poll.register(self.sock, select.POLLIN)

    def wait(self, timeout_s: float) -> bool:
        """Whether an answer came within ``timeout_s``."""
        return bool(self._poll.poll(max(0, int(timeout_s * 1000 + 0.999))))

    def read(self) -> list[Answer]:
        """Every answer queued, in the order they came."""
        out: list[Answer] = []
        while True:
            try:
                data = self.sock.recv(DGRAM_MAX)
            except BlockingIOError:
                return out
            out.extend(unpack_answers(data))

    def remove_file(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self.remove_file()
        self.sock.close()
