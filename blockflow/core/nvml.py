"""NVML, the one way BlockFlow reads GPUs without touching CUDA: counts, memory, per-process use.

Every reader goes through :func:`session`, which initialises NVML and shuts it down again (NVML
counts its initialisations), and yields ``None`` where there is no driver: without a GPU every
reading is simply empty, so the same code runs on the CPU machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any


def init() -> Any:
    """The ``pynvml`` module, initialised (call ``nvmlShutdown`` when done); ``None`` without NVML.

    For readers that sample for as long as they live (the block monitor, the benchmarks' sampler);
    one-off readings use :func:`session`.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no package, no driver, no device: the same to every caller
        return None
    return pynvml


@contextmanager
def session() -> Iterator[Any]:
    """The ``pynvml`` module, initialised, for the ``with`` body; ``None`` without NVML."""
    nv = init()
    try:
        yield nv
    finally:
        if nv is not None:
            nv.nvmlShutdown()


def gpu_count() -> int:
    """GPUs NVML sees (0 without a driver)."""
    with session() as nv:
        return int(nv.nvmlDeviceGetCount()) if nv is not None else 0


def gpu_name(index: int = 0) -> str | None:
    """GPU ``index``'s name ("NVIDIA H200"), None without a driver or that GPU."""
    with session() as nv:
        if nv is None or index >= int(nv.nvmlDeviceGetCount()):
            return None
        name = nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(index))
        return name.decode() if isinstance(name, bytes) else str(name)


def handle_by_uuid(nv: Any, uuid: str) -> Any:
    """NVML's handle of the GPU with this UUID (torch's ``get_device_properties(d).uuid``): CUDA and
    NVML may number devices differently (``CUDA_VISIBLE_DEVICES``, PCI order)."""
    return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def pid_gpu_bytes(nv: Any, handle: Any, pids: Iterable[int]) -> dict[int, float]:
    """GPU memory (bytes) NVML lists on one GPU for each of ``pids``; a PID it does not list is left out.

    In a container without the host's PID namespace NVML reports host PIDs, which then match nothing.
    """
    want = set(pids)
    return {p.pid: float(p.usedGpuMemory) for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid in want and p.usedGpuMemory is not None}


def used_mib(index: int = 0) -> float:
    """Memory in use on GPU ``index`` (MiB); 0 without NVML."""
    with session() as nv:
        if nv is None:
            return 0.0
        return float(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index)).used) / 2**20
