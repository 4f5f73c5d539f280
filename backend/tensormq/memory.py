"""Pool segments and their events, for the CPU (POSIX shared memory) and the GPU (CUDA IPC).

A producer creates one segment and a ring of events (one per slot) and exports
them once; a consumer opens each exactly once per producer generation and keeps
it. On the host, writes are complete when the producer returns its ticket, so
events are no-ops there.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from blockflow.backend.tensormq.ticket import DEVICE_CUDA, DEVICE_HOST
from blockflow.core import cuda

SHM_DIR = Path("/dev/shm")
VIEW_CACHE = 1024  # cached (offset, shape, dtype) views per segment


class Segment:
    """One contiguous byte range: ``tensor`` is a uint8 view of all of it."""

    kind: int
    nbytes: int
    tensor: torch.Tensor
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._views: OrderedDict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = OrderedDict()

    def _forget_views(self) -> None:
        """Drop every cached view (they hold the segment's tensor) before it is unmapped or freed."""
        self._typed.clear()
        self._views.clear()
        del self.tensor

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A row-major ``shape`` view of ``dtype`` starting ``offset`` bytes in (aligned to the item size).

        Views are cached: under steady load a pool hands out the same few (offset, shape) ranges
        again and again, and building a view costs several torch calls (~20-40 us each on a busy
        host), which sat on every request's path.
        """
        key = (offset, shape, dtype)
        hit = self._views.get(key)
        if hit is not None:
            self._views.move_to_end(key)
            return hit
        typed = self._typed.get(dtype)
        if typed is None:
            usable = self.nbytes - self.nbytes % dtype.itemsize
            typed = self._typed[dtype] = self.tensor[:usable].view(dtype)
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        out = typed.as_strided(shape, tuple(reversed(strides)), offset // dtype.itemsize)
        self._views[key] = out
        if len(self._views) > VIEW_CACHE:
            self._views.popitem(last=False)
        return out

    def describe(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class HostSegment(Segment):
    kind = DEVICE_HOST

    def __init__(self, name: str, nbytes: int, create: bool) -> None:
        super().__init__(nbytes)
        self.name, self.owner = name, create
        path = SHM_DIR / name
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)
                self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        else:
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.fstat(fd).st_size < nbytes:
                    raise OSError(f"shared memory {name} is smaller than announced")
                # Consumers map read-only: they cannot corrupt the producer's pool.
                self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write through it
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def describe(self) -> dict[str, Any]:
        return {"kind": "host", "name": self.name, "nbytes": self.nbytes}

    def close(self) -> None:
        self._forget_views()
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)


class CudaSegment(Segment):
    kind = DEVICE_CUDA

    def __init__(self, device: int, nbytes: int, handle: bytes | None = None) -> None:
        super().__init__(nbytes)
        self.device = device
        with torch.cuda.device(device):
            # The driver calls below need the primary context current; torch.cuda.init() alone does not
            # make it so (a process with no tensor yet got CUDA_ERROR_INVALID_CONTEXT on an H100).
            torch.zeros(1, device=f"cuda:{device}")
            if handle is None:
                self.owner = True
                self.ptr = cuda.mem_alloc(nbytes)
                self.handle = cuda.ipc_mem_handle(self.ptr)
            else:
                self.owner = False
                self.ptr = cuda.ipc_open_mem(handle)
                self.handle = handle
            self.tensor = torch.as_tensor(cuda.DeviceBytes(self.ptr, nbytes), device=f"cuda:{device}")

    def describe(self) -> dict[str, Any]:
        return {"kind": "cuda", "handle": self.handle.hex(), "nbytes": self.nbytes, "device": self.device}

    def close(self) -> None:
        self._forget_views()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            (cuda.mem_free if self.owner else cuda.ipc_close_mem)(self.ptr)


class EventRing:
    """One interprocess CUDA event per slot (empty on the host)."""

    def __init__(self, device: int | None, count: int = 0, handles: list[bytes] | None = None) -> None:
        self.device = device
        self.owner = handles is None
        self.events: list[int] = []
        if device is None:
            return
        with torch.cuda.device(device):
            if handles is None:
                self.events = [cuda.event_create_ipc() for _ in range(count)]
            else:
                self.events = [cuda.ipc_open_event(h) for h in handles]

    def handles(self) -> list[str]:
        return [cuda.ipc_event_handle(e).hex() for e in self.events]

    def record(self, index: int, stream: int) -> None:
        if self.events:
            cuda.event_record(self.events[index], stream)

    def wait(self, index: int, stream: int) -> None:
        if self.events:
            cuda.stream_wait_event(stream, self.events[index])

    def close(self) -> None:
        if self.device is not None:
            with torch.cuda.device(self.device):
                for e in self.events:
                    cuda.event_destroy(e)
        self.events = []
