"""The block monitor: each block instance samples its own process and publishes the values on
Triton's metrics endpoint (the thesis' monitor thread, §3.5.1, done the Triton way).

One daemon thread per instance wakes every ``period_s`` and reads what only this process
knows: its CPU use and RSS (psutil) and, on a GPU, the GPU memory NVML charges to it and
torch's allocator. Device-level values (utilisation, power, clocks) are Triton's own
``nv_gpu_*`` metrics (and DCGM's): repeating them per block would only multiply series.

Labels (:func:`metric_labels`) follow Triton's: ``model`` and ``model_instance`` as on
``nv_inference_*``, ``gpu_uuid`` as on ``nv_gpu_*``, so a query joins them with ``on (model)``
or ``on (gpu_uuid)`` and no label collides with Prometheus' own ``instance`` target label. A
CPU instance has no ``gpu_uuid`` and no GPU families. With ``period_s == 0`` no thread, no NVML
handle and no metric family exist: off costs nothing. Sampling never touches the execute
thread or the CUDA stream.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import psutil
import torch

from blockflow.backend.gauges import Gauge
from blockflow.core import nvml
from blockflow.core.threads import named_thread

GAUGES = {
    "blockflow_block_cpu_utilization_ratio": "CPU time of this instance's process per wall second since the last sample (1 = one core)",
    "blockflow_block_rss_bytes": "Resident memory of this instance's process",
}
GPU_GAUGES = {  # only on instances placed on a GPU
    "blockflow_block_gpu_memory_bytes": "GPU memory NVML charges to this block instance's process",
    "blockflow_block_torch_allocated_bytes": "GPU memory held by live torch tensors in this instance",
    "blockflow_block_torch_reserved_bytes": "GPU memory reserved by this instance's torch caching allocator",
}
COUNTERS = {
    "blockflow_block_cpu_seconds_total": "CPU seconds this instance's process used",
    "blockflow_block_monitor_samples_total": "Samples the block monitor took",
}


def metric_labels(model: str, model_instance: str, device: torch.device) -> dict[str, str]:
    """The labels of every series a block instance exports (see the module's docstring)."""
    out = {"model": model, "model_instance": model_instance}
    if device.type == "cuda":
        out["gpu_uuid"] = gpu_uuid(device)
    return out


def gpu_uuid(device: torch.device) -> str:
    """A CUDA device's UUID as NVML, Triton's ``nv_gpu_*`` and DCGM write it (``GPU-…``)."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def nvml_handle(nv: Any, device: torch.device) -> Any:
    """NVML's handle of a torch CUDA device (NVML must be initialised)."""
    return nvml.handle_by_uuid(nv, gpu_uuid(device))


class _Nvml:
    """NVML's view of this process on one GPU (see :func:`nvml_handle`)."""

    def __init__(self, device: torch.device) -> None:
        self.nv = nvml.init()
        if self.nv is None:
            raise RuntimeError("NVML is not available")
        self.handle = nvml_handle(self.nv, device)
        self.pid = os.getpid()

    def sample(self) -> dict[str, float]:
        mine = nvml.pid_gpu_bytes(self.nv, self.handle, [self.pid])
        # NVML may not list this PID (a container's PID namespace): then the gauge stays unset.
        return {"blockflow_block_gpu_memory_bytes": mine[self.pid]} if self.pid in mine else {}

    def close(self) -> None:
        self.nv.nvmlShutdown()


class BlockMonitor:
    """Samples one block instance every ``period_s`` and publishes the values as metrics."""

    def __init__(self, pb_utils: Any, labels: dict[str, str], device: torch.device, period_s: float) -> None:
        fam = pb_utils.MetricFamily
        gauges = GAUGES | (GPU_GAUGES if device.type == "cuda" else {})
        # The families must outlive their metrics (the backend refuses updates otherwise): keep them.
        self._families = {n: fam(name=n, description=d, kind=fam.GAUGE) for n, d in gauges.items()}
        self._families.update({n: fam(name=n, description=d, kind=fam.COUNTER) for n, d in COUNTERS.items()})
        self._gauges = {n: Gauge(self._families[n].Metric(labels=labels)) for n in gauges}
        self._counters = {n: self._families[n].Metric(labels=labels) for n in COUNTERS}
        self.device = device
        self.period_s = period_s
        self._proc = psutil.Process()
        self._cpu_last = self._cpu_seconds()
        self._sent_cpu = 0.0
        self._nvml: _Nvml | None = None
        if device.type == "cuda":
            try:
                self._nvml = _Nvml(device)
            except Exception:  # no NVML (driver without it): GPU gauges stay unset, the rest works
                self._nvml = None
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "bf-monitor")
        self.sample()
        self._thread.start()

    def _cpu_seconds(self) -> float:
        t = self._proc.cpu_times()
        return float(t.user + t.system)

    def sample(self) -> dict[str, float]:
        values: dict[str, float] = {}
        cpu = self._cpu_seconds()
        values["blockflow_block_cpu_utilization_ratio"] = max(0.0, cpu - self._cpu_last) / self.period_s
        self._cpu_last = cpu
        values["blockflow_block_rss_bytes"] = float(self._proc.memory_info().rss)
        if self.device.type == "cuda":
            values["blockflow_block_torch_allocated_bytes"] = float(torch.cuda.memory_allocated(self.device))
            values["blockflow_block_torch_reserved_bytes"] = float(torch.cuda.memory_reserved(self.device))
            if self._nvml is not None:
                try:
                    values.update(self._nvml.sample())
                except Exception:
                    pass  # a transient NVML error loses one sample, not the block
        for name, value in values.items():
            self._gauges[name].set(value)
        if cpu > self._sent_cpu:
            self._counters["blockflow_block_cpu_seconds_total"].increment(cpu - self._sent_cpu)
            self._sent_cpu = cpu
        self._counters["blockflow_block_monitor_samples_total"].increment(1)
        return values

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except Exception:
                pass  # never let monitoring take the block down; the samples counter shows the gap

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.period_s + 2)
        if self._nvml is not None:
            self._nvml.close()
