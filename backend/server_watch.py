"""Ends a block process whose tritonserver is gone.

python_backend's stub watches its server with ``kill(pid, 0)`` every 300 ms (``pb_stub.cc``,
r24.10), which a zombie passes. A tritonserver killed by a signal (the OOM killer, SIGKILL) whose
own parent has not reaped it yet leaves its stubs running, each holding its GPU memory and shared
memory, for as long as nobody reaps it: a Python program that started the server and never polls
it, or a container's first process that reaps nothing. BlockFlow's own supervisor kills the stubs
itself (``blockflow.triton.server``); a server started by hand, or a supervisor that was killed
first, has nobody to do it.

The kernel gives a process's children a new parent the moment it exits, reaped or not, so a
change of ``getppid()`` says the server is gone; so does the server pid on the stub's command line
turning zombie or vanishing, should a launcher ever stand between the two. One daemon thread per
block process checks both every :data:`PERIOD_S`; when the server is gone it runs the process's
clean-ups (files only the block knows, such as its TensorMQ pool) and exits.

The thread needs the GIL, so no thread of a block may wait for the server while holding it:
python_backend's ``Metric.set`` did, and a server killed during one left its block for good
(``blockflow.backend.gauges``; docs/triton-notes.md).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from blockflow.core.procfs import exiting
from blockflow.core.threads import named_thread

PERIOD_S = 1.0
EXIT_CODE = 1
SHM_DIR = Path("/dev/shm")
STUB_NAME = "triton_python_backend_stub"


def stub_arguments(cmdline: bytes | None = None) -> tuple[int | None, str | None]:
    """The server's pid and this stub's shared-memory region, from the stub's command line
    (``stub MODEL_PATH SHM_REGION DEFAULT_SIZE GROWTH_SIZE PARENT_PID ...``, ``stub_launcher.cc``);
    ``(None, None)`` in a process that is not a stub."""
    if cmdline is None:
        try:
            cmdline = Path("/proc/self/cmdline").read_bytes()
        except OSError:
            return None, None
    argv = cmdline.split(b"\0")
    if len(argv) < 6 or not argv[0].endswith(STUB_NAME.encode()) or not argv[5].isdigit():
        return None, None
    region = argv[2].decode(errors="replace")
    return int(argv[5]), region if region and "/" not in region else None


class ServerWatch:
    """Exits this process, after its clean-ups, once its server has exited."""

    def __init__(self, name: str, period_s: float = PERIOD_S) -> None:
        self.name = name
        self.parent = os.getppid()
        server, self.region = stub_arguments()
        # The stub's own record of its server. Its parent is the server itself (python_backend execs the
        # stub from a shell); should a launcher ever stand between them, the parent still tells, and the
        # recorded server only says whether it was already gone when this block started.
        self.server = server if server is not None else self.parent
        self.period_s = period_s
        self._cleanups: list[Callable[[], object]] = []
        self._stop = threading.Event()
        self._thread = named_thread(self._run, "bf-server-watch")
        self._thread.start()

    def on_gone(self, cleanup: Callable[[], object]) -> None:
        """Run ``cleanup`` (best effort, without locks another thread may hold) before exiting."""
        self._cleanups.append(cleanup)

    def gone(self) -> bool:
        return os.getppid() != self.parent or (self.server != self.parent and exiting(self.server))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.gone():
                self._exit()
            self._stop.wait(self.period_s)

    def _exit(self) -> None:
        # Not through Triton's logger: it writes through the server, which is gone. The stub's
        # stderr is the server's log.
        print(f"blockflow: {self.name}: tritonserver (pid {self.server}) has exited; this block process "
              "cleans up and exits", file=sys.stderr, flush=True)
        for cleanup in self._cleanups:
            try:
                cleanup()
            except Exception as exc:  # the exit must happen whatever a clean-up does
                print(f"blockflow: {self.name}: clean-up failed: {exc!r}", file=sys.stderr, flush=True)
        if self.region is not None:  # this stub's own region of the server's shared memory; nobody else frees it
            (SHM_DIR / self.region).unlink(missing_ok=True)
        os._exit(EXIT_CODE)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.period_s)
