"""What both clients of ``blockflow.clients.client`` build the same way: the tritonclient module of a
protocol, a call's request (its image input and side inputs, the outputs it asks for, Triton's per-request options),
its answer read back, and tritonclient's errors as :class:`ClientError`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from blockflow.clients.cuda_shm import CudaInputRegion
from blockflow.clients.detections import is_detector
from blockflow.clients.task_input import TaskInput
from blockflow.core import endpoints
from blockflow.core.errors import ClientError, Unreachable
from blockflow.core.spec import IMAGE, LOGITS

Protocol = Literal["http", "grpc"]
Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Timed:
    logits: Array
    latency_ms: float
    request_id: str = ""  # the id Triton answered with (the one sent, or "")


def _module(protocol: Protocol) -> Any:
    if protocol == "http":
        import tritonclient.http as mod
    elif protocol == "grpc":
        import tritonclient.grpc as mod
    else:
        raise ClientError(f"unknown protocol {protocol!r}; use http or grpc")
    return mod


# What a retry can help with: the server busy, restarting or out of time, not a wrong request.
_RETRYABLE = {"429", "502", "503", "504", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "ABORTED"}


def failure(exc: Exception, what: str, url: str) -> ClientError:
    """``exc`` from tritonclient as a :class:`ClientError` carrying the server's status and whether to retry."""
    from tritonclient.utils import InferenceServerException

    if not isinstance(exc, InferenceServerException):  # sockets, DNS, a closed port
        return Unreachable(f"cannot reach the server at {url}: {type(exc).__name__}: {exc}")
    status = str(exc.status() or "").removeprefix("StatusCode.") or None
    text = str(exc.message() or exc).strip()
    if status == "UNAVAILABLE" and ("connect" in text.lower() or "socket" in text.lower()):
        return Unreachable(f"cannot reach the server at {url}: {text}", status)
    if status is None and ("Connection refused" in text or "connect" in text.lower()):
        return Unreachable(f"cannot reach the server at {url}: {text}")
    if "unknown model" in text or status in ("404", "NOT_FOUND"):
        return ClientError(f"{what} is not served here ({text})", status)
    return ClientError(f"{what} failed ({status or 'no status'}): {text}", status, status in _RETRYABLE)


