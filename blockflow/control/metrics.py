"""``blockflow serve``'s own metrics, in Prometheus' text format on the control service's ``GET /metrics``.

Triton's metrics port says how requests fare; these say what ``serve`` did to keep it serving, which was only
in its log: servers started again after one died, starts that failed, blocks reloaded after their process
died, plan changes and rollbacks with their result, and the plan being served (an info metric whose labels
are its name and digest). A private registry: nothing of the process's default collectors.

The endpoint wants the control service's token like every other (Prometheus: ``authorization:
{credentials_file: ...}`` in the scrape config).
"""

from __future__ import annotations

import hashlib

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

RESULTS = ("ok", "failed")


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.restarts = Counter("blockflow_tritonserver_restarts", "tritonserver started again after it died", registry=r)
        self.failed_starts = Counter("blockflow_tritonserver_failed_starts", "starts of tritonserver that failed", registry=r)
        self.block_reloads = Counter("blockflow_block_reloads", "blocks reloaded after a process of theirs died", registry=r)
        self.applies = Counter("blockflow_plan_applies", "plan changes applied (POST /plan, blockflow apply), by result",
                               ["result"], registry=r)
        self.rollbacks = Counter("blockflow_plan_rollbacks", "rollbacks to an earlier plan (POST /plan/rollback), by result",
                                 ["result"], registry=r)
        self.plan = Gauge("blockflow_plan_info", "the plan being served: 1 for its name and the digest of its text",
                          ["name", "digest"], registry=r)
        for result in RESULTS:  # every series there from the start, at 0
            self.applies.labels(result)
            self.rollbacks.labels(result)

    def serving(self, name: str, text: str) -> None:
        """Record the plan now served (``text`` as recorded in the plan history)."""
        self.plan.clear()
        self.plan.labels(name, hashlib.sha256(text.encode()).hexdigest()[:16]).set(1)

    def text(self) -> bytes:
        return generate_latest(self.registry)
