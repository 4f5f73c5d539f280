"""Who may do what on a BlockFlow server: the restricted Triton APIs and the secrets that open them.

Task clients get what inference needs and nothing that changes what the server runs:

========================  ==========  ==================================================================
Triton API (HTTP / gRPC)  open?       why
========================  ==========  ==================================================================
health                    open        load balancers and readiness probes
metadata                  open        a client learns a task's inputs and outputs
inference                 open        the service itself
shared-memory             open        registering a CUDA/system shared-memory region for inputs
                                      (``TaskClient(input_memory="cuda")``, ``perf_analyzer --shared-memory``)
model-config              open        read-only; ``perf_analyzer`` and ``tritonclient`` read it
statistics                open        read-only counters; ``perf_analyzer`` reads them for its report
model-repository          **key**     load/unload run code in the server (a load may carry its own
                                      ``model.py`` as a file override); the index lists internal models
trace                     **key**     trace settings name a file the server writes
logging                   **key**     log settings change what the server records
========================  ==========  ==================================================================

The key is random per server, written 0600 into the server's 0700 runtime directory
(:data:`ADMIN_KEY_FILE`) and sent as header :data:`ADMIN_HEADER` by the applier, the heal loop
and the tools that need it (over gRPC as metadata :data:`GRPC_ADMIN_HEADER`). Triton takes it only on
its command line, which every local user can read in ``/proc``: :mod:`blockflow.triton.argv_key` keeps it off there.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

# gRPC metadata keys are lower case; Triton compares HTTP header names case-insensitively.
ADMIN_HEADER = "blockflow-admin-key"
# Triton looks for the gRPC form under this prefix.
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
ADMIN_KEY_FILE = "admin.key"
RESTRICTED_APIS = ("model-repository", "trace", "logging")
OPEN_APIS = ("health", "metadata", "inference", "shared-memory", "model-config", "statistics")


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def read_secret(path: Path) -> str:
    return path.read_text().strip()


def restricted_args(key: str) -> list[str]:
    """``tritonserver`` flags that put the restricted APIs behind ``key``, on HTTP and gRPC."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={key}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={key}"]


def admin_headers(key: str) -> dict[str, str]:
    """HTTP headers that open the restricted APIs."""
    return {ADMIN_HEADER: key}


def grpc_admin_headers(key: str) -> dict[str, str]:
    """gRPC metadata that opens the restricted protocols (Triton prefixes the key's name)."""
    return {GRPC_ADMIN_HEADER: key}


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison (the time taken says nothing about how much of ``given`` matched)."""
    return hmac.compare_digest(given.encode(), expected.encode())
