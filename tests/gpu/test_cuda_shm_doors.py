"""On an NVIDIA GPU: CUDA shared memory through the shared-memory key. A TensorMQ pool's CUDA IPC handle, as its
producer hands it to a consumer, is refused to a client without the key over HTTP and gRPC; perf_analyzer's
``--shared-memory cuda`` and ``system`` register their regions with the key and measure (the figures are printed);
the server and its blocks stay the same processes and the task equals its unsplit reference throughout."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import zmq
from tritonclient.utils import InferenceServerException

from blockflow.backend.tensormq.wire import HELLO, WELCOME
from blockflow.bench.perf_analyzer import perf_analyzer
from blockflow.clients.client import TaskClient
from blockflow.core import endpoints, env
from blockflow.triton.server import TritonServer

from .small_plan import plan_text, served

pytestmark = pytest.mark.gpu
PLAN = plan_text("gpu-doors", "doors", ('d0', 'd1'), seed=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with served(tmp_path_factory.mktemp("doors"), PLAN) as s:
        yield s


def _processes(s: TritonServer) -> tuple[int, dict[str, list[int]]]:
    assert s.process is not None and s.process.poll() is None
    return s.process.pid, {m: sorted(p) for m, p in s.stub_processes().items()}


def _exact(s: TritonServer) -> None:
    with TaskClient(s.http_url) as c:
        x = np.random.default_rng(2).standard_normal((3, 3, 64, 64), dtype=np.float32)
        got, want = c.infer("doors", x), c.infer("doors__ref_graph", x)
        assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-2  # fp16 rounding between processes


def _pool_handles(s: TritonServer) -> list[dict[str, object]]:
    """Each TensorMQ producer's pool segment as it hands it to a consumer (HELLO -> WELCOME): kind, CUDA IPC handle..."""
    ctx = zmq.Context.instance()
    found = []
    for sock in sorted((s.runtime_dir / env.TMQ_DIR).glob("*.sock")):
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"ipc://{sock}")
        try:
            dealer.send_multipart([HELLO])
            assert dealer.poll(5000), f"no WELCOME from {sock}"
            kind, body = dealer.recv_multipart()[:2]
        finally:
            dealer.close(0)
        assert kind == WELCOME
        found.append(json.loads(body)["segment"])
    return found


def test_a_tensormq_pools_cuda_handle_is_refused_without_the_key(server: TritonServer) -> None:
    _exact(server)  # the producers are up and their pools in use
    before = _processes(server)
    pools = [p for p in _pool_handles(server) if p["kind"] == "cuda"]
    assert pools, "no CUDA pool"
    h, g = th.InferenceServerClient(server.http_url), tg.InferenceServerClient(server.grpc_url)
    registered = 0
    for pool in pools:
        raw = base64.b64encode(bytes.fromhex(str(pool["handle"]))).decode()  # as both of tritonclient's clients take it
        device, nbytes = int(str(pool["device"])), int(str(pool["nbytes"]))
        for http_headers, grpc_headers in ((None, None), (endpoints.shm_headers("wrong"), endpoints.shm_headers("wrong", "grpc"))):
            for call in (partial(h.register_cuda_shared_memory, "pool", raw, device, nbytes, headers=http_headers),
                         partial(g.register_cuda_shared_memory, "pool", raw, device, nbytes, headers=grpc_headers)):
                try:
                    call()
                    registered += 1
                except InferenceServerException as exc:
                    assert "restricted" in str(exc), exc
    print(f"TensorMQ CUDA pools offered: {len(pools)}, registered without the key: {registered}")
    assert registered == 0
    key = server.shm_key_file.read_text().strip()
    assert h.get_cuda_shared_memory_status(headers=endpoints.shm_headers(key)) == []
    assert _processes(server) == before
    _exact(server)


@pytest.mark.parametrize("memory", ["cuda-shm", "system-shm"])
def test_perf_analyzer_registers_its_regions_with_the_key(server: TritonServer, memory: str) -> None:
    before = _processes(server)
    figures = {}
    for model in ("doors", "doors__ref_graph"):
        for concurrency in (1, 8):
            r = perf_analyzer(server.http_url, model, "IMAGE:3,64,64", 1, 2.0, concurrency, input_memory=memory,
                              output_bytes=400, shm_key_file=Path(server.shm_key_file))
            assert "error" not in r and r["throughput"] > 0, r
            figures[f"{model} c{concurrency}"] = (round(r["p50_ms"], 3), round(r["throughput"], 1))
    print(f"perf_analyzer --shared-memory {memory.removesuffix('-shm')} (p50 ms, infer/s):", figures)
    key = server.shm_key_file.read_text().strip()
    assert th.InferenceServerClient(server.http_url).get_cuda_shared_memory_status(headers=endpoints.shm_headers(key)) == []
    assert _processes(server) == before
    _exact(server)
