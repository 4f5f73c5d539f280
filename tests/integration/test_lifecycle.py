"""The server's own life: a tritonserver that dies leaves no block process behind.

Runs before the session server starts (files run in name order), so its one extra
stub does not add to that server's host-memory peak on a CPU machine.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from blockflow.core import env
from blockflow.core.activity import ActivityStamp
from blockflow.core.procfs import stat_fields
from blockflow.ensemble_gen import generator
from blockflow.plan import load_plan
from blockflow.triton.process_group import group_members
from blockflow.triton.server import ServerOptions, TritonServer

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
        (said,) = [r.getMessage() for r in caplog.records if "exited unexpectedly" in r.getMessage()]
        assert str(server.log_path) in said
        last = server.log_path.read_text(errors="replace").strip().splitlines()[-1]
        assert "its last lines:" in said and said.endswith(last)  # the crashed server's own last words
    finally:
        server.stop()
    assert not server.runtime_dir.exists()


def test_serve_runs_without_the_command_line(tmp_path: Path) -> None:
    """`blockflow serve`'s life cycle as a library: start, serve, run until told, stop and leave nothing."""
    import threading

    import httpx
    import numpy as np

    from blockflow.clients.client import TaskClient
    from blockflow.control.serve import ServeOptions, Serving
    from blockflow.triton.options import free_port

    token = "a-token-for-the-service-test"
    plan = PLAN.parent / "one_block.yaml"
    said: list[str] = []
    serving = Serving(ServeOptions(plan, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                                   control_port=free_port(), token=token, state_dir=tmp_path / "plans",
                                   warm_cores_ms=20, tritonserver_args=["--log-format=ISO8601"]), say=said.append)
    runtime = serving.runtime
    try:
        serving.start()
        # The pass-through flag reached tritonserver: its log lines start with an ISO 8601 time.
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", serving.server.log_path.read_text()), \
            serving.server.log_path.read_text()[:300]
        assert serving.control is not None and serving.token_path is not None
        assert serving.token_path.read_text().strip() == token and serving.token_path.stat().st_mode & 0o077 == 0
        # --warm-cores-ms: a poller per CPU, and the block stamps its execute for them.
        assert serving.server.warm_cores is not None
        pollers = [p.pid for p in serving.server.warm_cores.processes]
        assert len(pollers) == len(os.sched_getaffinity(0))
        stamp = ActivityStamp(runtime / env.ACTIVITY_STAMP, writable=False)
        assert stamp.last() == 0
        with TaskClient(serving.server.http_url) as client:
            assert client.infer("only", np.zeros((2, 3, 32, 32), np.float32)).shape == (2, 10)
        assert 0 < time.monotonic_ns() - stamp.last() < 30e9
        stamp.close()
        r = httpx.get(f"{serving.control.url}/status", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200 and r.json()["plan"] == "one-block", r.text
        stop = threading.Event()
        runner = threading.Thread(target=serving.run, args=(stop,))
        runner.start()
        time.sleep(1)  # a few supervisor rounds: nothing to restart, nothing to heal
        stop.set()
        runner.join(30)
        assert not runner.is_alive() and said == []
        pgid = serving.server.process.pid if serving.server.process else None
    finally:
        serving.stop()
    assert not runtime.exists()
    assert pgid is not None and list(group_members(pgid)) == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in pollers)


def test_serve_refuses_a_plan_for_gpus_this_machine_lacks(tmp_path: Path) -> None:
    from blockflow.control.serve import ServeOptions, Serving
    from blockflow.core.errors import PlanError
    from blockflow.core.nvml import gpu_count

    if gpu_count() > 3:
        pytest.skip("this machine has a GPU 3")
    plan = tmp_path / "p.yaml"
    plan.write_text((PLAN.parent / "one_block.yaml").read_text().replace("placement: cpu", "placement: [3]"))
    with pytest.raises(PlanError, match="GPU 3"):
        Serving(ServeOptions(plan, control_port=0))


def _pid_namespace() -> list[str] | None:
    """A command prefix that runs a command as PID 1 of a new PID namespace, or None where none can be made."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "--pid", "--fork", "--mount-proc"], ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]):
        if subprocess.run([*prefix, "true"], capture_output=True, check=False).returncode == 0:
            return prefix
    return None


def test_serve_as_a_containers_init_leaves_no_zombie(tmp_path: Path) -> None:
    """`blockflow serve` as PID 1 (a container started without an init): the stubs of a server that
    died are handed to it, and after the restart none of them is left a zombie; SIGTERM ends it all."""
    from blockflow.triton.options import free_port

    prefix = _pid_namespace()
    if prefix is None:  # the machine's kernel or sandbox forbids namespaces; not ours to change
        pytest.skip("needs PID namespaces (unshare --pid --fork --mount-proc)")
    log = tmp_path / "serve.log"
    ports = [str(free_port()) for _ in range(4)]
    with log.open("wb") as out:
        ns = subprocess.Popen([*prefix, sys.executable, "-m", "blockflow", "serve", "--plan", str(PLAN.parent / "one_block.yaml"),
                               "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2],
                               "--control-port", ports[3]], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in log.read_text(errors="replace"):
            assert ns.poll() is None and time.monotonic() < deadline, f"no {text!r} in the log:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)

    try:
        wait_for("Ctrl-C stops the server.", float(os.environ.get("BLOCKFLOW_TEST_START_TIMEOUT", "900")))
        (serve,) = [p.pid for p in psutil.Process(ns.pid).children()]  # PID 1 inside; these are the PIDs this process sees
        # serve's children: tritonserver and nginx, its HTTP front door.
        (triton,) = [p.pid for p in psutil.Process(serve).children() if p.status() != psutil.STATUS_ZOMBIE and p.name() == "tritonserver"]
        stubs = [p for p in group_members(triton) if p != triton]
        assert stubs, "the server started no stub"
        os.kill(triton, signal.SIGKILL)
        wait_for("again after", 300)
        # Each stub of the dead server was re-parented to serve; it reaped them when it stopped that server.
        zombies = [p.pid for p in psutil.Process(serve).children() if p.status() == psutil.STATUS_ZOMBIE]
        threads = {p: sorted(stat_fields(p, int(t.name))[0] for t in Path(f"/proc/{p}/task").iterdir()) for p in zombies}
        assert zombies == [], f"zombies left under PID 1: {zombies}, thread states {threads} (the old server's stubs were {stubs})"
        (new,) = [p.pid for p in psutil.Process(serve).children() if p.name() == "tritonserver"]
        os.kill(serve, signal.SIGTERM)
        assert ns.wait(60) == 0, log.read_text()[-3000:]
        assert list(group_members(new)) == []
    finally:
        if ns.poll() is None:
            os.killpg(ns.pid, signal.SIGKILL)
            ns.wait()
