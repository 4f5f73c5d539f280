"""A producer pool's bookkeeping: byte ranges of one segment handed out as slots.

Pure logic (no I/O, no locks): :class:`~blockflow.backend.tensormq.producer.Producer`
serialises access. A slot holds one batch; it is freed when every sample ticket
issued for it has been released (which the producer reads from its claim table,
:mod:`~blockflow.backend.tensormq.claims`, sample by sample) or when its lease
expires. Each reuse of a slot index gets a new sequence number, so a late release
for an earlier use is recognised and ignored.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

ALIGN = 512


@dataclass
class Slot:
    index: int
    seq: int
    offset: int
    nbytes: int
    samples: int  # the batch: one ticket per sample
    deadline: float
    # Until when consumers may claim its samples (blockflow.backend.tensormq.claims); after it, the samples
    # nobody claimed are released by the producer. inf until the slot is committed.
    claim_deadline: float = float("inf")
    retired: int = 0  # samples nobody claimed in time, given back by the producer itself


class SlotTable:
    def __init__(self, capacity: int, max_slots: int) -> None:
        if capacity <= 0 or max_slots <= 0:
            raise ValueError("capacity and max_slots must be positive")
        self.capacity = capacity
        self.max_slots = max_slots
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (offset, size) extents
        self._idle_slots = list(range(max_slots - 1, -1, -1))  # stack: lowest index first
        self._seq = [0] * max_slots
        self.live: dict[int, Slot] = {}
        self.bytes_in_use = 0

    def allocate(self, nbytes: int, samples: int, deadline: float) -> Slot | None:
        """A slot of at least ``nbytes`` (aligned), or None if no range or slot index is free."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if not self._idle_slots:
            return None
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                index = self._idle_slots.pop()
                self._seq[index] = (self._seq[index] + 1) & 0xFFFFFFFF
                slot = Slot(index, self._seq[index], off, size, samples, deadline)
                self.live[index] = slot
                self.bytes_in_use += size
                return slot
        return None

    def unclaimed_due(self, now: float) -> list[Slot]:
        """Live slots whose claim window closed (each is returned once)."""
        due = [s for s in self.live.values() if s.claim_deadline <= now]
        for s in due:
            s.claim_deadline = float("inf")
        return due

    def next_due(self) -> float:
        """The earliest lease end or claim-window end among live slots (inf when none)."""
        return min((min(s.deadline, s.claim_deadline) for s in self.live.values()), default=float("inf"))

    def release_all(self, index: int, seq: int) -> None:
        slot = self.live.get(index)
        if slot is not None and slot.seq == seq:
            self._free_slot(slot)

    def reap(self, now: float) -> list[Slot]:
        """Free and return every slot whose lease has expired."""
        expired = [s for s in self.live.values() if s.deadline <= now]
        for s in expired:
            self._free_slot(s)
        return expired

    def _free_slot(self, slot: Slot) -> None:
        del self.live[slot.index]
        self._idle_slots.append(slot.index)
        self.bytes_in_use -= slot.nbytes
        pos = bisect.bisect(self._free, (slot.offset, 0))
        self._free.insert(pos, (slot.offset, slot.nbytes))
        # Coalesce with the neighbours so the pool does not fragment.
        if pos + 1 < len(self._free) and self._free[pos][0] + self._free[pos][1] == self._free[pos + 1][0]:
            self._free[pos] = (self._free[pos][0], self._free[pos][1] + self._free[pos + 1][1])
            del self._free[pos + 1]
        if pos > 0 and self._free[pos - 1][0] + self._free[pos - 1][1] == self._free[pos][0]:
            self._free[pos - 1] = (self._free[pos - 1][0], self._free[pos - 1][1] + self._free[pos][1])
            del self._free[pos]
