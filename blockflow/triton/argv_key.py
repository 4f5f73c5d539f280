"""Keeps the keys off tritonserver's command line, and the library preloaded into it for that.

Triton takes its restricted APIs' keys only as arguments, and ``/proc/<pid>/cmdline`` is readable
by every local user: with the admin key, any of them could load a model into the server, which runs
its code as the server's user; with the shared-memory key, register regions. So BlockFlow passes
placeholders there (:data:`ADMIN_PLACEHOLDER`, :data:`SHM_PLACEHOLDER`) and preloads a small
library (``argv_key.c``, beside this module) that swaps the keys in inside the process before
Triton's ``main`` runs; each key travels in a 0600 file whose name is in the server's environment,
which only its user can read. The same library holds ``shm_guard.c`` (:mod:`blockflow.triton.shm_guard`):
what Triton's shared-memory API may open, and the mode of the regions the server creates.

The library is compiled once per user into BlockFlow's cache with the system's C compiler, or
ahead of time where there is none (the container image builds it in a stage of its own) and named
by ``BLOCKFLOW_ARGV_KEY_LIB``. Either way it carries the ID of the ``argv_key.c`` it was built from
(:func:`build_command`), and only a library built from the source this BlockFlow ships is preloaded.
Without one, :func:`library` lets the key go on the command line only where ``/proc`` hides other
users' processes (``hidepid``) or the operator says so (``BLOCKFLOW_ALLOW_KEY_ON_COMMAND_LINE=1``),
and refuses otherwise.
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

# These five are spelled again in argv_key.c (a test checks that they agree).
ADMIN_PLACEHOLDER = "@BLOCKFLOW_ADMIN_KEY@"
SHM_PLACEHOLDER = "@BLOCKFLOW_SHM_KEY@"
ADMIN_KEY_FILE_VAR = blockflow_env.ADMIN_KEY_FILE_VAR
SHM_KEY_FILE_VAR = blockflow_env.SHM_KEY_FILE_VAR
PRELOAD_VAR = blockflow_env.ARGV_KEY_PRELOAD
LIB_VAR = blockflow_env.ARGV_KEY_LIB
ALLOW_VAR = blockflow_env.ALLOW_KEY_ON_COMMAND_LINE
SOURCE = Path(__file__).with_name("argv_key.c")
# Every source the library is built from, in the order its ID hashes them.
SOURCES = (SOURCE, Path(__file__).with_name("shm_guard.c"))
ID_MARK = b"blockflow-argv-key-id:"  # argv_key.c's build_id, followed by source_id()


@functools.cache
def source_id() -> str:
    """The ID a library built from this BlockFlow's sources carries: the first 16 hex digits of their SHA-256,
    one after the other (``cat argv_key.c shm_guard.c | sha256sum | cut -c1-16``)."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]


def build_command(out: Path | str, cc: str = "cc") -> list[str]:
    """The compiler's command line that builds the library into ``out``, ID included."""
    return [cc, "-O2", "-shared", "-fPIC", f'-DARGV_KEY_ID="{source_id()}"', "-o", str(out), *map(str, SOURCES), "-ldl"]


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


def _preloadable(path: Path) -> bool:
    """Whether LD_PRELOAD can carry ``path``: it splits at spaces and colons."""
    return not any(c.isspace() or c == ":" for c in str(path))


def _private(path: Path) -> bool:
    """Owned by this user and writable by nobody else: what may be preloaded into the server."""
    st = path.lstat()
    return not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _unswappable(path: Path) -> str | None:
    """Why another user could replace ``path`` (resolved) or a directory above it, or None: each must be owned by
    root or this user, and writable by nobody else unless it is a directory with the sticky bit (``/tmp``)."""
    for p in (path, *path.parents):
        st = p.stat()
        if st.st_uid not in (0, os.geteuid()):
            return f"{p} belongs to uid {st.st_uid}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (p != path and st.st_mode & stat.S_ISVTX):
            return f"{p} is writable by other users"
    return None


def _prebuilt(named: str) -> Path:
    """The library ``BLOCKFLOW_ARGV_KEY_LIB`` names, once it is safe to preload and built from this BlockFlow's source."""
    try:
        lib = Path(named).resolve(strict=True)
    except OSError as exc:
        raise EnvironmentProblem(f"{LIB_VAR}={named}: {exc.strerror or exc}") from exc
    rebuild = f"build it with: {' '.join(build_command(lib))}"
    if not lib.is_file():
        raise EnvironmentProblem(f"{LIB_VAR}={named} is not a file; {rebuild}")
    if not _preloadable(lib):
        raise EnvironmentProblem(f"{LIB_VAR}={named}: LD_PRELOAD cannot carry a path with a space or a colon")
    why = _unswappable(lib)
    if why is not None:
        raise EnvironmentProblem(f"{LIB_VAR}={named}: {why}; BlockFlow preloads into tritonserver only a library "
                                 "that no other user can replace")
    data = lib.read_bytes()
    at = data.find(ID_MARK)
    found = data[at + len(ID_MARK):].split(b"\0", 1)[0][:64].decode("ascii", "replace") if at >= 0 else None
    if found != source_id():
        raise EnvironmentProblem(f"{LIB_VAR}={named} was built from other sources (ID {found or 'none'}) than this "
                                 f"BlockFlow's ({source_id()}); {rebuild}")
    return lib


