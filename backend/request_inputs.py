"""The input path of a block: each request's input tensors, read from Triton (or from the pool slots
its TensorMQ tickets name) and checked; a request that cannot be read fails alone.

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack

from blockflow.backend.device_inputs import DeviceInputs
from blockflow.backend.image_input import feed_dtype, takes_encoded
from blockflow.backend.replies import error, failure_code
from blockflow.backend.runtime import DTYPES
from blockflow.backend.side_inputs import check_sides, side_dtypes
from blockflow.backend.tensormq.releases import Release
from blockflow.backend.tensormq_ends import TensorMQEnds
from blockflow.backend.trace import NoTracer, Tracer
from blockflow.core.errors import RequestError
from blockflow.core.spec import ModelSpec

if TYPE_CHECKING:
    from blockflow.backend.image_decode import ImageDecoder


class RequestInputs:
    """Reads a call's requests for one block instance: Triton tensors by DLPack, or the tensors their tickets name."""

    def __init__(self, spec: ModelSpec, names: list[str], device: torch.device, ends: TensorMQEnds, stream: int,
                 tracer: Tracer | NoTracer) -> None:
        self.names = names
        # The hop's tensors' names (a TensorMQ hop's: its ticket), then each side input's (instance_args.tensor_names).
        self.sides = spec.side_inputs
        self.side_dtypes = side_dtypes(spec.side_inputs)
        self.hops = len(names) - len(self.sides)
        self.hop_names = names[:self.hops]
        self.shapes = spec.in_shapes
        self.dtype = feed_dtype(spec) or DTYPES[spec.in_dtype]
        self.consumer, self.relay = ends.consumer, ends.relay
        self.stream, self.tracer = stream, tracer
        # JPEG/PNG files' bytes (always in host memory), decoded here into this block's memory.
        self.decoder: ImageDecoder | None = None
        if takes_encoded(spec):
            # Imported here: the decoder pulls in torchvision (~160 MiB of a process) and Pillow, which
            # every other block, loading its stages from the stage cache, never needs.
            from blockflow.backend.image_decode import ImageDecoder

            self.decoder = ImageDecoder(spec.input_shape, device)
        # Images that arrive on a GPU (CUDA shared memory) are copied into this block's memory.
        self.device_inputs = DeviceInputs(device) if spec.takes_image and device.type == "cuda" and self.decoder is None else None

    def read_all(self, requests: list[Any], responses: list[Any], releases: list[Release]) -> tuple[list[list[torch.Tensor]], list[int]]:
        """Each readable request's input tensors and its position in ``requests``; the others get
        their error response in ``responses``. The slots read are added to ``releases``. Encoded
        images are decoded here, the call's together (:class:`ImageDecoder`); each request's side
        inputs follow its decoded images."""
        batch: list[list[torch.Tensor]] = []
        owners: list[int] = []
        files: list[list[bytes]] = []
        sides: list[list[torch.Tensor]] = []  # of the requests in ``files``
        for i, request in enumerate(requests):
            try:
                if self.decoder is not None:
                    rows = self.files(request)
                    sides.append(self.read_sides(request, len(rows)) if self.sides else [])
                    files.append(rows)
                else:
                    batch.append(self.read(request, releases))
                owners.append(i)
            except Exception as exc:  # fails this request alone: the caller's fault (HTTP 400), its ticket's producer's or ours
                responses[i] = pb_utils.InferenceResponse(error=error(str(exc), failure_code(exc)))
        if self.decoder is None or not files:
            return batch, owners
        decoded = owners
        owners = []
        for i, x, side in zip(decoded, self.decoder.decode(files), sides, strict=True):
            if isinstance(x, RequestError):
                responses[i] = pb_utils.InferenceResponse(error=error(str(x), failure_code(x)))
            else:
                batch.append([x, *side])
                owners.append(i)
        self.tracer.lap("read:decode")
        return batch, owners

    def files(self, request: Any) -> list[bytes]:
        """A request's encoded images: the rows of its uint8 ``[n, L]`` input, each one file's bytes
        padded to the request's longest (cut at each file's end by the decoder)."""
        tensor = pb_utils.get_input_tensor_by_name(request, self.names[0])
        if tensor is None:
            raise RequestError(f"request has no input {self.names[0]!r}")
        # By DLPack, as every input: never as_numpy() (the stub's NumPy path reads wrong bytes, see read()).
        x = from_dlpack(tensor.to_dlpack())
        if x.dtype != torch.uint8 or x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
            raise RequestError(f"input {self.names[0]!r} is {x.dtype} {list(x.shape)}; expected uint8 [n, L], "
                               "one JPEG or PNG file's bytes per row, zero-padded to the longest")
        rows = x.cpu().contiguous().numpy()  # in host memory already (FORCE_CPU_ONLY_INPUT_TENSORS=yes)
        return [row.tobytes() for row in rows]

    def read(self, request: Any, releases: list[Release]) -> list[torch.Tensor]:
        """A request's input tensors (the tensors its tickets name, for TensorMQ)."""
        tensors = _named(request, self.names)
        if self.consumer is not None:
            # Tickets are 256 host bytes: NumPy takes them through the tensor's own DLPack export in
            # ~5 us, where torch.utils.dlpack.from_dlpack took ~30 us inside a stub (2-core host).
            # Not as_numpy(): that is a copy the stub made when it loaded the request, and with the
            # H100 machine's NumPy it held the same wrong bytes on every request.
            tickets = np.from_dlpack(tensors[0]) if tensors[0].is_cpu() else from_dlpack(tensors[0].to_dlpack())
            # Side inputs are checked before the tickets claim their slots: a request they fail holds none.
            sides = self._sides(tensors[self.hops:], int(tickets.shape[0])) if self.sides else []
            self.tracer.lap("read:input")
            gather, shapes, stream, lap = self.consumer.gather_tensors, self.shapes, self.stream, self.tracer.part_lap
            views, rel = (gather(tickets, shapes, stream, lap) if self.relay is None else
                          self.relay.read(tickets, lambda t: gather(t, shapes, stream, lap)))
            self.tracer.lap("read:gather")
            releases.extend(rel)
            return [*views, *sides] if sides else views  # side inputs: not through the pool, plain tensors of the request
        xs = [from_dlpack(t.to_dlpack()) for t in tensors]
        for name, x, shape in zip(self.hop_names, xs[:self.hops] if self.sides else xs, self.shapes, strict=True):
            if x.dtype != self.dtype or tuple(x.shape[1:]) != shape or x.shape[0] != xs[0].shape[0]:
                raise RequestError(f"input {name!r} is {x.dtype} {list(x.shape)}; "
                                   f"expected {self.dtype} [{int(xs[0].shape[0])}, {', '.join(map(str, shape))}]")
        if self.sides:
            check_sides(xs[self.hops:], self.sides, self.side_dtypes, int(xs[0].shape[0]))
        return xs

    def read_sides(self, request: Any, batch: int) -> list[torch.Tensor]:
        """A request of ``batch`` samples' side inputs, checked."""
        return self._sides(_named(request, self.names[self.hops:]), batch)

    def _sides(self, tensors: list[Any], batch: int) -> list[torch.Tensor]:
        """Side inputs' Triton tensors (host or GPU) by DLPack, checked."""
        xs = [from_dlpack(t.to_dlpack()) for t in tensors]
        check_sides(xs, self.sides, self.side_dtypes, batch)
        return xs

    def own(self, batch: list[list[torch.Tensor]]) -> None:
        """Copy the inputs that arrived on a GPU into this block's memory (:meth:`DeviceInputs.own`)."""
        if self.device_inputs is not None and self.device_inputs.own(batch):
            self.tracer.lap("read:own")


def _named(request: Any, names: list[str]) -> list[Any]:
    """The request's Triton tensors of ``names``, in order; a ``RequestError`` naming the first it lacks."""
    tensors = []
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise RequestError(f"request has no input {name!r}")
        tensors.append(tensor)
    return tensors
