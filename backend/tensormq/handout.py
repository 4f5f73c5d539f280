"""Direct hand-overs, the sender's side: a block gives its tickets to the next block itself.

``HandOut`` sends each call's tickets (or their failures) to the receiver's instances, as AF_UNIX datagrams
with ZeroMQ the fallback (``datagrams.py``); the receiver's side and the relay are in ``handover.py``. The
rules, with the rest of the protocol, are in the package note (``backend/tensormq/__init__.py``, "Direct
hand-overs" and "Chains"); the messages and the receivers' sockets in ``backend/tensormq/wire.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.datagrams import DatagramOut, datagrams_on
from blockflow.backend.tensormq.wire import NO_ORIGIN, failed, hand_over_prefix, handed, listening
from blockflow.core import env
from blockflow.core.errors import BlockError

MAC = tk.LAYOUT["mac"]
# Hand-overs a sender queues for one receiver instance that is not reading (then they are dropped).
SEND_HWM = 65536


def keys_of(rows: np.ndarray[Any, Any]) -> list[bytes]:
    """The key of each of a request's input tickets (its MAC); none for input that is not tickets
    (the consumer refuses that request with a clear error)."""
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != tk.TICKET_BYTES:
        return []
    return [bytes(r) for r in rows[:, MAC]]


class NoReceiverError(BlockError):
    """No instance of the block a sender hands over to is listening: the receiver's failure, not the
    request's (UNAVAILABLE)."""


class HandOut:
    """A sender's side: the keys of the current call, then for each its ticket or its failure."""

    def __init__(self, runtime_dir: Path, to_model: str, own_keys: bool = False, one: bool = False,
                 origin: bytes = NO_ORIGIN) -> None:
        self.dir = runtime_dir / env.TMQ_DIR
        self.prefix = hand_over_prefix(to_model)
        self.to = to_model
        # A chain's head keys each hand-over by the ticket it hands over (the ensemble gives the chain's
        # join that ticket); other senders by the ticket they were given.
        self.own_keys = own_keys
        # A chain's link takes every hand-over it hears (no request picks its instance): each call's go to one
        # instance, the next call's to the next (an instance that does not take them: the one after).
        self.one = one
        # A chain's head that its tail answers names itself as each of its hand-overs' origin; a link
        # hands on the origin it was handed.
        self.origin = origin
        self._turn = 0
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket[Any]] = {}
        self._dgram = DatagramOut() if datagrams_on() else None
        self._seen: tuple[int, float] = (-1, 0.0)  # the directory's mtime at the last listing, and when it was listed
        self._keys: list[bytes] = []
        self._origins: list[bytes] = []  # a link's: each key's, as it was handed
        self.dropped = 0  # hand-overs a receiver instance did not take in time

    @property
    def by_zmq(self) -> int:
        """Calls whose hand-overs went over ZeroMQ to an instance that has a datagram socket."""
        return self._dgram.by_zmq if self._dgram is not None else 0

    def _receivers(self) -> dict[str, zmq.Socket[Any]]:
        """A socket to each receiver instance, listed again when the directory changed. File times
        tick coarsely (a few ms), so a listing made within that of the last change is made again."""
        mtime = os.stat(self.dir).st_mtime_ns
        if mtime != self._seen[0] or self._seen[1] - mtime / 1e9 < 0.05:
            self._seen = (mtime, time.time())
            names = {n for n in os.listdir(self.dir) if n.startswith(self.prefix) and n.endswith(".sock")}
            for gone in set(self._socks) - names:
                self._socks.pop(gone).close(0)
                if self._dgram is not None:
                    self._dgram.gone(gone)
            for name in sorted(names - set(self._socks)):
                if listening(self.dir / name):  # a killed instance leaves its file
                    sock = self._ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                    sock.connect(f"ipc://{self.dir / name}")
                    self._socks[name] = sock
                    if self._dgram is not None:
                        self._dgram.found(name, self.dir / name)
        return self._socks

    def begin(self) -> None:
        self._keys, self._origins = [], []

    def take(self, keys: Sequence[bytes], origins: Sequence[bytes] | None = None) -> None:
        """One request's keys, read: its samples are the next ones of this call's batch (a link: with the
        origin each was handed with)."""
        self._keys.extend(keys)
        self._origins.extend(origins if origins is not None else [self.origin] * len(keys))

    def send(self, tickets: Sequence[bytes], must_reach: bool = False) -> None:
        """This call's tickets, one per sample of its batch, in the order of its keys (a chain's head: keyed
        by themselves). ``must_reach``: :class:`NoReceiverError` where no instance of the receiver listens
        (a head that waits for its tail's answers fails its call at once rather than waiting for nothing)."""
        keys, origins = self._keys, self._origins
        self._keys, self._origins = [], []
        if self.own_keys:
            keys, origins = [t[MAC] for t in tickets], [self.origin] * len(tickets)
        try:
            pushed = self._push([handed(k, t, o) for k, t, o in zip(keys, tickets, origins, strict=True)])
        except BaseException:
            if not self.own_keys:
                self._keys, self._origins = keys, origins  # not sent: ``finish`` fails them
            raise
        if not pushed and must_reach and tickets:
            raise NoReceiverError(f"no instance of block {self.to!r} is running to take this batch (it stopped or was unloaded)")

    def fail(self, keys: Sequence[bytes], reason: str, forwarded: bool = False, origins: Sequence[bytes] | None = None) -> None:
        """The receiver fails these samples' requests at once, with ``reason``, instead of waiting
        (``forwarded``: a chain's link hands on the failure it was handed, as it was)."""
        why = reason if forwarded else f"{reason} (in block {self.to}'s sender)"
        self._push([failed(k, why, o) for k, o in zip(keys, origins if origins is not None else [self.origin] * len(keys), strict=True)])

    def finish(self, reason: str) -> None:
        """End of the call: keys read but never sent (the batch failed before its tickets) fail."""
        keys, origins = self._keys, self._origins
        self._keys, self._origins = [], []
        if keys:
            self.fail(keys, reason, origins=origins)

    def _push(self, messages: list[list[bytes]]) -> bool:
        """Whether ``messages`` went to some instance of the receiver (queued there, or dropped as its queue was full)."""
        if not messages:
            return True
        socks = self._receivers()
        datagrams = self._dgram.pack(messages) if self._dgram is not None else []
        names = list(socks)
        if self.one and names:
            # A link: one instance takes the call, the next call's the next one. A call in one datagram
            # that does not go (all or nothing) is tried on the next instance; otherwise the rest goes to
            # the same instance over ZeroMQ (it keeps the first copy of each key): a sample two instances
            # took would run twice, and the second's failed claim would be handed on as its failure.
            self._turn = (self._turn + 1) % len(names)
            names = names[self._turn:] + names[:self._turn]
            if len(datagrams) == 1 and self._dgram is not None and any(self._dgram.send(datagrams, n) for n in names):
                return True
            # A killed instance leaves its files (and ZeroMQ queues for it without a word): the first one listening.
            names = next(([n] for n in names if listening(self.dir / n)), [])
        for name in names:
            if datagrams and self._dgram is not None and self._dgram.send(datagrams, name):
                continue
            for message in messages:
                try:
                    socks[name].send_multipart(message, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    self.dropped += 1
        return bool(names)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks = {}
        if self._dgram is not None:
            self._dgram.close()
