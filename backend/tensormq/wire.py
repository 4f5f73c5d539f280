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
    origin  4             the process id (little-endian) of the chain head's instance that took the
                          sample's request and waits for its answer (:func:`answer_path`); 0: none

:func:`handed` and :func:`failed` build a message, :func:`hand_over_of` reads one.

Sender to receiver as datagrams (the default; ``BLOCKFLOW_TMQ_HANDOVER_DGRAM=0`` turns them off): the same messages, those of one
call in one AF_UNIX datagram (more where they pass ``DGRAM_MAX`` bytes), sent to each receiver
instance's datagram socket at :func:`hand_over_dgram_path` (its stream socket's name ending ``.dg``)
without waiting. Each message in a datagram, one after the other::

    field          bytes          what
    key            MAC_BYTES      as above
    origin         4              as above
    status length  2              little-endian, at most STATUS_MAX; 0 (HANDED): a ticket follows
    status         status length  why the sender failed the sample's request, UTF-8
    ticket         TICKET_BYTES   only with HANDED

A chain's tail to its head (plan option ``chain_answers: head``): each sample's answer, as AF_UNIX
datagrams only, to the datagram socket of the head instance its hand-overs name as their origin, at
:func:`answer_path` (``tmq/an<pid, 8 hex>.dg``). The tail waits while that socket's queue is full (up to
``ANSWER_SEND_S``), so answers are not dropped; an answer the head never hears fails its request after
the head's wait. Each message in a datagram, one after the other (:func:`pack_answers`, :func:`unpack_answers`)::

    field           bytes           what
    key             MAC_BYTES       the hand-over's key (the head's ticket for the sample)
    status length   2               little-endian, at most STATUS_MAX; 0: the answer follows
    status          status length   why the chain failed the sample's request, UTF-8
    answer length   4               little-endian, at most ANSWER_MAX; 0 with a failure
    answer          answer length   the sample's value of each task output in order, raw (little-endian)

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
from blockflow.core.spec import ANSWER_MAX

HELLO, WELCOME, RELEASE, STATS, ERROR = b"HELLO", b"WELCOME", b"RELEASE", b"STATS", b"ERROR"
RELEASE_ITEM = struct.Struct("<IIII")  # generation, slot, seq, sample: one claimed sample handed back
WELCOME_KEYS = ("producer", "generation", "segment", "events", "max_slots")

HANDED = b""  # a hand-over's status when it carries the sample's ticket
STATUS_MAX = 4096
DGRAM_MAX = 65536  # bytes of hand-overs in one datagram (AF_UNIX takes up to its send buffer, ~200 KiB)
_STATUS_LEN = struct.Struct("<H")
_ANSWER_LEN = struct.Struct("<I")
ORIGIN = struct.Struct("<I")
NO_ORIGIN = ORIGIN.pack(0)
# How long a tail waits for room in its head's queue before it gives an answer up (the head then
# fails the request after its own wait).
ANSWER_SEND_S = 2.0
# A hand-over: key, status, ticket (empty with a failure) and origin.
HandOverMessage = tuple[bytes, bytes, bytes, bytes]
# A tail's answer to its head: key, status, the sample's answer (empty with a failure).
Answer = tuple[bytes, bytes, bytes]


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


def answer_path(runtime_dir: Path, pid: int) -> Path:
    """The datagram socket of the chain head's instance ``pid``, where its tail's answers come."""
    return runtime_dir / env.TMQ_DIR / f"an{pid:08x}.dg"


def handed(key: bytes, ticket: bytes, origin: bytes = NO_ORIGIN) -> list[bytes]:
    """The hand-over of one sample's ticket under ``key``."""
    return [key, HANDED, ticket, origin]


def failed(key: bytes, reason: str, origin: bytes = NO_ORIGIN) -> list[bytes]:
    """The hand-over of one sample's failure under ``key``: the receiver fails its request with ``reason``."""
    return [key, _status(reason), b"", origin]


