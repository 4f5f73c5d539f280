"""What a block answers: Triton errors, tickets as a tensor, a batch's rows per request, and a
TensorMQ request's response sent before the block queues its GPU work.

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack  # type: ignore[attr-defined]  # re-exported without __all__

from blockflow.backend.tensormq.producer import Producer
from blockflow.backend.tensormq.reservation import PoolExhaustedError, Reservation
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
    help); a bad request is the caller's (INVALID_ARG); anything else is INTERNAL."""
    if isinstance(exc, (PoolExhaustedError, ProducerGoneError)):
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


def split(outputs: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Each request's rows of a batch's outputs (no split call for the common single-request batch)."""
    return [outputs] if len(sizes) == 1 else list(torch.split(outputs, sizes))


class EarlyReply:
    """The response of a call's one request, sent through its response sender as soon as its tickets exist.

    The ensemble then schedules the next block while this one queues its GPU work (copies, graph
    replay, the slot's event): the next block's step overlaps that host work. The next block waits
    for the commit (``blockflow.backend.tensormq``). Python-backend models that are not decoupled
    may send their one response this way (r24.10: ``ResponseSender::Send``); ``execute`` then
    returns None for that request. One round trip to the server per response, so a call of
    several requests returns its responses together instead.
    """

    __slots__ = ("name", "request", "reservation", "sent")

    def __init__(self, request: Any, name: str) -> None:
        self.request, self.name = request, name
        self.sent = False
        self.reservation: Reservation | None = None  # taken by answer_first, until the block's run takes it over

    def answer_first(self, producer: Producer, in_name: str, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> None:
        """Answer before the input is read: reserve the output's slot for the request's rows, issue
        its tickets and send them (kept in :attr:`reservation`).

        The rows come from the input's shape, which Triton checked against the model's config; the
        slot is the one prepared between calls when the call is of batch 1. Reading and claiming the
        input, the GPU work and the commit then overlap the ensemble's step to the next block (whose
        claim waits for the commit). A failure after the answer aborts the reservation: its
        consumer refuses the tickets, and the request fails there (``ProducerGoneError``).
        """
        tensor = pb_utils.get_input_tensor_by_name(self.request, in_name)
        if tensor is None:
            raise RequestError(f"request has no input {in_name!r}")
        reservation = producer.reserve_tensors(int(tensor.shape()[0]), shapes, dtype)
        try:
            tickets = producer.issue(reservation)
            self(reservation.packed if reservation.packed is not None else ticket_tensor(tickets))
        except BaseException:
            producer.abort(reservation)
            raise
        self.reservation = reservation

    def take(self) -> Reservation | None:
        """The reservation :meth:`answer_first` made, handed over once (to the block's run)."""
        reservation, self.reservation = self.reservation, None
        return reservation

    def abandon(self, producer: Producer) -> None:
        """Abort a reservation the block's run never took (the call failed before it)."""
        reservation = self.take()
        if reservation is not None:
            producer.abort(reservation)

    def __call__(self, tickets: torch.Tensor) -> None:
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor.from_dlpack(self.name, to_dlpack(tickets))])
        # Set first: the request has its one response once the send began, even if it raises
        # after the server took it; a second one is refused.
        self.sent = True
        self.request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
