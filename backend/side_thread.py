"""A block's second thread: it queues the block's GPU work while the block's own thread sends its early reply.

``InferenceResponseSender.send`` holds the calling thread for the whole round trip through the
server (python_backend r24.10 ``ResponseSender::Send``: it drops the GIL and waits until the
server has sent the response and the ensemble has scheduled the next step). A call of one request
that answers early (``replies.EarlyReply``) would otherwise queue its copies and its CUDA graph only
after that round trip, and the next block, which waits for this one's commit, may then wait for
them: the first block's copy of a host image to the GPU alone takes longer than the round trip.
With this thread the work and the send overlap; the block commits once both are done, on its own
thread, so a send that fails still leaves an uncommitted slot to abort.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from queue import SimpleQueue

import torch

# How long closing waits for a task still running (a CUDA call that hangs must not hang the unload).
CLOSE_S = 5.0


class SideThread:
    """One daemon thread that runs one task at a time for its block: :meth:`start`, then :meth:`wait`."""

    def __init__(self, name: str, device: torch.device) -> None:
        self._tasks: SimpleQueue[Callable[[], object] | None] = SimpleQueue()
        self._done: SimpleQueue[BaseException | None] = SimpleQueue()
        # The CUDA device and torch stream are per thread: this one uses the block's own, so its
        # graph replays and copies go where the block's commit (recorded on that stream) orders them.
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._running = False
        self._thread = threading.Thread(target=self._loop, args=(device, stream), name=name, daemon=True)
        self._thread.start()

    def _loop(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            torch.cuda.set_device(device)  # also makes the device's context current for driver calls
            torch.cuda.set_stream(stream)
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except BaseException as exc:  # handed to the block's thread, which fails the call with it
                self._done.put(exc)
            else:
                self._done.put(None)

    def start(self, task: Callable[[], object]) -> None:
        """Run ``task`` on this thread; :meth:`wait` must follow before the next start."""
        if self._running:
            raise RuntimeError("side thread: start() before the last task was waited for")
        self._running = True
        self._tasks.put(task)

    def wait(self) -> None:
        """Wait for the task; raises what it raised."""
        if not self._running:
            return
        exc = self._done.get()
        self._running = False
        if exc is not None:
            raise exc

    def close(self) -> None:
        """Stop the thread once its task (if any) is done."""
        self._tasks.put(None)
        self._thread.join(CLOSE_S)
