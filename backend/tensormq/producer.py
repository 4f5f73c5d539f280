"""The producer side of TensorMQ: a block instance's output pool and its ZeroMQ endpoint."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.claims import ClaimTable, claims_path
from blockflow.backend.tensormq.leftovers import remove_dead_generations, remove_generation
from blockflow.backend.tensormq.memory import CudaSegment, EventRing, HostSegment, Segment
from blockflow.backend.tensormq.preparer import Preparer
from blockflow.backend.tensormq.reservation import (
    PREPARE_MAX_BATCH,
    Key,
    PoolExhaustedError,
    Reservation,
    Stats,
    batch_bytes,
    producer_id,
)
from blockflow.backend.tensormq.slots import Slot, SlotTable
from blockflow.backend.tensormq.wire import (
    ERROR,
    HELLO,
    RELEASE,
    RELEASE_ITEM,
    STATS,
    WELCOME,
    endpoint,
    socket_path,
)
from blockflow.core import env
from blockflow.core.errors import BlockError
from blockflow.core.runtime_dir import read_key
from blockflow.core.threads import named_thread


class Producer(Preparer):
    """Owns one pool segment, one event per slot and a ROUTER socket that answers consumers.

    Threads: the block's execute thread calls :meth:`reserve` / :meth:`commit`;
    the server thread answers HELLO/STATS (and RELEASE messages) and reaps expired
    leases and unclaimed samples; the preparer thread reserves the next small batch's slot and signs
    its tickets between two calls (:meth:`prepare_ahead`). They touch the slot
    table under ``self._cond``.
    """

    def __init__(self, name: str, runtime_dir: Path, device: torch.device, pool_bytes: int, max_slots: int,
                 lease_s: float, wait_s: float, model: str = "", max_samples: int = 64, claim_s: float | None = None,
                 prepare: bool = True, pack: Callable[[list[bytes]], Any] | None = None) -> None:
        self.name = name
        # What the block hands on for a list of tickets (a tensor for Triton): for a prepared
        # reservation, the preparer makes it too, so that a call of batch 1 only takes it.
        self.pack = pack
        self.runtime_dir = runtime_dir
        self.key = read_key(runtime_dir)
        self.id = producer_id(name)
        self.model_id = tk.model_id(model or name.split("/", 1)[0])
        self.max_samples = max_samples
        self.claim_s = min(lease_s, claim_s if claim_s is not None else lease_s)
        self.generation = int.from_bytes(os.urandom(4), "little") | 1
        self.device = device
        self.lease_s, self.wait_s = lease_s, wait_s
        self.stats = Stats()
        self.table = SlotTable(pool_bytes, max_slots)
        self._cond = threading.Condition()
        self.segment: Segment
        if device.type == "cuda":
            self.segment = CudaSegment(int(device.index or 0), pool_bytes)
            self.events = EventRing(int(device.index or 0), max_slots)
            self.device_type = tk.DEVICE_CUDA
        else:
            self.segment = HostSegment(env.pool_shm_name(runtime_dir, self.id, self.generation), pool_bytes, create=True)
            self.events = EventRing(None)
            self.device_type = tk.DEVICE_HOST
        self._welcome = json.dumps({
            "producer": self.id, "generation": self.generation, "segment": self.segment.describe(),
            "events": self.events.handles(), "max_slots": max_slots,
        }).encode()
        sock_path = socket_path(runtime_dir, self.id, self.generation)
        sock_path.parent.mkdir(mode=0o700, exist_ok=True)
        remove_dead_generations(runtime_dir, self.id)
        # Created before the socket exists, so a consumer that reaches the socket finds the table.
        self.claims = ClaimTable(claims_path(sock_path), max_slots, max_samples, create=True)
        # Committed slots whose releases are read from the claim table, and the release words that free each.
        self._lent = np.zeros(max_slots, dtype=bool)
        self._target = np.zeros((max_slots, self.claims.words), dtype=np.uint64)
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(endpoint(runtime_dir, self.id, self.generation))
        self._stop = threading.Event()
        # The server thread sleeps until a slot falls due; close() wakes it through this pipe.
        self._wake_r, self._wake_w = os.pipe()
        # A slot reserved while the thread sleeps is reaped at most this late: a tenth of the claim window, or 0.1 s.
        self._nap_s = max(0.1, self.claim_s / 10)
        self._thread = named_thread(self._serve, "tmq-producer")
        self._thread.start()
        self._start_preparer(name, prepare)

    # ------------------------------------------------------------------ execute thread

    def reserve(self, batch_shape: tuple[int, ...], dtype: torch.dtype) -> Reservation:
        """A pool range for one batch of one tensor; see :meth:`reserve_tensors`."""
        return self.reserve_tensors(batch_shape[0], [tuple(batch_shape[1:])], dtype)

    def reserve_tensors(self, batch: int, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> Reservation:
        """A pool range for one batch of ``shapes`` (per sample; several make one record per sample);
        waits at most ``wait_s`` for space, then fails the request."""
        if not 1 <= batch <= self.max_samples:
            raise BlockError(f"batch of {batch} is above {self.name}'s TensorMQ limit of {self.max_samples} samples")
        key = (batch, tuple(tuple(s) for s in shapes), dtype)
        nbytes = batch_bytes(key)
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            ready = self._take_ready_locked(key)
            if ready is not None:
                return ready
            self._collect_locked()
            slot = self.table.allocate(nbytes, batch, time.monotonic() + self.lease_s)
            if slot is None and self._drop_ready_locked():  # a request never waits behind a prepared slot
                slot = self.table.allocate(nbytes, batch, time.monotonic() + self.lease_s)
            if slot is None:
                self.stats.pool_waits += 1
            while slot is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.stats.pool_failures += 1
                    raise PoolExhaustedError(
                        f"TensorMQ pool of {self.name} is full ({len(self.table.live)}/{self.table.max_slots} slots, "
                        f"{self.table.bytes_in_use}/{self.table.capacity} bytes) after waiting {self.wait_s:g} s; "
                        "raise tensormq.pool_mb or tensormq.slots in the plan, or lower the load")
                # Releases come through the claim table, which nothing signals: look again every 2 ms.
                self._cond.wait(min(remaining, 0.002))
                self._reap_locked()
                slot = self.table.allocate(nbytes, batch, time.monotonic() + self.lease_s)
            self.stats.allocations += 1
            # Views are built under the lock: the preparer thread builds them too, from the same cache.
            return self._reservation_locked(slot, key)

    def _reservation_locked(self, slot: Slot, key: Key) -> Reservation:
        batch, shapes, dtype = key
        self._lent[slot.index] = False  # until its commit; an earlier use's release words must not free it
        offsets = tk.record_offsets(shapes)
        sample_shape = shapes[0] if len(shapes) == 1 else (offsets[-1],)
        sample_bytes = offsets[-1] * dtype.itemsize
        whole = self.segment.view(slot.offset, (batch, *sample_shape), dtype)
        if len(shapes) == 1:
            return Reservation(slot, [whole], sample_shape, sample_bytes, key=key)
        # Each tensor's rows within the records: strided views that take the block's outputs in place.
        views = [whole[:, a:b].view(batch, *s) for a, b, s in zip(offsets, offsets[1:], shapes, strict=False)]
        return Reservation(slot, views, sample_shape, sample_bytes, tk.layout_id(shapes), key=key)

    def abort(self, r: Reservation) -> None:
        """Give ``r``'s slot back uncommitted; tickets already issued for it are refused from now on."""
        with self._cond:
            if r.issued:
                self.claims.fail_slot(r.slot.index, r.slot.seq)
            self.table.release_all(r.slot.index, r.slot.seq)
            self._cond.notify_all()

    def issue(self, r: Reservation) -> list[bytes]:
        """``r``'s tickets, to hand on *before* :meth:`commit` (signed now unless prepared).

        A consumer that gets one early finds the slot's claim entry still on an earlier use and
        waits (bounded) for the commit to open it; the commit records the slot's event first, so
        the consumer's stream still waits on this use's writes. If the writes fail, :meth:`abort`
        marks the use failed and its tickets are refused. Lets a block answer its request while its
        GPU work is being queued, so the next block's step overlaps that host work.
        """
        tickets = self._signed(r)
        r.issued = True
        self.stats.early_tickets += len(tickets)
        return tickets

    def _signed(self, r: Reservation) -> list[bytes]:
        """``r``'s tickets: signed ahead (a prepared or issued reservation) or now."""
        if r.tickets is None:
            r.tickets = self._sign(r)
        return r.tickets

    def commit(self, r: Reservation, stream: int, lap: Callable[[str], None] | None = None) -> list[bytes]:
        """Record the slot's event after the writes queued on ``stream``; one ticket per sample.

        The slot's claim entry is opened after the event is recorded and before a ticket of this
        use can be accepted, so each ticket is accepted exactly once, until ``claim_s`` from now,
        by a consumer whose stream then waits on these writes. ``lap`` (a block's tracer): called
        once the event is recorded.
        """
        self.events.record(r.slot.index, stream)
        if lap is not None:
            lap("run:event")
        with self._cond:
            r.slot.claim_deadline = time.monotonic() + self.claim_s
            self.claims.open_slot(r.slot.index, r.slot.seq, r.slot.claim_deadline)
            self._target[r.slot.index] = ClaimTable.release_target(r.slot.seq, r.view.shape[0], self.claims.words)
            self._lent[r.slot.index] = True
        out = self._signed(r)
        self.stats.tickets += len(out)
        small = self._preparer is not None and len(out) <= PREPARE_MAX_BATCH
        self._next_key = r.key if small else None
        return out

    def _sign(self, r: Reservation) -> list[bytes]:
        per_sample = r.sample_bytes
        dev_index = int(self.device.index or 0) if self.device.type == "cuda" else 0
        out = []
        for i in range(r.view.shape[0]):
            t = tk.Ticket(self.id, self.generation, r.slot.index, r.slot.seq, i, r.slot.offset + i * per_sample,
                          per_sample, r.view.dtype, r.sample_shape, self.device_type, dev_index, 0, self.model_id, r.layout)
            out.append(tk.encode(t, self.key))
        return out

    def done_event(self, r: Reservation) -> int | None:
        """The event :meth:`commit` recorded for ``r``'s slot (None on the host): it completes once every
        piece of work queued before the commit on that stream is done. Recorded again only when the
        slot is reused, after its consumers released it, so waiting on it never ends too early."""
        return self.events.events[r.slot.index] if self.events.events else None

    def usage(self) -> tuple[int, int]:
        """(bytes, slots) in use: lent to requests, the prepared slot not counted."""
        with self._cond:
            self._collect_locked()
            return self._usage_locked()

    def _usage_locked(self) -> tuple[int, int]:
        ready = self._ready
        if ready is None:
            return self.table.bytes_in_use, len(self.table.live)
        return self.table.bytes_in_use - ready.slot.nbytes, len(self.table.live) - 1

    # ------------------------------------------------------------------ server thread

    def _collect_locked(self) -> None:
        """Free the committed slots whose every sample is released in the claim table."""
        words = self.claims.release_words()
        if words is None or not self._lent.any():  # None: closed
            return
        done = np.flatnonzero(self._lent & (words == self._target).all(axis=1))
        for i in done.tolist():
            self._lent[i] = False
            slot = self.table.live.get(i)
            if slot is not None and slot.seq == int(self._target[i, 0]) >> 32:
                self.stats.releases += slot.samples - slot.retired
                self.table.release_all(i, slot.seq)
        if len(done):
            self._cond.notify_all()

    def _reap_locked(self) -> None:
        if self.claims.closed:  # a server thread that outlived close()
            return
        self._collect_locked()
        now = time.monotonic()
        # Samples nobody claimed within the claim window will never be read (consumers refuse
        # them from then on): give them back now rather than at the end of the lease.
        retired = 0
        for slot in self.table.unclaimed_due(now):
            n = len(self.claims.retire_unclaimed(slot.index, slot.seq, range(slot.samples)))
            slot.retired += n
            retired += n
        if retired:
            self.stats.unclaimed_tickets += retired
            self._collect_locked()
        expired = self.table.reap(now)
        for s in expired:  # what its consumers had released still counts as released
            released = max(0, self.claims.released(s.index, s.seq) - s.retired)
            self.stats.releases += released
            self.stats.expired_tickets += s.samples - s.retired - released
        if expired:
            self.stats.lease_expiries += len(expired)
            self._cond.notify_all()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            with self._cond:
                self._reap_locked()
                due = self.table.next_due()
            # Until the next slot falls due, a message comes or close() wakes it; an idle producer
            # does not wake every few milliseconds (each wake-up takes the stub's GIL).
            nap = min(due - time.monotonic(), self._nap_s)
            if dict(poller.poll(max(0, int(nap * 1000) + 1))).get(self._router):
                while True:
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        ident, kind = frames[0], frames[1]
        if kind == HELLO:
            self.stats.hellos += 1
            self._router.send_multipart([ident, WELCOME, self._welcome])
        elif kind == RELEASE and len(frames) == 3 and len(frames[2]) % RELEASE_ITEM.size == 0:
            # A release message sets the same bits a consumer sets itself (BLOCKFLOW_TMQ_RELEASE): the
            # claim table is the one record of what was released, whichever way each consumer releases.
            by_slot: dict[tuple[int, int], list[int]] = {}
            for gen, slot, seq, sample in RELEASE_ITEM.iter_unpack(frames[2]):
                if gen == self.generation:
                    by_slot.setdefault((slot, seq), []).append(sample)
            with self._cond:
                if self.claims.closed:
                    return
                applied = sum(self.claims.release(slot, seq, samples) for (slot, seq), samples in by_slot.items())
                self.stats.stale_releases += len(frames[2]) // RELEASE_ITEM.size - applied
                self._collect_locked()
        elif kind == STATS:
            with self._cond:
                self._collect_locked()
                used, slots = self._usage_locked()
                body = dict(self.stats.__dict__, bytes_in_use=used, slots_in_use=slots, slots_ready=int(self._ready is not None),
                            generation=self.generation)
            self._router.send_multipart([ident, STATS, json.dumps(body).encode()])
        else:
            self._router.send_multipart([ident, ERROR, b"unknown message"])

    def drain(self, timeout: float) -> int:
        """Wait until every lent slot came back (or its lease ran out), at most ``timeout`` s; slots still lent.

        When Triton unloads a block (a plan update, a reload), tickets it issued may still be on
        their way to the next block; its pool must outlive them.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            self._drop_ready_locked()
            while self.table.live and (remaining := deadline - time.monotonic()) > 0:
                self._cond.wait(min(remaining, 0.01))
                self._reap_locked()
            return len(self.table.live)

    def close(self, drain_s: float = 0.0) -> None:
        """Stop serving and free the pool (after draining for at most ``drain_s``); a second call does nothing."""
        if self._stop.is_set():
            return
        self._stop_preparer()
        if drain_s > 0:
            self.drain(min(drain_s, self.lease_s))
        self._stop.set()
        os.write(self._wake_w, b"x")  # written once: a pipe's buffer always has room for it
        self._thread.join(2)
        self._router.close(0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.remove_files()  # first the socket, so no consumer finds this producer while it closes
        with self._cond:  # a server thread that outlived its join sees it closed (claims.closed) and leaves it
            self.claims.close()
        self.events.close()
        self.segment.close()

    def remove_files(self) -> None:
        """Unlink what this producer made in the file system (:mod:`.leftovers`), without touching a
        lock or an open object: what a process does on its way out."""
        remove_generation(self.runtime_dir, self.id, self.generation)
