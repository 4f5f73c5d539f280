"""Finding the mapping a host input lives in (the Python backend's /dev/shm region), on the CPU."""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

from blockflow.backend import host_pins
from blockflow.backend.host_pins import HostPins


@pytest.fixture
def segment() -> Iterator[shared_memory.SharedMemory]:
    seg = shared_memory.SharedMemory(create=True, size=1 << 20)
    yield seg
    seg.close()
    seg.unlink()


def test_a_shared_memory_address_is_found_in_its_dev_shm_mapping(segment: shared_memory.SharedMemory) -> None:
    a = np.ndarray((1024,), dtype=np.uint8, buffer=segment.buf)
    found = host_pins._mapping_of(a.ctypes.data + 100)
    assert found is not None
    start, end, path = found
    assert path.startswith("/dev/shm/") and path.endswith(segment.name)
    assert start <= a.ctypes.data < a.ctypes.data + 1024 <= end
    assert host_pins._mapping_of(0) is None


def test_a_mapping_that_cannot_be_registered_is_learned_once(segment: shared_memory.SharedMemory,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a CUDA driver (this machine) registration fails: the copies stay staged, and the
    mapping is not looked up again for the next input in it."""
    a = np.ndarray((4096,), dtype=np.uint8, buffer=segment.buf)
    pins = HostPins()
    calls: list[int] = []
    real = host_pins._mapping_of

    def counted(ptr: int) -> tuple[int, int, str] | None:
        calls.append(ptr)
        return real(ptr)

    monkeypatch.setattr(host_pins, "_mapping_of", counted)
    assert pins.pinned(a.ctypes.data, 1024) is False
    assert pins.pinned(a.ctypes.data + 2048, 1024) is False
    assert len(calls) == 1 and not pins.any_pinned
    heap = np.zeros(1 << 16, dtype=np.uint8)  # not shared memory: never registered
    assert pins.pinned(heap.ctypes.data, heap.nbytes) is False
    assert len(calls) == 2


def test_a_mapping_found_again_with_other_bounds_replaces_the_ranges_it_overlaps(
        segment: shared_memory.SharedMemory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered range that a new mapping overlaps (here: the same start, grown) is released
    before the new one is registered, so no registration covers only part of a mapping."""
    a = np.ndarray((4096,), dtype=np.uint8, buffer=segment.buf)
    start, end, path = host_pins._mapping_of(a.ctypes.data) or (0, 0, "")
    driver: list[tuple[str, int, int]] = []
    monkeypatch.setattr(host_pins.cuda, "mem_host_register", lambda p, n: driver.append(("register", p, n)))
    monkeypatch.setattr(host_pins.cuda, "mem_host_unregister", lambda p: driver.append(("unregister", p, 0)))
    pins = HostPins()
    assert pins.pinned(a.ctypes.data, 1024) is True and pins.any_pinned
    assert driver == [("register", start, end - start)]
    grown = end + (1 << 20)
    monkeypatch.setattr(host_pins, "_mapping_of", lambda ptr: (start, grown, path))
    assert pins.pinned(end + 100, 1024) is True
    assert driver[1:] == [("unregister", start, 0), ("register", start, grown - start)]
    assert pins.pinned(end + 200, 1024) is True and len(driver) == 3  # answered from the new range
    pins.close()
    assert driver[3:] == [("unregister", start, 0)]
