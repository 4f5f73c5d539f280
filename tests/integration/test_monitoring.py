"""The block monitor's metrics on a real server's metrics endpoint, and `blockflow status`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockflow.clients.client import TaskClient
from blockflow.ensemble_gen import generator
from blockflow.plan import Plan
from blockflow.triton.options import free_port

from ..conftest import ROOT, Served

pytestmark = pytest.mark.integration

BLOCKFLOW = [sys.executable, "-m", "blockflow"]  # also where the package is not installed (GPU machine)
DASHBOARD = ROOT / "monitoring" / "grafana" / "blockflow.json"
TASK = "cls_a"
PATH = ["r50_s0", "r50_s1", "r50_s2", "r50_s3a"]


def _on_gpu() -> bool:
    """Whether blocks of placement `auto` run on a GPU (then their series carry `gpu_uuid`)."""
    import torch

    return torch.cuda.is_available()


def _python_models(served: Served) -> set[str]:
    return {name for name, files in _models(served).items() if b'backend: "python"' in files["config.pbtxt"]}


def _ensembles(served: Served) -> set[str]:
    return {name for name, files in _models(served).items() if b'platform: "ensemble"' in files["config.pbtxt"]}


def _models(served: Served) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for plan in served.plans.values():
        assert isinstance(plan, Plan)
        out.update(generator.by_model(generator.render(plan)))
    return out


def _metrics(served: Served) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("blockflow_block_"):
                out[s.name].append((dict(s.labels), float(s.value)))
    return out


def _value(m: dict[str, list[tuple[dict[str, str], float]]], name: str, block: str) -> float:
    hits = [v for lab, v in m[name] if lab["model"] == block]
    assert hits, f"{name} has no sample for block {block}"
    return sum(hits)


def _load(served: Served, seconds: float) -> int:
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    done = [0]
    stop = time.monotonic() + seconds

    def run() -> None:
        client = TaskClient(served.http)
        while time.monotonic() < stop:
            client.infer(TASK, x)
            done[0] += 1

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0]


def test_every_block_instance_reports_labelled_metrics(served: Served) -> None:
    time.sleep(2.5)  # at least one monitor period (2 s by default) after start-up
    m = _metrics(served)
    python_models = _python_models(served)
    for name in ("blockflow_block_rss_bytes", "blockflow_block_cpu_utilization_ratio", "blockflow_block_cpu_seconds_total",
                 "blockflow_block_monitor_samples_total"):
        labelled = {lab["model"] for lab, _ in m[name]}
        assert python_models <= labelled, f"{name} is missing for {sorted(python_models - labelled)}"
        for lab, value in m[name]:
            # Triton's own label names: `model` and `model_instance` as on nv_inference_*, `gpu_uuid` as on nv_gpu_*.
            assert set(lab) == ({"model", "model_instance", "gpu_uuid"} if _on_gpu() else {"model", "model_instance"}), lab
            assert lab["model_instance"].startswith(lab["model"]) and lab.get("gpu_uuid", "GPU-").startswith("GPU-")
            assert value >= 0
    assert _value(m, "blockflow_block_rss_bytes", "r50_s0") > 100 * 2**20  # torch and a ResNet stage
    # Gauges move by increments (backend/gauges.py): each still reads its last sample, not a running sum.
    rss = sum(psutil.Process(pid).memory_info().rss for pid in served.server.stub_processes()["r50_s0"])
    assert 0.8 * rss < _value(m, "blockflow_block_rss_bytes", "r50_s0") < 1.25 * rss
    assert all(value <= (os.cpu_count() or 1) for _, value in m["blockflow_block_cpu_utilization_ratio"])
    # The TensorMQ pool gauges carry the same labels.
    text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    pool = [ln for ln in text.splitlines() if ln.startswith('blockflow_tmq_pool_slots_in_use{')]
    assert any('model="r50_s0"' in ln and 'model_instance="r50_s0_0_0"' in ln for ln in pool), pool
    gpu_families = ("blockflow_block_gpu_memory_bytes", "blockflow_block_torch_reserved_bytes", "blockflow_block_torch_allocated_bytes")
    if _on_gpu():  # on a GPU the monitor also reads torch's allocator
        # (blockflow_block_gpu_memory_bytes needs NVML to list this PID, which a container may hide)
        assert _value(m, "blockflow_block_torch_reserved_bytes", "r50_s0") > 0
    else:  # no GPU families at all on CPU instances (no fake zeros)
        assert not any(f"# TYPE {name} " in text for name in gpu_families)
    # Device-level values are Triton's (nv_gpu_*), not repeated per block.
    assert "blockflow_block_gpu_utilization" not in text and "blockflow_block_gpu_power" not in text


def test_metrics_move_under_load(served: Served) -> None:
    before = _metrics(served)
    n = _load(served, 6.0)
    time.sleep(2.5)
    after = _metrics(served)
    assert n > 0
    for block in PATH:
        assert _value(after, "blockflow_block_monitor_samples_total", block) >= _value(before, "blockflow_block_monitor_samples_total", block) + 2
        cpu = _value(after, "blockflow_block_cpu_seconds_total", block) - _value(before, "blockflow_block_cpu_seconds_total", block)
        assert cpu > 0.05, f"{block} used {cpu:.3f} CPU s while serving {n} requests"
    idle = _value(after, "blockflow_block_cpu_seconds_total", "r34_body") - _value(before, "blockflow_block_cpu_seconds_total", "r34_body")
    assert idle < 1.0  # a block nobody calls stays (nearly) idle


def test_status_command_shows_tasks_and_blocks_under_load(served: Served) -> None:
    host, port = served.server.options.host, served.server.options.metrics_port
    result: dict[str, object] = {}

    def status() -> None:
        time.sleep(1.0)
        res = subprocess.run([*BLOCKFLOW, "status", "--url", served.http, "--metrics-url", f"http://{host}:{port}/metrics",
                              "--interval", "3", "--json"], capture_output=True, text=True, timeout=120)
        result["rc"], result["out"], result["err"] = res.returncode, res.stdout, res.stderr

    t = threading.Thread(target=status)
    t.start()
    _load(served, 6.0)
    t.join()
    assert result["rc"] == 0, result["err"]
    data = json.loads(str(result["out"]))
    tasks = {r["task"]: r for r in data["tasks"]}
    blocks = {r["block"]: r for r in data["blocks"]}
    assert tasks[TASK]["ready"] and tasks[TASK]["rate"] > 0 and tasks[TASK]["failed"] == 0
    assert tasks[TASK]["p50_ms"] is not None and tasks[TASK]["p99_ms"] >= tasks[TASK]["p50_ms"]
    assert tasks[TASK]["mean_ms"] > 0
    for b in PATH:
        row = blocks[b]
        assert row["ready"] and row["instances"] >= 1
        assert row["device"].startswith("GPU-") if _on_gpu() else row["device"] == "cpu", row["device"]
        assert row["rss_mib"] > 100 and row["rate"] > 0 and row["compute_ms"] > 0 and row["queue_ms"] is not None
    # The table form runs too (what a person reads).
    res = subprocess.run([*BLOCKFLOW, "status", "--url", served.http, "--metrics-url", f"http://{host}:{port}/metrics",
                          "--interval", "0.5"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "tasks" in res.stdout and "r50_s0" in res.stdout, res.stderr


def _tool(name: str) -> str:
    """A Prometheus binary from the venv (scripts/setup.sh puts Debian's there) or the PATH; required under CI."""
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: scripts/setup.sh installs Debian's prometheus package into the venv")
        pytest.skip(f"{name} is not installed (scripts/setup.sh installs it)")
    return found


def test_the_scrape_passes_promtool(served: Served) -> None:
    text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read()
    ours = b"".join(ln for ln in text.splitlines(keepends=True)
                    if ln.startswith((b"blockflow_", b"# HELP blockflow_", b"# TYPE blockflow_")))
    assert b"blockflow_block_rss_bytes" in ours and b"blockflow_tmq_" in ours
    # BlockFlow's families lint clean (names, units, help, types, duplicates): exit 0, nothing printed.
    res = subprocess.run([_tool("promtool"), "check", "metrics"], input=ours, capture_output=True, timeout=60)
    assert res.returncode == 0, (res.stdout + res.stderr).decode()
    # The whole scrape parses (exit 1 would be a parse error); the lint problems left (exit 3) are
    # Triton's own names (nv_inference_request_success without _total, ..._us units), none of ours.
    res = subprocess.run([_tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert res.returncode in (0, 3), (res.stdout + res.stderr).decode()
    problems = (res.stdout + res.stderr).decode().splitlines()
    assert all(ln.startswith("nv_") for ln in problems), problems


class _Prometheus:
    """A real Prometheus scraping the session server every second (loopback only, its own storage)."""

    def __init__(self, target: str, base: Path) -> None:
        self.port = free_port()
        config = base / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "blockflow", "static_configs": [{"targets": [target]}]}]}))
        self.log = (base / "prometheus.log").open("wb")
        self.proc = subprocess.Popen([_tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={base / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"Prometheus refused {expr!r}: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def wait(self, expr: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
            try:
                result = self.query(expr)
            except (urllib.error.URLError, ConnectionError):
                result = []
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def prometheus(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Prometheus]:
    opts = served.server.options
    prom = _Prometheus(f"{opts.host}:{opts.metrics_port}", tmp_path_factory.mktemp("prometheus"))
    try:
        assert prom.wait('up{job="blockflow"} == 1'), "Prometheus never scraped the server"
        yield prom
    finally:
        prom.close()


def test_prometheus_joins_block_and_triton_series_by_label(served: Served, prometheus: _Prometheus) -> None:
    # Requests after Prometheus' first scrape: every Python model of the default plan's tasks answers at least once.
    with TaskClient(served.http) as client:
        for task in ("cls_a", "cls_b", "det_c", "full_d"):
            client.infer(task, np.zeros((1, 3, 224, 224), np.float32))
    # A scrape after those requests (the counters rose between two samples) makes everything below current.
    assert prometheus.wait('count(rate(nv_inference_request_success{model="full_d"}[1m]) > 0)'), "no scrape with the requests"
    rss = prometheus.query("blockflow_block_rss_bytes")
    assert rss
    for series in rss:
        labels = series["metric"]
        # No clash with Prometheus' target label: `instance` is the scrape target, nothing was renamed exported_*.
        assert not any(k.startswith("exported_") for k in labels), labels
        assert labels["instance"] == f"{served.server.options.host}:{served.server.options.metrics_port}"
        assert {"model", "model_instance", "job"} <= set(labels)
    # The join itself: host CPU seconds per successful request of each block, one series per Python model.
    joined = prometheus.query("sum by (model) (blockflow_block_cpu_seconds_total)"
                              " / on (model) sum by (model) (nv_inference_request_success)")
    assert {str(r["metric"]["model"]) for r in joined} == _python_models(served)
    used = {str(r["metric"]["model"]): float(r["value"][1]) for r in joined}
    assert 0 < used["r50_full_d"] < float("inf")
    if _on_gpu():  # Triton's nv_gpu_* carry gpu_uuid as the block monitor writes it
        share = prometheus.wait("sum by (gpu_uuid) (blockflow_block_torch_reserved_bytes) / on (gpu_uuid) nv_gpu_memory_used_bytes", 5)
        if prometheus.query("nv_gpu_memory_used_bytes"):
            assert share and all(0 < float(r["value"][1]) <= 1 for r in share), share


def _instantiate(expr: str) -> str:
    """A dashboard expression as Grafana sends it with every variable at All."""
    return expr.replace('"$task"', '".+"').replace('"$block"', '".+"').replace("$__rate_interval", "30s")


def test_the_dashboard_queries_run_on_prometheus(served: Served, prometheus: _Prometheus) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert prometheus.wait("count(rate(nv_inference_request_success[30s]))"), "fewer than two scrapes"  # rate() needs two
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    # The task variable lists exactly the ensembles; the block variable every monitored Python model.
    task_query = variables["task"]["definition"]
    assert task_query.startswith("query_result(") and task_query.endswith(")")
    rows = prometheus.wait(task_query[len("query_result("):-1])
    pattern = re.compile(variables["task"]["regex"].strip("/"))
    labels = {pattern.search("{" + ",".join(f'{k}="{v}"' for k, v in r["metric"].items()) + "}") for r in rows}
    assert {m.group(1) for m in labels if m} == _ensembles(served)
    assert variables["block"]["definition"] == "label_values(blockflow_block_monitor_samples_total, model)"
    assert {str(r["metric"]["model"]) for r in prometheus.query("blockflow_block_monitor_samples_total")} == _python_models(served)
    empty = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            if not prometheus.query(_instantiate(target["expr"])) and not panel["title"].startswith("GPUs"):
                empty.append(panel["title"])
    # Every query parses and runs; all but the GPU panels (nv_gpu_* exist only where Triton reads a GPU) have data.
    if not _on_gpu():
        empty = [t for t in empty if t != "Blocks: GPU memory per process (NVML)" and not t.startswith("Blocks: torch")]
    assert not empty, f"panels without data: {empty}"