@dataclass(frozen=True)
class _Request:
    """One inference call's inputs and Triton's per-request options."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class ClientBase:
    """What both clients build the same way."""

    url: str
    protocol: Protocol
    timeout_s: float
    input_memory: Literal["host", "cuda"]
    device: int
    shm_headers: dict[str, str]  # open Triton's shared-memory API (registering CUDA regions)
    _shm_key: str
    _mod: Any
    _inputs: dict[str, TaskInput]  # each task's input, read from its metadata on its first call

    def _setup(self, url: str, protocol: Protocol, timeout_s: float, input_memory: str, device: int,
               shm_key: str | None) -> None:
        if input_memory not in ("host", "cuda"):
            raise ClientError(f"input_memory must be 'host' or 'cuda', not {input_memory!r}")
        self.url, self.protocol, self.timeout_s, self.device = url, protocol, timeout_s, device
        self.input_memory = input_memory  # type: ignore[assignment]
        self._mod = _module(protocol)
        self._shm_key = endpoints.shm_key() if shm_key is None and input_memory == "cuda" else shm_key or ""
        self.shm_headers = endpoints.shm_headers(self._shm_key, protocol) if self._shm_key else {}

    def _request(self, task: str, images: Any, kind: TaskInput, headers: dict[str, str] | None, request_id: str,
                 priority: int, timeout_s: float | None, region: CudaInputRegion | None = None,
                 outputs: tuple[str, ...] = (LOGITS,), sides: Mapping[str, Any] | None = None) -> _Request:
        """The call's arguments: the image input (``images`` checked by ``kind``; in the request, or
        written into ``region``), the side inputs (``sides``, checked: :meth:`_sides`; always in the
        request), the wanted output, and Triton's options: its own timeout in
        microseconds (and, over gRPC, the client's deadline), the priority, the request id, the headers."""
        from tritonclient.utils import np_to_triton_dtype

        if region is not None:
            inp = self._cuda_input(images, kind.datatype, region)
        else:
            x = np.asarray(images)  # checked: a contiguous array of the task's dtype (or a CPU tensor of it)
            inp = self._mod.InferInput(IMAGE, list(x.shape), kind.datatype)
            inp.set_data_from_numpy(x)
        inps = [inp]
        for name, value in (sides or {}).items():
            side = self._mod.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            side.set_data_from_numpy(value)
            inps.append(side)
        kwargs: dict[str, Any] = {"outputs": [self._mod.InferRequestedOutput(o) for o in outputs], "request_id": request_id,
                                  "priority": priority, "headers": headers}
        if timeout_s is not None:
            kwargs["timeout"] = int(timeout_s * 1e6)
        if self.protocol == "grpc":
            kwargs["client_timeout"] = timeout_s if timeout_s is not None else self.timeout_s
        return _Request((task, inps), kwargs)

    def _checked(self, task: str, images: Any) -> tuple[TaskInput, Any]:
        """The task's input and ``images`` as it takes them (:meth:`TaskInput.check`); where its metadata
        could not be read, as they are (:meth:`TaskInput.given`: the call says why it fails)."""
        kind = self._inputs.get(task)
        return (kind, kind.check(task, images)) if kind is not None else TaskInput.given(task, images)

    def _sides(self, task: str, inputs: Mapping[str, Any] | None, images: Any) -> dict[str, Any]:
        """A call's side inputs as the task takes them (:meth:`TaskInput.check_sides`, the batch of the
        checked ``images``); unchecked where the task's metadata could not be read (the call says why)."""
        if task not in self._inputs:
            return {name: np.ascontiguousarray(value) for name, value in (inputs or {}).items()}
        return self._inputs[task].check_sides(task, inputs, int(images.shape[0]))

    @staticmethod
    def _image_bytes(images: Any) -> int:
        """The bytes of checked ``images`` (numpy or torch)."""
        size = images.element_size() if callable(getattr(images, "element_size", None)) else images.itemsize
        return int(np.prod(images.shape)) * int(size)

    def _cuda_input(self, images: Any, datatype: str, region: CudaInputRegion) -> Any:
        nbytes = region.write(images)
        inp = self._mod.InferInput(IMAGE, list(images.shape), datatype)
        inp.set_shared_memory(region.name, nbytes)
        return inp

    @staticmethod
    def _wanted(task: str, kind: TaskInput, outputs: tuple[str, ...] | None) -> tuple[str, ...]:
        """The outputs a call asks for: ``outputs``, or every output of the task (None: all the task's,
        none named where they are not known, which asks the server for all); LOGITS only from a task that has it."""
        if outputs is None:
            # Empty where the task's metadata could not be read: the call asks for every output, or says why it fails.
            return kind.outputs
        if kind.outputs and LOGITS in outputs and LOGITS not in kind.outputs:
            raise ClientError(f"task {task!r} answers {', '.join(kind.outputs)}, not {LOGITS}: call infer_outputs"
                              + (" or detect" if is_detector(list(kind.outputs)) else ""))
        return outputs

    def _timed(self, task: str, result: Any, start: float) -> Timed:
        latency = (time.perf_counter() - start) * 1e3
        logits = result.as_numpy(LOGITS)
        if logits is None:
            raise ClientError(f"task {task!r} returned no {LOGITS}")
        response = result.get_response()
        rid = response.get("id", "") if isinstance(response, dict) else getattr(response, "id", "")
        return Timed(np.asarray(logits, dtype=np.float32), latency, str(rid or ""))

    def _names(self, stats: Any) -> list[dict[str, str]]:
        if self.protocol == "grpc":
            names = sorted({m.name for m in stats.model_stats})
        else:
            names = sorted({str(m["name"]) for m in stats.get("model_stats", [])})
        return [{"name": n, "state": "READY"} for n in names]

    @staticmethod
    def _shape(meta: Any) -> tuple[int, int, int]:
        inputs = meta["inputs"] if isinstance(meta, dict) else [{"shape": list(i.shape)} for i in meta.inputs]
        dims = [int(d) for d in inputs[0]["shape"]][-3:]
        if len(dims) < 3:  # an encoded task: one file's bytes per image, of any size
            raise ClientError(f"the task takes encoded images (shape {dims}), not arrays of one shape: see input_of")
        return dims[0], dims[1], dims[2]

    def _not_served(self, task: str, names: list[str]) -> str:
        return f"task {task!r} is not served at {self.url} (ready models: {', '.join(names) or 'none'})"
