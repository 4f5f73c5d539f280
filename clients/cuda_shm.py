"""CUDA shared-memory inputs: images that go from the client's GPU memory to Triton without a host copy.

A region is one device allocation of its own (``cuMemAlloc``, so its CUDA IPC handle covers
exactly it), registered with the server under a name; a request then names the region instead
of carrying the tensor. The server must run on the same machine and see the same GPU.
Lifetime: the client owns the memory; :meth:`CudaInputRegion.close` unregisters the region
first and frees it after, so the server never holds a handle to freed memory. A region is
rewritten per request and the server reads it while it serves that request, so one region
serves one request at a time: ``TaskClient`` keeps one, ``AsyncTaskClient`` one per call in flight.

    with TaskClient("127.0.0.1:8000", input_memory="cuda") as c:   # numpy or torch CUDA images
        logits = c.infer("cls_a", images)
"""

from __future__ import annotations

import base64
import os
from typing import Any

from blockflow.core import cuda
from blockflow.core.errors import ClientError


class CudaInputRegion:
    """``byte_size`` bytes on GPU ``device``, registered with a tritonclient client as ``name``.

    The memory is one ``cuMemAlloc`` of its own with its CUDA IPC handle, which is what Triton's
    CUDA shared-memory API takes (torch's caching allocator would hand out part of a larger block).
    """

    def __init__(self, client: Any, name: str, byte_size: int, device: int = 0, headers: dict[str, str] | None = None) -> None:
        try:
            import torch
        except ImportError as exc:
            raise ClientError(f"CUDA shared-memory inputs need torch with CUDA: {exc}") from exc
        if not torch.cuda.is_available() or device >= torch.cuda.device_count():
            raise ClientError(f"CUDA shared-memory inputs need a CUDA GPU {device} on this machine; use input_memory='host'")
        self._client, self.name, self.byte_size, self.device, self._headers = client, name, byte_size, device, headers
        with torch.cuda.device(device):
            torch.zeros(1, device=f"cuda:{device}")  # makes the primary context current for the driver calls
            self._ptr = cuda.mem_alloc(byte_size)
            handle = cuda.ipc_mem_handle(self._ptr)
            self._bytes = torch.as_tensor(cuda.DeviceBytes(self._ptr, byte_size), device=f"cuda:{device}")
        try:
            client.register_cuda_shared_memory(name, base64.b64encode(handle).decode(), device, byte_size, headers=headers)
        except Exception as exc:
            self._free()
            hint = ("it needs the server's shared-memory key (TaskClient's shm_key, or BLOCKFLOW_SHM_KEY_FILE)"
                    if "restricted" in str(exc) else "it must run on this machine and see this GPU")
            raise ClientError(f"the server refused CUDA shared-memory region {name!r} ({byte_size} bytes on GPU {device}): "
                              f"{str(exc).strip()}; {hint}") from exc
        self._registered = True

    def write(self, images: Any) -> int:
        """Copy ``images`` (numpy or torch, fp32, contiguous) into the region; returns the bytes written."""
        import torch

        x = images if isinstance(images, torch.Tensor) else torch.from_numpy(images)
        x = x.to(torch.float32).contiguous()
        nbytes = x.numel() * 4
        if nbytes > self.byte_size:
            raise ClientError(f"{nbytes} bytes of images do not fit region {self.name!r} of {self.byte_size}")
        self._bytes[:nbytes].view(torch.float32).view(x.shape).copy_(x)
        torch.cuda.synchronize(self.device)  # the server reads the region as soon as the request arrives
        return nbytes

    def close(self) -> None:
        if not getattr(self, "_registered", False):
            return
        self._registered = False
        try:
            self._client.unregister_cuda_shared_memory(self.name, headers=self._headers)
        finally:
            self._free()

    def _free(self) -> None:
        import torch

        del self._bytes
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()  # no copy into the region may still be running
            cuda.mem_free(self._ptr)


def region_name() -> str:
    return f"blockflow-in-{os.getpid()}-{os.urandom(4).hex()}"
