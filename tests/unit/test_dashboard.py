"""The Grafana dashboard only queries metrics that BlockFlow or Triton export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from blockflow.backend import monitor
from blockflow.backend.tensormq import metrics as tmq

DASHBOARD = Path(__file__).resolve().parents[2] / "monitoring" / "grafana" / "blockflow.json"
TRITON = {"nv_inference_request_success", "nv_inference_request_failure", "nv_inference_request_summary_us", "nv_inference_request_duration_us",
          "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
          "nv_gpu_utilization", "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}


def test_dashboard_queries_known_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ours = set(monitor.GAUGES) | set(monitor.GPU_GAUGES) | set(monitor.COUNTERS) | set(tmq.GAUGES) | set(tmq.COUNTERS)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    assert len(exprs) >= 10
    for expr in exprs:
        names = set(re.findall(r"\b((?:blockflow|nv)_[a-z0-9_]+)\b", expr))
        assert names, expr
        unknown = names - ours - TRITON
        assert not unknown, f"{unknown} in {expr!r}"
        # Triton's label names only: blocks are `model`, GPUs `gpu_uuid` (no label_replace needed to join).
        assert not re.search(r"\b(block|gpu|label_replace)\b", expr.replace("$block", "")), expr
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
