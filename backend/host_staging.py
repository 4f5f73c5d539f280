"""Pinned buffers through which a GPU block's host inputs reach its CUDA graph with asynchronous copies.

A first block gets each host image in the buffer Triton loaded it into, pageable memory. A copy from
pageable memory to the GPU holds the host thread while the driver stages it (0.24 ms for a 602 KB
image on the H100 machine, in the ``run:graph`` lap of ``blockflow.bench.timeline``). That thread
has just answered early with its tickets, and the next block waits for its commit, which follows
the copy. Copying the image into a pinned buffer first (a plain ``memcpy``) and from there with
an asynchronous DMA takes the host a fraction of that.

A buffer is rewritten only once the DMA out of it is done: an event recorded after each copy is
waited for before the next one (at batch 1 it finished long before). There is one buffer per
destination (a graph's static input), made when a host input first reaches it.
"""

from __future__ import annotations

import ctypes

import torch

from blockflow.core import cuda


class HostStaging:
    """A GPU block's pinned staging buffers, by destination (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # (address, bytes) -> (pinned, event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: int) -> bool:
        """Queue ``dst.copy_(src)`` on ``stream`` through a pinned buffer; False (nothing done) unless
        ``src`` is a host tensor of ``dst``'s dtype, shape and contiguous layout."""
        if src.device.type != "cpu" or src.dtype != dst.dtype or src.shape != dst.shape \
                or not src.is_contiguous() or not dst.is_contiguous():
            return False
        nbytes = dst.nbytes
        key = (dst.data_ptr(), nbytes)
        entry = self._buffers.get(key)
        if entry is None:
            entry = self._buffers[key] = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), cuda.event_create())
        pinned, done = entry
        cuda.event_synchronize(done)  # the last DMA out of this buffer (returns at once before the first)
        ctypes.memmove(pinned.data_ptr(), src.data_ptr(), nbytes)
        cuda.memcpy_async(dst.data_ptr(), pinned.data_ptr(), nbytes, stream)
        cuda.event_record(done, stream)
        return True

    def close(self) -> None:
        """Wait for the copies still queued and free the events (the pinned memory goes with its tensors)."""
        for _, event in self._buffers.values():
            cuda.event_synchronize(event)
            cuda.event_destroy(event)
        self._buffers.clear()
