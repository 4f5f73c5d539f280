"""A chain head's requests that wait for its tail's answers (plan option ``chain_answers: head``).

The head hands each sample over keyed by its own ticket and returns no response for the request
(``execute`` gives None for it); its tail sends each sample's answer back (``backend/tensormq/answers.py``),
and a thread of the head's answers the request once every sample's answer is in, through the
request's response sender (python_backend allows one response a request this way in its default
mode: ``ResponseSender::Send``, r24.10). A failure any sample was handed fails the request; a
request whose answers do not come within ``wait_s`` fails with UNAVAILABLE. The protocol's rules are
in ``backend/tensormq/__init__.py``, "Chains".

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack  # type: ignore[attr-defined]  # re-exported without __all__

from blockflow.backend.replies import error
from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.answers import AnswerIn
from blockflow.backend.tensormq.wire import HANDED
from blockflow.core.spec import TaskOutput

_MAC = tk.LAYOUT["mac"]
_DTYPES = {"fp32": torch.float32, "int64": torch.int64}
# How often the thread looks for requests past their wait while no answer comes.
_POLL_S = 0.1
# Threads that send the responses: each send is a round trip through the server (~0.3-0.5 ms under load, the
# GIL released), so one thread alone capped a head instance near 2,000 responses a second (H200, c256).
SENDERS = 8


class Waiting:
    """One request that waits for its samples' answers."""

    __slots__ = ("answers", "deadline", "done", "keys", "left", "request")

    def __init__(self, request: Any, samples: int, deadline: float) -> None:
        self.request = request
        self.keys: list[bytes] = []
        self.answers: list[bytes] = [b""] * samples
        self.left = samples
        self.deadline = deadline
        self.done = False  # answered, failed or given back to ``execute`` (one response a request)


class ChainAnswers:
    """The head instance's requests that wait, by key, and the thread that answers them."""

    def __init__(self, into: AnswerIn, outputs: Sequence[TaskOutput], wait_s: float, block: str,
                 log_error: Callable[[str], None]) -> None:
        self.into, self.outputs, self.wait_s, self.block, self.log_error = into, tuple(outputs), wait_s, block, log_error
        self._bytes = [o.sample_bytes or 0 for o in self.outputs]
        self._lock = threading.Lock()
        self._keys: dict[bytes, tuple[Waiting, int]] = {}
        self._waiting: OrderedDict[int, Waiting] = OrderedDict()  # by id, oldest (first deadline) first
        self.answered = self.failed = self.expired = 0  # requests (the metrics thread may read them)
        self._closing = threading.Event()
        self._senders = ThreadPoolExecutor(SENDERS, thread_name_prefix="blockflow-answer-send")
        self._thread = threading.Thread(target=self._loop, name="blockflow-answers", daemon=True)
        self._thread.start()

    def expect(self, requests: Sequence[Any], sizes: Sequence[int], tickets: Sequence[bytes]) -> list[Waiting]:
        """Before the head hands them over: ``requests`` (``sizes`` samples each, in the order of
        ``tickets``, the batch's) wait for the answers keyed by their tickets."""
        deadline = time.monotonic() + self.wait_s
        out = [Waiting(r, n, deadline) for r, n in zip(requests, sizes, strict=True)]
        with self._lock:
            i = 0
            for w in out:
                for j in range(len(w.answers)):
                    w.keys.append(tickets[i][_MAC])
                    self._keys[w.keys[-1]] = (w, j)
                    i += 1
                self._waiting[id(w)] = w
        return out

    def give_back(self, waiting: Sequence[Waiting]) -> list[bool]:
        """For each of ``waiting`` (its call failed after :meth:`expect`), whether ``execute`` answers it
        now: True unless it was answered already; either way it waits no more."""
        out = []
        with self._lock:
            for w in waiting:
                out.append(not w.done)
                self._forget(w)
        return out

    def _forget(self, w: Waiting) -> None:
        """Lock held: ``w`` waits no more (an answer for it that comes later is dropped)."""
        w.done = True
        self._waiting.pop(id(w), None)
        for key in w.keys:
            self._keys.pop(key, None)

    def _loop(self) -> None:
        while not self._closing.is_set():
            try:
                with self._lock:
                    first = next(iter(self._waiting.values()), None)
                heard = self.into.wait(_POLL_S if first is None else min(_POLL_S, first.deadline - time.monotonic()))
                self._answer(self.into.read() if heard else [])
            except Exception as exc:  # this thread must outlive anything one answer does
                self.log_error(f"blockflow: {self.block}: answering the chain's requests failed: {exc!r}")

    def _answer(self, answers: list[tuple[bytes, bytes, bytes]]) -> None:
        ready: list[Waiting] = []
        failed: list[tuple[Waiting, str]] = []
        now = time.monotonic()
        with self._lock:
            for key, status, answer in answers:
                found = self._keys.pop(key, None)
                if found is None:
                    continue  # its request failed or was answered already
                w, j = found
                if status != HANDED or len(answer) != sum(self._bytes):
                    why = status.decode(errors="replace") if status != HANDED else f"an answer of {len(answer)} bytes"
                    failed.append((w, why))
                    self._forget(w)
                    continue
                w.answers[j] = answer
                w.left -= 1
                if w.left == 0:
                    ready.append(w)
                    self._forget(w)
            while self._waiting and next(iter(self._waiting.values())).deadline <= now:
                w = next(iter(self._waiting.values()))
                failed.append((w, f"no answer from the chain's tail within {self.wait_s:g} s"))
                self._forget(w)
                self.expired += 1
        self.answered += len(ready)
        self.failed += len(failed)
        sends: list[tuple[Waiting, str | None]] = [(w, None) for w in ready] + list(failed)
        if len(sends) == 1:  # the only one: at once, without waking another thread
            self._send(*sends[0])
            return
        for waiting, reason in sends:
            self._senders.submit(self._send, waiting, reason)

    def _response(self, w: Waiting) -> Any:
        """The request's outputs: each task output's rows, one per sample, from its answers."""
        tensors = []
        at = 0
        for o, n in zip(self.outputs, self._bytes, strict=True):
            rows = bytearray(b"".join(a[at:at + n] for a in w.answers))
            t = torch.frombuffer(rows, dtype=_DTYPES[o.dtype]).reshape(len(w.answers), *o.shape)
            tensors.append(pb_utils.Tensor.from_dlpack(o.name, to_dlpack(t)))
            at += n
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _send(self, w: Waiting, why: str | None) -> None:
        """``w``'s response: its answers, or its failure ``why``."""
        try:
            response = (self._response(w) if why is None else
                        pb_utils.InferenceResponse(error=error(f"block {self.block!r} failed: {why}", "UNAVAILABLE")))
            w.request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # the client went away, or the server stops: nothing else to answer
            self.log_error(f"blockflow: {self.block}: a chain's answer could not be sent: {exc!r}")

    def close(self, drain_s: float) -> None:
        """Answer what its tail still sends for up to ``drain_s``; fail the rest; stop."""
        deadline = time.monotonic() + drain_s
        while self._waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            for w in self._waiting.values():
                w.deadline = 0.0
        self._answer([])  # fails them (or the thread did, just now)
        self._closing.set()
        self._thread.join(2)
        self._senders.shutdown(wait=True)
        self.into.close()
