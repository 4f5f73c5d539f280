"""A server's last-activity stamp: when a block last started an ``execute``.

Eight bytes in a file (0600) in the server's runtime directory, mapped by every writer and
reader: the time of the block's last ``execute`` as ``CLOCK_MONOTONIC`` nanoseconds, which all
processes of one machine share. Block processes write it (``BLOCKFLOW_ACTIVITY_FILE`` names
the file); the warm-core pollers of ``blockflow serve --warm-cores-ms`` read it
(:mod:`blockflow.triton.warm_cores`). The stamp is written and read as one aligned 8-byte word,
so it needs no lock; a poller still looks twice before it takes a stamp for stale.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

_STAMP = struct.Struct("q")


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
        """The stamp file, private to this user, saying "never" (0).

        Rewritten in place, never truncated: blocks of a running server may have it mapped, and
        a mapped page past the end of a file raises SIGBUS in the process that touches it.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, _STAMP.pack(0), 0)
        finally:
            os.close(fd)

    def touch(self) -> None:
        """Say "active now" (~0.2 µs)."""
        self._word[0] = time.monotonic_ns()

    def last(self) -> int:
        """When the stamp was last touched, ``time.monotonic_ns()``-style (0: never)."""
        return int(self._word[0])

    def close(self) -> None:
        self._word.release()
        self._map.close()
