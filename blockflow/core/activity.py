"""A server's last-activity stamp: when a block last started an ``execute``.

Sixteen bytes in a file (0600) in the server's runtime directory, mapped by every writer and
reader: two times as ``CLOCK_MONOTONIC`` nanoseconds, which all processes of one machine share.
The first is the last ``execute`` of a call that held one request, the second the last of a call
that held several (the scheduler found requests waiting: the server is no longer latency-bound).
Block processes write them (``BLOCKFLOW_ACTIVITY_FILE`` names the file); the warm-core pollers
of ``blockflow serve --warm-cores-ms`` read them (:mod:`blockflow.triton.warm_cores`). Each is
written and read as one aligned 8-byte word, so they need no lock; a poller still looks twice
before it takes a stamp for stale.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

_STAMP = struct.Struct("qq")


class ActivityStamp:
    """One mapping of a stamp file, to :meth:`touch` (a block) or to read :meth:`last` (a poller)."""

    def __init__(self, path: Path, writable: bool) -> None:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, _STAMP.size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        # Through a memoryview of native int64: one 8-byte memcpy each way, so one load or store.
        # Not struct.pack_into: it zero-fills the bytes before it writes them, and pollers read
        # that zero (a stamp from 1970) many times a second.
        self._word = memoryview(self._map).cast("q")

    @staticmethod
    def create(path: Path) -> None:
        """The stamp file, private to this user, saying "never" (0) twice.

        Rewritten in place, never truncated: blocks of a running server may have it mapped, and
        a mapped page past the end of a file raises SIGBUS in the process that touches it.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, _STAMP.pack(0, 0), 0)
        finally:
            os.close(fd)

    def touch(self, requests: int = 1) -> None:
        """Say "a call of ``requests`` requests started now" (~0.2 µs)."""
        self._word[0 if requests <= 1 else 1] = time.monotonic_ns()

    def last(self) -> int:
        """When a call of one request last started, ``time.monotonic_ns()``-style (0: never)."""
        return int(self._word[0])

    def last_batched(self) -> int:
        """When a call of several requests last started (0: never)."""
        return int(self._word[1])

    def close(self) -> None:
        self._word.release()
        self._map.close()
