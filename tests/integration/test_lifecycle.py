"""The server's own life: a tritonserver that dies leaves no block process behind.

Runs before the session server starts (files run in name order), so its one extra
stub does not add to that server's host-memory peak on a CPU machine.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from blockflow.plan import load_plan
from blockflow.triton.server import (
    ServerOptions,
    TritonServer,
    group_members,
)
from ensemble_gen import generator

pytestmark = pytest.mark.integration
PLAN = Path(__file__).resolve().parents[1] / "plans" / "live_a.yaml"


def test_a_crashed_server_leaves_no_block_process(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    generator.write(generator.render(load_plan(PLAN)), tmp_path / "repo")
    opts = ServerOptions.on_free_ports([tmp_path / "repo"], load=("trunk",))
    server = TritonServer(opts)
    server.start(timeout=float(os.environ.get("BLOCKFLOW_TEST_START_TIMEOUT", "900")))
    try:
        assert server.process is not None
        pgid = server.process.pid
        stubs = server.stub_processes()
        assert len(stubs.get("trunk", [])) >= 1
        # Only the server: its stubs survive it, and nobody here polls or waits on it.
        os.kill(pgid, signal.SIGKILL)
        assert server.exited.wait(30), "the watchdog did not see the server exit"
        assert server.process.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while list(group_members(pgid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(group_members(pgid)) == [], "block processes outlived their crashed server"
        assert any("exited unexpectedly" in r.getMessage() and str(server.log_path) in r.getMessage() for r in caplog.records)
    finally:
        server.stop()
    assert not server.runtime_dir.exists()