@functools.cache
def find() -> Path | str:
    """The library to preload: ``BLOCKFLOW_ARGV_KEY_LIB``'s, else BlockFlow's build in this user's cache (made on
    first use); or, where there is none, why (no C compiler, no cache). Raises EnvironmentProblem for a library
    that is there but may not be preloaded."""
    named = os.environ.get(LIB_VAR)
    if named:
        return _prebuilt(named)
    try:
        cache = _cache_dir()
    except OSError as exc:  # no writable home (a read-only root without /tmp): as without a compiler
        return f"BlockFlow cannot make its cache for the argv-key library ({exc})"
    # The machine in the name: a cache shared between machines (an NFS home) never offers another's build.
    lib = cache / f"{source_id()}-{platform.machine()}.so"
    if lib.exists():
        if not _private(lib):
            raise EnvironmentProblem(f"{lib} is not private to this user; remove it (BlockFlow builds it again)")
        return lib
    if not _preloadable(lib):
        return f"BlockFlow's cache path {cache} holds a space or a colon, which LD_PRELOAD cannot carry"
    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)), None)
    if cc is None:
        return f"no C compiler (cc, gcc or $CC) to build {SOURCE.name}"
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(fd)
    try:
        res = subprocess.run(build_command(tmp, cc), capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise EnvironmentProblem(f"{cc} could not build {SOURCE}: {(res.stderr or res.stdout).strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, lib)  # atomic: a server starting beside this one never sees half a library
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib


def hides_other_users(mountinfo: str) -> bool:
    """Whether ``/proc``, as this mount table (``/proc/self/mountinfo``) has it, hides other users' processes:
    any ``hidepid`` but 0 (``off``) keeps their command lines from everyone but their owner and root. Of several
    mounts on ``/proc``, the last is the one processes see."""
    hidden = False
    for line in mountinfo.splitlines():
        mount, _, source = line.partition(" - ")
        fields, fs = mount.split(), source.split()
        if len(fields) > 4 and fields[4] == "/proc" and len(fs) > 2 and fs[0] == "proc":
            hidepid = next((o.split("=", 1)[1] for o in fs[2].split(",") if o.startswith("hidepid=")), "0")
            hidden = hidepid not in ("0", "off")
    return hidden


@functools.cache
def library() -> Path | None:
    """The library to preload into tritonserver, or None where its admin key may go on its command line:
    ``/proc`` hides other users' processes, or the operator accepts it (``BLOCKFLOW_ALLOW_KEY_ON_COMMAND_LINE=1``).
    Otherwise the key would be readable by every local user, who could then load code into the server:
    EnvironmentProblem, with the fixes."""
    found = find()
    if isinstance(found, Path):
        return found
    if os.environ.get(ALLOW_VAR) == "1":
        log.warning("%s: tritonserver gets its admin key on its command line, which other local users can read in "
                    "/proc (%s=1)", found, ALLOW_VAR)
        return None
    try:
        hidden = hides_other_users(Path("/proc/self/mountinfo").read_text())
    except OSError:
        hidden = False
    if hidden:
        log.info("%s: tritonserver gets its admin key on its command line, which /proc (hidepid) shows to this user "
                 "and root only", found)
        return None
    raise EnvironmentProblem(
        f"{found}, so tritonserver's admin key would be on its command line, which every local user can read in "
        "/proc/<pid>/cmdline (and with it load code into the server); fix: install a C compiler (cc), or name a "
        f"library built ahead of time in {LIB_VAR} (docs/deploy.md), or mount /proc with hidepid=2; on a machine "
        f"no other user can reach, {ALLOW_VAR}=1 accepts it")


def preload_env(env: dict[str, str], lib: Path, admin_key_file: Path | None,
               shm_key_file: Path | None = None) -> dict[str, str]:
    """``env`` with the library preloaded and the key files named (None: a random key nobody has)."""
    out = dict(env)
    theirs = out.get("LD_PRELOAD", "")
    out["LD_PRELOAD"] = f"{lib}:{theirs}" if theirs else str(lib)
    out[PRELOAD_VAR] = theirs  # given back to the server's own children
    for var, key_file in ((ADMIN_KEY_FILE_VAR, admin_key_file), (SHM_KEY_FILE_VAR, shm_key_file)):
        if key_file is not None:
            out[var] = str(key_file.resolve())
        else:
            out.pop(var, None)
    return out
