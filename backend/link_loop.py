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

from blockflow.backend.runtime import BlockRunner
from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.handout import HandOut
from blockflow.backend.tensormq.handover import HandIn
from blockflow.backend.tensormq.releases import Release
from blockflow.backend.tensormq.wire import HANDED
from blockflow.backend.tensormq_ends import TensorMQEnds
from blockflow.core.threads import named_thread

# The ticket's bytes that name the use of a slot (producer, generation, slot, sequence): the samples of
# one use are claimed together, so one bad use fails only its own samples.
_USE = slice(tk.LAYOUT["producer"].start, tk.LAYOUT["seq"].stop)
# How long the thread waits for hand-overs before it looks whether it should stop.
_POLL_S = 0.1


class LinkLoop:
    """Runs a link instance's hand-overs on a thread of its own, at most ``max_batch`` samples a batch."""

    def __init__(self, ends: TensorMQEnds, runner: BlockRunner, shapes: tuple[tuple[int, ...], ...], device: torch.device,
                 max_batch: int, touch: Callable[[int], None], log_error: Callable[[str], None]) -> None:
        relay, consumer = ends.relay, ends.consumer
        assert relay is not None and relay.into is not None and relay.out is not None and consumer is not None
        self.ends, self.runner, self.shapes, self.device = ends, runner, shapes, device
        self.into: HandIn = relay.into
        self.out: HandOut = relay.out
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

    def _run(self, got: list[tuple[bytes, bytes, bytes]]) -> None:
        ends, out, tracer = self.ends, self.out, self.ends.tracer
        tracer.begin()
        ends.begin()
        uses: dict[bytes, list[tuple[bytes, bytes]]] = {}
        for key, status, ticket in got:
            if status != HANDED:  # failed before: the join's request fails with the sender's reason
                out.fail([key], status.decode(errors="replace"), forwarded=True)
            else:
                uses.setdefault(ticket[_USE], []).append((key, ticket))
        keys: list[bytes] = []
        views: list[list[torch.Tensor]] = []
        releases: list[Release] = []
        failed = False
        try:
            for samples in uses.values():
                rows = np.frombuffer(b"".join(t for _, t in samples), dtype=np.uint8).reshape(len(samples), tk.TICKET_BYTES)
                try:
                    v, rel = self.consumer.gather_tensors(rows, self.shapes, ends.stream)
                except Exception as exc:  # this use's samples fail; the others run
                    out.fail([k for k, _ in samples], str(exc))
                    continue
                keys.extend(k for k, _ in samples)
                views.append(v)
                releases.extend(rel)
            if not views:
                return
            tracer.mark()  # inputs read (as an execute's trace: read, run, respond)
            tracer.gpu_begin()
            out.take(keys)  # from here on, a key not handed on fails at the next block (end_sends)
            xs = views[0] if len(views) == 1 else self.runner.join([[v[j] for v in views] for j in range(len(views[0]))])
            ends.produce(self.runner, xs, None)  # hands its tickets on before queuing the GPU work
            tracer.mark()  # work queued
        except Exception as exc:
            failed = True
            self.log_error(f"blockflow: link batch of {len(keys)} failed: {exc!r}")
        finally:
            ends.end_sends()
            ends.end(releases, False, failed)
            tracer.end(len(got))

    def close(self) -> None:
        """Stop before the ends close: senders stop finding this instance once its sockets' files are gone;
        what reached it by then is still run (until it has heard nothing for two polls), and it waits for that."""
        self.into.remove_file()
        self._stopping.set()
        self._thread.join()
