"""A small typed client for BlockFlow tasks over Triton's HTTP or gRPC API.

Every task is a Triton ensemble that takes ``IMAGE`` (fp32 ``[batch, 3, H, W]``)
and gives ``LOGITS`` (fp32 ``[batch, classes]``)::

    with TaskClient("127.0.0.1:8000") as c:
        logits = c.infer("cls_a", images)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from blockflow.clients.cuda_shm import CudaInputRegion, region_name
from blockflow.core.errors import ClientError, Unreachable
from blockflow.core.spec import IMAGE, LOGITS

Protocol = Literal["http", "grpc"]
Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Timed:
    logits: Array
    latency_ms: float


def _module(protocol: Protocol) -> Any:
    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ClientError(f"unknown protocol {protocol!r}; use http or grpc")
    return mod


def _check_images(images: npt.NDArray[Any]) -> Array:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ClientError(f"images must be [batch, 3, H, W]; got shape {list(images.shape)}")
    return np.ascontiguousarray(images, dtype=np.float32)


def _explain(exc: Exception, task: str) -> ClientError:
    text = str(exc)
    if "unknown model" in text or "not found" in text:
        return ClientError(f"task {task!r} is not served here ({text.strip()})")
    return ClientError(f"inference on {task!r} failed: {text.strip()}")


class TaskClient:
    """Synchronous client. ``url`` is ``host:port`` of the HTTP or gRPC endpoint.

    ``input_memory="cuda"`` sends images through a CUDA shared-memory region on GPU ``device``
    (see blockflow.clients.cuda_shm): images already on that GPU (torch tensors) never cross the host.
    """
    def __init__(self, url: str, protocol: Protocol = "http", timeout_s: float = 120.0,
                 input_memory: Literal["host", "cuda"] = "host", device: int = 0) -> None:
        if input_memory not in ("host", "cuda"):
            raise ClientError(f"input_memory must be 'host' or 'cuda', not {input_memory!r}")
        self.url = url
        self.protocol = protocol
        self._mod = _module(protocol)
        self.timeout_s = timeout_s
        self.input_memory = input_memory
        self.device = device
        self._region: Any = None
        try:
            if protocol == "http":
                self._client = self._mod.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)
            else:
                self._client = self._mod.InferenceServerClient(url)
        except Exception as exc:
            raise ClientError(f"cannot create a {protocol} client for {url}: {exc}") from exc

    def is_ready(self) -> bool:
        try:
            return bool(self._client.is_server_ready())
        except Exception:
            return False

    def models(self) -> list[dict[str, str]]:
        """The server's loaded models (from its statistics: the repository index is an admin API)."""
        try:
            stats = self._client.get_inference_statistics()
        except Exception as exc:
            raise Unreachable(f"cannot reach the server at {self.url} over {self.protocol}: {exc}") from exc
        if self.protocol == "grpc":
            names = sorted({m.name for m in stats.model_stats})
        else:
            names = sorted({str(m["name"]) for m in stats.get("model_stats", [])})
        return [{"name": n, "state": "READY"} for n in names]

    def input_shape(self, task: str) -> tuple[int, int, int]:
        """The (channels, height, width) of one image the task takes."""
        try:
            meta = self._client.get_model_metadata(task)
        except Exception as exc:
            names = [m["name"] for m in self.models() if m.get("state") == "READY"]
            raise ClientError(f"task {task!r} is not served at {self.url} (ready models: {', '.join(names) or 'none'})") from exc
        inputs = meta["inputs"] if isinstance(meta, dict) else [{"shape": list(i.shape)} for i in meta.inputs]
        dims = [int(d) for d in inputs[0]["shape"]][-3:]
        return dims[0], dims[1], dims[2]

    def infer(self, task: str, images: Any) -> Array:
        """Logits of ``images`` (numpy, or with ``input_memory="cuda"`` also a torch tensor)."""
        return self.infer_timed(task, images).logits

    def infer_timed(self, task: str, images: Any) -> Timed:
        if self.input_memory == "cuda":
            inp = self._cuda_input(images)
        else:
            x = _check_images(images)
            inp = self._mod.InferInput(IMAGE, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
        out = self._mod.InferRequestedOutput(LOGITS)
        kwargs: dict[str, Any] = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
        start = time.perf_counter()
        try:
            result = self._client.infer(task, [inp], outputs=[out], **kwargs)
        except Exception as exc:
            raise _explain(exc, task) from exc
        latency = (time.perf_counter() - start) * 1e3
        logits = result.as_numpy(LOGITS)
        if logits is None:
            raise ClientError(f"task {task!r} returned no {LOGITS}")
        return Timed(np.asarray(logits, dtype=np.float32), latency)

    def _cuda_input(self, images: Any) -> Any:
        shape = list(images.shape)
        if len(shape) != 4 or shape[1] != 3:
            raise ClientError(f"images must be [batch, 3, H, W]; got shape {shape}")
        nbytes = 4 * shape[0] * shape[1] * shape[2] * shape[3]
        if self._region is None or self._region.byte_size < nbytes:
            if self._region is not None:
                self._region.close()
                self._region = None
            self._region = CudaInputRegion(self._client, region_name(), nbytes, self.device)
        self._region.write(images)
        inp = self._mod.InferInput(IMAGE, shape, "FP32")
        inp.set_shared_memory(self._region.name, nbytes)
        return inp

    def close(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None
        self._client.close()

    def __enter__(self) -> TaskClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class AsyncTaskClient:
    """The asyncio twin of :class:`TaskClient` (``tritonclient``'s aio clients)."""
    def __init__(self, url: str, protocol: Protocol = "http") -> None:
        self.url = url
        self.protocol = protocol
        if protocol == "http":
            import tritonclient.http.aio as aio
        else:
            import tritonclient.grpc.aio as aio
        self._mod = _module(protocol)
        self._client = aio.InferenceServerClient(url)

    async def infer(self, task: str, images: npt.NDArray[Any]) -> Array:
        x = _check_images(images)
        inp = self._mod.InferInput(IMAGE, list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        try:
            result = await self._client.infer(task, [inp], outputs=[self._mod.InferRequestedOutput(LOGITS)])
        except Exception as exc:
            raise _explain(exc, task) from exc
        return np.asarray(result.as_numpy(LOGITS), dtype=np.float32)

    async def close(self) -> None:
        await self._client.close()


def top_k(logits: Array, k: int = 5) -> list[list[tuple[int, float]]]:
    """Per row, the ``k`` best classes with their softmax probabilities."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    idx = np.argsort(-p, axis=1)[:, :k]
    return [[(int(i), float(p[r, i])) for i in row] for r, row in enumerate(idx)]
