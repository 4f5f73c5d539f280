"""Keep a block process's freed heap memory mapped, so the stub's copy of each host input reuses it.

When Triton's Python stub loads a request, it copies every host input tensor into a new NumPy
array (python_backend r24.10, ``PbTensor::LoadFromSharedMemory``: ``py::array`` without a base
object copies), whether or not the model reads it: 602 kB for a ResNet image at fp32. With glibc's
default settings a batch of such arrays is allocated on the heap and, once freed, given back to the
kernel (the heap's top exceeds the trim threshold, which glibc sets to twice the largest chunk
freed so far), so the next batch takes its pages again: a page fault and a zeroed page every 4 kB,
on the request's path. A sink model that answers without reading its input served 1725/s at
concurrency 32 on an H100 machine, with 7.2 ms of Triton's *compute infer* per execution of ~16
images (``bench/results/h100/input_ceiling-2026-11-27-78bb5b3/``).

Fixed thresholds (``mallopt``) keep those pages: allocations below ``MMAP_THRESHOLD`` come from
the heap, and freed memory at its top is returned only beyond ``TRIM_THRESHOLD``. The price is
memory the process already needed at its peak, kept mapped instead of returned.
``BLOCKFLOW_KEEP_HEAP=0`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from blockflow.core import env

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit); a batch of 32 images is 19 MB
TRIM_THRESHOLD = 256 * 2**20


def keep_freed_memory() -> bool:
    """Set the process's malloc thresholds (above); False where they were left as they are (turned
    off, or a C library without glibc's ``mallopt``)."""
    if os.environ.get(env.KEEP_HEAP) == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; set the trim threshold first, as fixing the mmap threshold
    # also stops glibc from raising the trim threshold by itself.
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
