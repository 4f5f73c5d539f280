"""Networks cut at module paths, served by a real tritonserver: every task on every transport gives
its unsplit reference's outputs. A network that is not a ResNet (tests/plans/mobilenet_shared.yaml),
and cuts where a skip connection crosses, so each hop carries two tensors (tests/plans/skip_cut.yaml)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from blockflow.plan import Plan, load_plan, naming
from blockflow.triton.server import ServerOptions, TritonServer
from clients.client import TaskClient
from ensemble_gen import generator

pytestmark = pytest.mark.integration
PLANS = Path(__file__).resolve().parents[1] / "plans"


@pytest.fixture(scope="module", params=["mobilenet_shared", "skip_cut"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Plan, str]]:
    plan = load_plan(PLANS / f"{request.param}.yaml")
    repo = tmp_path_factory.mktemp(request.param) / "repo"
    generator.write(generator.render(plan), repo)
    server = TritonServer(ServerOptions.on_free_ports([repo]))
    server.start(float(os.environ.get("BLOCKFLOW_TEST_START_TIMEOUT", "900")))
    try:
        yield plan, server.http_url
    finally:
        server.stop()


@pytest.mark.parametrize("batch", [1, 3])
def test_every_task_on_every_transport_equals_its_reference(served: tuple[Plan, str], batch: int) -> None:
    plan, url = served
    x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32), dtype=np.float32)
    with TaskClient(url) as client:
        for task in plan.tasks.values():
            want = client.infer(naming.reference_model(task.name, graph=False), x)
            for transport in plan.transports_of(task):
                got = client.infer(naming.task_model(task.name, transport, task.transport), x)
                err = float(np.abs(got - want).max() / np.abs(want).max())
                assert got.shape == (batch, 10) and err <= 1e-5, (task.name, transport, err)
        a = client.infer("task_a", x)
        b = client.infer("task_b", x)
    assert not np.allclose(a, b, rtol=1e-3, atol=0), "the two heads have different weights, so the tasks answer differently"
