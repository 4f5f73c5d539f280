"""What ``/proc`` says of a process: read by the server's supervisor (``blockflow.triton.process_group``)
and by each block process about its server (``blockflow.backend.server_watch``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def stat_fields(pid: int, thread: int | None = None) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` (of one ``thread``: ``/proc/<pid>/task/<thread>/stat``) after the
    parenthesised command: state, ppid, pgrp, ... (``proc(5)`` numbers them from 3). Raises OSError when
    the process is gone."""
    path = Path(f"/proc/{pid}/stat") if thread is None else Path(f"/proc/{pid}/task/{thread}/stat")
    return path.read_text().rsplit(")", 1)[-1].split()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid``'s threads so far, not its children's (proc(5)'s
    ``utime`` and ``stime``). Raises OSError when the process is gone."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes() -> Iterator[tuple[int, list[str]]]:
    """Each process on the machine, zombies included, with its :func:`stat_fields` (one that ends
    while the walk reads it is left out)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            yield int(entry.name), stat_fields(int(entry.name))
        except OSError:
            continue


def exiting(pid: int) -> bool:
    """Whether ``pid`` has called exit: its thread-group leader is a zombie, or it is gone. Its last
    threads may still be in the GPU driver, which tears down a CUDA context at its own pace (on an
    H100, right after a GPU test session, over 20 s); ``process_group.group_members`` waits for those too."""
    try:
        return stat_fields(pid)[0] in "ZX"
    except OSError:
        return True


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of process ``pid``'s live threads, added up by the kernel's name of each
    (``comm``; its main thread as ``main``, since every thread of a process starts with its name).
    Empty when the process is gone."""
    out: dict[str, float] = {}
    try:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            comm = "main" if tid == pid else Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = stat_fields(pid, tid)
        except OSError:
            continue  # that thread ended meanwhile
        out[comm] = out.get(comm, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out
