"""A generated repository on a tritonserver started by hand, with the script `blockflow triton-command`
writes, in both layouts BlockFlow finds: the nvidia-pytriton wheel's, and NVIDIA's container layout
(/opt/tritonserver, put together here from the same real binaries). TensorMQ needs no variable: the
block processes make their private runtime directory and ticket key beside the repository's digest."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

from blockflow.core import env
from blockflow.core.procfs import exiting, stat_fields
from blockflow.core.runtime_dir import default_for, write_private
from blockflow.ensemble_gen import generator
from blockflow.plan import load_plan
from blockflow.triton import access, argv_key
from blockflow.triton.install import STUB, locate
from blockflow.triton.options import free_port
from blockflow.triton.process_group import group_members, stubs_by_model

pytestmark = pytest.mark.integration
PLAN = Path(__file__).resolve().parents[1] / "plans" / "own_triton.yaml"
START_TIMEOUT = float(os.environ.get("BLOCKFLOW_TEST_START_TIMEOUT", "900"))


def container_layout(where: Path) -> Path:
    """NVIDIA's image layout (bin/, lib/, backends/python/ with the stub inside), linked from the wheel's files."""
    wheel = locate()
    home = where / "opt" / "tritonserver"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "tritonserver").symlink_to(wheel.server)
    (home / "lib").symlink_to(wheel.libs)
    python = home / "backends" / "python"
    python.mkdir(parents=True)
    for f in (wheel.python_backend / "libtriton_python.so", wheel.python_backend / "triton_python_backend_utils.py", wheel.stub()):
        (python / f.name).symlink_to(f)
    return home


def where_threads_are(pid: int) -> str:
    """Each thread of ``pid``: its state, where it sleeps (wchan) and, where this user may read it, its
    kernel stack: what a test that waits for a process to exit says when it does not."""
    rows = [f"pid {pid}:"]
    for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda t: int(t.name)):
        try:
            comm, state = (task / "comm").read_text().strip(), stat_fields(pid, int(task.name))[0]
            wchan = (task / "wchan").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        try:
            stack = " < ".join(line.split(" ", 1)[-1] for line in (task / "stack").read_text().splitlines()[:6])
        except OSError:
            stack = "(kernel stack not readable)"
        rows.append(f"  {task.name} {comm!r} {state} wchan={wchan} {stack}")
    return "\n".join(rows)


def launch_by_hand(where: Path, plan: Path, home_args: list[str],
                   extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``plan``'s repository under ``where``, served by a tritonserver started with the script
    `blockflow triton-command` writes, as a user's shell would (with ``extra_env`` too); its process
    (the script execs tritonserver), HTTP address and runtime base, as soon as it started."""
    repo = where / "repo"
    generator.write(generator.render(load_plan(plan)), repo)
    # A short base, as a user's /run/user/<uid> is: Unix socket paths hold at most 107 bytes.
    runtime_base = Path(tempfile.mkdtemp(prefix="bf-xdg-"))
    # What a user's shell has: none of the variables `blockflow serve` gives its server (an operator's
    # own, such as BLOCKFLOW_TRITON_HOME on the GPU machine, stay).
    shell_env = {k: v for k, v in os.environ.items() if k not in (env.RUNTIME_DIR, env.PYTHONPATH)}
    shell_env["XDG_RUNTIME_DIR"] = str(runtime_base)
    shell_env.update(extra_env or {})
    script = subprocess.run([sys.executable, "-m", "blockflow", "triton-command", str(repo), "--backend-dir", str(where / "be"),
                             *home_args], capture_output=True, text=True, env=shell_env, check=True).stdout
    assert ("--backend-directory=" + str(where / "opt" / "tritonserver" / "backends")) in script if home_args else str(where / "be") in script
    (where / "start.sh").write_text(script)
    port = free_port()
    with (where / "tritonserver.log").open("wb") as log:
        proc = subprocess.Popen(["sh", str(where / "start.sh"), f"--http-port={port}", f"--grpc-port={free_port()}",
                                 f"--metrics-port={free_port()}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
                                 "--metrics-address=127.0.0.1"],
                                stdout=log, stderr=subprocess.STDOUT, env=shell_env, start_new_session=True)
    return proc, f"127.0.0.1:{port}", runtime_base


