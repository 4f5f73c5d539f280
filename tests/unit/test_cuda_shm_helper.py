"""Which memory a CUDA input region takes (tritonclient's helper where it runs, else BlockFlow's driver calls),
and the region's order with the helper — created, registered, written, unregistered, freed — against a stand-in
helper and client (no GPU; the real helper on a GPU: tests/gpu/test_cuda_shm_helper.py)."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from blockflow.clients import cuda_shm
from blockflow.clients.cuda_shm import HELPER, CudaInputRegion, tritonclient_helper
from blockflow.core.errors import ClientError

RAW = bytes(range(64))


class _Handle:
    """cuda-bindings 13's cudaIpcMemHandle_t: bytes through getPtr(), no ``reserved``."""

    def getPtr(self) -> int:  # noqa: N802 - cuda-bindings' name
        return 0


def _helper(calls: list[tuple[Any, ...]], reads_handles: bool = True, fails_create: bool = False) -> ModuleType:
    """A stand-in for tritonclient.utils.cuda_shared_memory that records its calls in ``calls``."""
    h = ModuleType(HELPER)
    h.cudart = SimpleNamespace(cudaIpcMemHandle_t=_Handle)  # type: ignore[attr-defined]

    def get_raw_handle(region: Any) -> bytes:
        if not reads_handles:
            region._cuda_shm_handle.reserved  # noqa: B018 - what 2.60-2.71 read: gone in cuda-bindings 13
        return base64.b64encode(RAW)

    def create_shared_memory_region(name: str, byte_size: int, device: int) -> Any:
        if fails_create:
            raise RuntimeError("unable to create cuda shared memory handle")
        calls.append(("create", name, byte_size, device))
        return SimpleNamespace(_cuda_shm_handle=_Handle(), name=name)

    h.get_raw_handle = get_raw_handle  # type: ignore[attr-defined]
    h.create_shared_memory_region = create_shared_memory_region  # type: ignore[attr-defined]
    h.set_shared_memory_region = lambda region, arrays: calls.append(("set", [a.copy() for a in arrays]))  # type: ignore[attr-defined]
    h.set_shared_memory_region_from_dlpack = lambda region, xs: calls.append(("dlpack", xs))  # type: ignore[attr-defined]
    h.destroy_shared_memory_region = lambda region: calls.append(("destroy", region.name))  # type: ignore[attr-defined]
    return h


class _Client:
    def __init__(self, calls: list[tuple[Any, ...]], refuse: str = "") -> None:
        self.calls, self.refuse = calls, refuse

    def register_cuda_shared_memory(self, name: str, raw: str, device: int, byte_size: int,
                                    headers: dict[str, str] | None = None) -> None:
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.calls.append(("register", name, raw, device, byte_size, headers))

    def unregister_cuda_shared_memory(self, name: str, headers: dict[str, str] | None = None) -> None:
        self.calls.append(("unregister", name, headers))


@pytest.fixture
def fresh() -> Iterator[None]:
    tritonclient_helper.cache_clear()
    yield
    tritonclient_helper.cache_clear()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, fresh: None) -> list[tuple[Any, ...]]:
    found: list[tuple[Any, ...]] = []
    monkeypatch.setitem(sys.modules, HELPER, _helper(found))
    return found


def test_the_helper_is_taken_where_it_imports_and_reads_cuda_bindings_handles(calls: list[tuple[Any, ...]]) -> None:
    helper, why_not = tritonclient_helper()
    assert helper is sys.modules[HELPER] and why_not == ""


class _NoCudart:
    """Fails the helper's import as 2.50-2.59 fail on cuda-python 13."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == HELPER:
            raise ImportError("cannot import name 'cudart' from 'cuda' (unknown location)")


def _no_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, HELPER, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoCudart(), *sys.meta_path])


def test_a_helper_that_does_not_import_leaves_the_regions_to_blockflow(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    _no_helper(monkeypatch)
    helper, why_not = tritonclient_helper()
    assert helper is None and why_not == f"{HELPER}: ImportError: cannot import name 'cudart' from 'cuda' (unknown location)"


def test_a_helper_that_reads_handles_from_reserved_leaves_the_regions_to_blockflow(monkeypatch: pytest.MonkeyPatch,
                                                                                   fresh: None) -> None:
    monkeypatch.setitem(sys.modules, HELPER, _helper([], reads_handles=False))  # 2.60-2.71 on cuda-bindings 13
    helper, why_not = tritonclient_helper()
    assert helper is None and "AttributeError" in why_not and "reserved" in why_not


def test_the_installed_helper_is_checked_without_a_gpu(fresh: None) -> None:
    helper, why_not = tritonclient_helper()  # whatever is installed: an answer, never an exception
    assert (helper is None) == bool(why_not)


def test_a_region_from_the_helper_registers_writes_and_unregisters_before_it_is_freed(calls: list[tuple[Any, ...]]) -> None:
    headers = {"x-blockflow-shm-key": "k"}
    region = CudaInputRegion(_Client(calls), "r", 4 * 2 * 3 * 4 * 4, 1, headers)
    assert region.allocated_by == "tritonclient"
    assert calls == [("create", "r", 384, 1), ("register", "r", base64.b64encode(RAW).decode(), 1, 384, headers)]
    x = np.arange(2 * 3 * 4 * 4, dtype=np.float64).reshape(2, 3, 4, 4)
    assert region.write(x) == 384
    assert calls[-1][0] == "set" and calls[-1][1][0].dtype == np.float32 and np.array_equal(calls[-1][1][0], x)
    assert region.write(torch.from_numpy(x[:1])) == 192  # a CPU tensor goes the numpy way (torch takes no stream there)
    assert calls[-1][0] == "set" and np.array_equal(calls[-1][1][0], x[:1])
    with pytest.raises(ClientError, match="do not fit region 'r' of 384"):
        region.write(np.zeros((3, 3, 4, 4), np.float32))
    region.close()
    region.close()  # once only
    assert [c[0] for c in calls[-2:]] == ["unregister", "destroy"]


def test_a_refused_region_is_freed_and_names_the_key(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    found: list[tuple[Any, ...]] = []
    monkeypatch.setitem(sys.modules, HELPER, _helper(found))
    with pytest.raises(ClientError, match="shared-memory key"):
        CudaInputRegion(_Client(found, refuse="this API is restricted"), "r", 64)
    assert [c[0] for c in found] == ["create", "destroy"]


def test_no_gpu_for_the_helper_names_the_fix(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    monkeypatch.setitem(sys.modules, HELPER, _helper([], fails_create=True))
    with pytest.raises(ClientError, match=r"need a CUDA GPU 3 on this machine \(unable to .*input_memory='host'"):
        CudaInputRegion(_Client([]), "r", 64, 3)


def test_without_the_helper_regions_are_allocated_by_hand(monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    _no_helper(monkeypatch)
    made: list[int] = []

    def hand(byte_size: int, device: int) -> _Hand:
        made.append(byte_size)
        return _Hand()

    monkeypatch.setattr(cuda_shm, "_HandMemory", hand)
    region = CudaInputRegion(_Client([]), "r", 64)
    assert made == [64] and region.allocated_by == "blockflow"


class _Hand:
    allocated_by, raw_handle = "blockflow", "h"
