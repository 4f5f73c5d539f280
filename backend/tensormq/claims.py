"""One-shot tickets: a producer's claim table, shared with every consumer of that producer.

A ticket is accepted once: the consumer that reads it first *claims* its sample here, and
any later presentation of the same ticket (a replay, to this or any other instance) finds
the claim and is refused. A slot's table entry also says which use of the slot (its
sequence number) is current, so a ticket of an earlier use is refused before anything is
read, and until when a sample may be claimed (``claim_s`` after the slot was committed).
A sample nobody claimed by then (its ticket left the ensemble: a client called a block
directly, or the request was cancelled) is reclaimed by the producer at once, instead of
holding pool memory for the whole lease.

The table is a small file next to the producer's socket (``tmq/<id>-<generation>.claims``,
in the server's 0700 runtime directory, mode 0600), mapped by the producer and its
consumers. Layout, little-endian, per slot ``i`` at ``HEADER + i * stride``::

    offset    size  field
    0         8     claim deadline (f64, CLOCK_MONOTONIC seconds; shared by every process of the host;
                    FAILED (-1): the producer issued that use's tickets but could not write its data)
    8         8*W   W claim words: bits 63..32 the slot's sequence number, bits 31..0 claimed samples 32w..32w+31
    8+8*W     8*W   W release words, the same layout: bits 31..0 released samples

The release words are how a consumer gives a sample back (``release``): it sets the sample's bit,
under the entry's lock, only for a sample it claimed, of the use the entry holds; so a duplicated or
late release frees nothing early. The producer reads them without a lock (``release_words``, every
slot at once) and frees a slot once its words equal the use's full set (``release_target``). A
write may land byte by byte and a read may see part of it, but during a use the sequence number
does not change and the bits only grow, so a read can only see fewer samples released than there
are: it may free a slot late, never early. No message and no wake-up of the producer.

A producer may hand a batch's tickets on before it commits the batch (``Producer.issue``), so a
ticket can reach its consumer while the entry still holds an earlier use of the slot: a ticket
whose sequence number is *ahead* of the entry's is PENDING (the consumer waits for the commit),
one that is behind it is stale.

Every read-modify-write of an entry holds an open-file-description record lock on that entry's
bytes (Linux's ``F_OFD_SETLKW``), which excludes the other processes, and this process's lock of
the file, which excludes its other threads (they share the descriptor, so its record lock lets them
all in). Not a classic POSIX lock (``lockf``): those belong to the process, and the kernel's deadlock
check treats a process as one waiter, so under load it refused a claim with ``EDEADLK`` although
nothing was stuck (two H200s, every block ×4: instance A's thread holding an entry of table X
while another of A's threads waited for an entry of table Y that B held, and one of B's threads
waited for A's entry of X). OFD locks have no such check, and closing another descriptor of the
file does not drop them. A table still closes under its lock: the number of a closed descriptor
may be reused.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from blockflow.core import env

HEADER = struct.Struct("<4sHHII")  # magic, version, reserved, max_slots, words per slot
MAGIC = b"BFCL"
VERSION = 2
_DEADLINE = struct.Struct("<d")
# struct flock (64-bit Linux): l_type, l_whence, l_start, l_len, l_pid (0 for an OFD lock), padding.
_FLOCK = struct.Struct("@hhqqi4x")
_WORD = struct.Struct("<Q")
SAMPLES_PER_WORD = 32
FAILED = -1.0  # a claim deadline no clock reaches: the use's tickets were issued, its data never written
PENDING = "pending"  # claim(): the ticket's use is not committed yet; ask again
# Per file (device, inode), this process's lock: held with a record lock on the file, and while a
# descriptor of it closes.
_FILE_LOCKS: dict[tuple[int, int], threading.Lock] = {}
_FILE_LOCKS_GUARD = threading.Lock()


def _file_lock(fd: int) -> threading.Lock:
    st = os.fstat(fd)
    with _FILE_LOCKS_GUARD:
        return _FILE_LOCKS.setdefault((st.st_dev, st.st_ino), threading.Lock())
FAILED_BATCH = "failed batch: the block that issued this ticket could not produce its data (its log says why)"


def claims_path(socket_path: Path) -> Path:
    return env.claims_file(socket_path)


class ClaimTable:
    """The shared table of one producer generation (created by it, opened by consumers)."""

    def __init__(self, path: Path, max_slots: int = 0, max_samples: int = 0, create: bool = False) -> None:
        self.path = path
        if create:
            words = max(1, -(-max_samples // SAMPLES_PER_WORD))
            size = HEADER.size + max_slots * (8 + 16 * words)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.ftruncate(fd, size)
            os.pwrite(fd, HEADER.pack(MAGIC, VERSION, 0, max_slots, words), 0)
        else:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        self._fd = fd
        self._threads = _file_lock(fd)
        size = os.fstat(fd).st_size
        try:
            if size < HEADER.size:
                raise ValueError(f"claim table {path} is truncated")
            self._map = mmap.mmap(fd, size)
        except BaseException:
            with self._threads:
                os.close(fd)
            raise
        magic, version, _, max_slots, words = HEADER.unpack_from(self._map, 0)
        self.max_slots, self.words = int(max_slots), int(words)
        self._release_words: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        if magic != MAGIC or version != VERSION or size != HEADER.size + self.max_slots * (8 + 16 * self.words):
            self.close()
            raise ValueError(f"{path} is not a TensorMQ claim table of version {VERSION}")
        self.stride = 8 + 16 * self.words
        self.max_samples = self.words * SAMPLES_PER_WORD
        # Every slot's release words as one array over the mapping (HEADER and stride are multiples of 8).
        entries = np.frombuffer(self._map, dtype="<u8", count=self.max_slots * self.stride // 8, offset=HEADER.size)
        self._release_words = entries.reshape(self.max_slots, self.stride // 8)[:, 1 + self.words:]

    def _lock(self, slot: int) -> int:
        start: int = HEADER.size + slot * self.stride
        self._threads.acquire()
        try:
            if self._fd < 0:  # closed: its old number may be another file's by now
                raise ValueError(f"claim table {self.path} is closed")
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, self.stride, 0))
        except BaseException:
            self._threads.release()
            raise
        return start

    def _unlock(self, slot: int) -> None:
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, HEADER.size + slot * self.stride, self.stride, 0))
        finally:
            self._threads.release()

    # ------------------------------------------------------------------ producer

    def open_slot(self, slot: int, seq: int, deadline: float) -> None:
        """A new use of ``slot``: sequence ``seq``, nothing claimed or released, claimable until ``deadline``."""
        start = self._lock(slot)
        try:
            _DEADLINE.pack_into(self._map, start, deadline)
            for w in range(2 * self.words):
                _WORD.pack_into(self._map, start + 8 + 8 * w, (seq & 0xFFFFFFFF) << 32)
        finally:
            self._unlock(slot)

    def fail_slot(self, slot: int, seq: int) -> None:
        """Use ``seq`` of ``slot`` will never be committed: its tickets (already handed on) are refused."""
        self.open_slot(slot, seq, FAILED)

    def claimed(self, slot: int, seq: int) -> set[int] | None:
        """Samples of use ``seq`` of ``slot`` that were claimed; None if the entry holds another use."""
        start = self._lock(slot)
        try:
            return self._bits_locked(start, seq, 0)
        finally:
            self._unlock(slot)

    def retire_unclaimed(self, slot: int, seq: int, samples: Iterable[int]) -> list[int]:
        """Once the claim window of use ``seq`` ended: the ``samples`` nobody claimed, now marked claimed
        and released at once (so none can be claimed from now on); none if the entry holds another use."""
        start = self._lock(slot)
        try:
            claimed = self._bits_locked(start, seq, 0)
            if claimed is None:
                return []
            out = sorted(set(samples) - claimed)
            for k in out:
                for part in (0, self.words):
                    where = start + 8 + 8 * (part + k // SAMPLES_PER_WORD)
                    _WORD.pack_into(self._map, where, _WORD.unpack_from(self._map, where)[0] | 1 << (k % SAMPLES_PER_WORD))
            return out
        finally:
            self._unlock(slot)

    def _bits_locked(self, start: int, seq: int, part: int) -> set[int] | None:
        """The samples whose bit is set in the claim (``part`` 0) or release (``part`` W) words of the
        entry at ``start``, if it holds use ``seq``."""
        out: set[int] = set()
        for w in range(self.words):
            word = _WORD.unpack_from(self._map, start + 8 + 8 * (part + w))[0]
            if word >> 32 != seq & 0xFFFFFFFF:
                return None
            bits = word & 0xFFFFFFFF
            out.update(w * SAMPLES_PER_WORD + b for b in range(SAMPLES_PER_WORD) if bits >> b & 1)
        return out

    def release_words(self) -> np.ndarray[Any, np.dtype[np.uint64]] | None:
        """Every slot's release words, ``[max_slots, W]``, read in place (no lock: see the module's note);
        None once the table is closed."""
        return self._release_words

    def released(self, slot: int, seq: int) -> int:
        """How many samples of use ``seq`` of ``slot`` are released (0 if the entry holds another use)."""
        start = self._lock(slot)
        try:
            return len(self._bits_locked(start, seq, self.words) or ())
        finally:
            self._unlock(slot)

    @staticmethod
    def release_target(seq: int, batch: int, words: int) -> list[int]:
        """The release words of use ``seq`` of a slot once all its ``batch`` samples are released."""
        out = []
        for w in range(words):
            n = min(SAMPLES_PER_WORD, max(0, batch - w * SAMPLES_PER_WORD))
            out.append((seq & 0xFFFFFFFF) << 32 | ((1 << n) - 1))
        return out

    # ------------------------------------------------------------------ consumer

    def claim(self, slot: int, seq: int, sample: int, now: float | None = None) -> str | None:
        """Claim one sample; None when accepted, :data:`PENDING` while its use is not committed yet,
        else why it is refused."""
        if not 0 <= slot < self.max_slots or not 0 <= sample < self.max_samples:
            return f"slot {slot} / sample {sample} is outside the producer's claim table"
        start = self._lock(slot)
        try:
            # The clock is read under the lock: a retirement that got the lock first is then seen as expired, not replayed.
            now = time.monotonic() if now is None else now
            where = start + 8 + 8 * (sample // SAMPLES_PER_WORD)
            word = _WORD.unpack_from(self._map, where)[0]
            ahead = (seq - (word >> 32)) & 0xFFFFFFFF
            if ahead:  # sequence numbers wrap: half the circle is ahead, the other half behind
                return PENDING if ahead < 1 << 31 else "replayed or stale ticket: its pool slot has been reused since it was issued"
            bit = 1 << (sample % SAMPLES_PER_WORD)
            deadline = _DEADLINE.unpack_from(self._map, start)[0]
            if word & bit:  # claimed, or retired unclaimed once the window ended
                return "expired ticket: it was not used within its claim window" if deadline != FAILED and now >= deadline \
                    else "replayed ticket: it was already accepted once"
            if deadline == FAILED:
                return FAILED_BATCH
            if now >= deadline:  # the producer retires a window's unclaimed samples from its deadline on (SlotTable.unclaimed_due)
                return "expired ticket: it was not used within its claim window"
            _WORD.pack_into(self._map, where, word | bit)
            return None
        finally:
            self._unlock(slot)

    def release(self, slot: int, seq: int, samples: Iterable[int]) -> int:
        """Give back ``samples`` of use ``seq`` of ``slot`` (a consumer, once its reads are done): how many
        were released. Only claimed samples of the use the entry holds are, each once."""
        if not 0 <= slot < self.max_slots:
            return 0
        start = self._lock(slot)
        try:
            done = 0
            for k in samples:
                if not 0 <= k < self.max_samples:
                    continue
                bit = 1 << (k % SAMPLES_PER_WORD)
                claim_at = start + 8 + 8 * (k // SAMPLES_PER_WORD)
                release_at = claim_at + 8 * self.words
                claim, rel = _WORD.unpack_from(self._map, claim_at)[0], _WORD.unpack_from(self._map, release_at)[0]
                if claim >> 32 != seq & 0xFFFFFFFF or rel >> 32 != seq & 0xFFFFFFFF or not claim & bit or rel & bit:
                    continue
                _WORD.pack_into(self._map, release_at, rel | bit)
                done += 1
            return done
        finally:
            self._unlock(slot)

    def over(self, slot: int, seq: int, now: float, grace_s: float) -> str | None:
        """Why use ``seq`` of ``slot`` can no longer be claimed: its claim window ended at least
        ``grace_s`` ago. None while it may still be claimed, before its commit, or when that cannot be
        told. Claims nothing. A slot reused since is no sign by itself: its samples were claimed, but
        a direct hand-over keyed by one of them (a later receiver of a run) may still be on its way.
        Its current use's window ends after the one asked about, so once that one has ended too, the
        use asked about is over."""
        if not 0 <= slot < self.max_slots:
            return f"slot {slot} is outside the producer's claim table"
        start = self._lock(slot)
        try:
            word = _WORD.unpack_from(self._map, start + 8)[0]
            deadline = _DEADLINE.unpack_from(self._map, start)[0]
        finally:
            self._unlock(slot)
        ahead = (seq - (word >> 32)) & 0xFFFFFFFF
        if 0 < ahead < 1 << 31:
            return None  # not committed yet
        if deadline != FAILED and now > deadline + grace_s:
            return "expired ticket: it was not used within its claim window"
        return None

    def close(self) -> None:
        with self._threads:  # a descriptor closes while no thread of this process uses the table
            self._release_words = None  # a view of the mapping keeps it from closing
            if self._fd < 0:
                return
            try:
                self._map.close()
            except (BufferError, ValueError):
                pass
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self) -> bool:
        return self._fd < 0
