"""TensorMQ inside a real tritonserver: leases, bad tickets and cancellations leave the pools empty."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import zmq

from blockflow.backend.tensormq.wire import STATS
from blockflow.clients.client import TaskClient

from ..conftest import Served

pytestmark = pytest.mark.integration
LEASE_S = 5.0  # tests/plans/r18_three_cuts.yaml


def pool_stats(runtime: Path) -> list[dict[str, int]]:
    """STATS of every TensorMQ producer of the server, over its real ZeroMQ endpoint."""
    out = []
    ctx = zmq.Context.instance()
    for sock_path in sorted((runtime / "tmq").glob("*.sock")):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{sock_path}")
        s.send_multipart([STATS])
        assert s.poll(5000), f"no STATS answer from {sock_path}"
        out.append(json.loads(s.recv_multipart()[1]))
        s.close(0)
    return out


def wait_until_pools_empty(runtime: Path, timeout: float) -> list[dict[str, int]]:
    deadline = time.monotonic() + timeout
    while True:
        stats = pool_stats(runtime)
        if all(s["slots_in_use"] == 0 for s in stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.25)


def stub_private_rss(model: str) -> int:
    """Resident memory of a block's stub that is not shared memory (its pool pages are, and are bounded by pool_mb)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "triton_python_backend_stub" in cmd and f"/{model}/" in cmd:
            mem = p.memory_info()
            return int(mem.rss - mem.shared)
    raise AssertionError(f"no stub process for {model}")


def image(batch: int = 1) -> np.ndarray:
    return np.random.default_rng(batch).standard_normal((batch, 3, 64, 64), dtype=np.float32)


def test_ten_thousand_unconsumed_tickets_are_reclaimed_and_memory_is_flat(served: Served) -> None:
    """Tickets from calling a producer block directly are never consumed: the claim window or the lease reclaims them all."""
    runtime = served.server.runtime_dir
    x = image()

    def flood(n: int) -> None:
        def one(_: int) -> None:
            c = th.InferenceServerClient(served.http)
            inp = th.InferInput("IMAGE", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            for _ in range(n // 4):
                out = c.infer("r18_a__tensormq", [inp]).as_numpy("ACTIVATION_OUT")
                assert out.shape == (1, 256) and out.dtype == np.uint8
            c.close()

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(4)))

    flood(2_000)
    assert wait_until_pools_empty(runtime, LEASE_S + 10)
    rss_before = stub_private_rss("r18_a__tensormq")
    flood(10_000)
    stats = wait_until_pools_empty(runtime, LEASE_S + 10)
    assert all(s["slots_in_use"] == 0 and s["bytes_in_use"] == 0 for s in stats), stats
    # Dynamic batching packs several requests into one slot: count tickets, not slots. Nobody claims
    # them, so most go back when their claim window closes, the rest when the lease ends.
    assert sum(s["expired_tickets"] + s["unclaimed_tickets"] for s in stats) >= 12_000
    growth = stub_private_rss("r18_a__tensormq") - rss_before
    assert growth < 32 * 2**20, f"producer stub's private memory grew by {growth / 2**20:.1f} MiB over 10,000 requests"


