"""A plan that spans two servers changes as one: `blockflow serve --server cloud` and `--server edge`
(tests/plans/servers/cross.yaml, this test's ports), then `blockflow apply --fleet cloud,edge` with a
plan that adds a crossing task. Edge loads models with a 1 s limit, which a new crossing model's
process does not meet: cloud takes the plan first, edge fails it (and unloads that model once Triton has
loaded it), and cloud is given its plan back; both serve the first plan's tasks again, and its crossing
task still answers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from blockflow.clients.client import TaskClient
from blockflow.core.runtime_dir import write_private
from blockflow.triton.options import free_port

from ..conftest import wait_serve_ready

pytestmark = pytest.mark.integration
PLAN = Path(__file__).resolve().parents[2] / "tests" / "plans" / "servers" / "cross.yaml"
TOKEN = "crossing-test-token-0123456789"


@dataclass
class Serve:
    name: str
    proc: subprocess.Popen[bytes]
    http: str
    control: str
    log: Path


def _plan(where: Path, ports: dict[str, list[int]], name: str, extra_task: bool) -> Path:
    raw = yaml.safe_load(PLAN.read_text())
    for server, p in ports.items():
        raw["servers"][server]["grpc"] = f"127.0.0.1:{p[1]}"
    if extra_task:  # a new block on cloud, and the crossing task through it
        raw["blocks"]["x_head2"] = {"model": "r18", "stages": 1, "weights": {"seed": 11}, "server": "cloud"}
        raw["tasks"]["x_cross2"] = {"path": ["x_stem", "x_head2"], "transport": "triton-cpu"}
    path = where / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _start(where: Path, plan: Path, server: str, ports: list[int], token_file: Path, load_timeout: float) -> Serve:
    log = where / f"serve-{server}.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "blockflow", "serve", "--plan", str(plan), "--server", server,
                                 "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
                                 "--control-port", str(ports[3]), "--token-file", str(token_file),
                                 "--load-timeout", str(load_timeout)],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Serve(server, proc, f"127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[3]}", log)


def _wait_ready(s: Serve) -> None:
    wait_serve_ready(s.proc, s.log, s.control, s.http, TOKEN)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Serve, Serve, Path, Path]]:
    where = tmp_path_factory.mktemp("crossing_apply")
    token_file = where / "token"
    write_private(token_file, TOKEN)
    ports = {s: [free_port() for _ in range(4)] for s in ("edge", "cloud")}
    first, second = _plan(where, ports, "a.yaml", False), _plan(where, ports, "b.yaml", True)
    cloud = _start(where, first, "cloud", ports["cloud"], token_file, 300)
    edge = _start(where, first, "edge", ports["edge"], token_file, 1)
    try:
        _wait_ready(cloud)
        _wait_ready(edge)
        yield cloud, edge, second, token_file
    finally:
        for s in (edge, cloud):
            s.proc.terminate()
        for s in (edge, cloud):
            try:
                s.proc.wait(60)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()


def _served(s: Serve) -> set[str]:
    with TaskClient(s.http) as c:
        return {m["name"] for m in c.models()}


def test_each_server_reports_its_part(servers: tuple[Serve, Serve, Path, Path]) -> None:
    cloud, edge, _, _ = servers
    for s, tasks in ((edge, {"x_cross": ["x_cross"], "x_local": ["x_local"]}),
                     (cloud, {"x_cross": ["x_cross__run1"], "x_far": ["x_far"]})):
        status = httpx.get(f"{s.control}/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
        assert status["server"] == s.name
        assert {t: v["ensembles"] for t, v in status["tasks"].items()} == tasks
        assert all(v["ready"] for v in status["tasks"].values()) and all(v["ready"] for v in status["blocks"].values())


def test_a_server_that_cannot_take_the_plan_puts_both_back(servers: tuple[Serve, Serve, Path, Path]) -> None:
    cloud, edge, second, token_file = servers
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32), dtype=np.float32)
    with TaskClient(edge.http) as c:
        before = c.infer("x_cross", x)
    res = subprocess.run([sys.executable, "-m", "blockflow", "apply", str(second), "--token-file", str(token_file),
                          "--fleet", f"{cloud.control},{edge.control}"], capture_output=True, text=True, timeout=900)
    assert res.returncode != 0, res.stdout
    rows = {s.name: next(line for line in res.stdout.splitlines() if s.control in line) for s in (cloud, edge)}
    assert "rolled back" in rows["cloud"] and "failed" in rows["edge"], res.stdout
    # Cloud's new models are unloaded; edge's ensemble never loaded, and its crossing model, whose load
    # outlived its 1 s wait, was unloaded once that load ended inside Triton (the undo waits for it).
    assert not {"x_head2__triton_cpu", "x_cross2__run1"} & _served(cloud), res.stdout + res.stderr
    assert not {"x_cross2", "x_cross2__cross1"} & _served(edge), res.stdout + res.stderr
    assert "unloaded new x_cross2__cross1" in rows["edge"] + res.stderr, res.stdout + res.stderr
    with TaskClient(edge.http) as c:
        np.testing.assert_allclose(c.infer("x_cross", x), before, rtol=0, atol=1e-6)
