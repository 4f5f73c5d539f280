"""Everything TensorMQ puts on a socket: the message kinds, their frames, and where the sockets are.

The rules these messages serve (who owns a slot when, what a ticket promises, when a sender hands
over) are in the package note, ``backend/tensormq/__init__.py``; the ticket itself, which travels
inside Triton and inside hand-overs, is laid out in ``backend/tensormq/ticket.py``.

Consumer to producer: ZeroMQ multipart, a consumer's DEALER to the ROUTER of one producer
generation, at :func:`endpoint` (``tmq/<producer id, 16 hex>-<generation, 8 hex>.sock``)::

    kind     request frames                       answer
    HELLO    HELLO                                WELCOME, JSON of WELCOME_KEYS: producer, generation,
                                                  segment (kind, name or CUDA IPC handle in hex, nbytes,
                                                  device), events (one CUDA IPC event handle per slot, hex;
                                                  none on the host), max_slots
    RELEASE  RELEASE, n x RELEASE_ITEM            none (fire and forget)
             (generation, slot, seq, sample)
    STATS    STATS                                STATS, JSON of the producer's counters (slots_in_use and
                                                  bytes_in_use: lent or reserved; slots_ready: prepared)
    other    anything else                        ERROR, a short text

Sender to receiver (direct hand-overs): ZeroMQ multipart, a sender's PUSH to the PULL of each
instance of its receiver, at :func:`hand_over_path` (``tmq/ho<model id, 14 hex>-<pid, 8 hex>.sock``);
one message per sample, no answer::

    frame   bytes         what
    key     MAC_BYTES     the MAC of the ticket the sender took as its input (the receiver's key)
    status  0 to 4096     empty (HANDED): the sample's ticket follows; else why the sender failed
                          the sample's request, UTF-8 (STATUS_MAX bytes at most)
    ticket  TICKET_BYTES  the sender's ticket for the sample; empty with a failure

:func:`handed` and :func:`failed` build a message, :func:`hand_over_of` reads one.

Sender to receiver as datagrams (the default; ``BLOCKFLOW_TMQ_HANDOVER_DGRAM=0`` turns them off): the same messages, those of one
call in one AF_UNIX datagram (more where they pass ``DGRAM_MAX`` bytes), sent to each receiver
instance's datagram socket at :func:`hand_over_dgram_path` (its stream socket's name ending ``.dg``)
without waiting. Each message in a datagram, one after the other::

    field          bytes          what
    key            MAC_BYTES      as above
    status length  2              little-endian, at most STATUS_MAX; 0 (HANDED): a ticket follows
    status         status length  why the sender failed the sample's request, UTF-8
    ticket         TICKET_BYTES   only with HANDED

A receiver's queue holds a few datagrams (``net.unix.max_dgram_qlen``); a call that finds it full,
or finds no datagram socket, goes over ZeroMQ instead, and a receiver keeps the first copy of a key's
hand-over it hears (:func:`pack_datagrams`, :func:`unpack_datagram`).
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from blockflow.backend.tensormq.ticket import MAC_BYTES, TICKET_BYTES, model_id
from blockflow.core import env

HELLO, WELCOME, RELEASE, STATS, ERROR = b"HELLO", b"WELCOME", b"RELEASE", b"STATS", b"ERROR"
RELEASE_ITEM = struct.Struct("<IIII")  # generation, slot, seq, sample: one claimed sample handed back
WELCOME_KEYS = ("producer", "generation", "segment", "events", "max_slots")

HANDED = b""  # a hand-over's status when it carries the sample's ticket
STATUS_MAX = 4096
DGRAM_MAX = 65536  # bytes of hand-overs in one datagram (AF_UNIX takes up to its send buffer, ~200 KiB)
_STATUS_LEN = struct.Struct("<H")


def socket_path(runtime_dir: Path, pid: int, generation: int) -> Path:
    """One socket per producer *generation*: while a block reloads, old and new instances both serve."""
    return env.producer_socket(runtime_dir, pid, generation)


def endpoint(runtime_dir: Path, pid: int, generation: int) -> str:
    return f"ipc://{socket_path(runtime_dir, pid, generation)}"


def generations(runtime_dir: Path, pid: int) -> list[int]:
    """Generations of producer ``pid`` that have a socket file (live or left by a killed process)."""
    return [int(p.stem.rsplit("-", 1)[1], 16) for p in sorted((runtime_dir / env.TMQ_DIR).glob(f"{pid:016x}-*.sock"))]


def listening(path: Path) -> bool:
    """Whether a process still accepts connections on the Unix socket ``path``.

    A SIGKILLed producer leaves its socket file behind; connecting to it is refused at once.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def hand_over_prefix(model: str) -> str:
    """The start of the socket names of receiver ``model``'s instances (its senders list them)."""
    return f"ho{model_id(model) & (2**56 - 1):014x}-"


def hand_over_path(runtime_dir: Path, model: str, pid: int) -> Path:
    """A receiver instance's socket: as long as a producer's, so the runtime directory's limit holds."""
    return runtime_dir / env.TMQ_DIR / f"{hand_over_prefix(model)}{pid:08x}.sock"


def handed(key: bytes, ticket: bytes) -> list[bytes]:
    """The hand-over of one sample's ticket under ``key``."""
    return [key, HANDED, ticket]


def failed(key: bytes, reason: str) -> list[bytes]:
    """The hand-over of one sample's failure under ``key``: the receiver fails its request with ``reason``."""
    return [key, reason.encode()[:STATUS_MAX] or b"failed", b""]


def hand_over_of(frames: list[bytes]) -> tuple[bytes, bytes, bytes] | None:
    """``(key, status, ticket)`` of a well-formed hand-over; None for anything else."""
    if len(frames) != 3 or len(frames[0]) != MAC_BYTES:
        return None
    key, status, ticket = frames
    if status == HANDED and len(ticket) != TICKET_BYTES:
        return None
    return key, status, ticket


def hand_over_dgram_path(stream_path: Path) -> Path:
    """A receiver instance's datagram socket, beside its ZeroMQ socket ``stream_path``."""
    return stream_path.with_suffix(".dg")


def pack_datagrams(messages: list[list[bytes]]) -> list[bytes]:
    """Hand-overs (:func:`handed`, :func:`failed`) as datagrams of at most ``DGRAM_MAX`` bytes each."""
    out: list[bytes] = []
    current = bytearray()
    for key, status, ticket in messages:
        entry = key + _STATUS_LEN.pack(len(status)) + status + ticket
        if current and len(current) + len(entry) > DGRAM_MAX:
            out.append(bytes(current))
            current = bytearray()
        current += entry
    if current:
        out.append(bytes(current))
    return out


def unpack_datagram(data: bytes) -> list[tuple[bytes, bytes, bytes]]:
    """``(key, status, ticket)`` of each well-formed hand-over of a datagram, in order; reading stops
    at the first malformed one (only senders of this server reach the socket)."""
    out: list[tuple[bytes, bytes, bytes]] = []
    i = 0
    while i + MAC_BYTES + _STATUS_LEN.size <= len(data):
        key = data[i:i + MAC_BYTES]
        (n,) = _STATUS_LEN.unpack_from(data, i + MAC_BYTES)
        i += MAC_BYTES + _STATUS_LEN.size
        if n > STATUS_MAX or i + n > len(data):
            break
        status = data[i:i + n]
        i += n
        ticket = b""
        if status == HANDED:
            if i + TICKET_BYTES > len(data):
                break
            ticket = data[i:i + TICKET_BYTES]
            i += TICKET_BYTES
        out.append((key, status, ticket))
    return out
