"""What ``blockflow serve`` runs after start-up: it keeps the server serving its current plan.

Every ``period_s`` (a quarter second) :meth:`Supervisor.check`:

- brings back a ``tritonserver`` that died (a crash, a kill): the server's watchdog has
  already killed its block processes; the supervisor starts a new server on the same ports
  and runtime directory, from the repository on disk, which the applier keeps in step with
  the plan being served. A server that served and died is always brought back: at once the
  first time, then after a back-off that doubles from ``backoff_s`` up to ``max_backoff_s``
  while it keeps dying, and starts afresh once a server has stayed up ``stable_s``. Whatever
  kills it (a client's request included) can keep it restarting, but never ends ``serve``.
  Meanwhile ``/health/ready`` answers 503. Only a server that cannot start at all,
  ``max_failed_starts`` times in a row (a broken install, a port taken by another program,
  a model that no longer loads), ends it with :class:`~blockflow.core.errors.ServerError`:
  that needs a person, and the orchestrator learns it from the exit status.
- reloads a block whose process died (Triton's Python backend does not restart it; its
  requests fail until the model is loaded again).

Both wait while a plan is being applied (they share the applier's lock): a block being
swapped is not a dead one, and a restart must not race a load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from blockflow.control.service import Controller
from blockflow.core.errors import ModelReloadError, ServerError
from blockflow.triton.server import TritonServer

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, server: TritonServer, controller: Controller, lock: threading.Lock, start_timeout: float = 900.0,
                 load_timeout: float = 300.0, backoff_s: float = 1.0, max_backoff_s: float = 60.0, stable_s: float = 300.0,
                 max_failed_starts: int = 3, say: Callable[[str], None] | None = None) -> None:
        self.server = server
        self.controller = controller
        self.lock = lock
        self.start_timeout = start_timeout
        self.load_timeout = load_timeout
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.max_failed_starts = max_failed_starts
        self.say = say or log.warning
        self.restarts = 0  # servers started after the first
        self._delay = 0.0  # the back-off before the next start
        self._up_since = time.monotonic()  # when the server now serving started serving
        self._next_start: float | None = None  # when a dead server is started again
        self._failed_starts = 0  # in a row
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
        name = self.controller.plan.raw.name if self.controller.plan is not None else "?"
        if self._next_start is None:  # just found dead
            self._delay = 0.0 if now - self._up_since >= self.stable_s else min(self.max_backoff_s, max(self.backoff_s, 2 * self._delay))
            self._next_start = now + self._delay
            self.say(f"tritonserver exited (code {code}); restarting it with plan {name!r}"
                     + (f" in {self._delay:g} s (it died again within {self.stable_s:g} s of its start)" if self._delay else ""))
        if now < self._next_start:
            return
        self.server.stop()  # reaps what is left of the old one (processes, shared memory)
        t0 = time.monotonic()
        try:
            self.server.start(self.start_timeout)
        except ServerError as exc:
            self._failed_starts += 1
            self.controller.metrics.failed_starts.inc()
            if self._failed_starts >= self.max_failed_starts:
                raise ServerError(f"tritonserver could not start {self._failed_starts} times in a row; giving up: {exc}") from exc
            self._delay = min(self.max_backoff_s, max(self.backoff_s, 2 * self._delay))
            self._next_start = time.monotonic() + self._delay
            self.say(f"tritonserver did not start ({self._failed_starts} of {self.max_failed_starts} tries); "
                     f"trying again in {self._delay:g} s: {exc}")
            return
        self.restarts += 1
        self.controller.metrics.restarts.inc()
        self._failed_starts = 0
        self._next_start = None
        self._up_since = time.monotonic()
        self.say(f"tritonserver serves plan {name!r} again after {self._up_since - t0:.1f} s (restart {self.restarts})")

    def _heal(self) -> None:
        now = time.monotonic()
        expected = {m: n for m, n in self.controller.expected.items() if now - self._heal_failures.get(m, -1e9) > 10.0}
        try:
            for model in self.server.heal(expected, timeout=self.load_timeout):
                self._heal_failures.pop(model, None)
                self.controller.metrics.block_reloads.inc()
                self.say(f"block {model}: a process died; reloaded it")
        except ModelReloadError as exc:  # keeps serving the other blocks; tried again in 10 s
            self._heal_failures[exc.model] = now
            self.say(str(exc))
