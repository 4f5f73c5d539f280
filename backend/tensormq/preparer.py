"""A TensorMQ producer's preparer: between two calls of a small batch, the next call's slot reserved and its
tickets signed, so that the call only takes them (PREPARED in the rules, :mod:`blockflow.backend.tensormq`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from blockflow.backend.tensormq.reservation import Key, Reservation, Stats, batch_bytes
from blockflow.backend.tensormq.slots import Slot, SlotTable
from blockflow.core.threads import named_thread


class Preparer:
    """The prepared reservation of a :class:`~blockflow.backend.tensormq.producer.Producer` (a base of it) and the
    thread that makes it, from the producer's slot table under the producer's ``_cond``."""

    # The producer's, read here.
    pack: Callable[[list[bytes]], Any] | None
    lease_s: float
    stats: Stats
    table: SlotTable
    _cond: threading.Condition

    if TYPE_CHECKING:
        def _reservation_locked(self, slot: Slot, key: Key) -> Reservation: ...

        def _sign(self, r: Reservation) -> list[bytes]: ...

        def _collect_locked(self) -> None: ...

    def _start_preparer(self, name: str, prepare: bool) -> None:
        # A reservation made and signed between two calls, taken by the next call of the same
        # shape: at batch 1 that keeps reserving and signing (~0.1-0.2 ms of host time inside a
        # stub, bench.timeline) off a request's path. Its slot counts as ready, not in use.
        self._ready: Reservation | None = None
        self._next_key: Key | None = None  # what the preparer should reserve next
        self._wake = threading.Event()
        self._closing = threading.Event()  # stops the preparer (before the drain, which needs the server thread)
        self._preparer: threading.Thread | None = None
        if prepare:
            self._preparer = named_thread(self._prepare_loop, "tmq-prepare")
            self._preparer.start()

    def _stop_preparer(self) -> None:
        if self._preparer is not None:
            self._next_key = None
            self._closing.set()
            self._wake.set()
            self._preparer.join(2)

    def prepare_ahead(self) -> None:
        """Have the preparer thread reserve and sign the next call's batch, if the last one was small.

        Called by the block once its call's responses are built: the preparer then runs while
        the block waits for its next request, never during a request's own host work."""
        ready = self._ready
        if self._next_key is not None and (ready is None or ready.key != self._next_key):
            self._wake.set()

    def _take_ready_locked(self, key: Key) -> Reservation | None:
        r = self._ready
        if r is None or r.key != key:
            return None
        self._ready = None
        r.slot.deadline = time.monotonic() + self.lease_s  # its lease starts now
        self.stats.allocations += 1
        return r

    def _drop_ready_locked(self) -> bool:
        """Give the prepared slot back to the pool; whether there was one."""
        r = self._ready
        if r is None:
            return False
        self._ready = None
        self.table.release_all(r.slot.index, r.slot.seq)
        self._cond.notify_all()
        return True

    def _prepare_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing.is_set():
                return
            key = self._next_key
            if key is None:
                continue
            nbytes = batch_bytes(key)
            with self._cond:
                if self._closing.is_set() or (self._ready is not None and self._ready.key == key):
                    continue
                self._drop_ready_locked()  # one of another shape
                self._collect_locked()
                # Only from a pool with room to spare: a prepared slot must not make a request wait.
                if 2 * (len(self.table.live) + 1) > self.table.max_slots or 2 * (self.table.bytes_in_use + nbytes) > self.table.capacity:
                    continue
                # No lease while it waits to be taken (an idle block keeps it); it starts when taken.
                slot = self.table.allocate(nbytes, key[0], float("inf"))
                if slot is None:
                    continue
                r = self._reservation_locked(slot, key)
            r.tickets = self._sign(r)
            if self.pack is not None:
                r.packed = self.pack(r.tickets)
            with self._cond:
                if self._closing.is_set() or self._ready is not None:
                    self.table.release_all(slot.index, slot.seq)
                    self._cond.notify_all()
                else:
                    self._ready = r
