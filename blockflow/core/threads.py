"""Threads a block process starts, named for the host's tools as well as Python's: the kernel's name
of a thread (``/proc/<pid>/task/<tid>/comm``, 15 bytes) says which one uses the CPU, where every
thread of a stub is otherwise ``triton_python_b`` (``blockflow.bench.host_cpu`` adds them up by it)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

PR_SET_NAME = 15  # prctl(2)
COMM_BYTES = 15


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: the threads keep their process's name


_PRCTL = _prctl()


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 bytes) as the kernel's name, where the OS has one."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_NAME, ctypes.c_char_p(name.encode()[:COMM_BYTES]))


def named_thread(target: Callable[..., Any], name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon thread (not started) that runs ``target(*args)`` under ``name``, for Python and for the kernel."""
    def run() -> None:
        name_this_thread(name)
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)
