"""How a block's threads wait for its GPU work (``BLOCKFLOW_GPU_WAIT``).

A CUDA context spins a core in every wait by default (``cuda.CU_CTX_SCHED``: fewer contexts than
cores). Under load a block waits milliseconds a call for a GPU that other processes' work shares,
so each instance's spinning thread takes a core the server's own threads need (one H200, the chain
at c256: the join's ``execute`` thread and the links' release threads were ~40% of the split's host
CPU). So by default (``sleep``) a wait polls its event for a moment and then sleeps: up to
``SPIN_ONE_S`` for a call of one request (a lightly loaded server, where a wake-up's tens of
microseconds would show in the latency and cores are free), ``SPIN_MANY_S`` for a call of several.
A release thread, which no request waits for, sleeps at once on an event of its own
(``TensorMQEnds.end``). ``spin`` keeps the context's own spinning waits for a call's stream and the
release threads' waits on their slots' interprocess events (the waits for a first block's input copies
and for the release threads' own events sleep either way: blocking-sync events).

Inside a stub only.
"""

from __future__ import annotations

import os

import torch

from blockflow.core import cuda, env

SPIN_ONE_S = 0.002  # covers a batch-1 ResNet-50's whole network on the GPU (≈ 0.9-1.0 ms on an H200)
SPIN_MANY_S = 0.0001


def sleeping() -> bool:
    """Whether this process's waits sleep (``BLOCKFLOW_GPU_WAIT`` unset or ``sleep``)."""
    return os.environ.get(env.GPU_WAIT, "") != "spin"


def spin_for(requests: int) -> float:
    """How long a call of ``requests`` requests polls before it sleeps."""
    return SPIN_ONE_S if requests <= 1 else SPIN_MANY_S


class GpuWaits:
    """A block instance's wait for the work queued so far on its stream."""

    def __init__(self, device: torch.device, stream: int) -> None:
        self.device, self.stream = device, stream
        self.sleep = device.type == "cuda" and sleeping()
        self._done = cuda.event_create() if self.sleep else 0  # blocking-sync: its synchronize sleeps

    def spin_s(self, requests: int) -> float:
        """How long a call of ``requests`` requests polls a blocking-sync event before it sleeps on it; 0 with
        ``BLOCKFLOW_GPU_WAIT=spin``, where such a wait sleeps at once, as it did before the poll."""
        return spin_for(requests) if self.sleep else 0.0

    def stream_done(self, requests: int) -> None:
        """Until the stream's work queued so far is done (``requests``: the call's, for how long to poll)."""
        if self.device.type != "cuda":
            return  # a CPU block's work is done when its call returns
        if not self.sleep:
            torch.cuda.current_stream(self.device).synchronize()
            return
        cuda.event_record(self._done, self.stream)
        cuda.wait_event(self._done, spin_for(requests))

    def close(self) -> None:
        if self._done:
            cuda.event_destroy(self._done)
            self._done = 0
