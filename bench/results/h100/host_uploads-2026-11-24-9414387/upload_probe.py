"""Host time to get a batch of 8 client images (fp32 3x224x224, in pageable shared memory like the
stub's) onto the GPU, by path; with the block's stream idle or holding ~0.5 ms of earlier work,
and with another process keeping the GPU busy (time slicing) or not.

    source scripts/gpu_env.sh; python3 upload_probe.py
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

N, SHAPE = 8, (3, 224, 224)
ONE = int(np.prod(SHAPE)) * 4


def hog(stop: Any) -> None:
    """Another process's kernels, back to back, until ``stop`` is set."""
    torch.cuda.set_device(0)
    a = torch.randn(4096, 4096, device="cuda")
    while not stop.is_set():
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        torch.cuda.synchronize()


def main() -> None:
    cuda = torch.device("cuda", 0)
    fd = os.open("/dev/shm/bf-probe", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, N * ONE)
    mm = mmap.mmap(fd, N * ONE)
    os.unlink("/dev/shm/bf-probe")
    host = torch.frombuffer(mm, dtype=torch.float32).view(N, *SHAPE)
    host.copy_(torch.randn(N, *SHAPE))
    reqs = [host[i:i + 1] for i in range(N)]
    pinned = [torch.empty(N, *SHAPE, pin_memory=True) for _ in range(2)]
    events = [torch.cuda.Event() for _ in range(2)]  # type: ignore[no-untyped-call]
    dst = torch.empty(N, *SHAPE, device=cuda)
    side = torch.cuda.Stream(cuda)  # type: ignore[no-untyped-call]
    turn = [0]

    def blocking() -> torch.Tensor:
        return torch.cat([r.to(cuda) for r in reqs])

    def nonblocking() -> torch.Tensor:
        return torch.cat([r.to(cuda, non_blocking=True) for r in reqs])

    def sidestream() -> torch.Tensor:
        with torch.cuda.stream(side):
            out = torch.cat([r.to(cuda, non_blocking=True) for r in reqs])
        side.synchronize()
        return out

    def staged() -> torch.Tensor:
        i = turn[0] = (turn[0] + 1) % 2
        events[i].synchronize()
        base = pinned[i].data_ptr()
        for j, r in enumerate(reqs):
            ctypes.memmove(base + j * ONE, r.data_ptr(), ONE)
        dst.copy_(pinned[i], non_blocking=True)
        events[i].record()
        return dst

    paths: dict[str, Callable[[], torch.Tensor]] = {
        "pageable .to() per request (now)": blocking, "pageable non_blocking": nonblocking,
        "pageable on a side stream": sidestream, "memmove to pinned + 1 async copy": staged}
    for busy in (False, True):
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        p = None
        if busy:
            p = ctx.Process(target=hog, args=(stop,))
            p.start()
            time.sleep(8)
        for prior in (False, True):
            for name, f in paths.items():
                laps = []
                for it in range(150):
                    if prior:
                        torch.cuda._sleep(1_000_000)  # type: ignore[no-untyped-call]
                    t0 = time.perf_counter_ns()
                    out = f()
                    laps.append((time.perf_counter_ns() - t0) / 1e3)
                    if it % 10 == 0:
                        torch.cuda.synchronize()
                        assert torch.equal(out[3].cpu(), host[3])
                torch.cuda.synchronize()
                print(f"other process busy={busy!s:5s} earlier work queued={prior!s:5s} {name:36s} "
                      f"{statistics.median(laps[20:]):8.0f} us (p90 {np.percentile(laps[20:], 90):.0f})", flush=True)
        if p is not None:
            stop.set()
            p.join()


if __name__ == "__main__":
    main()
