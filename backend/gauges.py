"""A gauge on Triton's metrics endpoint that never holds the GIL while it talks to the server.

python_backend's ``Metric.set`` (``metric.cc``, ``SendSetValueRequest``; r24.10 and main) waits
for the server's reply while holding the GIL, where ``increment`` and ``observe`` let it go. If
the server dies meanwhile, the reply never comes and every Python thread of the block process
stops with it: the server watch (:mod:`blockflow.backend.server_watch`) could then never run,
and the block outlived its server (seen on an H100, in 6 of 12 runs of the killed-server test).
So a gauge moves by the difference from what it last sent, with ``increment``, which Triton
accepts for gauges in both directions.
"""

from __future__ import annotations

from typing import Any


class Gauge:
    """``set`` through ``increment`` (see the module's docstring); an unchanged value sends nothing."""

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self.sent = 0.0  # a new metric reads 0

    def set(self, value: float) -> None:
        delta = float(value) - self.sent
        if delta:
            self.metric.increment(delta)
            self.sent += delta
