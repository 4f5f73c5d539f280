"""A consumer's releases: the samples it claimed given back once the GPU work that read them is done.

A thread of the consumer's own waits for each batch's event, then sets the samples' bits in their
producers' claim tables (or, with ``BLOCKFLOW_TMQ_RELEASE=message``, sends RELEASE messages); the
rules are step 5 of the package note (``backend/tensormq/__init__.py``).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Protocol

import torch
import zmq

from blockflow.backend.tensormq.claims import ClaimTable, claims_path
from blockflow.backend.tensormq.wire import RELEASE, RELEASE_ITEM, endpoint, socket_path
from blockflow.core import cuda, env
from blockflow.core.threads import named_thread

Release = tuple[int, int, int, int, int]  # producer, generation, slot, seq, sample
RELEASE_EVENTS = 64


class _Counts(Protocol):
    releases_sent: int  # samples released: set in their producer's claim table, or sent in a RELEASE message


class Releaser:
    """Queues a consumer's releases and makes them on a thread of its own, each after its event."""

    def __init__(self, runtime_dir: Path, device: torch.device, stats: _Counts) -> None:
        self.runtime_dir, self.device, self.stats = runtime_dir, device, stats
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        # Items: (CUDA event to wait for, releases, set when sent); None stops the thread.
        # A SimpleQueue: its put is a few C calls, where Queue.put takes a Python lock and notifies.
        self._queue: queue.SimpleQueue[tuple[int | None, list[Release], threading.Event | None] | None] = queue.SimpleQueue()
        # A ring of plain events marks "the reads of this batch are done". Reusing one before the
        # release thread waited on it only makes that wait longer (it then waits for a later batch),
        # never shorter, so a release is never sent early. Blocking-sync events let the release thread
        # sleep rather than spin a core while it waits.
        self._ring: list[int] = []
        self._next = 0
        if device.type == "cuda":
            with torch.cuda.device(device):
                self._ring = [cuda.event_create() for _ in range(RELEASE_EVENTS)]
        # Releases as bits in each producer's claim table (no message, no wake-up of the producer), or
        # with BLOCKFLOW_TMQ_RELEASE=message as ZeroMQ RELEASE messages to the producer's server thread.
        self._by_message = os.environ.get(env.TMQ_RELEASE) == "message"
        self._thread = named_thread(self._loop, "tmq-releaser")
        self._thread.start()

    def after(self, releases: list[Release], stream: int | None, after: int | None = None) -> None:
        """Release ``releases`` once the work queued so far on ``stream`` (which read the slots) is done.

        ``stream`` None (or a host consumer) releases them as soon as the thread gets to them.
        ``after``: an event already recorded on ``stream`` after that work (a middle block's own
        output slot event, recorded at its commit), waited for instead of recording one more.
        """
        if not releases:
            return
        event = after
        if event is None and self._ring and stream is not None:
            event = self._ring[self._next]
            self._next = (self._next + 1) % len(self._ring)
            cuda.event_record(event, stream)
        self._queue.put((event, releases, None))

    def flush(self) -> None:
        """Block until every queued release was made (tests, shutdown)."""
        done = threading.Event()
        self._queue.put((None, [], done))
        done.wait(10)

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # driver calls below need the context current in this thread
        # Per producer generation: its claim table (None once it stopped), or with messages its socket.
        tables: dict[tuple[int, int], ClaimTable | None] = {}
        sockets: dict[tuple[int, int], zmq.Socket[Any]] = {}
        while True:
            item = self._queue.get()
            if item is None:
                break
            event, releases, done = item
            try:
                if event is not None:
                    self._wait(event)
                if len(tables) + len(sockets) > 64:  # generations come and go with reloads; opening again is cheap
                    _close_ends(tables, sockets)
                self.stats.releases_sent += self._send(releases, sockets) if self._by_message else self._mark(releases, tables)
            except Exception as exc:  # this thread must outlive one batch: the lease takes its slots back
                print(f"blockflow: TensorMQ releases failed: {exc!r}", file=sys.stderr, flush=True)
            finally:
                if done is not None:
                    done.set()
        _close_ends(tables, sockets)

    @staticmethod
    def _wait(event: int) -> None:
        """Wait for ``event``. A CUDA error of this process's context (an illegal address, say) is sticky:
        none of its work runs any more, so the slots it would have read are released all the same."""
        try:
            cuda.event_synchronize(event)
        except Exception as exc:
            print(f"blockflow: TensorMQ releases after a failed wait for the GPU: {exc!r}", file=sys.stderr, flush=True)

    def _mark(self, releases: list[Release], tables: dict[tuple[int, int], ClaimTable | None]) -> int:
        """Set the released samples' bits in their producers' claim tables; how many were released."""
        by_slot: dict[tuple[int, int, int, int], list[int]] = defaultdict(list)
        for pid, gen, slot, seq, sample in releases:
            by_slot[(pid, gen, slot, seq)].append(sample)
        n = 0
        for (pid, gen, slot, seq), samples in by_slot.items():
            if (pid, gen) not in tables:
                try:
                    tables[(pid, gen)] = ClaimTable(claims_path(socket_path(self.runtime_dir, pid, gen)))
                except FileNotFoundError:
                    tables[(pid, gen)] = None  # the producer stopped: its pool went with it
                except (OSError, ValueError):
                    continue  # tried again with the next release; meanwhile the lease takes these back
            table = tables[(pid, gen)]
            if table is not None:
                n += table.release(slot, seq, samples)
        return n

    def _send(self, releases: list[Release], sockets: dict[tuple[int, int], zmq.Socket[Any]]) -> int:
        """Send the releases to their producers, one RELEASE message each; how many were sent."""
        by_producer: dict[tuple[int, int], list[bytes]] = defaultdict(list)
        for pid, gen, slot, seq, sample in releases:
            by_producer[(pid, gen)].append(RELEASE_ITEM.pack(gen, slot, seq, sample))
        n = 0
        for key, items in by_producer.items():
            sock = sockets.get(key)
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.connect(endpoint(self.runtime_dir, *key))
                sockets[key] = sock
            try:
                sock.send_multipart([RELEASE, b"".join(items)], zmq.NOBLOCK)
                n += len(items)
            except zmq.Again:
                pass  # the producer's lease reclaims what we could not release
        return n

    def close(self) -> None:
        """Make the releases still queued, then stop."""
        self._queue.put(None)
        self._thread.join(5)
        if self._ring:
            with torch.cuda.device(self.device):
                for e in self._ring:
                    cuda.event_destroy(e)
            self._ring = []


def _close_ends(tables: dict[tuple[int, int], ClaimTable | None], sockets: dict[tuple[int, int], zmq.Socket[Any]]) -> None:
    for table in tables.values():
        if table is not None:
            table.close()
    for sock in sockets.values():
        sock.close()
    tables.clear()
    sockets.clear()
