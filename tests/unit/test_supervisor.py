"""The supervisor's restart policy (blockflow.control.supervisor), on a clock of its own: a server that keeps dying
is brought back with a growing back-off and never ends ``serve``; one that cannot start at all does, after a few tries.
A killed real tritonserver brought back is tests/integration/test_apply.py's."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from blockflow.control import supervisor as sup
from blockflow.control.metrics import ServeMetrics
from blockflow.core.errors import ServerError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StandInServer:
    """What the supervisor asks of a TritonServer: its process, stop and start (which may fail), heal."""

    def __init__(self) -> None:
        self.code: int | None = None  # None: running
        self.process = SimpleNamespace(poll=lambda: self.code, returncode=None)
        self.starts: list[float] = []
        self.failing_starts = 0
        self.clock: Clock | None = None

    def die(self, code: int = -11) -> None:
        self.code = code
        self.process.returncode = code

    def stop(self) -> None:
        pass

    def start(self, timeout: float) -> None:
        assert self.clock is not None
        self.starts.append(self.clock.now)
        if self.failing_starts:
            self.failing_starts -= 1
            raise ServerError("tritonserver exited with code 1 during start-up")
        self.code = None

    def heal(self, expected: dict[str, int], timeout: float) -> list[str]:
        return []


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> tuple[sup.Supervisor, StandInServer, Clock, list[str]]:
    clock = Clock()
    monkeypatch.setattr(sup.time, "monotonic", clock)
    server = StandInServer()
    server.clock = clock
    said: list[str] = []
    controller: Any = SimpleNamespace(plan=SimpleNamespace(raw=SimpleNamespace(name="p")), expected={}, metrics=ServeMetrics())
    s = sup.Supervisor(server, controller, threading.Lock(), backoff_s=1.0, max_backoff_s=60.0, stable_s=300.0,  # type: ignore[arg-type]
                       max_failed_starts=3, say=said.append)
    return s, server, clock, said


def _run_for(s: sup.Supervisor, clock: Clock, seconds: float, step: float = 0.25) -> None:
    end = clock.now + seconds
    while clock.now < end:
        s.check()
        clock.now += step


def test_a_server_that_served_long_is_brought_back_at_once(setup: tuple[sup.Supervisor, StandInServer, Clock, list[str]]) -> None:
    s, server, clock, said = setup
    clock.now += 600  # up for ten minutes
    server.die()
    s.check()
    assert server.starts == [clock.now] and s.restarts == 1
    assert said[0] == "tritonserver exited (code -11); restarting it with plan 'p'" and "again after" in said[1]


def test_a_server_that_keeps_dying_keeps_being_brought_back_with_a_growing_back_off(
        setup: tuple[sup.Supervisor, StandInServer, Clock, list[str]]) -> None:
    s, server, clock, said = setup
    clock.now += 600
    deaths = []
    for _ in range(12):  # a client that crashes it as soon as it is back, twelve times
        server.die()
        deaths.append(clock.now)
        before = len(server.starts)
        while len(server.starts) == before:
            s.check()
            clock.now += 0.25
    waits = [round(start - death) for start, death in zip(server.starts, deaths, strict=True)]
    assert waits == [0, 1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60]  # never more than max_backoff_s apart, never given up
    assert s.restarts == 12 and any("in 60 s" in m for m in said)
    assert b"blockflow_tritonserver_restarts_total 12.0" in s.controller.metrics.text()
    # Up for stable_s: the next death is brought back at once again.
    _run_for(s, clock, 301)
    server.die()
    s.check()
    assert server.starts[-1] == clock.now


def test_a_server_that_cannot_start_ends_serve_after_a_few_tries(setup: tuple[sup.Supervisor, StandInServer, Clock, list[str]]) -> None:
    s, server, clock, said = setup
    server.die()
    server.failing_starts = 2  # two failed starts, then one that works: serving goes on
    _run_for(s, clock, 30)
    assert len(server.starts) == 3 and server.code is None and s.restarts == 1
    assert sum("did not start" in m for m in said) == 2
    server.die()
    server.failing_starts = 3
    with pytest.raises(ServerError, match="could not start 3 times in a row; giving up"):
        _run_for(s, clock, 120)
    assert b"blockflow_tritonserver_failed_starts_total 5.0" in s.controller.metrics.text()


def test_serve_metrics_lint_clean_with_promtool() -> None:
    """The families serve exports pass Prometheus' own lint (names, _total counters, help, types)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    promtool = shutil.which("promtool", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: scripts/setup.sh installs Debian's prometheus package into the venv")
        pytest.skip("promtool is not installed (scripts/setup.sh installs it)")
    m = ServeMetrics()
    m.serving("default", "version: 1\n")
    m.applies.labels("ok").inc()
    text = m.text()
    assert b'blockflow_plan_info{digest="' in text and b'name="default"} 1.0' in text
    assert b'blockflow_plan_applies_total{result="ok"} 1.0' in text and b'blockflow_plan_rollbacks_total{result="failed"} 0.0' in text
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert res.returncode == 0, (res.stdout + res.stderr).decode()
