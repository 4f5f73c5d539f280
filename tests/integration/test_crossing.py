"""A plan that spans two servers (tests/plans/servers/cross.yaml), both real tritonservers on this
machine: a task whose path crosses from edge to cloud equals its unsplit model; when cloud stops,
only the crossing task fails, each request within cloud's timeout and saying why, while the task
that stays on edge keeps answering; when cloud is back, the crossing task answers again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from blockflow.backend.runtime import BlockRunner
from blockflow.bench.agreement import relative_error
from blockflow.clients.client import TaskClient
from blockflow.core.errors import ClientError
from blockflow.ensemble_gen import generator
from blockflow.plan import Plan, parse_plan
from blockflow.triton.options import ServerOptions
from blockflow.triton.server import TritonServer

pytestmark = pytest.mark.integration
PLAN = Path(__file__).resolve().parents[2] / "tests" / "plans" / "servers" / "cross.yaml"
TOL = 1e-5


@dataclass
class Servers:
    plan: Plan
    edge: TritonServer
    cloud_options: ServerOptions
    cloud: TritonServer

    def restart_cloud(self) -> None:
        self.cloud = TritonServer(self.cloud_options)
        self.cloud.start(900)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    where = tmp_path_factory.mktemp("crossing")
    options = {name: ServerOptions.on_free_ports([where / name]) for name in ("edge", "cloud")}
    raw = yaml.safe_load(PLAN.read_text())
    for name, opts in options.items():  # the ports this test's servers were given
        raw["servers"][name]["grpc"] = f"127.0.0.1:{opts.grpc_port}"
    plan = parse_plan(raw, source=str(PLAN))
    for name in options:
        generator.write(generator.render(plan.on_server(name)), where / name)
    state = Servers(plan, TritonServer(options["edge"]), options["cloud"], TritonServer(options["cloud"]))
    try:
        state.cloud.start(900)
        state.edge.start(900)
        yield state
    finally:
        state.edge.stop()
        state.cloud.stop()


def _images(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).standard_normal((batch, 3, 32, 32), dtype=np.float32)


def test_a_crossing_task_equals_its_unsplit_model(servers: Servers) -> None:
    reference = BlockRunner(generator.reference_spec(servers.plan, servers.plan.tasks["x_cross"], graph=False)[0],
                            torch.device("cpu"))
    with TaskClient(servers.edge.http_url) as edge, TaskClient(servers.cloud.http_url) as cloud:
        for batch in (1, 3):
            x = _images(batch)
            got = edge.infer("x_cross", x)
            want = reference.run(torch.from_numpy(x)).numpy()
            assert got.shape == want.shape == (batch, 10) and relative_error(got, want) <= TOL, batch
        assert edge.infer("x_local", _images(2)).shape == (2, 10)
        assert cloud.infer("x_far", _images(2)).shape == (2, 10)
        ready = {m["name"] for m in edge.models()}
        assert "x_cross__cross1" in ready and "x_head__triton_cpu" not in ready  # the rest of the path is cloud's


def test_concurrent_requests_crossing_together_each_get_their_own_rows(servers: Servers) -> None:
    """The crossing sends the requests of one call together (up to the onward blocks' batch of 4):
    under concurrent requests of 1 to 3 images, each request's answer is its own images'."""
    from concurrent.futures import ThreadPoolExecutor

    reference = BlockRunner(generator.reference_spec(servers.plan, servers.plan.tasks["x_cross"], graph=False)[0],
                            torch.device("cpu"))
    sent = [np.random.default_rng(100 + k).standard_normal((1 + k % 3, 3, 32, 32), dtype=np.float32) for k in range(24)]

    def ask(x: np.ndarray) -> np.ndarray:
        with TaskClient(servers.edge.http_url) as edge:
            return edge.infer("x_cross", x)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, sent))
    for x, got in zip(sent, answers, strict=True):
        want = reference.run(torch.from_numpy(x)).numpy()
        assert got.shape == want.shape and relative_error(got, want) <= TOL


def test_a_stopped_next_server_fails_only_the_crossing_task_quickly_and_it_heals(servers: Servers) -> None:
    timeout_s = servers.plan.raw.servers["cloud"].timeout_s
    servers.cloud.stop()
    with TaskClient(servers.edge.http_url) as edge:
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(ClientError, match=r"crossing 'x_cross__cross1': the next server .* did not answer"):
                edge.infer("x_cross", _images(1))
            assert time.monotonic() - start < timeout_s + 2.0
            assert edge.infer("x_local", _images(1)).shape == (1, 10)  # a task that does not cross keeps serving
        servers.restart_cloud()
        deadline = time.monotonic() + 30
        while True:
            try:
                assert edge.infer("x_cross", _images(1)).shape == (1, 10)
                break
            except ClientError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
