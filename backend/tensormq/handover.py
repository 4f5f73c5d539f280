"""Direct hand-overs, the receiver's side and the relay: a block gives its tickets to the next block itself,
not through the ensemble (the sender's side, ``HandOut``, is in ``handout.py``).

Where the plan says ``hand_over: direct``, the generator pairs a *sender* with the one block
after it, the *receiver* (``blockflow.plan.direct_pairs`` says which pairs qualify), and the task's
ensemble runs both at once, each given the ticket the sender takes as its input (the receiver's
*key*). The rules, with the rest of the protocol, are in the package note
(``backend/tensormq/__init__.py``, "Direct hand-overs"); the messages and the receivers' sockets
in ``backend/tensormq/wire.py``; hand-overs as AF_UNIX datagrams, ZeroMQ the fallback, in
``backend/tensormq/datagrams.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import zmq

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.claims import ClaimTable, claims_path
from blockflow.backend.tensormq.consumer import Consumer
from blockflow.backend.tensormq.datagrams import DatagramIn, datagrams_on
from blockflow.backend.tensormq.handout import MAC, SEND_HWM, HandOut, keys_of
from blockflow.backend.tensormq.ticket import ProducerGoneError, TicketError
from blockflow.backend.tensormq.wire import (
    HANDED,
    NO_ORIGIN,
    HandOverMessage,
    hand_over_dgram_path,
    hand_over_of,
    hand_over_path,
    listening,
)
from blockflow.backend.tensormq.wire import socket_path as producer_socket
from blockflow.core import also_accepts
from blockflow.core.spec import HandOver
from blockflow.core.threads import named_thread

T = TypeVar("T")

MODEL = tk.LAYOUT["model"]  # the producing block's model id
# Kept at most, received or served (beyond the window a receiver expires them in).
MAX_KEPT = 1 << 18
# A receiver that has waited this long for a key's hand-over asks the key's claim table whether it
# can still come (then again every LOOK_EVERY_S): a key replayed after the window, whose served
# entry is forgotten, fails then rather than after the whole wait.
LOOK_AFTER_S = 0.05
LOOK_EVERY_S = 0.5
# How long after its claim window a key's hand-over may still arrive (its sender claimed it at the
# end of the window, and the message is on its way).
LATE_S = 1.0


class HandIn:
    """A receiver instance's side: the key a request brings in, the sender's ticket for it out."""

    def __init__(self, runtime_dir: Path, model: str, role: HandOver, mac_key: bytes, wait_s: float, keep_s: float,
                 pid: int | None = None, also: also_accepts.Reader | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.model = model
        self.path = hand_over_path(runtime_dir, model, os.getpid() if pid is None else pid)
        self.path.unlink(missing_ok=True)  # left by a killed process that had this pid
        # The datagram socket first: senders find an instance by its ZeroMQ socket's file and look for
        # the datagram socket beside it once, then.
        self.dgram_path = hand_over_dgram_path(self.path)
        self.dgram_path.unlink(missing_ok=True)
        self.dgram: DatagramIn | None = None
        if datagrams_on():
            try:
                self.dgram = DatagramIn(self.dgram_path)
            except OSError:  # no datagram socket: senders find none beside the ZeroMQ one and use that
                pass
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        self.sock.bind(f"ipc://{self.path}")
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if self.dgram is not None:
            self.poller.register(self.dgram.fileno(), zmq.POLLIN)
        self.sender = role.takes_from
        # A join fed by a chain's link: the key is the head's ticket, claimed hops before the sender's
        # hand-over comes, so its claim window and its producer's life say nothing of that hand-over.
        self.looks = not role.from_link
        self.key_models = {tk.model_id(m).to_bytes(8, "little") for m in role.keys_from}
        self.sender_model = tk.model_id(role.takes_from).to_bytes(8, "little")
        self.also = also  # other blocks whose tickets are keys too, during a live plan change
        self.mac_key = mac_key
        self.wait_s = wait_s
        self.keep_s = keep_s
        self.pending: OrderedDict[bytes, tuple[float, bytes, bytes, bytes]] = OrderedDict()  # key -> (arrived, status, ticket, origin)
        self.served: OrderedDict[bytes, float] = OrderedDict()  # key -> when
        self._tables: dict[tuple[int, int], ClaimTable] = {}  # the keys' producers' claim tables, opened on demand
        # The execute thread reads the socket as it needs; an instance Triton gives no requests for a
        # while is read by this thread, so that its queue never fills and drops what comes next.
        self._lock = threading.Lock()
        self._read_at = time.monotonic()
        self._closed = threading.Event()
        self._idle = named_thread(self._idle_loop, "tmq-handover")
        self._idle.start()

    def resolve(self, rows: np.ndarray[Any, Any], deadline: float | None = None) -> np.ndarray[Any, Any]:
        """``rows`` with each key replaced by the ticket handed over for it. :class:`TicketError`
        for a forged or replayed key; :class:`ProducerGoneError` when the sender failed the sample
        or its hand-over did not come by ``deadline`` (monotonic; default: the wait from now)."""
        if not keys_of(rows):
            return rows
        models = [bytes(rows[i, MODEL]) for i in range(rows.shape[0])]
        keys = self.key_models
        if self.also is not None and any(m not in keys and m != self.sender_model for m in models):
            keys = keys | {tk.model_id(m).to_bytes(8, "little") for m in self.also.current().keys}
        at = [i for i, m in enumerate(models) if m in keys]
        if not at:
            return rows  # the sender's own tickets, given by the ensemble
        with self._lock:
            return self._resolve(rows, at, time.monotonic() + self.wait_s if deadline is None else deadline)

    def _resolve(self, rows: np.ndarray[Any, Any], at: list[int], deadline: float) -> np.ndarray[Any, Any]:
        out = np.array(rows, copy=True)
        for i in at:
            raw = bytes(rows[i])
            t = tk.decode(raw, self.mac_key)  # authentic, or TicketError
            key = raw[MAC]
            if key in self.served:
                raise TicketError("replayed ticket: this block already took the hand-over keyed by it")
            status, ticket = self._take(key, t, deadline)
            self.served[key] = time.monotonic()
            if status != HANDED:
                raise ProducerGoneError(status.decode(errors="replace"))
            out[i] = np.frombuffer(ticket, dtype=np.uint8)
        self._expire()
        return out

    def take_any(self, timeout_s: float, most: int, stale_s: float) -> list[HandOverMessage]:
        """A chain link's next hand-overs, ``(key, status, ticket, origin)`` in the order they came, at most ``most``;
        waits up to ``timeout_s`` for the first. Each key is served once (a copy that comes later is dropped).
        One that arrived over ``stale_s`` ago comes as failed (its request gave up by then)."""
        with self._lock:
            self._drain()
            if not self.pending and self.poller.poll(max(1, int(timeout_s * 1000))):
                self._drain()
            out: list[HandOverMessage] = []
            now = time.monotonic()
            while self.pending and len(out) < most:
                key, (arrived, status, ticket, origin) = self.pending.popitem(last=False)
                self.served[key] = now
                if status == HANDED and now - arrived > stale_s:
                    status = f"not run: it waited over {stale_s:g} s in block {self.model}'s queue".encode()
                out.append((key, status, ticket, origin))
            self._expire()
            return out

    def _take(self, key: bytes, t: tk.Ticket, deadline: float) -> tuple[bytes, bytes]:
        start = time.monotonic()
        look = start + LOOK_AFTER_S
        while key not in self.pending:
            self._drain()
            if key in self.pending:
                break
            now = time.monotonic()
            if now >= look and self.looks:
                look = now + LOOK_EVERY_S
                why = self._over(t, now)
                if why is not None:
                    self._drain()  # what its sender sent before the slot moved on is here by now
                    if key in self.pending:
                        break
                    raise why
            left = (min(deadline, look) if self.looks else deadline) - now
            if deadline - now <= 0 or (not self.poller.poll(max(1, int(left * 1000))) and time.monotonic() >= deadline):
                raise ProducerGoneError(f"block {self.sender} did not hand over this request's input within "
                                        f"{self.wait_s:g} s (it stopped, or the request did not come through its task)")
        _, status, ticket, _ = self.pending.pop(key)
        return status, ticket

    def _over(self, t: tk.Ticket, now: float) -> TicketError | ProducerGoneError | None:
        """Why the hand-over keyed by ``t`` cannot come any more, from its producer's claim table:
        its producer stopped, or its claim window ended (so its sender, which hands over as soon as
        it has claimed it, did so long ago or never will)."""
        table = self._tables.get((t.producer, t.generation))
        if table is None:
            sock = producer_socket(self.runtime_dir, t.producer, t.generation)
            try:
                table = ClaimTable(claims_path(sock)) if listening(sock) else None
            except (OSError, ValueError):
                table = None
            if table is None:
                return ProducerGoneError(f"stale key: producer {t.producer:016x} generation {t.generation:08x} "
                                         "is not running (its block was stopped, restarted or reloaded)")
            if len(self._tables) >= 64:  # generations come and go with reloads
                for old in self._tables.values():
                    old.close()
                self._tables.clear()
            self._tables[(t.producer, t.generation)] = table
        why = table.over(t.slot, t.seq, now, LATE_S)
        return None if why is None else TicketError(f"{why} (the key of a hand-over from block {self.sender})")

    def _idle_loop(self) -> None:
        while not self._closed.wait(0.25):
            with self._lock:
                if time.monotonic() - self._read_at > 0.25:
                    self._drain()
                    self._expire()

    def _drain(self) -> None:
        self._read_at = now = time.monotonic()
        if self.dgram is not None:
            for message in self.dgram.read():
                self._keep(message, now)
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            heard = hand_over_of(frames)
            if heard is not None:  # only senders of this server reach the socket; nothing else is read
                self._keep(heard, now)

    def _keep(self, message: HandOverMessage, now: float) -> None:
        """A hand-over heard: kept until asked for, unless its key was served or heard already (a
        call that went over ZeroMQ after some of its datagrams arrived comes twice)."""
        key, status, ticket, origin = message
        if key not in self.served and key not in self.pending:
            self.pending[key] = (now, status, ticket, origin)

    def _expire(self) -> None:
        """Forget hand-overs older than the claim window (their tickets are refused by then) and
        served keys as old, and never keep more than ``MAX_KEPT`` of either."""
        old = time.monotonic() - self.keep_s
        while self.pending and (len(self.pending) > MAX_KEPT or next(iter(self.pending.values()))[0] < old):
            self.pending.popitem(last=False)
        while self.served and (len(self.served) > MAX_KEPT or next(iter(self.served.values())) < old):
            self.served.popitem(last=False)

    def remove_file(self) -> None:
        self.path.unlink(missing_ok=True)
        self.dgram_path.unlink(missing_ok=True)

    def close(self) -> None:
        self.remove_file()
        self._closed.set()
        self._idle.join(2)
        self.sock.close(0)
        if self.dgram is not None:
            self.dgram.close()
        for table in self._tables.values():
            table.close()
        self._tables.clear()


class Relay:
    """A block's part in direct hand-overs: a sender's :class:`HandOut`, a receiver's :class:`HandIn`, or both."""

    def __init__(self, out: HandOut | None, into: HandIn | None) -> None:
        self.out = out
        self.into = into
        self._until: float | None = None  # the end of this call's wait for hand-overs

    def begin(self) -> None:
        """A new call: a sender's keys start afresh, and a receiver's requests share one wait, so a
        call of many keys whose hand-overs never come is held for the wait once, not once each."""
        if self.out is not None:
            self.out.begin()
        self._until = None

    @classmethod
    def open(cls, runtime_dir: Path, model: str, role: HandOver | None, consumer: Consumer | None, produces: bool,
             keep_s: float, origin: bytes = NO_ORIGIN) -> Relay | None:
        """The part ``role`` gives a block with ``consumer`` (and a producer where ``produces``; ``origin``: a
        chain head's that its tail answers, :mod:`~blockflow.backend.tensormq.answers`); None for none."""
        if role is None:
            return None
        out = (HandOut(runtime_dir, role.to, own_keys=role.own_keys, one=role.to_link, origin=origin)
               if role.to and produces else None)
        into = (HandIn(runtime_dir, model, role, consumer.key, consumer.commit_wait_s, keep_s, also=consumer.also)
                if role.takes_from and consumer is not None else None)
        return cls(out, into) if out or into else None

    def read(self, tickets: Any, gather: Callable[[Any], T]) -> T:
        """``gather`` of a request's tickets, its keys resolved (a receiver) and noted (a sender);
        a sender hands over the failure of a request it cannot read."""
        keys = keys_of(tickets) if self.out is not None and not self.out.own_keys and isinstance(tickets, np.ndarray) else []
        try:
            if self.into is not None and isinstance(tickets, np.ndarray):
                if self._until is None:
                    self._until = time.monotonic() + self.into.wait_s
                tickets = self.into.resolve(tickets, self._until)
            got = gather(tickets)
        except Exception as exc:  # the receiver hears why now, rather than waiting for a hand-over in vain
            if self.out is not None:
                self.out.fail(keys, str(exc))
            raise
        if self.out is not None:
            self.out.take(keys)
        return got

    def remove_files(self) -> None:
        if self.into is not None:
            self.into.remove_file()

    def close(self) -> None:
        if self.into is not None:
            self.into.close()
        if self.out is not None:
            self.out.close()
