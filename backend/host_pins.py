"""Page-locking the shared memory that Triton's Python backend hands a block its host inputs in.

The backend copies each request's host tensors into a shared-memory region (``/dev/shm``) that
the stub maps; a first block copies the image from there to the GPU. From pageable memory the
driver first copies it into a staging buffer of its own, on the host, on the request's path (a
ResNet image at fp32, 600 kB: ~0.18 ms of the first block's host time on an H100 machine,
``bench.timeline``'s *run:copy_in*). Once the mapping is registered with the driver, the same
copy is a DMA that the host only queues.

A registered source makes the copy asynchronous, so the block must wait for it before its
``execute`` returns: the backend frees a request's input memory once the call is over
(:meth:`blockflow.backend.runtime.BlockRunner.settle_inputs`).

The backend never unmaps a region while its stub lives (it grows by mapping the region again,
whole, and keeps the old mapping), so a registered range stays valid for the process's life.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from blockflow.core import cuda
from blockflow.core.errors import BlockError

SHM_PREFIX = "/dev/shm/"
log = logging.getLogger(__name__)


def _mapping_of(ptr: int, maps: Path = Path("/proc/self/maps")) -> tuple[int, int, str] | None:
    """(start, end, path) of the mapping of this process that holds address ``ptr``."""
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(a, 16) for a in fields[0].split("-"))
        if start <= ptr < end:
            return start, end, fields[5] if len(fields) > 5 else ""
    return None


class HostPins:
    """The mappings a block's host inputs came from, each registered with the driver or not.

    :meth:`pinned` answers from a sorted list of ranges; a pointer in none of them costs one read
    of ``/proc/self/maps``, and its mapping is registered if it is a ``/dev/shm`` file (the
    backend's region), else remembered as not pinned.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: list[tuple[int, int, bool]] = []  # (start, end, registered), sorted by start
        self.any_pinned = False  # once a range is registered, torch's copies out of it are asynchronous too

    def pinned(self, ptr: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``ptr`` are in memory registered with the driver (registering
        the mapping that holds them, the first time, if it is shared memory)."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0:
            start, end, ok = self._ranges[i]
            if ptr + nbytes <= end:
                return ok
        return self._learn(ptr, nbytes)

    def _learn(self, ptr: int, nbytes: int) -> bool:
        found = _mapping_of(ptr)
        if found is None:
            return False
        start, end, path = found
        self._forget(start, end)
        ok = False
        if path.startswith(SHM_PREFIX) and ptr + nbytes <= end:
            try:
                cuda.mem_host_register(start, end - start)
                ok = self.any_pinned = True
                log.info("page-locked %s (%d MiB) for DMA of host inputs", path, (end - start) >> 20)
            except BlockError as exc:  # e.g. a locked-memory limit: the copies stay staged, as before
                log.warning("could not page-lock %s (%d MiB): %s; host inputs are copied through the driver's staging",
                            path, (end - start) >> 20, exc)
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._ranges.insert(i, (start, end, ok))
        return ok  # registered only where the input fits the mapping

    def _forget(self, start: int, end: int) -> None:
        """Drop the ranges that ``[start, end)`` overlaps: the mapping there now is another one (the
        heap moved, a region was mapped again), so a registration of the old one is released
        rather than left covering part of the new one."""
        keep = []
        for r in self._ranges:
            if r[1] <= start or r[0] >= end:
                keep.append(r)
            elif r[2]:
                try:
                    cuda.mem_host_unregister(r[0])
                except BlockError as exc:  # the driver no longer knows it: nothing is left to release
                    log.warning("could not release the page-locked range at %#x: %s", r[0], exc)
        self._ranges, self._starts = keep, [r[0] for r in keep]

    def close(self) -> None:
        """Unregister every registered range (before its memory is unmapped, which the backend never does)."""
        for start, _, ok in self._ranges:
            if ok:
                cuda.mem_host_unregister(start)
        self._starts, self._ranges, self.any_pinned = [], [], False


def join_to_device(pins: HostPins, parts: Sequence[torch.Tensor], device: torch.device, stream: int) -> torch.Tensor | None:
    """``torch.cat(parts)`` on ``device`` by one DMA per part, queued on ``stream``, when every part
    is a contiguous host tensor of one dtype and row shape in page-locked memory; else None.

    Replaces one blocking ``.to(device)`` per request (each a staged copy and a stream sync) when a
    call joins several images. The caller waits for the copies before the call returns.
    """
    first = parts[0]
    if first.is_cuda or any(p.is_cuda or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                            or not p.is_contiguous() for p in parts):
        return None
    if not all(pins.pinned(p.data_ptr(), p.nbytes) for p in parts):
        return None
    out = torch.empty((sum(int(p.shape[0]) for p in parts), *first.shape[1:]), dtype=first.dtype, device=device)
    at = out.data_ptr()
    for p in parts:
        cuda.memcpy_async(at, p.data_ptr(), p.nbytes, stream)
        at += p.nbytes
    return out
