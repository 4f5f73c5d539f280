"""A chain head's requests that wait for its tail's answers (plan option ``chain_answers: head``).

The head hands each sample over keyed by its own ticket; its tail sends each sample's answer back
(``backend/tensormq/answers.py``) and the head's ``execute``, which waits for them, returns each
request's response built from its samples' answers, as any model answers: one ensemble step for the
whole chain, and no response sent from another thread (a send through python_backend's response
sender is a round trip through the server that cost the head more than the step it saved). A
failure any sample was handed fails its request; a request whose answers do not come within
``wait_s`` fails with UNAVAILABLE. An instance runs one call at a time, so every answer it reads is
for its current call or for an earlier one that gave up on it (dropped). The protocol's rules are in
``backend/tensormq/__init__.py``, "Chains".

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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


class Waiting:
    """One request of the current call that waits for its samples' answers."""

    __slots__ = ("answers", "left", "why")

    def __init__(self, samples: int) -> None:
        self.answers: list[bytes] = [b""] * samples
        self.left = samples
        self.why: str | None = None  # why it failed, once it did


class ChainAnswers:
    """The head instance's current call: the keys it waits for, and its answers once they come."""

    def __init__(self, into: AnswerIn, outputs: Sequence[TaskOutput], wait_s: float, block: str,
                 log_error: Callable[[str], None]) -> None:
        self.into, self.outputs, self.wait_s, self.block, self.log_error = into, tuple(outputs), wait_s, block, log_error
        self._bytes = [o.sample_bytes or 0 for o in self.outputs]
        self._keys: dict[bytes, tuple[Waiting, int]] = {}
        self.answered = self.failed = self.expired = self.stale = 0  # requests; stale: answers no call waited for

    def expect(self, sizes: Sequence[int], tickets: Sequence[bytes]) -> list[Waiting]:
        """Before the head hands them over: requests of ``sizes`` samples each, in the order of ``tickets``
        (the batch's), wait for the answers keyed by their tickets. What the socket holds before they are
        handed over is for earlier calls: read and dropped now, so it never fills meanwhile."""
        self.stale += len(self.into.read())
        out = [Waiting(n) for n in sizes]
        i = 0
        for w in out:
            for j in range(len(w.answers)):
                self._keys[tickets[i][_MAC]] = (w, j)
                i += 1
        return out

    def collect(self, waiting: Sequence[Waiting]) -> None:
        """Wait until each of ``waiting`` has every answer or has failed (a failure handed back, or
        nothing within ``wait_s``); what a request still lacks then fails it."""
        deadline = time.monotonic() + self.wait_s
        mine = {id(w) for w in waiting}
        left = sum(1 for w in waiting if w.left and w.why is None)
        while left:
            for key, status, answer in self.into.read():
                found = self._keys.pop(key, None)
                if found is None or id(found[0]) not in mine:
                    self.stale += 1  # for a call that gave up on it, or for a request that failed meanwhile
                    continue
                w, j = found
                if w.why is not None:
                    continue
                if status != HANDED or len(answer) != sum(self._bytes):
                    w.why = status.decode(errors="replace") if status != HANDED else f"an answer of {len(answer)} bytes"
                    left -= 1
                    continue
                w.answers[j] = answer
                w.left -= 1
                if w.left == 0:
                    left -= 1
            rest = deadline - time.monotonic()
            if left and (rest <= 0 or not self.into.wait(rest)) and time.monotonic() >= deadline:
                break
        expired = [w for w in waiting if w.why is None and w.left]
        for w in expired:
            w.why = f"no answer from the chain's tail within {self.wait_s:g} s"
        if expired:
            self.expired += len(expired)
            self.log_error(f"blockflow: {self.block}: {len(expired)} request(s) got no answer from the chain's tail "
                           f"within {self.wait_s:g} s ({self.expired} so far)")

    def response(self, w: Waiting) -> Any:
        """``w``'s response: each task output's rows, one per sample, from its answers; or its failure."""
        if w.why is not None:
            self.failed += 1
            return pb_utils.InferenceResponse(error=error(f"block {self.block!r} failed: {w.why}", "UNAVAILABLE"))
        tensors = []
        at = 0
        for o, n in zip(self.outputs, self._bytes, strict=True):
            rows = bytearray(b"".join(a[at:at + n] for a in w.answers))
            t = torch.frombuffer(rows, dtype=_DTYPES[o.dtype]).reshape(len(w.answers), *o.shape)
            tensors.append(pb_utils.Tensor.from_dlpack(o.name, to_dlpack(t)))
            at += n
        self.answered += 1
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def end_call(self) -> None:
        """The call is over: answers still to come for it are dropped when they do."""
        self._keys.clear()

    def close(self) -> None:
        self.into.close()
