"""One plan on a fleet: three `blockflow serve` processes under load, changed with `blockflow apply --fleet`.

The third server loads models with a 1 s limit (`--load-timeout 1`): an ensemble loads within it, a new
block process does not. So plan B (a new task over the same blocks) goes to all three, and plan C (a new
block) fails on the third after the first two took it, which must put the whole fleet back on B.
Clients keep calling a task that every plan serves, on every server, throughout: none may fail.
Plan D loads and is ready but fails every request: with `--soak`, the canary fails its soak and goes
back, and the servers after it are never changed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as http

from blockflow.core.runtime_dir import write_private
from blockflow.triton.options import free_port
from blockflow.triton.process_group import group_members

from ..conftest import wait_serve_ready

pytestmark = pytest.mark.integration
PLANS = Path(__file__).resolve().parents[1] / "plans"
TOKEN = "fleet-test-token-0123456789"


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    http_port: int
    control: str
    log: Path
    ok: int = 0
    failures: list[str] = field(default_factory=list)


def _start(where: Path, token_file: Path, load_timeout: float) -> Server:
    ports = [free_port() for _ in range(4)]
    log = where / f"serve-{ports[0]}.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "blockflow", "serve", "--plan", str(PLANS / "fleet_a.yaml"),
                                 "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
                                 "--control-port", str(ports[3]), "--token-file", str(token_file),
                                 "--load-timeout", str(load_timeout)],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Server(proc, ports[0], f"http://127.0.0.1:{ports[3]}", log)


def _wait_ready(s: Server) -> None:
    wait_serve_ready(s.proc, s.log, s.control, f"127.0.0.1:{s.http_port}", TOKEN)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Server], Path]]:
    where = tmp_path_factory.mktemp("fleet")
    token_file = where / "token"
    write_private(token_file, TOKEN)
    servers = [_start(where, token_file, 300), _start(where, token_file, 300), _start(where, token_file, 1)]
    try:
        for s in servers:
            _wait_ready(s)
        yield servers, token_file
    finally:
        for s in servers:
            s.proc.terminate()
        for s in servers:
            try:
                s.proc.wait(60)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
            assert list(group_members(s.proc.pid)) == [], f"processes of {s.control} outlived it"


def _load(s: Server, stop: threading.Event) -> None:
    """A closed-loop client of task `busy`, which every plan serves."""
    client = http.InferenceServerClient(f"127.0.0.1:{s.http_port}")
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    try:
        while not stop.is_set():
            inp = http.InferInput("IMAGE", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            try:
                client.infer("busy", [inp])
                s.ok += 1
            except Exception as exc:  # every failure is the finding
                s.failures.append(str(exc))
    finally:
        client.close()


def _apply(plan: str, servers: list[Server], token_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "blockflow", "apply", str(PLANS / plan), "--token-file", str(token_file),
                           "--fleet", ",".join(s.control for s in servers), *extra], capture_output=True, text=True, timeout=900)


def _rows(res: subprocess.CompletedProcess[str], servers: list[Server]) -> list[str]:
    """The result column of each server's row in the fleet table."""
    rows = {s.control: next(line for line in res.stdout.splitlines() if s.control in line) for s in servers}
    return [rows[s.control].split("│")[2].strip() for s in servers]


def _served(s: Server) -> tuple[str, set[str]]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    plan = httpx.get(f"{s.control}/plan", headers=headers, timeout=10).json()["name"]
    status = httpx.get(f"{s.control}/status", headers=headers, timeout=30).json()
    return plan, {t for t, v in status["tasks"].items() if v["ready"]}


def test_a_fleet_takes_a_plan_and_goes_back_whole_when_one_server_fails(fleet: tuple[list[Server], Path]) -> None:
    servers, token_file = fleet
    stop = threading.Event()
    clients = [threading.Thread(target=_load, args=(s, stop), daemon=True) for s in servers]
    for c in clients:
        c.start()
    try:
        good = _apply("fleet_b.yaml", servers, token_file, "--soak", "2")  # a healthy server passes its soak
        assert good.returncode == 0, good.stdout + good.stderr
        assert "applied to 3 server(s)" in good.stdout
        assert good.stderr.count("soaking for 2 s") == 3, good.stderr
        # The load reaches task busy only: the soak says that task `also` was checked for readiness alone.
        assert good.stderr.count("no request reached task(s) also during the soak") == 3, good.stderr
        assert [_served(s) for s in servers] == [("fleet-b", {"busy", "also"})] * 3

        bad = _apply("fleet_c.yaml", servers, token_file)
        assert bad.returncode != 0, bad.stdout
        assert _rows(bad, servers) == ["rolled back", "rolled back", "failed"], bad.stdout
        assert "the plan was not applied to the fleet" in bad.stderr
        assert [_served(s) for s in servers] == [("fleet-b", {"busy", "also"})] * 3
        time.sleep(1.0)  # requests after the rollback too
    finally:
        stop.set()
        for c in clients:
            c.join(60)
    for s in servers:
        assert s.ok > 0, f"no request answered by {s.control}"
        assert s.failures == [], f"{len(s.failures)} request(s) to {s.control} failed, e.g. {s.failures[:3]}"


def test_a_server_that_cannot_take_the_plan_leaves_the_fleet_untouched(fleet: tuple[list[Server], Path]) -> None:
    servers, token_file = fleet
    before = [_served(s)[0] for s in servers]
    res = subprocess.run([sys.executable, "-m", "blockflow", "apply", str(PLANS / "fleet_a.yaml"), "--token-file", str(token_file),
                          "--fleet", f"{servers[0].control},{servers[1].control},http://127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "refused before any change" in res.stdout + res.stderr
    assert [_served(s)[0] for s in servers] == before


def test_a_canary_that_fails_its_soak_puts_itself_back_and_stops_the_fleet(fleet: tuple[list[Server], Path]) -> None:
    servers, token_file = fleet
    before = [_served(s) for s in servers]
    for s in servers:
        s.ok, s.failures = 0, []
    stop = threading.Event()
    clients = [threading.Thread(target=_load, args=(s, stop), daemon=True) for s in servers]
    for c in clients:
        c.start()
    try:
        res = _apply("fleet_d.yaml", servers, token_file, "--soak", "120", "--json")
        answered = [s.ok for s in servers]
        time.sleep(1.0)  # requests after the rollback
    finally:
        stop.set()
        for c in clients:
            c.join(60)
    assert res.returncode != 0, res.stdout
    report = json.loads(res.stdout)
    assert [o["state"] for o in report["servers"]] == ["failed soak", "not reached", "not reached"], res.stdout
    assert "request(s) failed during the soak (busy: " in report["servers"][0]["error"], report
    assert report["servers"][0]["seconds"] < 120, "the soak did not stop at the first failures"
    assert [_served(s) for s in servers] == before
    # The canary's clients saw its failures, then it answered again; the servers after it never changed.
    canary, *rest = servers
    assert canary.failures and canary.ok > answered[0], (canary.ok, answered[0], canary.failures[:3])
    for s in rest:
        assert s.ok > 0 and s.failures == [], f"{len(s.failures)} request(s) to {s.control} failed, e.g. {s.failures[:3]}"
