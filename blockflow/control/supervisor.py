"""What ``blockflow serve`` runs after start-up: it keeps the server serving its current plan.

Every ``period_s`` (a quarter second) :meth:`Supervisor.check`:

- brings back a ``tritonserver`` that died (a crash, a kill): the server's watchdog has
  already killed its block processes; the supervisor starts a new server on the same ports
  and runtime directory, from the repository on disk, which the applier keeps in step with
  the plan being served. At most ``max_restarts`` restarts in ``restart_window_s``; past
  that it gives up with :class:`~blockflow.core.errors.ServerError` (a server that cannot stay
  up needs a person).
- reloads a block whose process died (Triton's Python backend does not restart it; its
  requests fail until the model is loaded again).

Both wait while a plan is being applied (they share the applier's lock): a block being
swapped is not a dead one, and a restart must not race a load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from blockflow.control.service import Controller
from blockflow.core.errors import ModelReloadError, ServerError
from blockflow.triton.server import TritonServer

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, server: TritonServer, controller: Controller, lock: threading.Lock, start_timeout: float = 900.0,
                 load_timeout: float = 300.0, max_restarts: int = 5, restart_window_s: float = 300.0,
                 say: Callable[[str], None] | None = None) -> None:
        self.server = server
        self.controller = controller
        self.lock = lock
        self.start_timeout = start_timeout
        self.load_timeout = load_timeout
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.say = say or log.warning
        self.restarts: deque[float] = deque()
        self._heal_failures: dict[str, float] = {}  # model -> when a reload last failed (retried after a pause)

    def run(self, stop: threading.Event, period_s: float = 0.25) -> None:
        """Check until ``stop`` is set."""
        while not stop.is_set():
            self.check()
            stop.wait(period_s)

    def check(self) -> None:
        if not self.lock.acquire(blocking=False):
            return  # a plan change is in progress
        try:
            proc = self.server.process
            if proc is None or proc.poll() is not None:
                self._restart(None if proc is None else proc.returncode)
            else:
                self._heal()
        finally:
            self.lock.release()

    def _restart(self, code: int | None) -> None:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.restart_window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            raise ServerError(f"tritonserver died {len(self.restarts) + 1} times within {self.restart_window_s:g} s; "
                              f"giving up (log: {self.server.log_path}):\n{self.server.log_tail(20)}")
        self.restarts.append(now)
        plan = self.controller.plan
        name = plan.raw.name if plan is not None else "?"
        self.say(f"tritonserver exited (code {code}); restarting it with plan {name!r} "
                 f"({len(self.restarts)} of at most {self.max_restarts} restarts in {self.restart_window_s:g} s)")
        self.server.stop()  # reaps what is left of the old one (processes, shared memory)
        t0 = time.monotonic()
        self.server.start(self.start_timeout)
        self.say(f"tritonserver serves plan {name!r} again after {time.monotonic() - t0:.1f} s")

    def _heal(self) -> None:
        now = time.monotonic()
        expected = {m: n for m, n in self.controller.expected.items() if now - self._heal_failures.get(m, -1e9) > 10.0}
        try:
            for model in self.server.heal(expected, timeout=self.load_timeout):
                self._heal_failures.pop(model, None)
                self.say(f"block {model}: a process died; reloaded it")
        except ModelReloadError as exc:  # keeps serving the other blocks; tried again in 10 s
            self._heal_failures[exc.model] = now
            self.say(str(exc))
