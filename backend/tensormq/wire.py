"""Everything TensorMQ puts on a socket: the message kinds, their frames, and where the sockets are.

The rules these messages serve (who owns a slot when, what a ticket promises) are in the
package note, ``backend/tensormq/__init__.py``; the ticket itself, which travels inside Triton
and not on these sockets, is laid out in ``backend/tensormq/ticket.py``.

Frames (ZeroMQ multipart, a consumer's DEALER to the producer generation's ROUTER)::

    HELLO                     -> WELCOME, JSON {producer, generation, segment, events, max_slots}
    RELEASE, n x RELEASE_ITEM -> (no answer)
    STATS                     -> STATS, JSON of the producer's counters
    anything else             -> ERROR, a short text
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from blockflow.core import env

HELLO, WELCOME, RELEASE, STATS, ERROR = b"HELLO", b"WELCOME", b"RELEASE", b"STATS", b"ERROR"
RELEASE_ITEM = struct.Struct("<IIII")  # generation, slot, seq, sample: one claimed sample handed back
# WELCOME's JSON: the producer's id and generation, its pool segment (HostSegment/CudaSegment.describe():
# kind, name or CUDA IPC handle in hex, nbytes, device), one CUDA IPC event handle per slot (hex;
# none on the host), and the slot count.
WELCOME_KEYS = ("producer", "generation", "segment", "events", "max_slots")


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