def start_by_hand(where: Path, plan: Path, home_args: list[str]) -> tuple[subprocess.Popen[bytes], str, Path]:
    """:func:`launch_by_hand`, returning once the server is ready."""
    proc, url, runtime_base = launch_by_hand(where, plan, home_args)
    try:
        client = http.InferenceServerClient(url)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, (where / "tritonserver.log").read_text()[-3000:]
            try:
                if client.is_server_ready():
                    break
            except Exception:  # not listening yet
                pass
            assert time.monotonic() < deadline, "tritonserver did not become ready"
            time.sleep(0.5)
        client.close()  # an open keep-alive connection holds tritonserver's exit for --exit-timeout-secs
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc, url, runtime_base


@pytest.fixture(scope="module", params=["pytriton", "container"])
def own_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path, Path]]:
    where = tmp_path_factory.mktemp(f"own-{request.param}")
    home_args = ["--triton-home", str(container_layout(where))] if request.param == "container" else []
    if request.param == "container":  # this one in explicit mode, its repository API behind a key
        write_private(where / "admin.key", access.new_secret())
        home_args += ["--admin-key-file", str(where / "admin.key")]
    proc, url, runtime_base = start_by_hand(where, PLAN, home_args)
    try:
        if argv_key.library() is not None:  # the key reaches tritonserver inside the process, never on its command line
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            assert cmdline.count(argv_key.ADMIN_PLACEHOLDER.encode()) == 2 and cmdline.count(argv_key.SHM_PLACEHOLDER.encode()) == 2
            if home_args:
                assert access.read_secret(where / "admin.key").encode() not in cmdline
        yield url, where / "repo", runtime_base, where / "admin.key"
    finally:
        proc.terminate()  # as a container runtime or systemd stops it: SIGTERM to tritonserver alone
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 30
    while list(group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(group_members(proc.pid)) == [], "block processes outlived the hand-started server"
    shutil.rmtree(runtime_base, ignore_errors=True)


def test_a_hand_started_triton_serves_tensormq_like_the_unsplit_model(own_server: tuple[str, Path, Path, Path]) -> None:
    url, *_ = own_server
    client = http.InferenceServerClient(url)
    x = np.random.default_rng(7).standard_normal((3, 3, 32, 32)).astype(np.float32)

    def logits(model: str) -> np.ndarray:
        inp = http.InferInput("IMAGE", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        out = client.infer(model, [inp]).as_numpy("LOGITS")
        assert out is not None
        return out

    split, whole = logits("split"), logits("split__ref")
    client.close()
    assert split.shape == (3, 10)
    # The CPU runs both exactly alike; a GPU block folds BatchNorm into its convolutions (blockflow.backend.runtime).
    tolerance = 1e-5 if torch.cuda.is_available() else 0.0
    assert np.abs(split - whole).max() <= tolerance


def test_its_runtime_directory_and_key_are_private(own_server: tuple[str, Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _, repo, runtime_base, _ = own_server
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_base))
    runtime = default_for(repo)
    assert runtime.parent == runtime_base
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert stat.S_IMODE((runtime / env.TMQ_DIR).stat().st_mode) == 0o700
    key = runtime / env.TMQ_KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_size == 32
    assert not [p for p in runtime.iterdir() if p.name.startswith(".tmq-key-")], "a key's temporary file was left"
    # The stubs' regions are named so that Triton's shared-memory API may not open them, and only their user may.
    regions = list(Path("/dev/shm").glob(env.stub_shm_prefix(0, repo.resolve()) + "*"))
    assert regions and all(stat.S_IMODE(r.stat().st_mode) == 0o600 for r in regions), regions


def test_its_model_repository_trace_logging_and_shared_memory_apis_need_a_key(own_server: tuple[str, Path, Path, Path]) -> None:
    url, _, _, key_file = own_server
    client = http.InferenceServerClient(url)
    try:
        # Behind a key in both modes: the key file's, or a random one nobody has (Triton's default mode).
        for call in (lambda: client.load_model("trunk"), client.get_trace_settings, client.get_log_settings,
                     client.get_system_shared_memory_status, client.get_cuda_shared_memory_status):
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
        if key_file.exists():  # explicit mode: the key opens it
            client.load_model("trunk", headers=access.admin_headers(access.read_secret(key_file)))
        assert client.is_model_ready("split")
    finally:
        client.close()


def test_the_container_layout_is_recognised(tmp_path: Path) -> None:
    home = container_layout(tmp_path)
    from blockflow.triton.install import TritonInstall

    install = TritonInstall(home)
    assert install.layout == "container" and install.stub() == home / "backends" / "python" / STUB
    assert install.stub_python() == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert install.problems() == []


def test_a_killed_hand_started_triton_left_unreaped_takes_its_block_processes_along(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL, and nobody reaps it: python_backend's stubs take a zombie server for alive; each block's
    server watch (blockflow.backend.server_watch) sees its parent change, removes its files, and exits."""
    proc, _, runtime_base = start_by_hand(tmp_path, PLAN, [])
    try:
        stubs = {pid: psutil.Process(pid).cmdline() for pids in stubs_by_model(proc.pid).values() for pid in pids}
        assert len(stubs) == 3, stubs  # trunk, head and the unsplit reference
        regions = [Path("/dev/shm") / argv[2] for argv in stubs.values()]
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_base))
        pools = list(Path("/dev/shm").glob(env.pool_shm_prefix(default_for(tmp_path / "repo")) + "*"))
        # Each stub's region of the server's shared memory, and on a CPU machine the trunk's host pool.
        assert all(r.exists() for r in regions) and (bool(pools) or torch.cuda.is_available()), (pools, regions)
        os.kill(proc.pid, signal.SIGKILL)
        # Each block must call exit; a GPU block's last threads may then spend longer in the driver
        # (procfs.exiting), which is the driver's pace, not the watch's.
        deadline = time.monotonic() + 20
        while not all(exiting(pid) for pid in stubs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE  # still not reaped
        left = [pid for pid in stubs if not exiting(pid)]
        threads = "\n".join(where_threads_are(pid) for pid in left)
        for pid in left:  # and where their Python threads are, in the log (backend/health.py registers it)
            os.kill(pid, signal.SIGUSR2)
        time.sleep(2 if left else 0)
        log = (tmp_path / "tritonserver.log").read_text(errors="replace")
        assert left == [], ("block processes outlived their killed server:\n" + threads + "\nthe blocks' lines of the server log "
                            "and their Python stacks:\n" + "\n".join(line for line in log.splitlines()
                                                                     if "blockflow" in line or line.startswith(("Thread 0x", "Current thread", "  File")))[-8000:])
        assert [p for p in [*pools, *regions] if p.exists()] == []
        assert log.count(f"tritonserver (pid {proc.pid}) has exited") == 3
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(runtime_base, ignore_errors=True)



def test_a_switch_set_wrong_fails_each_blocks_load_on_a_hand_started_triton(tmp_path: Path) -> None:
    """No `blockflow serve` checked this server's environment: each block process does, and names the variable."""
    proc, _, runtime_base = launch_by_hand(tmp_path, PLAN, [], {env.GRAPH_BUCKETS: "quarters"})
    try:
        # A model that fails its load at start-up stops tritonserver (without the check, it would serve: a timeout here).
        assert proc.wait(min(START_TIMEOUT, 300)) != 0
        log = (tmp_path / "tritonserver.log").read_text(errors="replace")
        assert "BLOCKFLOW_GRAPH_BUCKETS='quarters' is not one of pow2, quarter (its default: pow2)" in log, log[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(runtime_base, ignore_errors=True)
