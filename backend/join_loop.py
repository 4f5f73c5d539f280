"""A chain's join, which never holds a Triton instance while it waits (plan option ``hand_over: chain``).

The join is the ensemble step after a chain's last link: the ensemble gives it the head's ticket as
its key as soon as the head answers, while the links still run that sample. Waiting for the last
link's hand-over inside ``execute`` held one of the join's instances for the links' whole time (on
one H200 at c256, ResNet-50 in four blocks ×4: executions of ~17 ms for ~20 images, requests queued
~17 ms for an instance). So ``execute`` only keeps each request's keys and returns: Triton's
instance takes its next call at once, and this thread answers each request through its response
sender (r24.10: one response per request, sent after ``execute`` returned None for it) once every
hand-over it needs has come, the requests that are ready batched together as one call. A request
whose hand-over does not come within the wait fails as before (UNAVAILABLE); a forged key fails at
the door (400). ``BLOCKFLOW_TMQ_JOIN_HOLDS=0`` waits inside ``execute`` instead. The protocol's
rules are in the package note (``backend/tensormq/__init__.py``, "Chains").

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from blockflow.backend.replies import failed_response
from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.handover import HandIn
from blockflow.core.errors import RequestError

# How long the thread waits for hand-overs or requests before it looks whether it should stop.
_POLL_S = 0.1


class HeldRequest:
    """What the join keeps of a request once ``execute`` returned: its tickets (the keys), the outputs
    it asks for and its response sender. ``RequestInputs`` reads the tickets as a request's."""

    __slots__ = ("tickets", "keys", "samples", "outputs", "sender", "deadline")

    def __init__(self, request: Any, name: str, into: HandIn, mac_key: bytes) -> None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise RequestError(f"request has no input {name!r}")
        # A copy: Triton frees the request's tensors once execute returns. Tickets are host bytes
        # (FORCE_CPU_ONLY_INPUT_TENSORS), read by NumPy through the tensor's DLPack (RequestInputs.read).
        rows = np.array(np.from_dlpack(tensor), copy=True)
        if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[0] < 1 or rows.shape[1] != tk.TICKET_BYTES:
            raise RequestError(f"input {name!r} is {rows.dtype} {list(rows.shape)}; expected uint8 [n, {tk.TICKET_BYTES}] tickets")
        for row in rows:
            tk.decode(row.tobytes(), mac_key)  # a forged key fails now (TicketError), not after the wait
        self.tickets = rows
        self.keys = into.awaited(rows)
        self.samples = int(rows.shape[0])
        self.outputs = list(request.requested_output_names())
        self.sender = request.get_response_sender()
        self.deadline = time.monotonic() + into.wait_s

    def requested_output_names(self) -> list[str]:
        return self.outputs

    def get_response_sender(self) -> Any:
        return self.sender


class JoinLoop:
    """Keeps a join instance's requests (:meth:`hold`) and runs them through ``run`` on a thread of its
    own once their hand-overs came, at most ``max_batch`` samples a call (a request larger runs alone)."""

    def __init__(self, into: HandIn, mac_key: bytes, block: str, in_name: str, run: Callable[[list[Any]], list[Any]],
                 max_batch: int, device: torch.device, log_error: Callable[[str], None]) -> None:
        self.into, self.mac_key, self.block, self.in_name = into, mac_key, block, in_name
        self.run, self.max_batch, self.device, self.log_error = run, max_batch, device, log_error
        self._held: deque[HeldRequest] = deque()
        self._lock = threading.Lock()
        # A byte down this pipe wakes the thread when a request comes (hand-overs wake it themselves).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        into.wake_on(self._wake_r)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="blockflow-join", daemon=True)
        self._thread.start()

    def hold(self, requests: list[Any]) -> list[Any]:
        """``execute``'s part: each request kept for the thread (None in its place: it is answered through
        its response sender), or its error response now (a malformed or forged key)."""
        responses: list[Any] = []
        held: list[HeldRequest] = []
        for request in requests:
            try:
                held.append(HeldRequest(request, self.in_name, self.into, self.mac_key))
                responses.append(None)
            except RequestError as exc:
                responses.append(failed_response(exc, self.block))
        if held:
            with self._lock:
                self._held.extend(held)
            self._wake()
        return responses

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups: the thread is awake
            pass

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the CUDA context is per thread
        more = False  # ready requests were left for the next call
        timeout = 0.0
        while True:
            try:
                self.into.wait(timeout)
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                # After the wake-ups are read: a request held later writes another, so the next wait
                # returns at once (its hand-over may have come already, and nothing else would wake it).
                with self._lock:
                    held = list(self._held)
                if not held and self._stopping.is_set():
                    return
                ready, more = self._ready(held)
                if ready:
                    self._answer(ready)
                now = time.monotonic()
                timeout = 0.0 if more else max(0.0, min([_POLL_S, *(h.deadline - now for h in held if h not in ready)]))
            except Exception as exc:  # this thread must outlive any one call
                self.log_error(f"blockflow: {self.block}: join loop: {exc!r}")
                more, timeout = False, _POLL_S

    def _ready(self, held: list[HeldRequest]) -> tuple[list[HeldRequest], bool]:
        """The held requests to run now (every hand-over came, or the wait is over), in the order they
        came, at most ``max_batch`` samples (at least one request); whether ready ones were left."""
        now = time.monotonic()
        came = self.into.arrived([h.keys for h in held])
        ready: list[HeldRequest] = []
        samples = 0
        more = False
        for h, ok in zip(held, came, strict=True):
            if not (ok or now >= h.deadline):
                continue
            if ready and samples + h.samples > self.max_batch:
                more = True
                break
            ready.append(h)
            samples += h.samples
        if ready:
            taken = {id(h) for h in ready}
            with self._lock:
                self._held = deque(h for h in self._held if id(h) not in taken)
        return ready, more

    def _answer(self, ready: list[HeldRequest]) -> None:
        """One call of the ready requests; each request's response through its sender."""
        try:
            responses = self.run(ready)
        except Exception as exc:  # every request gets its one response, whatever failed
            self.log_error(f"blockflow: {self.block}: a call of {len(ready)} held requests failed: {exc!r}")
            responses = [failed_response(exc, self.block) for _ in ready]
        for h, response in zip(ready, responses, strict=True):
            if response is None:
                continue  # answered already (an early reply with its tickets)
            try:
                h.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # its client is gone, say: the others are answered
                self.log_error(f"blockflow: {self.block}: a response could not be sent: {exc!r}")

    def close(self) -> None:
        """Answer every held request (each within its wait), then stop."""
        self._stopping.set()
        self._wake()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