def _status(reason: str) -> bytes:
    return reason.encode()[:STATUS_MAX] or b"failed"


def hand_over_of(frames: list[bytes]) -> HandOverMessage | None:
    """``(key, status, ticket, origin)`` of a well-formed hand-over; None for anything else."""
    if len(frames) != 4 or len(frames[0]) != MAC_BYTES or len(frames[3]) != ORIGIN.size:
        return None
    key, status, ticket, origin = frames
    if status == HANDED and len(ticket) != TICKET_BYTES:
        return None
    return key, status, ticket, origin


def hand_over_dgram_path(stream_path: Path) -> Path:
    """A receiver instance's datagram socket, beside its ZeroMQ socket ``stream_path``."""
    return stream_path.with_suffix(".dg")


def _packed(entries: list[bytes]) -> list[bytes]:
    """``entries`` one after the other in datagrams of at most ``DGRAM_MAX`` bytes (a longer entry alone)."""
    out: list[bytes] = []
    current = bytearray()
    for entry in entries:
        if current and len(current) + len(entry) > DGRAM_MAX:
            out.append(bytes(current))
            current = bytearray()
        current += entry
    if current:
        out.append(bytes(current))
    return out


def pack_datagrams(messages: list[list[bytes]]) -> list[bytes]:
    """Hand-overs (:func:`handed`, :func:`failed`) as datagrams of at most ``DGRAM_MAX`` bytes each."""
    return _packed([key + origin + _STATUS_LEN.pack(len(status)) + status + ticket for key, status, ticket, origin in messages])


def unpack_datagram(data: bytes) -> list[HandOverMessage]:
    """``(key, status, ticket, origin)`` of each well-formed hand-over of a datagram, in order; reading
    stops at the first malformed one (only senders of this server reach the socket)."""
    out: list[HandOverMessage] = []
    i = 0
    head = MAC_BYTES + ORIGIN.size + _STATUS_LEN.size
    while i + head <= len(data):
        key, origin = data[i:i + MAC_BYTES], data[i + MAC_BYTES:i + MAC_BYTES + ORIGIN.size]
        (n,) = _STATUS_LEN.unpack_from(data, i + MAC_BYTES + ORIGIN.size)
        i += head
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
        out.append((key, status, ticket, origin))
    return out


def answered(key: bytes, answer: bytes) -> Answer:
    """A tail's answer for the sample under ``key``."""
    return key, HANDED, answer


def answer_failed(key: bytes, reason: str) -> Answer:
    """A tail's word that the sample under ``key`` failed, with ``reason``."""
    return key, _status(reason), b""


def pack_answers(answers: list[Answer]) -> list[bytes]:
    """A tail's answers (:func:`answered`, :func:`answer_failed`) as datagrams of at most ``DGRAM_MAX`` bytes."""
    return _packed([key + _STATUS_LEN.pack(len(status)) + status + _ANSWER_LEN.pack(len(answer)) + answer
                    for key, status, answer in answers])


def unpack_answers(data: bytes) -> list[Answer]:
    """``(key, status, answer)`` of each well-formed answer of a datagram, in order; reading stops at
    the first malformed one."""
    out: list[Answer] = []
    i = 0
    while i + MAC_BYTES + _STATUS_LEN.size <= len(data):
        key = data[i:i + MAC_BYTES]
        (n,) = _STATUS_LEN.unpack_from(data, i + MAC_BYTES)
        i += MAC_BYTES + _STATUS_LEN.size
        if n > STATUS_MAX or i + n + _ANSWER_LEN.size > len(data):
            break
        status = data[i:i + n]
        (m,) = _ANSWER_LEN.unpack_from(data, i + n)
        i += n + _ANSWER_LEN.size
        if m > ANSWER_MAX or i + m > len(data) or (status == HANDED) != (m > 0):
            break
        out.append((key, status, data[i:i + m]))
        i += m
    return out
