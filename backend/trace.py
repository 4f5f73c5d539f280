"""Opt-in timing and memory traces of one block instance, for finding where time and memory go.

Set ``BLOCKFLOW_TRACE_DIR`` in the server's environment and every block instance appends
JSON lines to ``<dir>/<model>.<instance>.<pid>.jsonl``:

- ``{"kind": "memory", "step": ..., ...}`` while ``initialize`` runs: this process's GPU memory
  (NVML, by PID) and the device's used memory after each step (start of the stub, CUDA
  context, weights, warm-up, TensorMQ pools, monitor);
- ``{"kind": "execute", "t": [...], "gpu_ms": ..., "n": ...}`` per ``execute`` call: host
  timestamps (``time.perf_counter_ns``, CLOCK_MONOTONIC, so comparable across processes) at
  entry, inputs read, work queued, and return; ``laps``, ``[name, t]`` pairs that end named
  steps inside those phases (``read:decode``, ``run:replay``, ...: ``blockflow.bench.timeline``'s
  report names them); and the GPU time between two CUDA events around the block's own kernels
  (after it waited for its producer).

Unset, the block gets a :class:`NoTracer`: nothing is created and each step costs one empty call. ``blockflow.bench.timeline`` and
``blockflow.bench.stub_memory`` read these files. What a traced ``execute`` does beyond the untraced
one is kept small, as it is part of what the trace measures: timestamps, laps and two CUDA event
records (events from a free list, not created per call). Reading the events and writing the lines
happen on a thread of its own every ``FLUSH_S`` seconds, one record at a time with the GIL given
up between them, and at ``close()``; so an ``execute`` line lands up to that long after the call.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from blockflow.backend.monitor import nvml_handle
from blockflow.core import env, nvml
from blockflow.core.threads import named_thread

ENV = env.TRACE_DIR
FLUSH_S = 0.2  # how often the writer thread reads finished calls' events and writes their lines


def trace_dir() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def tracer_for(model: str, instance: str, device: torch.device) -> Tracer | NoTracer:
    """The tracer of one block instance: a :class:`Tracer` where ``BLOCKFLOW_TRACE_DIR`` is set, else a :class:`NoTracer`."""
    directory = trace_dir()
    return Tracer(directory, model, instance, device) if directory else NoTracer()


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


class NoTracer:
    """The tracer of an untraced block instance: every step is an empty call, and the block's parts get no lap."""

    part_lap: Callable[[str], None] | None = None

    def start(self) -> None:
        pass

    def memory(self, step: str, **extra: Any) -> None:
        pass

    def begin(self) -> None:
        pass

    def mark(self) -> None:
        pass

    def lap(self, name: str) -> None:
        pass

    def gpu_begin(self) -> None:
        pass

    def end(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class Tracer:
    """Writes one block instance's trace lines (see the module docstring)."""

    def __init__(self, directory: Path, model: str, instance: str, device: torch.device) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.device = device
        # Handed to the consumer, the runner and the producer, which time the hop's finer steps with it
        # (None untraced: they then skip even the call).
        self.part_lap: Callable[[str], None] | None = self.lap
        self._file: IO[str] = (directory / f"{model}.{instance}.{os.getpid()}.jsonl").open("a", buffering=1)
        # Records of finished calls, with their event pair (or None), for the writer thread. deque's
        # append and popleft are atomic, so the execute thread takes no lock.
        self._pending: deque[tuple[dict[str, Any], tuple[Any, Any] | None]] = deque()
        self._free: list[tuple[Any, Any]] = []  # event pairs whose times were read
        self._t: list[int] = []
        self._laps: list[tuple[str, int]] = []
        self._events: tuple[Any, Any] | None = None
        # The block's stream (torch's current one, fixed for the instance's life), fetched at the first
        # call (not here: the first memory line comes before CUDA starts). An event's record() without
        # it asks torch for the current stream, several Python and torch calls per event.
        self._stream: Any = None
        self._stop = threading.Event()
        self._writer = named_thread(self._write_loop, "bf-trace")
        self._writer.start()

    def start(self) -> None:
        """The first memory lines: the stub's start and, on a GPU, its CUDA context (made here to measure it)."""
        self.memory("start", cuda_module_loading=os.environ.get("CUDA_MODULE_LOADING"))
        if self.device.type == "cuda":
            torch.zeros(1, device=self.device)
            self.memory("context")

    def memory(self, step: str, **extra: Any) -> None:
        self._write({"kind": "memory", "step": step, "t": time.perf_counter_ns(), **process_gpu_mib(self.device), **extra})

    # Per execute: begin(), then mark(), lap() and gpu_begin() as the call goes, then end(n).
    def begin(self) -> None:
        self._t = [time.perf_counter_ns()]
        self._laps = []
        self._events = None

    def mark(self) -> None:
        self._t.append(time.perf_counter_ns())

    def lap(self, name: str) -> None:
        """The end of step ``name`` (it began at the previous mark or lap)."""
        self._laps.append((name, time.perf_counter_ns()))

    def gpu_begin(self) -> None:
        if self.device.type == "cuda":
            pair = self._free.pop() if self._free else (torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
                                                        torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
            if self._stream is None:
                self._stream = torch.cuda.current_stream(self.device)
            pair[0].record(self._stream)
            self._events = pair

    def end(self, n: int) -> None:
        self._t.append(time.perf_counter_ns())
        record: dict[str, Any] = {"kind": "execute", "n": n, "t": self._t}
        if self._laps:
            record["laps"] = self._laps
        if self._events is not None:
            self._events[1].record(self._stream)
        self._pending.append((record, self._events))

    def _collect(self, block: bool) -> None:
        """Write the pending records whose events completed (all of them if ``block``), oldest first."""
        while self._pending:
            record, pair = self._pending[0]
            if pair is not None:
                if not block and not pair[1].query():
                    return
                pair[1].synchronize()
                record["gpu_ms"] = pair[0].elapsed_time(pair[1])
                self._free.append(pair)
            self._write(record)
            self._pending.popleft()
            if not block:
                time.sleep(0)  # gives the GIL to a block whose request arrived meanwhile

    def _write_loop(self) -> None:
        on_device = self.device.type != "cuda"
        while not self._stop.wait(FLUSH_S):
            if not on_device and self._pending:
                # Only once a call was traced: the block's CUDA context exists by then, and setting the
                # device earlier would make one before the first memory line (stub_memory reads it).
                torch.cuda.set_device(self.device)
                on_device = True
            self._collect(block=False)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._stop.set()
        self._writer.join(5)
        self._collect(block=True)
        self._file.close()
