"""What a running server is doing, per task and per block: `blockflow status`.

Built only from what Triton exposes without the admin key (through
:class:`~blockflow.triton.api.TritonApi`): model configs, the statistics extension (``/v2/models/stats``: cumulative counts and times) and the
metrics endpoint (``nv_inference_request_summary_us`` quantiles, ``nv_gpu_utilization``
where Triton exports GPU metrics, and the block monitor's ``blockflow_block_*`` gauges,
joined on ``model`` and ``gpu_uuid``). Rates and per-request times are deltas between
two snapshots.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from blockflow.core.errors import TritonApiError, Unreachable
from blockflow.triton.api import TritonApi


@dataclass
class Snapshot:
    at: float
    ready: dict[str, bool]  # model -> READY
    ensembles: set[str]
    instances: dict[str, int]  # python model -> instances in its config
    stats: dict[str, dict[str, Any]]  # model -> inference_stats
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)  # metric -> [(labels, value)]

    def metric(self, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
        return [(lab, v) for lab, v in self.samples.get(name, []) if all(lab.get(k) == x for k, x in match.items())]


def _url(url: str) -> str:
    return url if url.startswith("http") else f"http://{url}"


def snapshot(api: TritonApi, metrics_url: str, client: httpx.Client) -> Snapshot:
    """One reading of the server: Triton's statistics and configs through ``api``, the metrics through ``client``."""
    try:
        # The statistics list every loaded model; the repository index would need the admin key.
        stats = {name: m.get("inference_stats", {}) for name, m in api.statistics().items()}
        ready = dict.fromkeys(stats, True)
        ensembles, instances = set(), {}
        for name in ready:
            cfg = api.config(name)
            if cfg.get("platform") == "ensemble":
                ensembles.add(name)
            else:
                instances[name] = sum(int(g.get("count", 1)) for g in cfg.get("instance_group", []))
    except (TritonApiError, httpx.HTTPError, ValueError, KeyError) as exc:
        raise Unreachable(f"cannot read Triton's statistics at {api.url}: {exc}") from None
    try:
        r = client.get(_url(metrics_url))
        r.raise_for_status()
        text = r.text
    except httpx.HTTPError as exc:
        raise Unreachable(f"cannot read Triton's metrics at {metrics_url}: {exc}") from None
    samples = metric_samples(text, ("blockflow_", "nv_inference_request_summary_us", "nv_gpu_utilization"))
    return Snapshot(time.monotonic(), ready, ensembles, instances, stats, samples)


def metric_samples(text: str, prefixes: tuple[str, ...]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of a metrics endpoint's text (Prometheus' format) whose names start with one of ``prefixes``:
    name -> [(labels, value)]."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(prefixes):
                samples[s.name].append((dict(s.labels), float(s.value)))
    return dict(samples)


def _count(stats: dict[str, Any], key: str) -> tuple[int, int]:
    d = stats.get(key, {})
    return int(d.get("count", 0)), int(d.get("ns", 0))


def _delta(a: Snapshot, b: Snapshot, model: str, key: str) -> tuple[int, int]:
    c0, n0 = _count(a.stats.get(model, {}), key)
    c1, n1 = _count(b.stats.get(model, {}), key)
    return max(0, c1 - c0), max(0, n1 - n0)


def _ms_each(ns: int, n: int) -> float | None:
    """Milliseconds per count from a statistic's nanoseconds and count over an interval; None with no counts."""
    return ns / n / 1e6 if n else None


def _quantile(s: Snapshot, model: str, q: str) -> float | None:
    hits = [v for lab, v in s.metric("nv_inference_request_summary_us", model=model, quantile=q) if v == v]  # drop NaN
    return hits[0] / 1000.0 if hits else None


def task_rows(a: Snapshot, b: Snapshot) -> list[dict[str, Any]]:
    dt = max(b.at - a.at, 1e-9)
    rows = []
    for model in sorted(b.ensembles | {m for m in a.ensembles if m in b.ready}):
        n, ns = _delta(a, b, model, "success")
        failed, _ = _delta(a, b, model, "fail")
        # mean_ms from Triton's statistics, always there; p50/p99 only with its latency summaries on.
        rows.append({"task": model, "ready": b.ready.get(model, False), "rate": n / dt, "failed": failed,
                     "mean_ms": _ms_each(ns, n),
                     "p50_ms": _quantile(b, model, "0.5"), "p99_ms": _quantile(b, model, "0.99")})
    return rows


def device_name(gpu_uuid: str | None) -> str:
    """How `status` names a device: ``cpu``, or a GPU's UUID cut to its first group (as ``nvidia-smi -L`` starts it)."""
    return "-".join(gpu_uuid.split("-")[:2]) if gpu_uuid else "cpu"


def _counted(a: Snapshot, b: Snapshot, name: str, model: str) -> float | None:
    """How much the counter ``name`` of ``model``'s instances grew between the snapshots; None where it has none."""
    after = b.metric(name, model=model)
    return max(0.0, sum(v for _, v in after) - sum(v for _, v in a.metric(name, model=model))) if after else None


def block_rows(a: Snapshot, b: Snapshot) -> list[dict[str, Any]]:
    """One row per block model. A chain's link answers no requests: its ``rate`` is the samples handed to it a
    second (``blockflow_tmq_link_samples_total``), and ``link_batch`` the samples in each of its batches."""
    dt = max(b.at - a.at, 1e-9)
    rows = []
    for model in sorted(b.instances):
        n, queue_ns = _delta(a, b, model, "queue")
        linked, batches = (_counted(a, b, f"blockflow_tmq_link_{k}_total", model) for k in ("samples", "batches"))
        _, compute_ns = _delta(a, b, model, "compute_infer")
        monitored = b.metric("blockflow_block_monitor_samples_total", model=model)
        gpus = sorted({lab.get("gpu_uuid", "") for lab, _ in monitored})
        gpu_mem = sum(v for _, v in b.metric("blockflow_block_gpu_memory_bytes", model=model))
        rss = sum(v for _, v in b.metric("blockflow_block_rss_bytes", model=model))
        # Utilisation is the device's (Triton's nv_gpu_utilization, 0-1), joined on the instances' GPUs.
        util = [v for g in gpus if g for _, v in b.metric("nv_gpu_utilization", gpu_uuid=g)]
        cpu = sum(v for _, v in b.metric("blockflow_block_cpu_utilization_ratio", model=model))
        rows.append({
            "block": model, "ready": b.ready.get(model, False), "instances": b.instances[model],
            "device": ",".join(device_name(g) for g in gpus) or "-",
            "gpu_mem_mib": gpu_mem / 2**20 if gpu_mem else None, "rss_mib": rss / 2**20 if rss else None,
            "gpu_util": max(util) if util else None, "cpu_util": cpu,
            "rate": n / dt if linked is None else linked / dt,
            "queue_ms": _ms_each(queue_ns, n), "compute_ms": _ms_each(compute_ns, n),
            "link": linked is not None, "link_batch": linked / batches if linked is not None and batches else None,
        })
    return rows
