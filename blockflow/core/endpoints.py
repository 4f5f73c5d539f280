"""Where the running ``blockflow serve`` answers: the endpoints file it writes, read by the client commands.

``blockflow serve`` writes, once every model is loaded, ``endpoints.json`` (0600) in the user's
runtime directory (``$XDG_RUNTIME_DIR/blockflow/``, else ``<temp dir>/blockflow-<uid>/``; or the
path in ``$BLOCKFLOW_ENDPOINTS``), and removes it when it stops. ``infer``, ``load``, ``status``
and ``apply`` take each address from, in order: their flag, its ``BLOCKFLOW_*`` variable, this
file (when the server that wrote it still runs), the default port on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from blockflow.core import env
from blockflow.core.runtime_dir import private_dir, write_private

FILE_NAME = "endpoints.json"
# The header that opens Triton's shared-memory API (blockflow.triton.access); over gRPC, Triton looks for a restricted
# protocol's metadata under the prefix.
SHM_HEADER = "blockflow-shm-key"
GRPC_PROTOCOL_PREFIX = "triton-grpc-protocol-"


@dataclass(frozen=True)
class Endpoints:
    """The addresses of one ``blockflow serve``; ``control`` and ``token_file`` are empty without a control service.
    ``shm_key_file`` holds the key of Triton's shared-memory API (clients with CUDA or system shared-memory inputs)."""

    http: str
    grpc: str
    metrics: str
    control: str
    token_file: str
    pid: int
    plan: str
    shm_key_file: str = ""


def shm_headers(key: str, protocol: str = "http") -> dict[str, str]:
    """The headers (``http``) or metadata (``grpc``) that open Triton's shared-memory API with ``key``."""
    return {(GRPC_PROTOCOL_PREFIX if protocol == "grpc" else "") + SHM_HEADER: key}


def shm_key() -> str:
    """The key that opens Triton's shared-memory API: from the file ``$BLOCKFLOW_SHM_KEY_FILE`` names, else the one
    the endpoints file names (the local ``blockflow serve``'s), else '' (registration is then refused: 403)."""
    named = os.environ.get(env.SHM_KEY_FILE_VAR)
    if not named:
        found = read()
        named = found.shm_key_file if found is not None else ""
    if not named:
        return ""
    try:
        return Path(named).read_text().strip()
    except OSError:
        return ""


def path() -> Path:
    """The endpoints file: ``$BLOCKFLOW_ENDPOINTS``, else in the user's runtime directory."""
    named = os.environ.get(env.ENDPOINTS)
    if named:
        return Path(named)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(xdg) / "blockflow" if xdg else Path(tempfile.gettempdir()) / f"blockflow-{os.geteuid()}"
    return base / FILE_NAME


def write(e: Endpoints) -> Path:
    """Write ``e`` (0600), replacing any earlier file whole.

    The default directory must be this user's own and closed (made 0700 here if absent): a
    directory another user made first in a shared temp dir is refused, not written into.
    """
    target = path()
    if os.environ.get(env.ENDPOINTS):
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    else:
        private_dir(target.parent, what="endpoints directory", setting=env.ENDPOINTS)
    write_private(target, json.dumps(asdict(e), indent=1))
    return target


# One parse per version of the file: a command asks for several of its fields.
_cache: dict[tuple[Path, int, int, int], Endpoints] = {}


def read() -> Endpoints | None:
    """The file's endpoints if it is this user's own, closed to others, and its server still runs; else None."""
    target = path()
    try:
        st = target.lstat()
        if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            return None  # another user's file, one others could have written, or a link: not trusted
        key = (target, st.st_ino, st.st_mtime_ns, st.st_size)
        e = _cache.get(key)
        if e is None:
            e = Endpoints(**json.loads(target.read_text()))
            _cache.clear()
            _cache[key] = e
    except (OSError, ValueError, TypeError):
        return None
    return e if _alive(e.pid) else None


def remove(pid: int) -> None:
    """Remove the file if it is still the one process ``pid`` wrote (a later server may have replaced it)."""
    target = path()
    try:
        if json.loads(target.read_text()).get("pid") == pid:
            target.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
