"""How a wait for the GPU polls, then sleeps (``blockflow.core.cuda.wait_event``), and how long a call
polls (``backend/gpu_waits.py``), with the driver's two calls stood in for (the real ones:
tests/gpu/test_gpu_waits.py)."""

from __future__ import annotations

import time

import pytest

from blockflow.backend import gpu_waits
from blockflow.core import cuda, env
from blockflow.core.errors import BlockError


class _Driver:
    """An event done after ``polls`` queries, and the calls made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, polls: int, rc: int = cuda.CUDA_ERROR_NOT_READY) -> None:
        self.polls, self.queries, self.slept = polls, 0, 0
        lib = type("Lib", (), {"cuEventQuery": self._query})()
        monkeypatch.setattr(cuda, "_lib", lambda: lib)
        monkeypatch.setattr(cuda, "event_synchronize", self._sleep)
        self.rc = rc

    def _query(self, event: object) -> int:
        self.queries += 1
        return 0 if self.queries > self.polls else self.rc

    def _sleep(self, event: int) -> None:
        self.slept += 1


def test_work_done_within_the_poll_is_never_slept_for(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _Driver(monkeypatch, polls=3)
    cuda.wait_event(7, spin_s=10.0)
    assert d.queries == 4 and d.slept == 0


def test_a_wait_sleeps_once_its_poll_is_over_or_at_once_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _Driver(monkeypatch, polls=10**9)
    t0 = time.perf_counter()
    cuda.wait_event(7, spin_s=0.01)
    assert d.slept == 1 and d.queries > 1 and time.perf_counter() - t0 >= 0.01
    d.queries = 0
    cuda.wait_event(7, spin_s=0.0)
    assert d.slept == 2 and d.queries == 0


def test_a_driver_error_while_polling_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    _Driver(monkeypatch, polls=10**9, rc=700)  # CUDA_ERROR_ILLEGAL_ADDRESS

    def check(rc: int, what: str) -> None:  # as cuda._check, without the driver's error names
        if rc:
            raise BlockError(f"{what} failed: {rc}")

    monkeypatch.setattr(cuda, "_check", check)
    with pytest.raises(BlockError, match="cuEventQuery failed: 700"):
        cuda.wait_event(7, spin_s=1.0)


def test_a_call_of_one_request_polls_longer_than_a_call_of_several(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_waits.spin_for(1) == gpu_waits.SPIN_ONE_S > gpu_waits.spin_for(2) == gpu_waits.SPIN_MANY_S > 0
    monkeypatch.delenv(env.GPU_WAIT, raising=False)
    assert gpu_waits.sleeping()
    monkeypatch.setenv(env.GPU_WAIT, "spin")
    assert not gpu_waits.sleeping()
    assert env.switch_problems({env.GPU_WAIT: "nap"}) == [f"{env.GPU_WAIT}='nap' is not one of sleep, spin (its default: sleep)"]
