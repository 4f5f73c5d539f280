"""The processes of one ``tritonserver``: its process group, its Python-backend stubs, and how it is stopped.

The server runs in a session of its own, so its process group holds it and every stub it
started: ending the group ends them all, and an empty group is the proof that nothing is left.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from blockflow.core.errors import TritonApiError
from blockflow.core.procfs import processes, stat_fields
from blockflow.triton.api import TritonApi


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: stop() and the signal handlers still clean up


# Looked up here, in the parent: a child between fork and exec must not dlopen (another thread may have held the loader's lock).
_PRCTL = _prctl()


def die_with_parent() -> None:
    """In the child before exec: SIGTERM it if whoever started it dies (even by SIGKILL)."""
    PR_SET_PDEATHSIG = 1
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_child(cmd: list[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None, check: bool = False,
              capture_output: bool = False, stdout: int | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` (text mode) for a tool's child (a load generator, a measuring process, a bench):
    the child gets SIGTERM when this process ends, however it ends. Its own children are its to end
    (``blockflow bench`` stops its server on SIGTERM; a server's stubs die with it)."""
    return subprocess.run(cmd, env=env, timeout=timeout, check=check, capture_output=capture_output, stdout=stdout,
                          text=True, preexec_fn=die_with_parent)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _group(pgid: int) -> Iterable[tuple[int, list[str]]]:
    """Each process in group ``pgid``, zombies included, with its :func:`stat_fields`."""
    return ((pid, fields) for pid, fields in processes() if len(fields) > 2 and int(fields[2]) == pgid)


def _dead(pid: int, fields: list[str]) -> bool:
    """Whether a process has exited with every thread: a zombie leader whose other threads are
    still exiting (a stub's CUDA teardown can take seconds) is alive, and cannot be reaped yet."""
    if fields[0] not in "ZX":
        return False
    try:
        threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if t.name != str(pid)]
    except OSError:
        return True
    for thread in threads:
        try:
            if stat_fields(pid, thread)[0] not in "ZX":
                return False
        except OSError:
            continue  # that thread is gone
    return True


def group_members(pgid: int) -> Iterable[int]:
    """Live PIDs still in process group ``pgid`` (not zombies with all threads gone): what stopping must leave empty."""
    return (pid for pid, fields in _group(pgid) if not _dead(pid, fields))


def reap_orphans(pgid: int) -> list[int]:
    """Reap the dead members of group ``pgid`` that were handed to this process; their PIDs.

    A stub whose server died is re-parented to the PID namespace's init. Where that is this
    process (``blockflow serve`` as a container's PID 1) nobody else would ever reap it, and each
    server restart would leave one zombie per block instance. Elsewhere they go to the real init
    and this finds none. The group's leader, ``tritonserver``, is left to the ``Popen`` that
    started it, so no caller loses its exit status.
    """
    me, reaped = os.getpid(), []
    for pid, fields in list(_group(pgid)):
        if pid != pgid and int(fields[1]) == me and _dead(pid, fields):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped.append(pid)
            except ChildProcessError:  # reaped meanwhile (by another thread)
                pass
    return reaped


def reap_adopted(name: str, timeout: float, environ: str = "") -> list[int]:
    """Reap this process's children whose command name (``/proc/<pid>/comm``, 15 characters) starts
    with ``name``; wait at most ``timeout`` s for those still running whose environment holds
    ``environ`` (``KEY=value``) to exit. Their PIDs.

    For a daemon that forked away from its starter (``nvidia-cuda-mps-control -d``): it is re-parented
    to the PID namespace's init, and where that is this process (``blockflow serve`` as a container's
    PID 1) nobody else would reap it. Elsewhere it is not this process's child and this returns at once.
    """
    me, reaped = os.getpid(), []
    deadline = time.monotonic() + timeout
    while True:
        waiting = False
        for pid, fields in processes():
            if int(fields[1]) != me:
                continue
            try:
                if not Path(f"/proc/{pid}/comm").read_text().startswith(name[:15]):
                    continue
                if os.waitpid(pid, os.WNOHANG)[0]:
                    reaped.append(pid)
                elif environ.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    waiting = True  # ours, still quitting
            except OSError:  # gone, or reaped by another thread meanwhile (ChildProcessError)
                continue
        if not waiting or time.monotonic() >= deadline:
            return reaped
        time.sleep(0.05)


def stub_model(pid: int) -> str | None:
    """The model a Python-backend stub process serves; None for another process or one gone."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    # The stub is started as: triton_python_backend_stub <repo>/<model>/<version>/model.py ...
    if len(cmd) > 1 and cmd[0].endswith(b"triton_python_backend_stub"):
        return Path(cmd[1].decode()).parent.parent.name
    return None


def stubs_by_model(pgid: int) -> dict[str, list[int]]:
    """Model name -> PIDs of the live Python-backend stubs in process group ``pgid``."""
    out: dict[str, list[int]] = {}
    for pid in group_members(pgid):
        if (model := stub_model(pid)) is not None:
            out.setdefault(model, []).append(pid)
    return out


def drain_then_terminate(proc: subprocess.Popen[bytes], api: TritonApi, grace: float) -> bool:
    """SIGTERM the server, then unload every model through gRPC; True once all are unloaded.

    After SIGTERM Triton takes no new HTTP connections but waits, up to its exit timeout, for
    the open ones to close, idle keep-alive ones included, before it even starts to unload;
    its gRPC endpoint still answers meanwhile. Unloading the ensembles first, then the rest,
    lets requests in flight finish and every block process run its finalize, so the server
    can then be stopped without waiting out clients that merely stay connected.
    """
    try:
        ready = [m.name for m in api.index() if m.state == "READY"]
        ensembles = api.ensembles(ready)
    except TritonApiError:
        ready, ensembles = [], set()
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        for group in (ensembles, set(ready) - ensembles):
            for m in group:
                api.unload(m)
            while any(m.name in group and m.state in ("READY", "UNLOADING") for m in api.index()):
                if time.monotonic() > deadline or proc.poll() is not None:
                    return False
                time.sleep(0.05)
    except TritonApiError:
        return False  # gone, or stopping on its own: wait for it as before
    return True

