"""CUDA shared-memory inputs: images that go from the client's GPU memory to Triton without a host copy.

A region is one device allocation of its own (so its CUDA IPC handle covers exactly it), registered
with the server under a name; a request then names the region instead of carrying the tensor. The
server must run on the same machine and see the same GPU.
Lifetime: the client owns the memory; :meth:`CudaInputRegion.close` unregisters the region
first and frees it after, so the server never holds a handle to freed memory. A region is
rewritten per request and the server reads it while it serves that request, so one region
serves one request at a time: ``TaskClient`` keeps one, ``AsyncTaskClient`` one per call in flight.

The memory comes from tritonclient's own helper, ``tritonclient.utils.cuda_shared_memory``, where it
runs (:func:`tritonclient_helper`): one ``cudaMalloc`` per region, numpy images copied from the host,
torch CUDA images device to device through DLPack; numpy images then need no torch. Elsewhere it
comes from BlockFlow's driver calls (``blockflow.core.cuda``, one ``cuMemAlloc``), written through torch.

    with TaskClient("127.0.0.1:8000", input_memory="cuda") as c:   # numpy or torch CUDA images
        logits = c.infer("cls_a", images)
"""

from __future__ import annotations

import base64
import importlib
import os
import sys
from functools import cache
from types import SimpleNamespace
from typing import Any

import numpy as np

from blockflow.core import cuda
from blockflow.core.errors import ClientError

HELPER = "tritonclient.utils.cuda_shared_memory"


@cache
def tritonclient_helper() -> tuple[Any | None, str]:
    """tritonclient's CUDA shared-memory helper, or None and why it cannot run here.

    It runs on cuda-python's runtime bindings, which each tritonclient line reaches in its own way:
    2.50-2.59 ``from cuda import cudart`` (gone in cuda-python 13) and ``import pkg_resources``
    (gone in setuptools 82); 2.60-2.71 ``import cuda.bindings.runtime`` but still ``pkg_resources``,
    and read a region's IPC handle from ``cudaIpcMemHandle_t.reserved`` (gone in cuda-bindings 13);
    2.73 reads it through ``getPtr()``, which cuda-bindings 13 keeps. So on cuda-bindings 13 (what torch's
    CUDA 13 wheels install) only 2.73 and later run; ``[server]``'s 2.50 allocates by hand. The check
    imports the helper and reads an empty handle (no GPU needed): a release that changes those
    internals fails it and its regions are allocated by hand too.
    """
    try:
        helper = importlib.import_module(HELPER)
        helper.get_raw_handle(SimpleNamespace(_cuda_shm_handle=helper.cudart.cudaIpcMemHandle_t()))
    except Exception as exc:  # ImportError, AttributeError, RuntimeError (its "needs cuda-python"): any failure here
        return None, f"{HELPER}: {type(exc).__name__}: {exc}"
    return helper, ""


class CudaInputRegion:
    """``byte_size`` bytes on GPU ``device``, registered with a tritonclient client as ``name``.

    The memory is one device allocation of its own with its CUDA IPC handle, which is what Triton's
    CUDA shared-memory API takes (torch's caching allocator would hand out part of a larger block).
    ``allocated_by`` says whose: ``"tritonclient"`` (its helper) or ``"blockflow"`` (by hand).
    """

    def __init__(self, client: Any, name: str, byte_size: int, device: int = 0, headers: dict[str, str] | None = None) -> None:
        self._client, self.name, self.byte_size, self.device, self._headers = client, name, byte_size, device, headers
        helper, _ = tritonclient_helper()
        self._memory: _HelperMemory | _HandMemory = (_HelperMemory(helper, name, byte_size, device) if helper is not None
                                                     else _HandMemory(byte_size, device))
        self.allocated_by = self._memory.allocated_by
        try:
            client.register_cuda_shared_memory(name, self._memory.raw_handle, device, byte_size, headers=headers)
        except Exception as exc:
            self._memory.free()
            hint = ("it needs the server's shared-memory key (TaskClient's shm_key, or BLOCKFLOW_SHM_KEY_FILE)"
                    if "restricted" in str(exc) else "it must run on this machine and see this GPU")
            raise ClientError(f"the server refused CUDA shared-memory region {name!r} ({byte_size} bytes on GPU {device}): "
                              f"{str(exc).strip()}; {hint}") from exc
        self._registered = True

    def write(self, images: Any) -> int:
        """Copy ``images`` (numpy or torch; uint8 as it is, anything else as fp32) into the region;
        returns the bytes written."""
        return self._memory.write(images, self.name)

    def close(self) -> None:
        if not getattr(self, "_registered", False):
            return
        self._registered = False
        try:
            self._client.unregister_cuda_shared_memory(self.name, headers=self._headers)
        finally:
            self._memory.free()


