"""Where a client command sends its calls: flag, then variable, then the running server's endpoints file.

Each address remembers where it came from, so a server that does not answer is reported with the
flag and the variable that would point the command elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from blockflow.core import endpoints, env
from blockflow.core.errors import Unreachable


@dataclass(frozen=True)
class Address:
    value: str
    source: str  # "--url", "$BLOCKFLOW_HTTP_URL", "the endpoints file …", "the default"
    flag: str
    var: str


def pick(given: str | None, flag: str, var: str, field: str, default: str) -> Address:
    """``given`` (the flag's value), else ``$var``, else the endpoints file's ``field``, else ``default``."""
    if given:
        return Address(given, flag, flag, var)
    if os.environ.get(var):
        return Address(os.environ[var], f"${var}", flag, var)
    found = endpoints.read()
    if found is not None and getattr(found, field):
        return Address(getattr(found, field), f"the endpoints file of blockflow serve (pid {found.pid}, {endpoints.path()})", flag, var)
    return Address(default, "the default", flag, var)


def http(given: str | None, protocol: str = "http") -> Address:
    """Triton's HTTP or gRPC endpoint (host:port)."""
    if protocol == "grpc":
        return pick(given, "--url", env.GRPC_URL, "grpc", "127.0.0.1:8001")
    return pick(given, "--url", env.HTTP_URL, "http", "127.0.0.1:8000")


def metrics(given: str | None, triton: Address) -> Address:
    """Triton's metrics URL; without a flag, variable or endpoints file, port 8002 on ``triton``'s host."""
    if given or os.environ.get(env.METRICS_URL):
        return pick(given, "--metrics-url", env.METRICS_URL, "metrics", "")
    found = endpoints.read()
    if found is not None and found.metrics and found.http == triton.value:
        return pick(None, "--metrics-url", env.METRICS_URL, "metrics", "")
    host = triton.value.removeprefix("http://").rsplit(":", 1)[0]
    return Address(f"http://{host}:8002/metrics", f"port 8002 on the host of {triton.flag}", "--metrics-url", env.METRICS_URL)


def control(given: str | None) -> Address:
    """The control service of ``blockflow serve``."""
    return pick(given, "--url", env.CONTROL_URL, "control", "http://127.0.0.1:8003")


def token_file(given: Path | None) -> Path | None:
    """The control token's file: ``--token-file``, ``$BLOCKFLOW_TOKEN_FILE``, else the endpoints file's."""
    if given is not None:
        return given
    if os.environ.get(env.TOKEN_FILE):
        return Path(os.environ[env.TOKEN_FILE])
    found = endpoints.read()
    return Path(found.token_file) if found is not None and found.token_file and not os.environ.get(env.TOKEN) else None


@contextmanager
def reaching(*addresses: Address) -> Iterator[None]:
    """Re-raise :class:`Unreachable` with where the addresses came from and how to give others."""
    try:
        yield
    except Unreachable as exc:
        hints = "; ".join(f"{a.value} is from {a.source} (set {a.flag} or ${a.var})" for a in addresses)
        raise Unreachable(f"{exc}. {hints}; `blockflow serve` writes its addresses to {endpoints.path()}") from None
