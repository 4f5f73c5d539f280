"""What a block answers: Triton errors, tickets as a tensor, a batch's rows per request, and a
TensorMQ request's response sent before the block queues its GPU work.

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack  # type: ignore[attr-defined]  # re-exported without __all__

from blockflow.backend.tensormq.handout import NoReceiverError
from blockflow.backend.tensormq.reservation import PoolExhaustedError
from blockflow.backend.tensormq.ticket import ProducerGoneError
from blockflow.core.errors import RequestError
from blockflow.core.spec import TICKET_BYTES


def error(message: str, code: str) -> Any:
    """A Triton error with status ``code`` (a ``TritonError`` constant; older backends know none)."""
    value = getattr(pb_utils.TritonError, code, None)
    return pb_utils.TritonError(message) if value is None else pb_utils.TritonError(message, value)


def failure_code(exc: BaseException) -> str:
    """The status of a request that ``exc`` failed: a full pool is load, and a ticket whose producer
    stopped or failed is the producer's fault, not a bad request (UNAVAILABLE: a retry later can
    help), as are a next block with no instance running and a GPU out of memory; a bad request is the caller's (INVALID_ARG); anything else is INTERNAL."""
    if isinstance(exc, (PoolExhaustedError, ProducerGoneError, NoReceiverError, torch.cuda.OutOfMemoryError)):
        return "UNAVAILABLE"
    return "INVALID_ARG" if isinstance(exc, RequestError) else "INTERNAL"


def failed_response(exc: BaseException, block: str) -> Any:
    """The response of a request that ``exc`` failed in ``block``, once it had been read."""
    return pb_utils.InferenceResponse(error=error(f"block {block!r} failed: {exc}", failure_code(exc)))


def ticket_tensor(tickets: list[bytes]) -> torch.Tensor:
    """A batch's tickets as the uint8 ``[n, 256]`` tensor a block returns.

    Through torch's DLPack capsule: the Python backend (r24.10) fails on numpy's own capsules.
    A bytearray is writable, so torch takes it without a copy.
    """
    return torch.from_numpy(np.frombuffer(bytearray(b"".join(tickets)), dtype=np.uint8).reshape(len(tickets), TICKET_BYTES))


class Packed(NamedTuple):
    """A prepared slot's tickets as the block hands them on, made by the producer's preparer
    thread between calls (``Producer(pack=...)``), so that a call of batch 1 only takes them."""

    tensor: torch.Tensor
    response: Any  # the response carrying them, for a block that answers early; else None


def ticket_response(name: str, tickets: torch.Tensor) -> Any:
    """The response that hands ``tickets`` on as output ``name``."""
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor.from_dlpack(name, to_dlpack(tickets))])


def packer(answer_as: str | None) -> Callable[[list[bytes]], Packed]:
    """The preparer's ``pack``: the tickets' tensor and, where ``answer_as`` names the output of a
    block that answers early, their response too (~20 µs off the request's path)."""

    def pack(tickets: list[bytes]) -> Packed:
        tensor = ticket_tensor(tickets)
        return Packed(tensor, ticket_response(answer_as, tensor) if answer_as is not None else None)

    return pack


def split(outputs: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Each request's rows of a batch's outputs (no split call for the common single-request batch)."""
    return [outputs] if len(sizes) == 1 else list(torch.split(outputs, sizes))


def trimmed(columns: list[list[torch.Tensor]], ragged: Sequence[int]) -> list[list[torch.Tensor]]:
    """A detector's outputs per request (``columns[i][k]``: output ``i``'s rows of request ``k``;
    output 0 is ``COUNT``, ``[b, 1]`` on the host), each ``ragged`` output cut along its detection
    axis to the request's largest count (at least 1): the batch's were padded to the batch's."""
    out = list(columns)
    for i in ragged:
        out[i] = [rows[:, :max(1, int(count.max()))].contiguous() for rows, count in zip(columns[i], columns[0], strict=True)]
    return out


class EarlyReply:
    """The response of a call's one request, sent through its response sender as soon as its tickets exist.

    The ensemble then schedules the next block while this one queues its GPU work (copies, graph
    replay, the slot's event): the next block's step overlaps that host work. The next block waits
    for the commit (``blockflow.backend.tensormq``). Python-backend models that are not decoupled
    may send their one response this way (r24.10: ``ResponseSender::Send``); ``execute`` then
    returns None for that request. One round trip to the server per response, so a call of
    several requests returns its responses together instead.
    """

    __slots__ = ("name", "request", "sent")

    def __init__(self, request: Any, name: str) -> None:
        self.request, self.name = request, name
        self.sent = False

    def __call__(self, tickets: torch.Tensor, response: Any = None) -> None:
        """Send ``tickets``, in ``response`` where it was built ahead (:func:`packer`)."""
        if response is None:
            response = ticket_response(self.name, tickets)
        # Set first: the request has its one response once the send began, even if it raises
        # after the server took it; a second one is refused.
        self.sent = True
        self.request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
