"""The block monitor's metrics on a real server's metrics endpoint, and `blockflow status`."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockflow.clients.client import TaskClient
from blockflow.ensemble_gen import generator

from ..conftest import Served

pytestmark = pytest.mark.integration

BLOCKFLOW = [sys.executable, "-m", "blockflow"]  # also where the package is not installed (GPU machine)
TASK = "cls_a"
PATH = ["r50_s0", "r50_s1", "r50_s2", "r50_s3a"]


def _device_label() -> str:
    """The `gpu` label blocks of placement `auto` get: GPU 0 where there is one, else "cpu"."""
    import torch

    return "0" if torch.cuda.is_available() else "cpu"


def _metrics(served: Served) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("blockflow_block_"):
                out[s.name].append((dict(s.labels), float(s.value)))
    return out


def _value(m: dict[str, list[tuple[dict[str, str], float]]], name: str, block: str) -> float:
    hits = [v for lab, v in m[name] if lab["block"] == block]
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
    python_models = {name for name, files in generator.by_model(generator.render(served.plans["default"])).items()
                     if b'backend: "python"' in files["config.pbtxt"]}
    for name in ("blockflow_block_rss_bytes", "blockflow_block_cpu_utilization_ratio", "blockflow_block_cpu_seconds_total",
                 "blockflow_block_monitor_samples_total"):
        labelled = {lab["block"] for lab, _ in m[name]}
        assert python_models <= labelled, f"{name} is missing for {sorted(python_models - labelled)}"
        for lab, value in m[name]:
            assert set(lab) == {"block", "instance", "gpu"}, lab
            assert lab["instance"].startswith(lab["block"]) and lab["gpu"] == _device_label()
            assert value >= 0
    assert _value(m, "blockflow_block_rss_bytes", "r50_s0") > 100 * 2**20  # torch and a ResNet stage
    # The TensorMQ pool gauges carry the same labels.
    text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
    assert f'blockflow_tmq_pool_slots_in_use{{block="r50_s0",gpu="{_device_label()}",instance="r50_s0_0_0"}}' in text
    if _device_label() != "cpu":  # on a GPU the monitor also reads NVML and torch's allocator
        # (blockflow_block_gpu_memory_bytes needs NVML to list this PID, which a container may hide)
        for name in ("blockflow_block_torch_reserved_bytes", "blockflow_block_gpu_power_watts",
                     "blockflow_block_gpu_sm_clock_hertz", "blockflow_block_gpu_temperature_celsius"):
            assert _value(m, name, "r50_s0") > 0, name


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
    for b in PATH:
        row = blocks[b]
        assert row["ready"] and row["instances"] >= 1 and row["device"] == ("gpu0" if _device_label() == "0" else "cpu")
        assert row["rss_mib"] > 100 and row["rate"] > 0 and row["compute_ms"] > 0 and row["queue_ms"] is not None
    # The table form runs too (what a person reads).
    res = subprocess.run([*BLOCKFLOW, "status", "--url", served.http, "--metrics-url", f"http://{host}:{port}/metrics",
                          "--interval", "0.5"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "tasks" in res.stdout and "r50_s0" in res.stdout, res.stderr
