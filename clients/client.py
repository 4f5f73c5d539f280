"""A small typed client for BlockFlow tasks over Triton's HTTP or gRPC API.

Every task is a Triton ensemble that takes ``IMAGE`` (fp32 ``[batch, 3, H, W]``, or uint8
``[batch, 3, H, W]`` or ``[batch, H, W, 3]``, or JPEG/PNG files' bytes, where its plan says so:
:meth:`TaskClient.input_of`) and gives ``LOGITS`` (fp32 ``[batch, classes]``, or ``[batch, classes, H, W]`` from a segmenter)::

    with TaskClient("127.0.0.1:8000") as c:
        logits = c.infer("cls_a", images)

A detector's task gives ``COUNT``, ``BOXES``, ``SCORES``, ``LABELS`` (and ``MASKS``) instead:
:meth:`TaskClient.detect` returns them per image, :meth:`TaskClient.infer_outputs` as they are.
A task whose network takes more than the image (side inputs, e.g. an image's ``size``) takes them
by name, batched like the images: ``c.infer_outputs("boxes", images, inputs={"size": sizes})``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal

import numpy as np

from blockflow.clients.calls import Array, ClientBase, Protocol, Timed, failure
from blockflow.clients.cuda_shm import CudaInputRegion, region_name
from blockflow.clients.detections import Detections, per_image
from blockflow.clients.task_input import TaskInput
from blockflow.core.errors import ClientError
from blockflow.core.spec import LOGITS

# Array, Protocol and Timed are the calls' types (blockflow.clients.calls), named here too.
__all__ = ["Array", "AsyncTaskClient", "Protocol", "TaskClient", "Timed", "top_k"]


class TaskClient(ClientBase):
    """Synchronous client. ``url`` is ``host:port`` of the HTTP or gRPC endpoint.

    ``input_memory="cuda"`` sends images through a CUDA shared-memory region on GPU ``device``
    (see blockflow.clients.cuda_shm): images already on that GPU (torch tensors) never cross the host.
    Registering the region takes the server's shared-memory key: ``shm_key``, else the file
    ``$BLOCKFLOW_SHM_KEY_FILE`` names, else the local ``blockflow serve``'s (its endpoints file). Every call takes Triton's per-request options: ``headers``, ``request_id``, ``priority`` and
    ``timeout_s`` (Triton's own timeout for the request; over gRPC the client's deadline too).
    """

    def __init__(self, url: str, protocol: Protocol = "http", timeout_s: float = 120.0,
                 input_memory: Literal["host", "cuda"] = "host", device: int = 0, shm_key: str | None = None) -> None:
        self._setup(url, protocol, timeout_s, input_memory, device, shm_key)
        try:
            if protocol == "http":
                self._client = self._mod.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)
            else:
                self._client = self._mod.InferenceServerClient(url)
        except Exception as exc:
            raise ClientError(f"cannot create a {protocol} client for {url}: {exc}") from exc
        self._region: CudaInputRegion | None = None  # one call at a time: one region, grown when a batch needs more
        self._inputs: dict[str, TaskInput] = {}  # each task's input, read from its metadata on its first call

    def _region_for(self, images: Any) -> CudaInputRegion:
        nbytes = self._image_bytes(images)
        if self._region is None or self._region.byte_size < nbytes:
            self._close_region()
            self._region = CudaInputRegion(self._client, region_name(), nbytes, self.device, self.shm_headers)
        return self._region

    def _close_region(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None

    def is_ready(self) -> bool:
        try:
            return bool(self._client.is_server_ready())
        except Exception:
            return False

    def models(self) -> list[dict[str, str]]:
        """The server's loaded models (from its statistics: the repository index is an admin API)."""
        try:
            return self._names(self._client.get_inference_statistics())
        except Exception as exc:
            raise failure(exc, "listing the models", self.url) from exc

    def input_shape(self, task: str) -> tuple[int, int, int]:
        """The shape of one image the task takes: (channels, height, width), or (height, width,
        channels) for a task that takes HWC images (:meth:`input_of`)."""
        return self._shape(self._metadata(task))

    def input_of(self, task: str) -> TaskInput:
        """The task's image input (dtype and shape), its side inputs and outputs, read once per task."""
        if task not in self._inputs:
            self._inputs[task] = TaskInput.of(self._metadata(task))
        return self._inputs[task]

    def _metadata(self, task: str) -> Any:
        try:
            return self._client.get_model_metadata(task)
        except Exception as exc:
            names = [m["name"] for m in self.models()]
            raise ClientError(self._not_served(task, names),
                              str(getattr(exc, "status", lambda: "")() or "").removeprefix("StatusCode.") or None) from exc

    def infer(self, task: str, images: Any, *, headers: dict[str, str] | None = None, request_id: str = "",
              priority: int = 0, timeout_s: float | None = None,
              inputs: Mapping[str, Any] | None = None) -> Array:
        """Logits of ``images`` (numpy, or with ``input_memory="cuda"`` also a torch tensor). ``inputs``: the
        task's side inputs by name (:meth:`input_of` lists them), numpy arrays batched like ``images``;
        they go in the request, also where the images go through CUDA shared memory."""
        return self.infer_timed(task, images, headers=headers, request_id=request_id, priority=priority, timeout_s=timeout_s,
                                inputs=inputs).logits

    def infer_timed(self, task: str, images: Any, *, headers: dict[str, str] | None = None, request_id: str = "",
                    priority: int = 0, timeout_s: float | None = None,
                    inputs: Mapping[str, Any] | None = None) -> Timed:
        start = time.perf_counter()
        result = self._call(task, images, (LOGITS,), headers, request_id, priority, timeout_s, inputs)
        return self._timed(task, result, start)

    def infer_outputs(self, task: str, images: Any, *, headers: dict[str, str] | None = None, request_id: str = "",
                      priority: int = 0, timeout_s: float | None = None,
                      inputs: Mapping[str, Any] | None = None) -> dict[str, Array]:
        """Every output the task answers with, by name (a detector's ``COUNT``, ``BOXES``, ...)."""
        result = self._call(task, images, None, headers, request_id, priority, timeout_s, inputs)
        return {name: np.asarray(result.as_numpy(name)) for name in self.input_of(task).outputs}

    def detect(self, task: str, images: Any, *, headers: dict[str, str] | None = None, request_id: str = "",
               priority: int = 0, timeout_s: float | None = None,
               inputs: Mapping[str, Any] | None = None) -> list[Detections]:
        """A detector task's detections, per image (:class:`blockflow.clients.detections.Detections`)."""
        return per_image(self.infer_outputs(task, images, headers=headers, request_id=request_id, priority=priority,
                                            timeout_s=timeout_s, inputs=inputs))

    def _call(self, task: str, images: Any, outputs: tuple[str, ...] | None, headers: dict[str, str] | None,
              request_id: str, priority: int, timeout_s: float | None, inputs: Mapping[str, Any] | None) -> Any:
        if task not in self._inputs:
            try:
                self._inputs[task] = TaskInput.of(self._client.get_model_metadata(task))
            except Exception:  # the call itself says why (not served, unreachable, loading)
                pass
        kind, images = self._checked(task, images)
        sides = self._sides(task, inputs, images)
        region = self._region_for(images) if self.input_memory == "cuda" and not kind.encoded else None
        req = self._request(task, images, kind, headers, request_id, priority, timeout_s, region,
                            self._wanted(task, kind, outputs), sides)
        try:
            return self._client.infer(*req.args, **req.kwargs)
        except Exception as exc:
            raise failure(exc, f"task {task!r}", self.url) from exc

    def close(self) -> None:
        self._close_region()
        self._client.close()

    def __enter__(self) -> TaskClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class AsyncTaskClient(ClientBase):
    """The asyncio twin of :class:`TaskClient`: the same constructor, calls and options, awaited
    (``tritonclient``'s aio clients); ``async with`` closes it."""

    def __init__(self, url: str, protocol: Protocol = "http", timeout_s: float = 120.0,
                 input_memory: Literal["host", "cuda"] = "host", device: int = 0, shm_key: str | None = None) -> None:
        self._setup(url, protocol, timeout_s, input_memory, device, shm_key)
        if protocol == "http":
            import tritonclient.http.aio as aio

            self._client = aio.InferenceServerClient(url, conn_timeout=timeout_s)
        else:
            import tritonclient.grpc.aio as aio

            self._client = aio.InferenceServerClient(url)
        self._sync: TaskClient | None = None  # registers CUDA regions (a control call, once per region)
        # Calls run concurrently, and the server reads a request's region while it serves it: each
        # call in flight writes a region of its own, taken from these and given back when it ends.
        self._regions: list[CudaInputRegion] = []
        self._idle: list[CudaInputRegion] = []
        self._inputs: dict[str, TaskInput] = {}

    async def is_ready(self) -> bool:
        try:
            return bool(await self._client.is_server_ready())
        except Exception:
            return False

    async def models(self) -> list[dict[str, str]]:
        try:
            return self._names(await self._client.get_inference_statistics())
        except Exception as exc:
            raise failure(exc, "listing the models", self.url) from exc

    async def input_shape(self, task: str) -> tuple[int, int, int]:
        return self._shape(await self._metadata(task))

    async def input_of(self, task: str) -> TaskInput:
        """The task's image input (dtype and shape), its side inputs and outputs, read once per task."""
        if task not in self._inputs:
            self._inputs[task] = TaskInput.of(await self._metadata(task))
        return self._inputs[task]

    async def _metadata(self, task: str) -> Any:
        try:
            return await self._client.get_model_metadata(task)
        except Exception as exc:
            names = [m["name"] for m in await self.models()]
            raise ClientError(self._not_served(task, names)) from exc

    async def infer(self, task: str, images: Any, *, headers: dict[str, str] | None = None, request_id: str = "",
                    priority: int = 0, timeout_s: float | None = None,
                    inputs: Mapping[str, Any] | None = None) -> Array:
        return (await self.infer_timed(task, images, headers=headers, request_id=request_id, priority=priority,
                                       timeout_s=timeout_s, inputs=inputs)).logits

    async def infer_timed(self, task: str, images: Any, *, headers: dict[str, str] | None = None, request_id: str = "",
                          priority: int = 0, timeout_s: float | None = None,
                          inputs: Mapping[str, Any] | None = None) -> Timed:
        start = time.perf_counter()
        result = await self._call(task, images, (LOGITS,), headers, request_id, priority, timeout_s, inputs)
        return self._timed(task, result, start)

    async def infer_outputs(self, task: str, images: Any, *, headers: dict[str, str] | None = None, request_id: str = "",
                            priority: int = 0, timeout_s: float | None = None,
                            inputs: Mapping[str, Any] | None = None) -> dict[str, Array]:
        """Every output the task answers with, by name (:meth:`TaskClient.infer_outputs`)."""
        result = await self._call(task, images, None, headers, request_id, priority, timeout_s, inputs)
        return {name: np.asarray(result.as_numpy(name)) for name in (await self.input_of(task)).outputs}

    async def detect(self, task: str, images: Any, *, headers: dict[str, str] | None = None, request_id: str = "",
                     priority: int = 0, timeout_s: float | None = None,
                     inputs: Mapping[str, Any] | None = None) -> list[Detections]:
        """A detector task's detections, per image (:meth:`TaskClient.detect`)."""
        return per_image(await self.infer_outputs(task, images, headers=headers, request_id=request_id,
                                                  priority=priority, timeout_s=timeout_s, inputs=inputs))

    async def _call(self, task: str, images: Any, outputs: tuple[str, ...] | None, headers: dict[str, str] | None,
                    request_id: str, priority: int, timeout_s: float | None, inputs: Mapping[str, Any] | None) -> Any:
        if task not in self._inputs:
            try:
                self._inputs[task] = TaskInput.of(await self._client.get_model_metadata(task))
            except Exception:  # the call itself says why (not served, unreachable, loading)
                pass
        kind, images = self._checked(task, images)
        sides = self._sides(task, inputs, images)
        wanted = self._wanted(task, kind, outputs)
        region = self._take_region(images) if self.input_memory == "cuda" and not kind.encoded else None  # files: in the request
        try:
            req = self._request(task, images, kind, headers, request_id, priority, timeout_s, region, wanted, sides)
            try:
                return await self._client.infer(*req.args, **req.kwargs)
            except Exception as exc:
                raise failure(exc, f"task {task!r}", self.url) from exc
        finally:
            if region is not None:
                # Answered or failed: free for the next call. (After a client-side timeout the server may
                # still read it for the abandoned request, whose answer nobody takes.)
                self._idle.append(region)

    def _take_region(self, images: Any) -> CudaInputRegion:
        """An idle region large enough for ``images``, or a new one: at most as many as calls ever ran at once."""
        nbytes = self._image_bytes(images)
        fits = [r for r in self._idle if r.byte_size >= nbytes]
        if fits:
            region = min(fits, key=lambda r: r.byte_size)
            self._idle.remove(region)
            return region
        if self._idle:  # only smaller ones: replace one rather than keep it
            small = self._idle.pop()
            self._regions.remove(small)
            small.close()
        if self._sync is None:
            self._sync = TaskClient(self.url, self.protocol, self.timeout_s, shm_key=self._shm_key)
        region = CudaInputRegion(self._sync._client, region_name(), nbytes, self.device, self.shm_headers)
        self._regions.append(region)
        return region

    async def close(self) -> None:
        for region in self._regions:
            region.close()
        self._regions, self._idle = [], []
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        await self._client.close()

    async def __aenter__(self) -> AsyncTaskClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()


def top_k(logits: Array, k: int = 5) -> list[list[tuple[int, float]]]:
    """Per row, the ``k`` best classes with their softmax probabilities."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    idx = np.argsort(-p, axis=1)[:, :k]
    return [[(int(i), float(p[r, i])) for i in row] for r, row in enumerate(idx)]
