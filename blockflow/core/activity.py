"""A server's last-activity stamp: when a block last started an ``execute``.

Eight bytes in a file (0600) in the server's runtime directory, mapped by every writer and
reader: the time of the block's last ``execute`` as ``CLOCK_MONOTONIC`` nanoseconds, which all
processes of one machine share. Block processes write it (``BLOCKFLOW_ACTIVITY_FILE`` names
the file); the warm-core pollers of ``blockflow serve --warm-cores-ms`` read it
(:mod:`blockflow.triton.warm_cores`). An aligned 8-byte store is one instruction on the
machines this runs on, and a torn read would only make a poller spin a little longer or
shorter, so the stamp needs no lock.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

_STAMP = struct.Struct("<q")


class ActivityStamp:
    """One mapping of a stamp file, to :meth:`touch` (a block) or to read :meth:`last` (a poller)."""

    def __init__(self, path: Path, writable: bool) -> None:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, _STAMP.size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)

    @staticmethod
    def create(path: Path) -> None:
        """A new stamp file that says "never" (0), private to this user."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, _STAMP.pack(0))
        finally:
            os.close(fd)

    def touch(self) -> None:
        """Say "active now" (~1 µs)."""
        _STAMP.pack_into(self._map, 0, time.monotonic_ns())

    def last(self) -> int:
        """When the stamp was last touched, ``time.monotonic_ns()``-style (0: never)."""
        return int(_STAMP.unpack_from(self._map, 0)[0])

    def close(self) -> None:
        self._map.close()
