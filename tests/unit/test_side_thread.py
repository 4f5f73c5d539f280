"""A block's side thread: its task runs while the caller goes on, and what it raises reaches the caller."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from blockflow.backend.side_thread import SideThread


@pytest.fixture
def side() -> Iterator[SideThread]:
    t = SideThread("test-side", torch.device("cpu"))
    yield t
    t.close()


def test_the_task_overlaps_the_caller(side: SideThread) -> None:
    # The task waits for the caller: start() must return before the task ends, or this would hang.
    caller_went_on = threading.Event()
    ran_on: list[str] = []

    def task() -> None:
        assert caller_went_on.wait(5)
        ran_on.append(threading.current_thread().name)

    side.start(task)
    caller_went_on.set()
    side.wait()
    assert ran_on == ["test-side"]


def test_what_the_task_raises_reaches_wait_and_the_thread_goes_on(side: SideThread) -> None:
    def fails() -> None:
        raise ValueError("graph replay failed")

    side.start(fails)
    with pytest.raises(ValueError, match="graph replay failed"):
        side.wait()
    done: list[int] = []
    side.start(lambda: done.append(1))
    side.wait()
    assert done == [1]


def test_one_task_at_a_time(side: SideThread) -> None:
    release = threading.Event()
    side.start(release.wait)
    with pytest.raises(RuntimeError, match="before the last task was waited for"):
        side.start(lambda: None)
    release.set()
    side.wait()
    side.wait()  # nothing running: returns at once


def test_close_stops_the_thread() -> None:
    t = SideThread("test-side-close", torch.device("cpu"))
    t.close()
    assert not t._thread.is_alive()
