"""Keeps the admin key off tritonserver's command line.

Triton takes its restricted APIs' key only as an argument, and ``/proc/<pid>/cmdline`` is readable
by every local user: with the key, any of them could load a model into the server, which runs its
code as the server's user. So BlockFlow passes :data:`PLACEHOLDER` there and preloads a small
library (``argv_key.c``, beside this module) that swaps the key in inside the process before
Triton's ``main`` runs; the key travels in a 0600 file whose name is in the server's environment,
which only its user can read.

The library is compiled once per user into BlockFlow's cache with the system's C compiler. Without
one, :func:`shim` says so once and returns None, and callers put the key on the command line as
before (``/proc`` mounted with ``hidepid=2`` then keeps it from other users).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from blockflow.core import env as blockflow_env
from blockflow.core.errors import EnvironmentProblem

log = logging.getLogger(__name__)

# These three are spelled again in argv_key.c (a test checks that they agree).
PLACEHOLDER = "@BLOCKFLOW_ADMIN_KEY@"
KEY_FILE_VAR = blockflow_env.ADMIN_KEY_FILE_VAR
PRELOAD_VAR = blockflow_env.ARGV_KEY_PRELOAD
SOURCE = Path(__file__).with_name("argv_key.c")


def _cache_dir() -> Path:
    """BlockFlow's cache directory (as ``install.user_cache``) and its ``argv-key`` directory, both made
    private to this user: nobody else may swap a library that is preloaded into the server."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blockflow"
    for d in (base, base / "argv-key"):
        d.mkdir(parents=True, exist_ok=True)
        if d.stat().st_uid == os.geteuid():
            d.chmod(0o700)  # whatever the umask made it
        if not _private(d):
            raise EnvironmentProblem(f"{d} is not private to this user; BlockFlow will not preload a library from it")
    return base / "argv-key"


def _private(path: Path) -> bool:
    """Owned by this user and writable by nobody else: what may be preloaded into the server."""
    st = path.lstat()
    return not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


@functools.cache
def shim() -> Path | None:
    """The compiled library (built on first use), or None where no C compiler is found."""
    source = SOURCE.read_bytes()
    try:
        cache = _cache_dir()
    except OSError as exc:  # no writable home (a read-only root without /tmp): as without a compiler
        log.warning("cannot make BlockFlow's cache for the argv-key library (%s): tritonserver gets its admin key on its "
                    "command line, which other local users can read in /proc", exc)
        return None
    # The machine in the name: a cache shared between machines (an NFS home) never offers another's build.
    lib = cache / f"{hashlib.sha256(source).hexdigest()[:16]}-{platform.machine()}.so"
    if lib.exists():
        if not _private(lib):
            raise EnvironmentProblem(f"{lib} is not private to this user; remove it (BlockFlow builds it again)")
        return lib
    if any(c.isspace() or c == ":" for c in str(lib)):  # LD_PRELOAD splits at both
        log.warning("BlockFlow's cache path %s holds a space or a colon, which LD_PRELOAD cannot carry: tritonserver gets "
                    "its admin key on its command line, which other local users can read in /proc", cache)
        return None
    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)), None)
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC) to build %s: tritonserver gets its admin key on its command "
                    "line, which other local users can read in /proc; install one, or mount /proc with hidepid=2", SOURCE.name)
        return None
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        res = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE)], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise EnvironmentProblem(f"{cc} could not build {SOURCE}: {(res.stderr or res.stdout).strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, lib)  # atomic: a server starting beside this one never sees half a library
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib


def server_env(env: dict[str, str], lib: Path, key_file: Path | None) -> dict[str, str]:
    """``env`` with the library preloaded and the key file named (None: a random key nobody has)."""
    out = dict(env)
    theirs = out.get("LD_PRELOAD", "")
    out["LD_PRELOAD"] = f"{lib}:{theirs}" if theirs else str(lib)
    out[PRELOAD_VAR] = theirs  # given back to the server's own children
    if key_file is not None:
        out[KEY_FILE_VAR] = str(key_file.resolve())
    else:
        out.pop(KEY_FILE_VAR, None)
    return out
