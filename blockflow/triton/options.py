"""What a ``tritonserver`` is started with: :class:`ServerOptions`, and the ports it listens on (a free one
chosen, a taken one refused before the server tries it)."""

from __future__ import annotations

import errno
import random
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blockflow.core.errors import PortInUseError, ServerError
from blockflow.triton.flags import CUDA_POOL_MB
from blockflow.triton.front_door import DEFAULT_MAX_BODY_BYTES


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, outside the kernel's ephemeral range.

    Port 0 would give an ephemeral port, the range every outgoing connection takes its local
    port from: between this call and the server's bind, a client connection (a load test opens
    thousands) can take it, and the server then fails to start. No port is returned twice in
    one process.
    """
    low, high = _ephemeral_range()
    candidates = [p for p in range(10000, 32768) if not low <= p <= high] or list(range(1024, 65536))
    rng = random.Random()
    for port in rng.sample(candidates, min(200, len(candidates))):
        # A port handed out earlier is not listened on until its server starts: without this
        # record, two calls for one server (HTTP, then gRPC) can return the same port.
        with _HANDED_OUT_LOCK, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if port in _HANDED_OUT:
                continue
            try:
                s.bind((host, port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise ServerError(f"no free port on {host} between 10000 and 32767")


def check_port(host: str, port: int, what: str) -> None:
    """Raise :class:`PortInUseError` if something listens on ``host:port``.

    SO_REUSEADDR as every server sets it (Triton included): connections in TIME_WAIT, which a
    load test leaves for a minute, do not make a free port look taken.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(f"{what} port {port} on {host} is already in use; "
                                     f"stop what holds it or choose another with --{what.lower()}-port") from None
            raise ServerError(f"cannot bind {what} port {port} on {host}: {exc.strerror}") from None


# The quantiles Triton keeps with latency summaries on: the two BlockFlow reads, with the coarsest
# errors that still tell them apart (Triton's defaults add 0.9, 0.95, 0.999 at errors down to 0.001,
# which cost the most under load).
LATENCY_QUANTILES = "0.5:0.05,0.99:0.01"
# Triton's own (core's metric_model_reporter.cc), for measuring what they cost.
TRITON_DEFAULT_QUANTILES = "0.5:0.05,0.9:0.01,0.95:0.001,0.99:0.001,0.999:0.001"


@dataclass
class ServerOptions:
    repositories: Sequence[Path]
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    load: Sequence[str] = ("*",)
    log_verbose: int = 0
    # Triton's CUDA memory pool per GPU, in MiB. The Python backend moves GPU tensors between the
    # server and block processes through it; when it runs out, python_backend r24.10 falls back to
    # per-tensor CUDA IPC, which returned other requests' data under concurrent load on an H100
    # (blockflow.bench.stress: 50-60% of 120 concurrent requests wrong with the 64 MiB default, none with
    # 1 GiB; with no pool the server crashed). Size it for the activations in flight.
    cuda_pool_mb: int = CUDA_POOL_MB
    # Run the block processes as clients of a private MPS daemon (see blockflow.triton.mps).
    mps: bool = False
    # Keep the server's CPUs out of idle for this long after each block execute; 0: off
    # (see blockflow.triton.warm_cores).
    warm_cores_ms: float = 0.0
    # Triton's per-model latency quantiles on the metrics endpoint (nv_inference_request_summary_us and its
    # phases: what `blockflow status` and the dashboard read for p50/p99), keeping latency_quantiles. Off by
    # default: each is a sliding window of quantile sketches that every request of every model feeds, and under
    # sustained load with Triton's default quantiles (errors to 0.001) throughput fell 18-21% within 25 s
    # (docs/performance.md, "Latency summaries").
    latency_summaries: bool = False
    latency_quantiles: str = LATENCY_QUANTILES  # quantile:error pairs, as Triton's summary_quantiles takes them
    extra_args: Sequence[str] = field(default_factory=list)
    # Extra environment for the server and so for every block process (e.g. BLOCKFLOW_TRACE_DIR).
    env: Mapping[str, str] = field(default_factory=dict)
    # The key of Triton's restricted APIs (model repository, trace, logging; see blockflow.triton.access).
    # Empty: a new random one, written to <runtime dir>/admin.key.
    admin_key: str = ""
    # The key of Triton's shared-memory API. Empty: a new random one, written to shm_key_file (default
    # <runtime dir>/shm.key), readable by this user, and by the members of group shm_key_group (a gid) if given.
    shm_key: str = ""
    shm_key_file: Path | None = None
    shm_key_group: int | None = None
    # nginx on http_port, Triton's HTTP on a Unix socket behind it (blockflow.triton.front_door); False: Triton's
    # HTTP on http_port itself, open to the chunked requests that crash Triton 2.51.
    front_door: bool = True
    # The largest request body the front door lets through.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @classmethod
    def on_free_ports(cls, repositories: Sequence[Path], **options: Any) -> ServerOptions:
        """Options for a server on this host's loopback, on three free ports (tests and benchmarks)."""
        return cls(repositories, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), **options)
