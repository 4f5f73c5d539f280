"""TensorMQ counters on Triton's metrics endpoint, through the Python backend's custom metrics.

Each metric update is a round trip to the server process, so values are
published at most every ``period_s`` from the execute thread (they are at most
that old), never per request.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from blockflow.backend.gauges import Gauge
from blockflow.backend.tensormq.consumer import Consumer
from blockflow.backend.tensormq.producer import Producer

GAUGES = {
    "blockflow_tmq_pool_bytes_in_use": "Bytes of the block instance's TensorMQ pool lent to consumers",
    "blockflow_tmq_pool_slots_in_use": "Slots of the block instance's TensorMQ pool lent to consumers",
}
COUNTERS = {
    "blockflow_tmq_tickets_issued_total": "TensorMQ tickets this instance issued (one per sample)",
    "blockflow_tmq_releases_total": "Samples released back to this instance's pool by consumers",
    "blockflow_tmq_lease_expiries_total": "Pool slots reclaimed because their lease expired (cancelled or lost requests)",
    "blockflow_tmq_pool_full_failures_total": "Requests failed because the pool stayed full for the whole wait",
    "blockflow_tmq_handle_opens_total": "CUDA IPC / shared-memory handles this instance opened as a consumer",
    "blockflow_tmq_tickets_consumed_total": "TensorMQ tickets this instance read as a consumer",
    "blockflow_tmq_bad_tickets_total": "Requests refused for a malformed, forged or stale ticket",
    "blockflow_tmq_refused_tickets_total": "Authentic tickets refused as replayed, redirected, reused or expired",
    "blockflow_tmq_unclaimed_tickets_total": "Samples reclaimed because no consumer claimed their ticket in time",
}


class TmqMetrics:
    def __init__(self, pb_utils: Any, labels: dict[str, str], period_s: float = 0.5) -> None:
        fam = pb_utils.MetricFamily
        # The families must outlive their metrics (the backend refuses updates otherwise): keep them.
        self._families = {n: fam(name=n, description=d, kind=fam.GAUGE) for n, d in GAUGES.items()}
        self._families.update({n: fam(name=n, description=d, kind=fam.COUNTER) for n, d in COUNTERS.items()})
        self._gauges = {n: Gauge(self._families[n].Metric(labels=labels)) for n in GAUGES}
        self._counters = {n: self._families[n].Metric(labels=labels) for n in COUNTERS}
        self._sent = dict.fromkeys(COUNTERS, 0)
        self._period = period_s
        self._last = 0.0
        self._lock = threading.Lock()  # the execute thread and the block monitor both publish

    def publish(self, producer: Producer | None, consumer: Consumer | None, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self._period:
            return
        with self._lock:
            self._last = now
            self._publish(producer, consumer)

    def _publish(self, producer: Producer | None, consumer: Consumer | None) -> None:
        values: dict[str, int] = {}
        if producer is not None:
            used, slots = producer.usage()
            self._gauges["blockflow_tmq_pool_bytes_in_use"].set(used)
            self._gauges["blockflow_tmq_pool_slots_in_use"].set(slots)
            s = producer.stats
            values.update({"blockflow_tmq_tickets_issued_total": s.tickets, "blockflow_tmq_releases_total": s.releases,
                           "blockflow_tmq_lease_expiries_total": s.lease_expiries,
                           "blockflow_tmq_pool_full_failures_total": s.pool_failures,
                           "blockflow_tmq_unclaimed_tickets_total": s.unclaimed_tickets})
        if consumer is not None:
            c = consumer.stats
            values.update({"blockflow_tmq_handle_opens_total": c.handle_opens, "blockflow_tmq_tickets_consumed_total": c.tickets,
                           "blockflow_tmq_bad_tickets_total": c.bad_tickets,
                           "blockflow_tmq_refused_tickets_total": c.refused_tickets})
        for name, value in values.items():
            delta = value - self._sent[name]
            if delta > 0:
                self._counters[name].increment(delta)
                self._sent[name] = value
