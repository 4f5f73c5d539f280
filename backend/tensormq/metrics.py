"""TensorMQ counters on Triton's metrics endpoint, through the Python backend's custom metrics.

Each metric update is a round trip to the server process, so values are published
from a thread of their own every ``period_s`` (they are at most that old), never
from the execute thread.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from blockflow.backend.gauges import Gauge
from blockflow.backend.tensormq.consumer import Consumer
from blockflow.backend.tensormq.producer import Producer
from blockflow.core.threads import named_thread

PERIOD_S = 1.0
GAUGES = {
    "blockflow_tmq_pool_bytes_in_use": "Bytes of the block instance's TensorMQ pool lent to consumers",
    "blockflow_tmq_pool_slots_in_use": "Slots of the block instance's TensorMQ pool lent to consumers",
}
COUNTERS = {
    "blockflow_tmq_tickets_issued_total": "TensorMQ tickets this instance issued (one per sample)",
    "blockflow_tmq_releases_total": "Samples consumers released back to this instance's pool, counted when their slot is freed",
    "blockflow_tmq_lease_expiries_total": "Pool slots reclaimed because their lease expired (cancelled or lost requests)",
    "blockflow_tmq_pool_full_failures_total": "Requests failed because the pool stayed full for the whole wait",
    "blockflow_tmq_handle_opens_total": "CUDA IPC / shared-memory handles this instance opened as a consumer",
    "blockflow_tmq_tickets_consumed_total": "TensorMQ tickets this instance read as a consumer",
    "blockflow_tmq_bad_tickets_total": "Requests refused for a malformed, forged or stale ticket",
    "blockflow_tmq_refused_tickets_total": "Authentic tickets refused as replayed, redirected, reused or expired",
    "blockflow_tmq_unclaimed_tickets_total": "Samples reclaimed because no consumer claimed their ticket in time",
    "blockflow_tmq_early_tickets_total": "Tickets this instance handed on before committing their batch (calls of one request)",
    "blockflow_tmq_commit_waits_total": "Tickets that reached this instance before their batch's commit and waited for it",
    "blockflow_tmq_pool_waits_total": "Batches that found this instance's pool full and waited for a release",
}
# A chain's links only: their series say which blocks are links (``blockflow status``).
LINK_COUNTERS = {
    "blockflow_tmq_link_batches_total": "Batches this instance ran as a chain's link (hand_over: chain)",
    "blockflow_tmq_link_samples_total": "Samples in the batches this instance ran as a chain's link",
}


# A chain's head that its tail answers (chain_answers: head), and the tail.
ANSWER_COUNTERS = {
    "blockflow_tmq_chain_answered_total": "Requests this chain head answered with its tail's answers (chain_answers: head)",
    "blockflow_tmq_chain_failed_total": "Requests this chain head failed: a failure its chain handed back, or no answer in time",
    "blockflow_tmq_chain_expired_total": "Requests this chain head failed because its tail's answers did not come in time",
}
TAIL_COUNTERS = {
    "blockflow_tmq_chain_answers_lost_total": "Answers this chain's tail could not send: the head instance stopped, or its queue stayed full",
}


class LinkCounts(Protocol):
    """What a chain's link instance counts (``backend/link_loop.py``); ``answers_lost``: None unless it is the tail."""

    batches: int
    samples: int

    @property
    def answers_lost(self) -> int | None: ...


class AnswerCounts(Protocol):
    """What a chain's head that its tail answers counts (``backend/chain_answers.py``)."""

    answered: int
    failed: int
    expired: int


class TmqMetrics:
    """The TensorMQ series of one block instance, published every ``period_s`` on a daemon thread."""

    def __init__(self, pb_utils: Any, labels: dict[str, str], producer: Producer | None, consumer: Consumer | None,
                 period_s: float = PERIOD_S, link: LinkCounts | None = None, answers: AnswerCounts | None = None) -> None:
        fam = pb_utils.MetricFamily
        # The families must outlive their metrics (the backend refuses updates otherwise): keep them.
        self._families = {n: fam(name=n, description=d, kind=fam.GAUGE) for n, d in GAUGES.items()}
        counters = dict(COUNTERS)
        if link is not None:
            counters |= LINK_COUNTERS | (TAIL_COUNTERS if link.answers_lost is not None else {})
        if answers is not None:
            counters |= ANSWER_COUNTERS
        self._families.update({n: fam(name=n, description=d, kind=fam.COUNTER) for n, d in counters.items()})
        self._gauges = {n: Gauge(self._families[n].Metric(labels=labels)) for n in GAUGES}
        self._counters = {n: self._families[n].Metric(labels=labels) for n in counters}
        self._sent = dict.fromkeys(counters, 0)
        self.producer, self.consumer, self.link, self.answers = producer, consumer, link, answers
        self._lock = threading.Lock()  # the first publish runs on the initializing thread, the rest on the thread
        self._stop = threading.Event()
        self.publish()
        self._thread = named_thread(self._run, "tmq-metrics", (period_s,))
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self.publish()
            except Exception:
                pass  # a failed update loses one refresh, never the block

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def publish(self) -> None:
        with self._lock:
            self._publish(self.producer, self.consumer)

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
                           "blockflow_tmq_unclaimed_tickets_total": s.unclaimed_tickets,
                           "blockflow_tmq_early_tickets_total": s.early_tickets,
                           "blockflow_tmq_pool_waits_total": s.pool_waits})
        if consumer is not None:
            c = consumer.stats
            values.update({"blockflow_tmq_handle_opens_total": c.handle_opens, "blockflow_tmq_tickets_consumed_total": c.tickets,
                           "blockflow_tmq_bad_tickets_total": c.bad_tickets,
                           "blockflow_tmq_refused_tickets_total": c.refused_tickets,
                           "blockflow_tmq_commit_waits_total": c.commit_waits})
        if self.link is not None:
            values.update({"blockflow_tmq_link_batches_total": self.link.batches,
                           "blockflow_tmq_link_samples_total": self.link.samples})
            if (lost := self.link.answers_lost) is not None:
                values["blockflow_tmq_chain_answers_lost_total"] = lost
        if self.answers is not None:
            values.update({"blockflow_tmq_chain_answered_total": self.answers.answered,
                           "blockflow_tmq_chain_failed_total": self.answers.failed,
                           "blockflow_tmq_chain_expired_total": self.answers.expired})
        for name, value in values.items():
            delta = value - self._sent[name]
            if delta > 0:
                self._counters[name].increment(delta)
                self._sent[name] = value