def test_cancelled_ensemble_requests_leave_pools_empty_and_results_exact(served: Served) -> None:
    runtime = served.server.runtime_dir
    c = tg.InferenceServerClient(served.grpc)
    x = image(2)
    inp = tg.InferInput("IMAGE", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    failures = 0
    for _ in range(300):
        try:
            c.infer("t18_one__tensormq", [inp], client_timeout=0.0005)
        except Exception:
            failures += 1
    assert failures > 0  # some deadlines did expire mid-flight
    stats = wait_until_pools_empty(runtime, LEASE_S + 10)
    assert all(s["slots_in_use"] == 0 for s in stats), stats
    with TaskClient(served.http) as tc:
        got, want = tc.infer("t18_one__tensormq", x), tc.infer("t18_one__ref", x)
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4


def test_forged_and_garbage_tickets_fail_alone(served: Served) -> None:
    c = th.InferenceServerClient(served.http)
    x = image()
    inp = th.InferInput("IMAGE", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    ticket = c.infer("r18_a__tensormq", [inp]).as_numpy("ACTIVATION_OUT")
    cases = {
        "garbage": np.random.default_rng(0).integers(0, 256, (1, 256), dtype=np.uint8),
        "zeros": np.zeros((1, 256), dtype=np.uint8),
        "flipped": ticket.copy(),
    }
    cases["flipped"][0, 60] ^= 0xFF
    for name, t in cases.items():
        bad = th.InferInput("ACTIVATION_IN", list(t.shape), "UINT8")
        bad.set_data_from_numpy(t)
        with pytest.raises(Exception, match="magic|signature") as info:
            c.infer("r18_b__tensormq", [bad])
        assert "Traceback" not in str(info.value), name
    # The genuine ticket still works after the bad ones, and the task still answers.
    good = th.InferInput("ACTIVATION_IN", list(ticket.shape), "UINT8")
    good.set_data_from_numpy(ticket)
    assert c.infer("r18_b__tensormq", [good]).as_numpy("ACTIVATION_OUT").shape == (1, 256)
    with TaskClient(served.http) as tc:
        assert tc.infer("t18_two__tensormq", x).shape == (1, 10)


def test_pool_counters_on_the_metrics_endpoint(served: Served) -> None:
    import urllib.request

    with TaskClient(served.http) as tc:
        for _ in range(10):
            tc.infer("t18_one__tensormq", image(2))
    lines: list[str] = []

    def value(name: str, model: str) -> float:
        hits = [float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(name + "{") and f'model="{model}"' in ln]
        assert hits, f"{name} for {model} missing from the metrics endpoint"
        return sum(hits)

    # Published every second from a thread of each block, never from execute: wait for a refresh.
    deadline = time.monotonic() + 10
    while True:
        text = urllib.request.urlopen(served.server.metrics_url, timeout=10).read().decode()
        lines = [ln for ln in text.splitlines() if ln.startswith("blockflow_tmq_")]
        issued = [ln for ln in lines if ln.startswith("blockflow_tmq_tickets_issued_total{") and 'model="r18_a__tensormq"' in ln]
        consumed = [ln for ln in lines if ln.startswith("blockflow_tmq_tickets_consumed_total{") and 'model="r18_b__tensormq"' in ln]
        if (issued and consumed and value("blockflow_tmq_tickets_issued_total", "r18_a__tensormq") >= 10
                and value("blockflow_tmq_tickets_consumed_total", "r18_b__tensormq") >= 10) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert value("blockflow_tmq_tickets_issued_total", "r18_a__tensormq") >= 10
    assert value("blockflow_tmq_tickets_consumed_total", "r18_b__tensormq") >= 10
    import torch

    # Opened once per producer a consumer hears from: one host segment on the CPU; one CUDA segment
    # and one event per slot (4096) on a GPU. With placement auto there is one instance per GPU,
    # so on n GPUs up to n*n (consumer, producer) pairs; opening per request would pass 10 of them.
    per_pair = 1 + 4096 if torch.cuda.is_available() else 1
    stubs = served.server.stub_processes()
    pairs = len(stubs["r18_a__tensormq"]) * len(stubs["r18_b__tensormq"])
    opens = value("blockflow_tmq_handle_opens_total", "r18_b__tensormq")
    assert opens % per_pair == 0 and 1 <= opens // per_pair <= pairs, (opens, per_pair, pairs)
    assert value("blockflow_tmq_pool_slots_in_use", "r18_b__tensormq") >= 0
    assert any('model_instance="' in ln for ln in lines)


def test_calls_of_one_sample_leave_the_next_slot_prepared_and_answer_exactly(served: Served) -> None:
    """After a call of batch 1, a producer block reserves and signs its next call's slot between
    calls (on its own thread, inside Triton's stub); the calls that take those slots answer as
    the reference does, and the prepared slots count as ready, never in use. A call of one request
    answers with its tickets before it queues its work (through the stub's response sender), and
    the next block still reads the committed data."""
    runtime = served.server.runtime_dir
    early = sum(s["early_tickets"] for s in pool_stats(runtime))
    x = image(1)
    with TaskClient(served.http) as tc:
        want = tc.infer("t18_one__ref", x)
        for _ in range(12):  # one at a time: every block's calls are of batch 1
            got = tc.infer("t18_one__tensormq", x)
            assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4
    stats = wait_until_pools_empty(runtime, LEASE_S + 10)
    assert all(s["slots_in_use"] == 0 for s in stats), stats
    assert sum(s["slots_ready"] for s in stats) >= 2, stats  # r18_a and r18_b, the task's two producers
    assert sum(s["early_tickets"] for s in stats) - early >= 24, stats  # both producers, every call
