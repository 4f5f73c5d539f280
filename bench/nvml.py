"""GPU utilisation, power, energy and per-process memory and SM use from NVML, sampled in the background.

Without a GPU (or NVML) every method returns empty results, so the benchmark runs on CPU too.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from blockflow.core import nvml


class GpuSampler:
    """Samples every GPU's utilisation and power every ``period_s`` while running."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.handles: list[Any] = []
        self.nv: Any = nvml.init()
        if self.nv is not None:
            self.handles = [self.nv.nvmlDeviceGetHandleByIndex(i) for i in range(self.nv.nvmlDeviceGetCount())]
        self._samples: list[tuple[float, list[float], list[float]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def names(self) -> list[str]:
        return [str(self.nv.nvmlDeviceGetName(h)) for h in self.handles]

    def energy_mj(self) -> list[float]:
        """Each GPU's energy counter (millijoules since the driver loaded)."""
        out = []
        for h in self.handles:
            try:
                out.append(float(self.nv.nvmlDeviceGetTotalEnergyConsumption(h)))
            except Exception:
                out.append(float("nan"))
        return out

    def memory_used_mib(self) -> list[float]:
        return [self.nv.nvmlDeviceGetMemoryInfo(h).used / 2**20 for h in self.handles]

    def process_memory_mib(self, pids: Iterable[int]) -> dict[int, float]:
        """GPU memory of each of ``pids`` (summed over GPUs); a PID NVML does not list is left out."""
        want = list(pids)
        out: dict[int, float] = {}
        for h in self.handles:
            for pid, used in nvml.pid_gpu_bytes(self.nv, h, want).items():
                out[pid] = out.get(pid, 0.0) + used / 2**20
        return out

    def process_sm_pct(self, since_wall_s: float, pids_by_model: Mapping[str, Iterable[int]]) -> dict[str, Any]:
        """Each model's share of the GPUs' time with its kernels running since ``since_wall_s`` (``time.time()``),
        from NVML's per-process samples (each the % of one sample period a process had a kernel on the SMs):
        per GPU, a process's samples summed over the periods of the process sampled most (a process is
        sampled only in the periods it ran, each on its own clock), then summed over a model's processes and the GPUs; ``all`` sums every
        process sampled. Beside the device's ``util_pct`` (any kernel running) it says how much of a busy GPU
        no process's kernel held: switching between processes' time slices. Empty where NVML keeps no such
        samples (some GPUs; under MPS it may sample only the MPS server)."""
        pct_by_pid: dict[int, float] = {}
        periods: list[int] = []  # per GPU: the sample periods counted (for the reader to judge the figure)
        for h in self.handles:
            try:
                samples = self.nv.nvmlDeviceGetProcessUtilization(h, int(since_wall_s * 1e6))
            except Exception:  # not supported here, or no process sampled since
                continue
            # NVML stamps each process's samples on its own clock (one H200: 14-19 stamps for 5 processes over
            # a run), so the periods are those of the process sampled most: one that ran in every period.
            counts = Counter(int(x.pid) for x in samples)
            if not counts:
                continue
            periods.append(max(counts.values()))
            for x in samples:
                pct_by_pid[int(x.pid)] = pct_by_pid.get(int(x.pid), 0.0) + float(x.smUtil) / periods[-1]
        shares = sm_shares(pct_by_pid, pids_by_model)
        return shares | {"periods": periods} if shares else {}

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            util = [float(self.nv.nvmlDeviceGetUtilizationRates(h).gpu) for h in self.handles]
            power = [self.nv.nvmlDeviceGetPowerUsage(h) / 1000.0 for h in self.handles]
            self._samples.append((time.monotonic(), util, power))

    def start(self) -> None:
        if self.available and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()

    def window(self, t0: float, t1: float) -> dict[str, list[float]]:
        """Mean utilisation (%) and power (W) per GPU between two ``time.monotonic()`` stamps."""
        rows = [s for s in self._samples if t0 <= s[0] <= t1]
        if not rows:
            return {}
        n = len(self.handles)
        return {"util_pct": [sum(r[1][i] for r in rows) / len(rows) for i in range(n)],
                "power_w": [sum(r[2][i] for r in rows) / len(rows) for i in range(n)]}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)


def sm_shares(pct_by_pid: Mapping[int, float], pids_by_model: Mapping[str, Iterable[int]]) -> dict[str, Any]:
    """``{"models": {model: % summed over its pids}, "all": % summed over every pid}``, rounded; {} without samples."""
    if not pct_by_pid:
        return {}
    models = {m: round(sum(pct_by_pid.get(p, 0.0) for p in pids), 1) for m, pids in sorted(pids_by_model.items())}
    return {"models": {m: v for m, v in models.items() if v > 0}, "all": round(sum(pct_by_pid.values()), 1)}
