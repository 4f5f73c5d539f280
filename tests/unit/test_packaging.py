"""The wheel is complete: type hints (PEP 561), the license, the plans, calibration and dashboard as
package data; installed into a fresh virtual environment (no checkout in reach), it validates its own
default plan and passes `blockflow doctor`; its base install (the client) needs no torch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["blockflow/data/plans/default.yaml", "blockflow/data/plans/bench_r50.yaml", "blockflow/data/plans/examples/skipnet.yaml",
           "blockflow/data/calibration/memory_calibration.json", "blockflow/data/grafana/blockflow.json", "clients/imagenet_classes.txt"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
                         capture_output=True, text=True, timeout=300, cwd=out)
    assert res.returncode == 0, res.stderr[-2000:]
    (found,) = out.glob("blockflow-*.whl")
    yield found


def test_the_wheel_has_py_typed_the_license_and_the_shipped_files(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("blockflow", "backend", "ensemble_gen", "clients", "bench"):
        assert f"{package}/py.typed" in names, package
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


def test_installed_in_a_fresh_venv_it_validates_its_default_plan_and_passes_doctor(wheel: Path, fresh_venv: Path, tmp_path: Path) -> None:
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


def test_the_client_install_needs_no_torch(wheel: Path, fresh_venv: Path, tmp_path: Path) -> None:
    bin_dir = fresh_venv
    res = _run(bin_dir, "pip", "install", "-q", f"{wheel}[client]", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _run(bin_dir, "python", "-c", "import importlib.util as u; print(u.find_spec('torch') is None)", cwd=tmp_path)
    assert res.stdout.strip() == "True"
    code = ("from clients.client import TaskClient; from clients.images import class_names; "
            "assert len(class_names(1000)) == 1000; print('client ok')")
    res = _run(bin_dir, "python", "-c", code, cwd=tmp_path)
    assert res.stdout.strip() == "client ok", res.stderr
    res = _run(bin_dir, "blockflow", "infer", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    where = _run(bin_dir, "python", "-c", "from blockflow.core.shipped import shipped; print(shipped('plans/default.yaml'))", cwd=tmp_path)
    res = _run(bin_dir, "blockflow", "validate", where.stdout.strip(), cwd=tmp_path)
    assert res.returncode == 3 and "pip install 'blockflow[runtime]'" in res.stderr, res.stdout + res.stderr
