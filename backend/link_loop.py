"""A link's own thread (plan option ``hand_over: chain``): the block runs what it is handed, not requests.

A link is no ensemble step. Its instances take the hand-overs the block before it sends them
(``backend/tensormq/handout.py``: each call's to one instance), claim the tickets, run the batch
into their own pool slot and hand their tickets on under the same keys, the first block's
(``HandOver.own_keys``), to the next block: another link, or the chain's *join*, the step the
ensemble gives that key. A sample that fails here is handed on as its failure, so the join's request
fails with it (UNAVAILABLE). The protocol's rules are in the package note (``backend/tensormq/__init__.py``,
"Chains").

Inside a stub only (through ``TensorMQEnds``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from blockflow.backend.gpu_waits import GpuWaits
from blockflow.backend.runtime import BlockRunner
from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.answers import AnswerOut
from blockflow.backend.tensormq.handout import HandOut
from blockflow.backend.tensormq.handover import HandIn
from blockflow.backend.tensormq.releases import Release
from blockflow.backend.tensormq.wire import HANDED, Answer, HandOverMessage, answer_failed, answered
from blockflow.backend.tensormq_ends import TensorMQEnds
from blockflow.core.threads import named_thread

# The ticket's bytes that name the use of a slot (producer, generation, slot, sequence): the samples of
# one use are claimed together, so one bad use fails only its own samples.
_USE = slice(tk.LAYOUT["producer"].start, tk.LAYOUT["seq"].stop)
# How long the thread waits for hand-overs before it looks whether it should stop.
_POLL_S = 0.1


class LinkLoop:
    """Runs a link instance's hand-overs on a thread of its own, at most ``max_batch`` samples a batch;
    a chain's tail sends each sample's answer back to the head instance that took its request."""

    def __init__(self, ends: TensorMQEnds, runner: BlockRunner, shapes: tuple[tuple[int, ...], ...], device: torch.device,
                 max_batch: int, touch: Callable[[int], None], log_error: Callable[[str], None], waits: GpuWaits) -> None:
        relay, consumer = ends.relay, ends.consumer
        # The block's own waits: a link's execute answers nothing, so this thread alone uses them.
        self.waits = waits
        assert relay is not None and relay.into is not None and consumer is not None
        assert (relay.out is None) == (ends.answer_out is not None)  # a link hands on, or is the tail and answers
        self.ends, self.runner, self.shapes, self.device = ends, runner, shapes, device
        self.into: HandIn = relay.into
        self.out: HandOut | None = relay.out
        self.answer_out: AnswerOut | None = ends.answer_out
        self.consumer = consumer
        self.max_batch, self.touch, self.log_error = max_batch, touch, log_error
        self.batches = self.samples = 0  # what it ran (the metrics thread reads them: blockflow_tmq_link_*)
        self._stopping = threading.Event()
        self._thread = named_thread(self._loop, "bf-link")
        self._thread.start()

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the CUDA context is per thread
        quiet = 0  # polls in a row that heard nothing, once stopping
        while quiet < 2:
            try:
                # A hand-over that waited longer than the join waits for it is handed on as failed, not run.
                got = self.into.take_any(_POLL_S, self.max_batch, stale_s=self.into.wait_s)
                if got:
                    self.touch(len(got))
                    self.batches += 1
                    self.samples += len(got)
                    self._run(got)
            except Exception as exc:  # a batch's failure is handed on; this thread must outlive it
                self.log_error(f"blockflow: link batch failed: {exc!r}")
                got = []
            quiet = quiet + 1 if self._stopping.is_set() and not got else 0

    def _fail(self, samples: list[tuple[bytes, bytes]], reason: str, forwarded: bool = False) -> None:
        """These ``(key, origin)`` samples fail with ``reason``: handed on, or (the tail) answered."""
        if self.out is not None:
            self.out.fail([k for k, _ in samples], reason, forwarded=forwarded, origins=[o for _, o in samples])
        elif self.answer_out is not None:
            by_origin: dict[bytes, list[Answer]] = {}
            for key, origin in samples:
                by_origin.setdefault(origin, []).append(answer_failed(key, reason))
            self.answer_out.send(by_origin)

    def _run(self, got: list[HandOverMessage]) -> None:
        ends, out, tracer = self.ends, self.out, self.ends.tracer
        tracer.begin()
        # The samples not yet failed, handed on or answered: whatever goes wrong before that, they fail
        # here (handed on as failed; the tail: answered so), so no request waits for them until its timeout.
        owed = {key: origin for key, _, _, origin in got}
        samples: list[tuple[bytes, bytes]] = []  # (key, origin) of each sample of the batch, in order
        views: list[list[torch.Tensor]] = []
        releases: list[Release] = []
        failed = synced = False
        try:
            uses: dict[bytes, list[tuple[bytes, bytes, bytes]]] = {}  # (key, ticket, origin) by slot use
            for key, status, ticket, origin in got:
                if status != HANDED:  # failed before: the request fails with the sender's reason
                    self._fail([(key, origin)], status.decode(errors="replace"), forwarded=True)
                    owed.pop(key, None)
                else:
                    uses.setdefault(ticket[_USE], []).append((key, ticket, origin))
            ends.begin()
            for use in uses.values():
                rows = np.frombuffer(b"".join(t for _, t, _ in use), dtype=np.uint8).reshape(len(use), tk.TICKET_BYTES)
                try:
                    v, rel = self.consumer.gather_tensors(rows, self.shapes, ends.stream)
                except Exception as exc:  # this use's samples fail; the others run
                    self._fail([(k, o) for k, _, o in use], str(exc))
                    for k, _, _ in use:
                        owed.pop(k, None)
                    continue
                samples.extend((k, o) for k, _, o in use)
                views.append(v)
                releases.extend(rel)
            if not views:
                return
            tracer.mark()  # inputs read (as an execute's trace: read, run, respond)
            tracer.gpu_begin()
            xs = views[0] if len(views) == 1 else self.runner.join([[v[j] for v in views] for j in range(len(views[0]))])
            if out is not None:
                out.take([k for k, _ in samples], [o for _, o in samples])  # from here on, a key not handed on fails at the next block
                owed.clear()  # the sender's now: ``end_sends`` fails what it took and never sent
                ends.produce(self.runner, xs, None)  # hands its tickets on before queuing the GPU work
            else:
                synced = self._answer(xs, samples, owed)
            tracer.mark()  # work queued (the tail: answered)
        except Exception as exc:
            failed = True
            if owed:
                self._fail(list(owed.items()), f"block {self.into.model!r} failed: {exc}")
            self.log_error(f"blockflow: link batch of {len(got)} failed: {exc!r}")
        finally:
            try:
                ends.end_sends()
            finally:
                ends.end(releases, synced, failed)  # the slots it read are released whatever happened
                tracer.end(len(got))

    def _answer(self, xs: list[torch.Tensor], samples: list[tuple[bytes, bytes]], owed: dict[bytes, bytes]) -> bool:
        """The tail: run the batch, bring its outputs to the host and send each sample's answer (its
        value of each task output, in order) to its origin; ``owed`` forgets them once sent. Returns once
        the GPU work is done."""
        assert self.answer_out is not None
        outs = [o.to("cpu", non_blocking=True) for o in self.runner.run_all(xs)]
        self.waits.stream_done(len(samples))
        self.ends.tracer.lap("run:graph")
        rows = [o.reshape(len(samples), -1).contiguous().numpy() for o in outs]
        by_origin: dict[bytes, list[Answer]] = {}
        for i, (key, origin) in enumerate(samples):
            by_origin.setdefault(origin, []).append(answered(key, b"".join(r[i].tobytes() for r in rows)))
        self.answer_out.send(by_origin)
        owed.clear()
        self.ends.tracer.lap("respond:answer")
        return True

    @property
    def answers_lost(self) -> int | None:
        """The tail's answers that could not be sent (``blockflow_tmq_chain_answers_lost_total``); None for another link."""
        return self.answer_out.lost if self.answer_out is not None else None

    def close(self) -> None:
        """Stop before the ends close: senders stop finding this instance once its sockets' files are gone;
        what reached it by then is still run (until it has heard nothing for two polls), and it waits for that."""
        self.into.remove_file()
        self._stopping.set()
        self._thread.join()
