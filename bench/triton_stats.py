"""Triton's per-model statistics as a benchmark reads them: cumulative counts and times, the change
between two reads, and what it comes to per execution and per block of an ensemble; and the blocks' own
TensorMQ counters from the metrics endpoint, for what Triton's statistics cannot see (a chain's links)."""

from __future__ import annotations

from typing import Any

import httpx

from blockflow.control.status import metric_samples
from blockflow.triton.api import TritonApi

# Counters (per block instance, summed per model): a chain's links' batches and samples, and the batches
# that found a producer's pool full and waited (backend/tensormq/metrics.py).
TMQ_COUNTERS = {"blockflow_tmq_link_batches_total": "link_batches", "blockflow_tmq_link_samples_total": "link_samples",
                "blockflow_tmq_pool_waits_total": "pool_waits", "blockflow_tmq_chain_answered_total": "chain_answered",
                "blockflow_tmq_chain_failed_total": "chain_failed", "blockflow_tmq_chain_answers_lost_total": "chain_answers_lost"}

PHASES = ("compute_input", "compute_infer", "compute_output")  # Triton's: before the backend's model runs, the run, after it


def model_stats(url: str) -> dict[str, dict[str, int]]:
    """Cumulative counts and times of every loaded model of the server at ``url`` (HTTP)."""
    out = {}
    for name, m in TritonApi(http_url=url, timeout=30).statistics().items():
        s = m["inference_stats"]
        out[name] = {"executions": int(m["execution_count"]), "inferences": int(m["inference_count"]),
                          "requests": int(s["success"]["count"]),
                          **{f"{k}_ns": int(s[k]["ns"]) for k in ("queue", "compute_input", "compute_infer", "compute_output")},
                          # Each execution once (inference_stats count a batch once per request in it).
                          "execution_ns": sum(int(b[k]["ns"]) for b in m.get("batch_stats", []) for k in PHASES),
                          **{f"execution_{k}_{u}": sum(int(b[k][f]) for b in m.get("batch_stats", []))
                             for k in PHASES for u, f in (("ns", "ns"), ("n", "count"))}}
    return out


def tmq_counters(metrics_url: str) -> dict[str, dict[str, int]]:
    """:data:`TMQ_COUNTERS` per model from the metrics endpoint; empty where it cannot be read. The blocks publish
    them once a second, so a reading is up to a second old."""
    try:
        r = httpx.get(metrics_url, timeout=10)
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    return counters_of(r.text)


def counters_of(text: str) -> dict[str, dict[str, int]]:
    """:data:`TMQ_COUNTERS` per model in a metrics endpoint's text (Prometheus' format)."""
    out: dict[str, dict[str, int]] = {}
    for name, samples in metric_samples(text, tuple(TMQ_COUNTERS)).items():
        for labels, value in samples:
            if name in TMQ_COUNTERS and "model" in labels:
                m = out.setdefault(labels["model"], {})
                m[TMQ_COUNTERS[name]] = m.get(TMQ_COUNTERS[name], 0) + int(value)
    return out


def delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {m: {k: v - before.get(m, {}).get(k, 0) for k, v in s.items()} for m, s in after.items()}


def phases_per_execution(d: dict[str, int]) -> dict[str, float]:
    """Samples per execution, queue ms per request and each compute phase in ms per execution (from
    ``batch_stats``, which count each execution once), from a :func:`delta` of :func:`model_stats`."""
    execs, infers = max(1, d["executions"]), max(1, d["inferences"])
    out = {"executions": float(d["executions"]), "samples_per_execution": d["inferences"] / execs,
           "queue_ms_per_request": d["queue_ns"] / infers / 1e6}
    for k in PHASES:
        out[f"{k}_ms"] = d[f"execution_{k}_ns"] / max(1, d[f"execution_{k}_n"]) / 1e6
    return out


def compute_ms(s: dict[str, int]) -> float:
    """Triton's compute time (input + infer + output) per execution, from a statistics delta.

    Triton adds a batch's compute time once for every request in it, so the sum is divided by
    requests, not executions (which overstated it by the batch size under load).
    """
    total = s.get("compute_input_ns", 0) + s.get("compute_infer_ns", 0) + s.get("compute_output_ns", 0)
    return total / max(1, s.get("requests", s.get("executions", 0))) / 1e6


def block_breakdown(d: dict[str, dict[str, int]], blocks: list[str], batch: int,
                    counters: dict[str, dict[str, int]] | None = None) -> list[dict[str, Any]]:
    """Per block of a task: compute per execution, queue time per request, batch formed (Triton's statistics);
    with ``counters`` (a :func:`delta` of :func:`tmq_counters`), a link's samples per batch and each block's pool waits."""
    out = []
    for b in blocks:
        s = d.get(b, {})
        row: dict[str, Any] = {"block": b, "compute_ms": compute_ms(s),
                               "queue_ms": s.get("queue_ns", 0) / max(1, s.get("inferences", 0)) * batch / 1e6,
                               "batch_per_execution": s.get("inferences", 0) / max(1, s.get("executions", 0))}
        c = {k: max(0, v) for k, v in (counters or {}).get(b, {}).items()}  # an instance restarted meanwhile counts from 0
        if c.get("link_batches", 0) > 0:
            row["link_samples_per_batch"] = c["link_samples"] / c["link_batches"]
        if "pool_waits" in c:
            row["pool_waits"] = c["pool_waits"]
        out.append(row)
    return out
