"""The consumer side of TensorMQ: tickets in, tensor views of producers' pools out."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from blockflow.backend.tensormq import ticket as tk
from blockflow.backend.tensormq.claims import FAILED_BATCH, PENDING, ClaimTable, claims_path
from blockflow.backend.tensormq.memory import CudaSegment, EventRing, HostSegment, Segment
from blockflow.backend.tensormq.releases import Release, Releaser
from blockflow.backend.tensormq.ticket import ProducerGoneError, TicketError
from blockflow.backend.tensormq.wire import HELLO, WELCOME, endpoint, listening, socket_path
from blockflow.core import also_accepts as also_accepts_file
from blockflow.core.runtime_dir import read_key

# How long a ticket handed on before its batch was committed (Producer.issue) waits for that commit.
# A commit follows its tickets by the time the producer takes to queue its GPU work: microseconds,
# milliseconds under load; a producer that stopped is noticed sooner (its socket goes).
COMMIT_WAIT_S = 5.0


def _ticket_bytes(raw: torch.Tensor | np.ndarray[Any, Any]) -> bytes:
    """The bytes of a batch of tickets, which must be uint8 ``[batch, 256]``."""
    wrong = (raw.dtype != torch.uint8 or raw.dim() != 2) if isinstance(raw, torch.Tensor) else (raw.dtype != np.uint8 or raw.ndim != 2)
    if wrong or raw.shape[1] != tk.TICKET_BYTES:
        raise TicketError(f"tickets must be uint8 [batch, {tk.TICKET_BYTES}]; got {raw.dtype} {list(raw.shape)}")
    if isinstance(raw, torch.Tensor):
        raw = (raw if raw.device.type == "cpu" and raw.is_contiguous() else raw.cpu().contiguous()).numpy()
    return raw.tobytes()  # row-major whatever the array's strides


@dataclass
class _Remote:
    producer: int
    generation: int
    segment: Segment
    events: EventRing
    max_slots: int
    claims: ClaimTable


@dataclass
class ConsumerStats:
    handle_opens: int = 0
    hellos: int = 0
    tickets: int = 0
    bad_tickets: int = 0
    refused_tickets: int = 0  # authentic, but replayed, redirected, stale or expired
    commit_waits: int = 0  # tickets that arrived before their batch's commit and waited for it
    releases_sent: int = 0  # samples released: set in their producer's claim table, or sent in a RELEASE message


class Consumer:
    """Maps producers' pools once per generation and turns tickets into views.

    Threads: :meth:`gather` runs on the block's execute thread (it alone uses
    the HELLO socket and the cache); its :class:`Releaser`'s thread releases a
    batch's samples once the GPU work that read it has finished.
    """

    def __init__(self, runtime_dir: Path, device: torch.device, hello_timeout_s: float = 5.0,
                 accepts_from: Iterable[str] | None = None, commit_wait_s: float = COMMIT_WAIT_S,
                 also_accepts: Path | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.commit_wait_s = commit_wait_s
        # The blocks that feed this one (Triton model names); None accepts any producer (tests).
        self.accepts = None if accepts_from is None else {tk.model_id(m): m for m in accepts_from}
        # Feeders accepted for a while during a live plan change (blockflow.core.also_accepts).
        self.also = None if also_accepts is None else also_accepts_file.Reader(also_accepts)
        self.key = read_key(runtime_dir)
        self.device = device
        self.hello_timeout_ms = int(hello_timeout_s * 1000)
        self.stats = ConsumerStats()
        # Keyed by (producer, generation): during a block's reload its old and new instances both
        # issue tickets, and both must be readable until the old one drains.
        self._remotes: dict[tuple[int, int], _Remote] = {}
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._releases = Releaser(runtime_dir, device, self.stats)

    # ------------------------------------------------------------------ execute thread

    def _handshake(self, pid: int, gen: int) -> dict[str, Any]:
        path = socket_path(self.runtime_dir, pid, gen)
        if not listening(path):  # also false when the socket file is gone
            raise ProducerGoneError(f"stale ticket: producer {pid:016x} generation {gen:08x} is not running "
                              "(its block was stopped, restarted or reloaded)")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint(self.runtime_dir, pid, gen))
        try:
            sock.send_multipart([HELLO])
            if not sock.poll(self.hello_timeout_ms):
                raise ProducerGoneError(f"producer {pid:016x} did not answer within {self.hello_timeout_ms} ms")
            kind, body = sock.recv_multipart()[:2]
        finally:
            sock.close(0)
        if kind != WELCOME:
            raise TicketError(f"producer {pid:016x} refused the handshake: {body[:200]!r}")
        self.stats.hellos += 1
        info: dict[str, Any] = json.loads(body)
        return info

    def _remote(self, t: tk.Ticket) -> _Remote:
        r = self._remotes.get((t.producer, t.generation))
        if r is not None:
            return r
        info = self._handshake(t.producer, t.generation)
        if int(info["producer"]) != t.producer or int(info["generation"]) != t.generation:
            raise TicketError(f"endpoint of producer {t.producer:016x}/{t.generation:08x} answered as "
                              f"{int(info['producer']):016x}/{int(info['generation']):08x}")
        # Mappings of this producer's earlier generations that have stopped are of no further use.
        for key in [k for k in self._remotes if k[0] == t.producer]:
            if not listening(socket_path(self.runtime_dir, *key)):
                self._drop(self._remotes[key])
        seg_info = info["segment"]
        segment: Segment
        if seg_info["kind"] == "host":
            segment = HostSegment(str(seg_info["name"]), int(seg_info["nbytes"]), create=False)
            events = EventRing(None)
        else:
            if self.device.type != "cuda":
                raise TicketError("a CPU block cannot read a GPU producer's pool; place both blocks on GPUs")
            dev = int(self.device.index or 0)
            segment = CudaSegment(dev, int(seg_info["nbytes"]), bytes.fromhex(seg_info["handle"]))
            events = EventRing(dev, handles=[bytes.fromhex(h) for h in info["events"]])
        try:
            claims = ClaimTable(claims_path(socket_path(self.runtime_dir, t.producer, t.generation)))
        except (OSError, ValueError) as exc:
            events.close()
            segment.close()
            raise TicketError(f"producer {t.producer:016x} has no usable claim table: {exc}") from None
        self.stats.handle_opens += 1 + len(events.events)
        r = _Remote(t.producer, t.generation, segment, events, int(info["max_slots"]), claims)
        self._remotes[(t.producer, t.generation)] = r
        return r

    def _also_accepts(self, model: int) -> bool:
        """Whether a ticket of ``model`` (not a feeder in this block's spec) comes from an old or new
        feeder during a live plan change. Read on refusals only: a plan's own hops never get here."""
        return self.also is not None and any(tk.model_id(m) == model for m in self.also.current().models)

    def _drop(self, r: _Remote) -> None:
        del self._remotes[(r.producer, r.generation)]
        r.events.close()
        r.segment.close()
        r.claims.close()

    def gather(self, raw: torch.Tensor | np.ndarray[Any, Any], sample_shape: tuple[int, ...], stream: int) -> tuple[torch.Tensor, list[Release]]:
        """:meth:`gather_tensors` for a hop of one tensor."""
        views, releases = self.gather_tensors(raw, (sample_shape,), stream)
        return views[0], releases

    def gather_tensors(self, raw: torch.Tensor | np.ndarray[Any, Any], shapes: Sequence[tuple[int, ...]],
                       stream: int, lap: Callable[[str], None] | None = None) -> tuple[list[torch.Tensor], list[Release]]:
        """Views of the samples that ``raw`` (uint8 ``[n, 256]``, a tensor or a host array) names: one
        ``[n, *shape]`` tensor per entry of ``shapes`` (several: the tickets name records of those tensors).

        The consumer's ``stream`` is made to wait (on the GPU) for each producer slot's event.
        Returns the tensors and the releases to send once the GPU work reading them is done.
        ``lap`` (a block's tracer): called at the end of the steps of the first ticket (decoded, claimed,
        waited for).
        """
        offsets = tk.record_offsets(shapes)
        sample_shape, layout = (tuple(shapes[0]), 0) if len(shapes) == 1 else ((offsets[-1],), tk.layout_id(shapes))
        data = _ticket_bytes(raw)
        count = int(raw.shape[0])
        if count == 0:
            raise TicketError("no tickets: a request carries one per sample, at least one")
        parts: list[torch.Tensor] = []
        seen: list[Release] = []  # every ticket this request claimed, released whatever happens next
        waited: set[tuple[int, int, int]] = set()
        run_start: tuple[_Remote, tk.Ticket, int] | None = None
        try:
            for i in range(count):
                t = tk.decode(data[i * tk.TICKET_BYTES:(i + 1) * tk.TICKET_BYTES], self.key)
                if lap is not None and i == 0:
                    lap("read:decode")
                if self.accepts is not None and t.model not in self.accepts and not self._also_accepts(t.model):
                    self.stats.refused_tickets += 1
                    raise TicketError("redirected ticket: it was issued by a block that does not feed this one "
                                      f"(this block takes tickets from {', '.join(sorted(self.accepts.values()))})")
                if t.shape != sample_shape or t.layout != layout:
                    what = "a record of several tensors" if t.layout else f"shape {list(t.shape)}"
                    want = f"shape {list(sample_shape)}" if not layout else f"{' + '.join(str(list(x)) for x in shapes)}"
                    raise TicketError(f"ticket carries {what}; this block takes {want}")
                r = self._remote(t)
                if t.slot >= r.max_slots or t.segment != 0 or t.offset + t.nbytes > r.segment.nbytes:
                    raise TicketError(f"ticket range {t.offset}+{t.nbytes} (slot {t.slot}) is outside producer "
                                      f"{t.producer:016x}'s pool of {r.segment.nbytes} bytes / {r.max_slots} slots")
                # One-shot: the first reader claims the sample; a replay (here or at another instance)
                # is refused before anything is read. Only claimed tickets are ever released, so a
                # refused copy cannot free a slot that its rightful reader still uses.
                why = r.claims.claim(t.slot, t.seq, t.sample)
                if why is PENDING:
                    why = self._await_commit(r, t)
                if why is not None:
                    self.stats.refused_tickets += 1
                    # A batch its producer could not write is the producer's failure, not the caller's.
                    raise (ProducerGoneError if why is FAILED_BATCH else TicketError)(why)
                seen.append((t.producer, t.generation, t.slot, t.seq, t.sample))
                if lap is not None and i == 0:
                    lap("read:claim")
                if (t.producer, t.generation, t.slot) not in waited:
                    r.events.wait(t.slot, stream)
                    waited.add((t.producer, t.generation, t.slot))
                    if lap is not None and i == 0:
                        lap("read:wait")
                # Consecutive samples of one slot become one zero-copy view.
                if run_start is not None:
                    r0, t0, n = run_start
                    if r0 is r and t0.slot == t.slot and t0.seq == t.seq and t.offset == t0.offset + n * t0.nbytes:
                        run_start = (r0, t0, n + 1)
                        continue
                    parts.append(self._view(r0, t0, n))
                run_start = (r, t, 1)
            if run_start is not None:
                parts.append(self._view(*run_start))
            batch = parts[0] if len(parts) == 1 else torch.cat([p.to(self.device) for p in parts])
        except Exception as exc:
            if isinstance(exc, TicketError):
                self.stats.bad_tickets += 1
            # What this request claimed is still released (nothing reads it), so a request that fails
            # here leaks no slots: a bad ticket, or a good one whose read failed (a CUDA error, say).
            self.release_now(seen)
            raise
        self.stats.tickets += count
        if len(shapes) == 1:
            return [batch], seen
        n = int(batch.shape[0])
        return [batch[:, a:b].view(n, *s) for a, b, s in zip(offsets, offsets[1:], shapes, strict=False)], seen

    def _await_commit(self, r: _Remote, t: tk.Ticket) -> str | None:
        """Claim ``t`` once its producer committed the batch it was issued for; why not, if that use
        is refused; ProducerGoneError if the commit never comes or the producer stops.

        Polls the claim entry: first back to back (the commit is usually microseconds away), then
        with sleeps that grow to 1 ms, checking now and then that the producer still listens.
        """
        self.stats.commit_waits += 1
        start = time.monotonic()
        pause, checked = 0.0, start
        while True:
            now = time.monotonic()
            why = r.claims.claim(t.slot, t.seq, t.sample, now)
            if why is not PENDING:
                return why
            if now - start > self.commit_wait_s:
                self.stats.refused_tickets += 1
                raise ProducerGoneError(f"uncommitted ticket: producer {t.producer:016x} issued it but did not commit its batch "
                                        f"within {self.commit_wait_s:g} s")
            if now - checked > 0.1:
                checked = now
                if not listening(socket_path(self.runtime_dir, t.producer, t.generation)):
                    raise ProducerGoneError(f"producer {t.producer:016x} generation {t.generation:08x} stopped "
                                            "before it committed the batch of this ticket")
            if now - start > 200e-6:
                pause = min(1e-3, max(20e-6, 2 * pause))
            time.sleep(pause)

    @staticmethod
    def _view(r: _Remote, t: tk.Ticket, n: int) -> torch.Tensor:
        return r.segment.view(t.offset, (n, *t.shape), t.dtype)

    def release_after(self, releases: list[Release], stream: int | None, after: int | None = None) -> None:
        """Release ``releases`` once the work queued so far on ``stream`` (which read the slots) is done
        (:meth:`Releaser.after`)."""
        self._releases.after(releases, stream, after)

    def release_now(self, releases: list[Release]) -> None:
        self._releases.after(releases, None)

    def flush(self) -> None:
        """Block until every queued release was made (tests, shutdown)."""
        self._releases.flush()

    def close(self) -> None:
        self._releases.close()  # makes the releases still queued
        for r in list(self._remotes.values()):
            self._drop(r)
