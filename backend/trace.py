"""Opt-in timing and memory traces of one block instance, for finding where time and memory go.

Set ``BLOCKFLOW_TRACE_DIR`` in the server's environment and every block instance appends
JSON lines to ``<dir>/<model>.<instance>.<pid>.jsonl``:

- ``{"kind": "memory", "step": ..., ...}`` while ``initialize`` runs: this process's GPU memory
  (NVML, by PID) and the device's used memory after each step (start of the stub, CUDA
  context, weights, warm-up, TensorMQ pools, monitor);
- ``{"kind": "execute", "t": [...], "gpu_ms": ..., "n": ...}`` per ``execute`` call: host
  timestamps (``time.perf_counter_ns``, CLOCK_MONOTONIC, so comparable across processes) at
  entry, inputs read, work queued, and return; ``laps``, ``[name, t]`` pairs that end named
  steps inside those phases (``read:gather``, ``run:graph``, ...); and the GPU time between two
  CUDA events around the block's own kernels (after it waited for its producer).

Unset, nothing is created and each call costs one attribute test. ``blockflow.bench.timeline`` and
``blockflow.bench.stub_memory`` read these files. GPU times are collected without stalling the
execute thread: an event pair is read once ``query()`` says it completed, at a later call or
at ``close()``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

import torch

from blockflow.backend.monitor import nvml_handle
from blockflow.core import env, nvml

ENV = env.TRACE_DIR


def trace_dir() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def process_gpu_mib(device: torch.device | None = None) -> dict[str, float]:
    """This process's GPU memory (NVML, by PID) and the device's used memory, in MiB; empty without NVML.

    The GPU is found by UUID (as the block monitor finds it) once torch has initialised CUDA; before
    that, by index, so that the reading itself does not initialise CUDA.
    """
    with nvml.session() as nv:
        if nv is None:
            return {}
        out: dict[str, float] = {}
        if device is not None and device.type == "cuda" and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            h = nvml_handle(nv, device)
        else:
            h = nv.nvmlDeviceGetHandleByIndex((device.index or 0) if device is not None and device.type == "cuda" else 0)
        out["device_used_mib"] = float(nv.nvmlDeviceGetMemoryInfo(h).used) / 2**20
        mine = nvml.pid_gpu_bytes(nv, h, [os.getpid()])
        if os.getpid() in mine:
            out["process_mib"] = mine[os.getpid()] / 2**20
        return out


class Tracer:
    """Writes one block instance's trace lines (see the module docstring)."""

    def __init__(self, directory: Path, model: str, instance: str, device: torch.device) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.device = device
        self._file: IO[str] = (directory / f"{model}.{instance}.{os.getpid()}.jsonl").open("a", buffering=1)
        self._pending: list[tuple[dict[str, Any], Any, Any]] = []
        self._t: list[int] = []
        self._laps: list[tuple[str, int]] = []
        self._start: Any = None

    def memory(self, step: str, **extra: Any) -> None:
        self._write({"kind": "memory", "step": step, "t": time.perf_counter_ns(), **process_gpu_mib(self.device), **extra})

    # Per execute: begin() ... mark() ... gpu_begin() / gpu_end() ... end(n).
    def begin(self) -> None:
        self._t = [time.perf_counter_ns()]
        self._laps = []
        self._start = None
        self._collect(block=False)

    def mark(self) -> None:
        self._t.append(time.perf_counter_ns())

    def lap(self, name: str) -> None:
        """The end of step ``name`` (it began at the previous mark or lap)."""
        self._laps.append((name, time.perf_counter_ns()))

    def gpu_begin(self) -> None:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._start.record()

    def end(self, n: int) -> None:
        self._t.append(time.perf_counter_ns())
        record: dict[str, Any] = {"kind": "execute", "n": n, "t": self._t}
        if self._laps:
            record["laps"] = self._laps
        if self._start is not None:
            stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            stop.record()
            self._pending.append((record, self._start, stop))
        else:
            self._write(record)

    def _collect(self, block: bool) -> None:
        while self._pending:
            record, start, stop = self._pending[0]
            if not block and not stop.query():
                return
            stop.synchronize()
            record["gpu_ms"] = start.elapsed_time(stop)
            self._write(record)
            self._pending.pop(0)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._collect(block=True)
        self._file.close()
