"""The few CUDA driver calls TensorMQ and the blocks' waits need, through ctypes on ``libcuda.so.1``.

The driver API works on the context PyTorch made current (its primary context),
needs nothing beyond the driver, and exposes the IPC handles as plain bytes
(no pickling, no torch internals). Every call is checked.
"""

from __future__ import annotations

import ctypes
import time
from functools import cache
from typing import Any

from blockflow.core import env
from blockflow.core.errors import BlockError

IPC_HANDLE_BYTES = 64
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
CU_EVENT_BLOCKING_SYNC = 0x1
CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4
CUDA_ERROR_NOT_READY = 600  # cuEventQuery: the work before the event is not done yet
# How a host thread waits for the GPU in a context (cuDevicePrimaryCtxSetFlags): the driver's default
# ("auto") spins while the process has fewer contexts than the machine has cores, as every block has.
CU_CTX_SCHED = {"auto": 0x0, "spin": 0x1, "yield": 0x2, "blocking": 0x4}
CU_CTX_SCHED_MASK = 0x7


class _IpcHandle(ctypes.Structure):
    # Bytes, not c_char: a c_char array field reads back truncated at its first NUL.
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]

    @classmethod
    def of(cls, raw: bytes) -> _IpcHandle:
        if len(raw) != IPC_HANDLE_BYTES:
            raise BlockError(f"CUDA IPC handle must be {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
        h = cls()
        ctypes.memmove(ctypes.byref(h), raw, IPC_HANDLE_BYTES)
        return h

    def raw(self) -> bytes:
        return ctypes.string_at(ctypes.byref(self), IPC_HANDLE_BYTES)


@cache
def _lib() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise BlockError(f"TensorMQ on a GPU needs the CUDA driver (libcuda.so.1): {exc}") from exc
    P, u64, vp = ctypes.POINTER, ctypes.c_uint64, ctypes.c_void_p
    signatures: dict[str, list[Any]] = {
        "cuMemAlloc_v2": [P(u64), ctypes.c_size_t],
        "cuMemFree_v2": [u64],
        "cuIpcGetMemHandle": [P(_IpcHandle), u64],
        "cuIpcOpenMemHandle_v2": [P(u64), _IpcHandle, ctypes.c_uint],  # the handle goes by value
        "cuIpcCloseMemHandle": [u64],
        "cuEventCreate": [P(vp), ctypes.c_uint],
        "cuIpcGetEventHandle": [P(_IpcHandle), vp],
        "cuIpcOpenEventHandle": [P(vp), _IpcHandle],
        "cuEventDestroy_v2": [vp],
        "cuEventRecord": [vp, vp],
        "cuEventSynchronize": [vp],
        "cuEventQuery": [vp],
        "cuStreamWaitEvent": [vp, vp, ctypes.c_uint],
        "cuMemcpyAsync": [u64, u64, ctypes.c_size_t, vp],
        "cuMemHostRegister_v2": [vp, ctypes.c_size_t, ctypes.c_uint],
        "cuMemHostUnregister": [vp],
        "cuGetErrorName": [ctypes.c_int, P(ctypes.c_char_p)],
        "cuInit": [ctypes.c_uint],
        "cuDeviceGet": [P(ctypes.c_int), ctypes.c_int],
        "cuDevicePrimaryCtxSetFlags_v2": [ctypes.c_int, ctypes.c_uint],
        "cuDevicePrimaryCtxGetState": [ctypes.c_int, P(ctypes.c_uint), P(ctypes.c_int)],
        "cuCtxGetFlags": [P(ctypes.c_uint)],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(rc, ctypes.byref(name))
        raise BlockError(f"CUDA driver call {what} failed: {name.value.decode() if name.value else rc}")


def mem_alloc(nbytes: int) -> int:
    ptr = ctypes.c_uint64()
    _check(_lib().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cuMemAlloc")
    return int(ptr.value)


def mem_free(ptr: int) -> None:
    _check(_lib().cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree")


def ipc_mem_handle(ptr: int) -> bytes:
    h = _IpcHandle()
    _check(_lib().cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(ptr)), "cuIpcGetMemHandle")
    return h.raw()


def ipc_open_mem(handle: bytes) -> int:
    h = _IpcHandle.of(handle)
    ptr = ctypes.c_uint64()
    _check(_lib().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
    return int(ptr.value)


def ipc_close_mem(ptr: int) -> None:
    _check(_lib().cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")


def event_create_ipc() -> int:
    # Other processes wait for it on the GPU only. A host thread's wait on it spins a core whatever the
    # blocking-sync flag (H200, 2026-12-02), so release threads wait on events of their own
    # (backend/gpu_waits.py); the flag stays for BLOCKFLOW_GPU_WAIT=spin, where they wait on it.
    return event_create(CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS | CU_EVENT_BLOCKING_SYNC)


def event_create(flags: int = CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC) -> int:
    ev = ctypes.c_void_p()
    _check(_lib().cuEventCreate(ctypes.byref(ev), flags), "cuEventCreate")
    return int(ev.value or 0)


def event_synchronize(event: int) -> None:
    """Wait for ``event`` (ctypes drops the GIL meanwhile; a blocking-sync event sleeps instead of spinning)."""
    _check(_lib().cuEventSynchronize(ctypes.c_void_p(event)), "cuEventSynchronize")


def event_done(event: int) -> bool:
    """Whether the work before ``event`` is done (``cuEventQuery``; never waits)."""
    rc = _lib().cuEventQuery(ctypes.c_void_p(event))
    if rc == CUDA_ERROR_NOT_READY:
        return False
    _check(rc, "cuEventQuery")
    return True


def wait_event(event: int, spin_s: float) -> None:
    """Wait for a blocking-sync ``event``: polled for up to ``spin_s`` (a thread woken from sleep
    answers tens of microseconds later), then asleep in ``cuEventSynchronize`` (no core spun)."""
    if spin_s > 0:
        end = time.perf_counter() + spin_s
        while not event_done(event):
            if time.perf_counter() >= end:
                break
        else:
            return
    event_synchronize(event)


def ipc_event_handle(event: int) -> bytes:
    h = _IpcHandle()
    _check(_lib().cuIpcGetEventHandle(ctypes.byref(h), ctypes.c_void_p(event)), "cuIpcGetEventHandle")
    return h.raw()


def ipc_open_event(handle: bytes) -> int:
    h = _IpcHandle.of(handle)
    ev = ctypes.c_void_p()
    _check(_lib().cuIpcOpenEventHandle(ctypes.byref(ev), h), "cuIpcOpenEventHandle")
    return int(ev.value or 0)


def event_destroy(event: int) -> None:
    _check(_lib().cuEventDestroy_v2(ctypes.c_void_p(event)), "cuEventDestroy")


def event_record(event: int, stream: int) -> None:
    _check(_lib().cuEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)), "cuEventRecord")


def stream_wait_event(stream: int, event: int) -> None:
    _check(_lib().cuStreamWaitEvent(ctypes.c_void_p(stream), ctypes.c_void_p(event), 0), "cuStreamWaitEvent")


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Copy ``nbytes`` between two device (or pinned host) addresses on ``stream`` (unified
    addressing tells the driver which is which). A few microseconds of host time where
    ``Tensor.copy_`` takes tens: it is on every request's path."""
    _check(_lib().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")


def mem_host_register(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for the current context: copies from it to
    the GPU become DMA, asynchronous to the host (no staging copy by the driver)."""
    _check(_lib().cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), 0), "cuMemHostRegister")


def mem_host_unregister(ptr: int) -> None:
    _check(_lib().cuMemHostUnregister(ctypes.c_void_p(ptr)), "cuMemHostUnregister")


def _device(ordinal: int) -> ctypes.c_int:
    _check(_lib().cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _check(_lib().cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    return dev


def set_schedule(ordinal: int, mode: str) -> None:
    """How host threads of this process wait for GPU ``ordinal`` (a key of :data:`CU_CTX_SCHED`): set on its
    primary context (the one torch uses) before that context is made, as it reads the flag then."""
    if mode not in CU_CTX_SCHED:
        raise BlockError(f"unknown CUDA wait mode {mode!r} ({env.CUDA_SCHEDULE}): one of {', '.join(CU_CTX_SCHED)}")
    dev = _device(ordinal)
    flags, active = ctypes.c_uint(), ctypes.c_int()
    _check(_lib().cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)), "cuDevicePrimaryCtxGetState")
    if active.value:
        raise BlockError(f"the CUDA context of GPU {ordinal} is made already: {env.CUDA_SCHEDULE} must be set "
                         "before anything in the process uses the GPU")
    new = (flags.value & ~CU_CTX_SCHED_MASK) | CU_CTX_SCHED[mode]
    _check(_lib().cuDevicePrimaryCtxSetFlags_v2(dev, new), "cuDevicePrimaryCtxSetFlags")


def schedule() -> str:
    """The wait mode of the calling thread's current context, as the driver runs it (a key of :data:`CU_CTX_SCHED`)."""
    flags = ctypes.c_uint()
    _check(_lib().cuCtxGetFlags(ctypes.byref(flags)), "cuCtxGetFlags")
    mode = flags.value & CU_CTX_SCHED_MASK
    return next((k for k, v in CU_CTX_SCHED.items() if v == mode), hex(mode))


class DeviceBytes:
    """Just enough ``__cuda_array_interface__`` for ``torch.as_tensor`` to wrap raw device memory as bytes."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}
