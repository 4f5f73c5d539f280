"""The relay bench's ensembles on a real tritonserver: a fan-out whose steps hand over by ZeroMQ gives
back every input under concurrency, and Triton skips the steps whose outputs a client did not ask
for (the reason the bench's `relay` shape cannot serve a task; docs/triton-notes.md)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from blockflow.bench.lab import relay_floor
from blockflow.triton.server import ServerOptions, TritonServer

pytestmark = pytest.mark.integration


def test_relay_ensembles_give_back_their_inputs_and_pruning_skips_side_steps(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    repo, socks = tmp_path / "repo", Path(tempfile.mkdtemp(prefix="relay-"))  # short: an ipc path has ~100 bytes
    request.addfinalizer(lambda: shutil.rmtree(socks, ignore_errors=True))
    repo.mkdir()
    relay_floor.write_repository(repo, socks, tmp_path, ensembles=("relay", "relay_join"))
    assert sorted(p.name for p in repo.iterdir()) == ["head_j", "head_r", "j1", "j2", "join", "r1", "r2", "r3", "relay", "relay_join"]
    with TritonServer(ServerOptions.on_free_ports([repo])) as server:
        assert relay_floor.check(server.http_url, "relay_join", requests=64, clients=8) == 0
        assert relay_floor.check(server.http_url, "relay_join", requests=8, clients=4, only_out=True) == 0
        assert relay_floor.check(server.http_url, "relay", requests=16, clients=4) == 0
        # Asking for OUT alone prunes r1 and r2 (their outputs lead only to R1 and R2): r3 waits in vain.
        assert relay_floor.check(server.http_url, "relay", requests=1, clients=1, only_out=True) == 1
