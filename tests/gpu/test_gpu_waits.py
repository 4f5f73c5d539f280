"""How a block waits for its GPU (``backend/gpu_waits.py``) on a real GPU: a wait returns only once the work
before its event is done, polls no longer than its budget and then sleeps (its thread's CPU time stays far below
the wait), and ``BLOCKFLOW_GPU_WAIT=spin`` waits through the stream as before."""

from __future__ import annotations

import time

import pytest
import torch

from blockflow.backend import gpu_waits
from blockflow.backend.gpu_waits import GpuWaits
from blockflow.core import cuda, env

pytestmark = pytest.mark.gpu

GPU_WORK_CYCLES = 50_000_000  # ~20 ms of one kernel (torch.cuda._sleep)


def _queued_work() -> None:
    """~20 ms of work on the current stream."""
    torch.cuda._sleep(GPU_WORK_CYCLES)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("spin_s", [0.0, 0.005])
def test_a_wait_returns_once_the_work_is_done_and_sleeps_past_its_spin(spin_s: float) -> None:
    torch.ones(1, device="cuda").sum().item()  # the context exists
    event = cuda.event_create()
    try:
        _queued_work()
        cuda.event_record(event, torch.cuda.current_stream().cuda_stream)
        assert not cuda.event_done(event)
        wall, cpu = time.perf_counter(), time.thread_time()
        cuda.wait_event(event, spin_s)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        assert cuda.event_done(event) and torch.cuda.current_stream().query()  # the work is done, not only queued
        assert wall > 0.005, wall  # it did wait for the kernel
        assert cpu < spin_s + 0.5 * wall, (cpu, wall)  # asleep past the budget, not spinning the whole wait
    finally:
        cuda.event_destroy(event)


@pytest.mark.parametrize("mode", ["sleep", "spin"])
def test_a_blocks_stream_wait_covers_its_work_in_either_mode(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.GPU_WAIT, mode)
    torch.ones(1, device="cuda").sum().item()
    waits = GpuWaits(torch.device("cuda", 0), int(torch.cuda.current_stream().cuda_stream))
    assert waits.sleep == (mode == "sleep") == gpu_waits.sleeping()
    for requests in (1, 8):
        _queued_work()
        waits.stream_done(requests)
        assert torch.cuda.current_stream().query(), (mode, requests)  # nothing queued is left
