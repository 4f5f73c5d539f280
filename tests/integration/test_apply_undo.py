"""An apply that fails on a new block whose load outlives the applier's 1 s wait, on a real tritonserver
(tests/plans/fleet_a.yaml, then fleet_c.yaml's new block head2). Triton goes on loading the block after
the wait: the undo waits for that load to end, unloads the block and deletes its directory, and the
server serves the first plan, alive."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from blockflow.clients.client import TaskClient
from blockflow.control.apply import Applier
from blockflow.core.errors import ApplyError
from blockflow.plan import load_plan

from ..conftest import own_server

pytestmark = pytest.mark.integration
PLANS = Path(__file__).resolve().parents[1] / "plans"


def test_an_undo_unloads_a_new_block_whose_load_outlived_its_wait(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32), dtype=np.float32)
    with own_server(load_plan(PLANS / "fleet_a.yaml"), tmp_path) as server:
        with TaskClient(server.http_url) as c:
            before = c.infer("busy", x)
        applier = Applier(server.grpc_url, tmp_path / "repo", timeout=1.0, admin_key=server.admin_key)
        with pytest.raises(ApplyError, match="loading head2 failed") as failed:
            applier.apply(load_plan(PLANS / "fleet_c.yaml"))
        assert "rolled back (unloaded new head2)" in str(failed.value)
        # Statistics list the models Triton runs, with a directory or not; a load nobody waits for any
        # more would make head2 one of them, its process among the server's.
        api = server.api(timeout=10)
        deadline = time.monotonic() + 60
        while ("head2" in api.statistics() or "head2" in server.stub_processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "head2" not in api.statistics() and "head2" not in server.stub_processes()
        assert not (tmp_path / "repo" / "head2").exists()
        assert {m.name: m.state for m in api.index()} == {"busy": "READY", "head": "READY", "trunk": "READY"}
        assert server.process is not None and server.process.poll() is None
        with TaskClient(server.http_url) as c:
            np.testing.assert_allclose(c.infer("busy", x), before, rtol=0, atol=1e-6)