def _no_gpu(device: int, why: str = "") -> ClientError:
    return ClientError(f"CUDA shared-memory inputs need a CUDA GPU {device} on this machine{why}; use input_memory='host'")


def _host_dtype(images: Any) -> type[np.generic]:
    """What a host array is written as: uint8 images as they are (a task that takes them), else fp32."""
    return np.uint8 if np.asarray(images).dtype == np.uint8 else np.float32


def _fits(nbytes: int, byte_size: int, name: str) -> None:
    if nbytes > byte_size:
        raise ClientError(f"{nbytes} bytes of images do not fit region {name!r} of {byte_size}")


class _HelperMemory:
    """A region from tritonclient's helper; writes return once the copy is done (it waits on its own stream)."""

    allocated_by = "tritonclient"

    def __init__(self, helper: Any, name: str, byte_size: int, device: int) -> None:
        self._helper, self.byte_size = helper, byte_size
        try:
            self._handle: Any = helper.create_shared_memory_region(name, byte_size, device)
        except Exception as exc:  # no such device, no driver: the CUDA error is the cause, its text in bytes
            why = (exc.__cause__ or exc).args[:1] or ("",)
            raise _no_gpu(device, f" ({why[0].decode() if isinstance(why[0], bytes) else why[0]})") from exc
        try:
            self.raw_handle = helper.get_raw_handle(self._handle).decode()
        except Exception:
            helper.destroy_shared_memory_region(self._handle)  # or tritonclient's list keeps it for the process's life
            raise

    def write(self, images: Any, name: str) -> int:
        torch = sys.modules.get("torch")  # a torch tensor means torch is loaded; numpy images need no torch
        if torch is not None and isinstance(images, torch.Tensor):
            x = images.detach()
            x = (x if x.dtype == torch.uint8 else x.to(torch.float32)).contiguous()
            if x.is_cuda:
                _fits(x.numel() * x.element_size(), self.byte_size, name)
                # The helper copies on a stream of its own, and 2.73 asks for the DLPack capsule without
                # a stream (it compares the device's (type, id) to the type alone), so torch orders
                # nothing: the work that made ``x`` must be done first.
                torch.cuda.current_stream(x.device).synchronize()
                self._helper.set_shared_memory_region_from_dlpack(self._handle, [x])
                return int(x.numel() * x.element_size())
            images = x.numpy()  # on the CPU, the helper's numpy path (torch takes no stream there)
        a = np.ascontiguousarray(images, dtype=_host_dtype(images))
        _fits(a.nbytes, self.byte_size, name)
        self._helper.set_shared_memory_region(self._handle, [a])
        return int(a.nbytes)

    def free(self) -> None:
        handle, self._handle = self._handle, None
        # The helper frees the memory when its last reference goes (CudaSharedMemoryRegion.__del__): this one.
        self._helper.destroy_shared_memory_region(handle)
        del handle


class _HandMemory:
    """A region from BlockFlow's driver calls: one ``cuMemAlloc``, written through a torch view of it."""

    allocated_by = "blockflow"

    def __init__(self, byte_size: int, device: int) -> None:
        try:
            import torch
        except ImportError as exc:
            raise ClientError(f"CUDA shared-memory inputs need torch with CUDA: {exc}") from exc
        if not torch.cuda.is_available() or device >= torch.cuda.device_count():
            raise _no_gpu(device)
        self.byte_size, self.device = byte_size, device
        with torch.cuda.device(device):
            torch.zeros(1, device=f"cuda:{device}")  # makes the primary context current for the driver calls
            self._ptr = cuda.mem_alloc(byte_size)
            self.raw_handle = base64.b64encode(cuda.ipc_mem_handle(self._ptr)).decode()
            self._bytes = torch.as_tensor(cuda.DeviceBytes(self._ptr, byte_size), device=f"cuda:{device}")

    def write(self, images: Any, name: str) -> int:
        import torch

        x = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(images, dtype=_host_dtype(images)))
        x = (x if x.dtype == torch.uint8 else x.to(torch.float32)).contiguous()
        nbytes = x.numel() * x.element_size()
        _fits(nbytes, self.byte_size, name)
        self._bytes[:nbytes].view(x.dtype).view(x.shape).copy_(x)
        torch.cuda.synchronize(self.device)  # the server reads the region as soon as the request arrives
        return int(nbytes)

    def free(self) -> None:
        import torch

        del self._bytes
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()  # no copy into the region may still be running
            cuda.mem_free(self._ptr)


def region_name() -> str:
    return f"blockflow-in-{os.getpid()}-{os.urandom(4).hex()}"
