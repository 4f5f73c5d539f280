"""A server's runtime directory (layout in :mod:`blockflow.core.env`): found or made, private to its user.

``blockflow serve`` makes one per ``tritonserver`` and names it in ``BLOCKFLOW_RUNTIME_DIR``. A
``tritonserver`` started by hand on a generated repository has no such variable; its block
processes then share ``<$XDG_RUNTIME_DIR or the temp dir>/blockflow-<uid>-<repository digest>``,
which the first of them makes. Whoever finds the directory first, each process checks it before
trusting it: a directory (not a link), owned by this user, closed to everyone else. A
world-writable temp dir lets another user create that path first; the check turns that into a
clear refusal instead of a key the other user can read.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from blockflow.core import env
from blockflow.core.errors import EnvironmentProblem

TEMP_SUFFIX = ".tmp"  # of the files write_private_file renames into place
KEY_BYTES = 32
# A TensorMQ socket is <runtime>/tmq/<16 hex>-<8 hex>.sock, and a Unix socket's path holds at most 107 bytes.
MAX_CHARS = 107 - len("/tmq/0123456789abcdef-01234567.sock")


def default_for(repository: Path) -> Path:
    """The runtime directory of a hand-started server serving ``repository`` (one per user and repository)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    digest = hashlib.sha256(str(repository.resolve()).encode()).hexdigest()[:12]
    return Path(base) / f"blockflow-{os.geteuid()}-{digest}"


def locate(repository: Path | None) -> Path:
    """``$BLOCKFLOW_RUNTIME_DIR``, else the default for ``repository`` (made if absent); checked private."""
    named = os.environ.get(env.RUNTIME_DIR)
    if named:
        path = Path(named)
    elif repository is not None:
        path = default_for(repository)
    else:
        raise EnvironmentProblem(f"no runtime directory: set {env.RUNTIME_DIR} to a directory only this user can open")
    return private_dir(path, create=not named)


def private_dir(path: Path, create: bool = True, what: str = "runtime directory", setting: str = env.RUNTIME_DIR) -> Path:
    """``path``, made 0700 if ``create`` and absent; refused unless it is this user's own closed directory.

    ``what`` and ``setting`` name the directory and the variable that moves it, in the errors.
    """
    if create:
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made by another block process of the same server, or left from an earlier one: checked below
        except OSError as exc:
            raise EnvironmentProblem(f"cannot create {what} {path}: {exc.strerror}; "
                                     f"set {setting} to a writable place") from None
    try:
        st = path.lstat()
    except OSError as exc:
        raise EnvironmentProblem(f"{what} {path} is missing: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise EnvironmentProblem(f"{what} {path} is not a directory (a link or a file); remove it or set {setting}")
    if st.st_uid != os.geteuid():
        raise EnvironmentProblem(f"{what} {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}); "
                                 f"set {setting} to a place of your own")
    if st.st_mode & 0o077:
        raise EnvironmentProblem(f"{what} {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); "
                                 f"chmod 700 it")
    return path


def temp_path(path: Path) -> Path:
    """A new name for :func:`write_private_file` to write ``path`` under before renaming it:
    ``.<name>.<pid>.<8 hex>.tmp`` beside it (unique to the writer, also between threads of one process)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def write_private_file(path: Path, write: Callable[[IO[bytes]], object], group: int | None = None) -> None:
    """Replace ``path`` whole with what ``write`` writes into the file it is given, readable by this user only
    (and, with ``group``, read-only by that group's members: 0640).

    The bytes go to a new 0600 file beside it (:func:`temp_path`, ``O_EXCL``, never through a link), flushed
    to the disk and renamed over ``path``: a reader sees the old file or the new one, never a part (also after
    a power loss), and never a mode wider than asked (an existing file's mode would survive an in-place
    rewrite). The temporary file is removed whatever happens.
    """
    tmp = temp_path(path)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
            if group is not None:
                os.fchown(f.fileno(), -1, group)
                os.fchmod(f.fileno(), 0o640)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_private(path: Path, text: str, group: int | None = None) -> None:
    """Replace ``path`` whole with ``text`` (and a newline), as :func:`write_private_file` does."""
    write_private_file(path, lambda f: f.write(text.encode() + b"\n"), group)


def open_own(path: Path, what: str, closed: int = stat.S_IWGRP | stat.S_IWOTH) -> IO[bytes]:
    """``path`` opened for reading, never through a link, if it is a regular file of this user's with none of the
    mode bits ``closed`` (by default: no one else may write it).

    Raises ``OSError`` if it cannot be opened, ``EnvironmentProblem`` (naming it as ``what``) if it is not such a file.
    """
    f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & closed:
        f.close()
        raise EnvironmentProblem(f"{what} {path} must be a regular file of this user with mode {0o666 & ~closed:o} or "
                                 f"narrower (it has mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}); remove it")
    return f


def ensure_tensormq(runtime_dir: Path) -> None:
    """The TensorMQ socket directory and ticket-signing key of one server, made if absent (both private).

    Several block processes start at once: the key is written to a file of its own and linked into
    place, so exactly one key wins and nobody reads a half-written one.
    """
    if len(os.fsencode(runtime_dir)) > MAX_CHARS:
        raise EnvironmentProblem(f"runtime directory {runtime_dir} is too long for TensorMQ's Unix sockets (at most {MAX_CHARS} "
                                 f"bytes); set {env.RUNTIME_DIR}, or XDG_RUNTIME_DIR, to a shorter path")
    private_dir(runtime_dir / env.TMQ_DIR)
    key = runtime_dir / env.TMQ_KEY_FILE
    if not key.exists():
        fd, tmp = tempfile.mkstemp(dir=runtime_dir, prefix=".tmq-key-")  # 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(KEY_BYTES))
            try:
                os.link(tmp, key)
            except FileExistsError:
                pass  # another process's key won
        finally:
            os.unlink(tmp)
    read_key(runtime_dir)  # checked by whoever made it


def read_key(runtime_dir: Path) -> bytes:
    """The TensorMQ ticket key, refused unless it is this user's own regular 0600 file of full length."""
    path = runtime_dir / env.TMQ_KEY_FILE
    try:
        f = open_own(path, "TensorMQ key", closed=0o077)
    except OSError as exc:
        raise EnvironmentProblem(f"TensorMQ key {path} cannot be opened ({exc.strerror}); it is made when the first "
                                 f"block starts (blockflow serve, or tritonserver on a generated repository)") from None
    with f:
        key = f.read()
    if len(key) < 16:
        raise EnvironmentProblem(f"TensorMQ key {path} is too short ({len(key)} bytes); remove it")
    return key
