"""The wheel is complete: one `blockflow` package, type hints (PEP 561), the license, the plans,
calibration and dashboard as package data; installed into a fresh virtual environment (no checkout in
reach), it validates its own default plan, passes `blockflow doctor` and serves a plan whose block
processes run from the wheel; its base install (the client) needs no torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from blockflow.core.env import NGINX
from blockflow.triton.front_door import find_nginx
from blockflow.triton.server import free_port

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["blockflow/data/plans/default.yaml", "blockflow/data/plans/bench_r50.yaml", "blockflow/data/plans/examples/skipnet.yaml",
           "blockflow/data/calibration/memory_calibration.json", "blockflow/data/grafana/blockflow.json", "blockflow/clients/imagenet_classes.txt",
           "blockflow/triton/argv_key.c"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
                         capture_output=True, text=True, timeout=300, cwd=out)
    assert res.returncode == 0, res.stderr[-2000:]
    (found,) = out.glob("blockflow-*.whl")
    yield found


def test_the_wheel_has_one_package_py_typed_the_license_and_the_shipped_files(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    # One top-level name in site-packages: the source folders backend/, bench/, ... install as blockflow.*.
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"blockflow"}
    assert "blockflow/py.typed" in names  # PEP 561: it covers the subpackages
    for package in ("blockflow/backend", "blockflow/backend/tensormq", "blockflow/ensemble_gen", "blockflow/clients", "blockflow/bench"):
        assert f"{package}/__init__.py" in names, package
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert set(SHIPPED) <= names
    assert not [n for n in names if n.endswith((".pt2", ".safetensors", ".pyc"))], "built or generated files in the wheel"


@pytest.fixture
def fresh_venv(tmp_path: Path) -> Iterator[Path]:
    """A new virtual environment's bin/, removed afterwards (with torch it holds several GB)."""
    where = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(where)
    try:
        yield where / "bin"
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # A user's shell: this venv first on PATH, nothing of the checkout importable.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, timeout=1200, cwd=cwd, env=env)


def test_installed_in_a_fresh_venv_it_validates_passes_doctor_and_serves(wheel: Path, fresh_venv: Path, tmp_path: Path) -> None:
    bin_dir = fresh_venv
    res = _run(bin_dir, "pip", "install", "-q", f"{wheel}[server]", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    where = _run(bin_dir, "python", "-c", "from blockflow.core.shipped import shipped; print(shipped('plans/default.yaml'))", cwd=tmp_path)
    default = Path(where.stdout.strip())
    assert str(tmp_path / "venv") in str(default) and default.is_file(), where.stdout + where.stderr
    res = _run(bin_dir, "blockflow", "validate", str(default), cwd=tmp_path)
    assert res.returncode == 0 and "is valid" in res.stdout, res.stdout + res.stderr
    res = _run(bin_dir, "blockflow", "doctor", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    res = _run(bin_dir, "blockflow", "plan-memory", str(default), "--gpus", "1", cwd=tmp_path)
    assert res.returncode == 0 and "calibration: fitted to" in res.stdout, res.stdout + res.stderr  # the shipped calibration
    _serve_and_infer(bin_dir, tmp_path)


def _serve_and_infer(bin_dir: Path, where: Path) -> None:
    """`blockflow serve` from the venv: Triton's stubs import the block runtime from the wheel's blockflow.backend."""
    plan = where / "one_block.yaml"
    plan.write_text((ROOT / "tests" / "plans" / "one_block.yaml").read_text())
    http_port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    # nginx, the HTTP front door, is the machine's (no wheel carries it): the one this checkout's setup installed.
    nginx = find_nginx()
    assert nginx is not None, "run ./scripts/setup.sh: it installs nginx"
    env[NGINX] = str(nginx)
    log = where / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(bin_dir / "blockflow"), "serve", "--plan", str(plan), "--http-port", str(http_port),
                                 "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--control-port", str(free_port()),
                                 "--repository", str(where / "repo")],
                                stdout=out, stderr=subprocess.STDOUT, cwd=where, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not _ready(http_port):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        res = _run(bin_dir, "blockflow", "infer", "only", "--random", "--url", f"127.0.0.1:{http_port}", cwd=where)
        # Nothing of the checkout is on the stubs' path (no PYTHONPATH, cwd elsewhere): they ran the wheel's code.
        assert res.returncode == 0 and "latency" in res.stdout, res.stdout + res.stderr
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready(http_port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_client_install_needs_no_torch(wheel: Path, fresh_venv: Path, tmp_path: Path) -> None:
    bin_dir = fresh_venv
    res = _run(bin_dir, "pip", "install", "-q", f"{wheel}[client]", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _run(bin_dir, "python", "-c", "import importlib.util as u; print(u.find_spec('torch') is None)", cwd=tmp_path)
    assert res.stdout.strip() == "True"
    code = ("from blockflow.clients.client import TaskClient; from blockflow.clients.images import class_names; "
            "assert len(class_names(1000)) == 1000; print('client ok')")
    res = _run(bin_dir, "python", "-c", code, cwd=tmp_path)
    assert res.stdout.strip() == "client ok", res.stderr
    res = _run(bin_dir, "blockflow", "infer", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    where = _run(bin_dir, "python", "-c", "from blockflow.core.shipped import shipped; print(shipped('plans/default.yaml'))", cwd=tmp_path)
    res = _run(bin_dir, "blockflow", "validate", where.stdout.strip(), cwd=tmp_path)
    assert res.returncode == 3 and "pip install 'blockflow[runtime]'" in res.stderr, res.stdout + res.stderr
