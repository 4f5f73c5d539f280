"""Who may do what on a BlockFlow server: the restricted Triton APIs and the secrets that open them.

Task clients get what inference needs and nothing that changes what the server runs or reaches
its memory:

========================  ==========  ==================================================================
Triton API (HTTP / gRPC)  open?       why
========================  ==========  ==================================================================
health                    open        load balancers and readiness probes
metadata                  open        a client learns a task's inputs and outputs
inference                 open        the service itself
model-config              open        read-only; ``perf_analyzer`` and ``tritonclient`` read a task's config
                                      (a block's config names its weights file's path on the server)
statistics                open        read-only counters; ``perf_analyzer`` and ``blockflow status`` read
                                      them (they show how much each task and block serves)
shared-memory             **shm key** a registered region is memory Triton reads and writes for whoever
                                      names it, and Triton opens any ``/dev/shm`` name its user can
                                      (``shm_guard.c`` keeps the server's own regions out even then);
                                      local clients with CUDA/system shared-memory inputs read the key
                                      from a file (:data:`SHM_KEY_FILE`, or ``serve --shm-key-file``)
model-repository          **admin**   load/unload run code in the server (a load may carry its own
                                      ``model.py`` as a file override); the index lists internal models
trace                     **admin**   trace settings name a file the server writes
logging                   **admin**   log settings change what the server records
========================  ==========  ==================================================================

Each key is random per server and written 0600 (the shared-memory key 0640 for ``serve
--shm-key-group``). The admin key lives in the server's 0700 runtime directory (:data:`ADMIN_KEY_FILE`) and
is sent as header :data:`ADMIN_HEADER` by the applier, the heal loop and the tools that need it (over gRPC as
metadata :data:`GRPC_ADMIN_HEADER`); the shared-memory key as :data:`SHM_HEADER` / :data:`GRPC_SHM_HEADER`.
Triton takes keys only on its command line, which every local user can read in ``/proc``:
:mod:`blockflow.triton.argv_key` keeps them off there.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from blockflow.core import endpoints, env

# gRPC metadata keys are lower case; Triton compares HTTP header names case-insensitively.
ADMIN_HEADER = "blockflow-admin-key"
# Triton looks for a restricted protocol's gRPC metadata under this prefix.
GRPC_PREFIX = endpoints.GRPC_PROTOCOL_PREFIX
GRPC_ADMIN_HEADER = f"{GRPC_PREFIX}{ADMIN_HEADER}"
SHM_HEADER = endpoints.SHM_HEADER  # clients send it too (blockflow.clients), so the core spells it
GRPC_SHM_HEADER = f"{GRPC_PREFIX}{SHM_HEADER}"
ADMIN_KEY_FILE = env.ADMIN_KEY_FILE
SHM_KEY_FILE = env.SHM_KEY_FILE
# Names Triton's shared-memory API may not open (shm_guard.c spells them again): BlockFlow's regions (the
# stubs' IPC under env.stub_shm_prefix, TensorMQ's host pools) and the Python backend's default prefix.
SERVER_SHM_PREFIXES = ("blockflow", "triton_")
ADMIN_APIS = ("model-repository", "trace", "logging")
SHM_APIS = ("shared-memory",)
OPEN_APIS = ("health", "metadata", "inference", "model-config", "statistics")


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def read_secret(path: Path) -> str:
    return path.read_text().strip()


def restricted_args(admin_key: str, shm_key: str) -> list[str]:
    """``tritonserver`` flags that put the admin APIs behind ``admin_key`` and the shared-memory API behind
    ``shm_key``, on HTTP and gRPC."""
    out = []
    for apis, header, key in ((ADMIN_APIS, ADMIN_HEADER, admin_key), (SHM_APIS, SHM_HEADER, shm_key)):
        out += [f"--http-restricted-api={','.join(apis)}:{header}={key}",
                f"--grpc-restricted-protocol={','.join(apis)}:{header}={key}"]
    return out


def admin_headers(key: str) -> dict[str, str]:
    """HTTP headers that open the restricted APIs."""
    return {ADMIN_HEADER: key}


def grpc_admin_headers(key: str) -> dict[str, str]:
    """gRPC metadata that opens the restricted protocols (Triton prefixes the key's name)."""
    return {GRPC_ADMIN_HEADER: key}


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison (the time taken says nothing about how much of ``given`` matched)."""
    return hmac.compare_digest(given.encode(), expected.encode())
