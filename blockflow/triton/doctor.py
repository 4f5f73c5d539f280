"""``blockflow doctor``: what BlockFlow needs, whether it is there, and the fix when not."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from blockflow import __version__
from blockflow.core import env, nvml
from blockflow.core.errors import EnvironmentProblem
from blockflow.triton import argv_key
from blockflow.triton.front_door import find_nginx
from blockflow.triton.install import locate, perf_analyzer_env


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_checks() -> list[Check]:
    rows = []
    for dist, fix in (("torch", "pip install torch"), ("torchvision", "pip install torchvision"),
                      ("tritonclient", "pip install 'tritonclient[all]'"), ("pyzmq", "pip install pyzmq"),
                      ("nvidia-ml-py", "pip install nvidia-ml-py"), ("psutil", "pip install psutil")):
        v = _version(dist)
        rows.append(Check(dist, v is not None, v or f"not installed; fix: {fix} (or ./scripts/setup.sh)"))
    return rows


def _torch_check() -> Check:
    try:
        import torch
    except ImportError as exc:
        return Check("torch/CUDA", False, f"torch does not import: {exc}")
    if torch.cuda.is_available():
        return Check("torch/CUDA", True, f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s): "
                     + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
    return Check("torch/CUDA", True, "no CUDA device: blocks with placement auto run on the CPU")


def _nvml_check() -> Check:
    with nvml.session() as nv:
        if nv is None:
            return Check("NVML GPUs", True, "NVML unavailable (no driver or no GPU): CPU-only serving")
        names = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            names.append(f"{i}: {nv.nvmlDeviceGetName(h)} ({mem.total / 2**30:.0f} GiB)")
        return Check("NVML GPUs", True, f"driver {nv.nvmlSystemGetDriverVersion()}; " + "; ".join(names))


def _missing_libs(binary: Path, env_libs: Path) -> list[str]:
    if not shutil.which("ldd"):
        return []
    env = dict(os.environ, LD_LIBRARY_PATH=str(env_libs))
    res = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if "not found" in line]


def _triton_checks() -> list[Check]:
    try:
        install = locate()
    except EnvironmentProblem as exc:
        return [Check("tritonserver", False, str(exc))]
    where = f"nvidia-pytriton {_version('nvidia-pytriton') or '?'}" if install.layout == "pytriton" else f"{install.layout} layout"
    rows = [Check("tritonserver", True, f"{install.server} ({where})")]
    stub = install.stub()
    missing = _missing_libs(stub, install.libs)
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    if missing:
        fix = f"install libpython{py} (Debian/Ubuntu: apt-get install libpython{py})" if any("libpython" in m for m in missing) else "reinstall nvidia-pytriton"
        rows.append(Check("Python-backend stub", False, f"{stub} lacks {', '.join(missing)}; fix: {fix}"))
    else:
        rows.append(Check("Python-backend stub", True, str(stub)))
    missing = _missing_libs(install.server, install.libs)
    if missing:
        rows.append(Check("tritonserver libraries", False, f"missing {', '.join(missing)}; reinstall nvidia-pytriton"))
    pa = perf_analyzer_path()
    if pa is None:
        rows.append(Check("perf_analyzer", False, "not on PATH; fix: pip install 'tritonclient[all]==2.50.0' (ships the binary)"))
    else:
        # As BlockFlow runs it (`blockflow perf-analyzer`, the benchmarks): with the server's libraries.
        res = subprocess.run([pa, "--version"], capture_output=True, text=True, check=False, env=perf_analyzer_env())
        text = (res.stdout + res.stderr).strip().splitlines()
        ok = res.returncode == 0 or "error while loading shared libraries" not in (res.stdout + res.stderr)
        rows.append(Check("perf_analyzer", ok, f"{pa} (run it as `blockflow perf-analyzer ...`)" if ok else
                          f"{pa}: {text[-1] if text else 'does not run'}; fix: pip install 'blockflow[server]' (its libraries)"))
    return rows


def _argv_key_check() -> Check:
    name = "admin key off the command line"
    try:
        lib = argv_key.library()
    except EnvironmentProblem as exc:  # serve and triton-command refuse to start the server
        return Check(name, False, str(exc))
    if lib is None:
        return Check(name, True, f"no: {argv_key.find()}; the key goes on tritonserver's command line, as "
                     f"{argv_key.ALLOW_VAR}=1 or /proc's hidepid allows")
    return Check(name, True, f"yes ({lib}{', from ' + argv_key.LIB_VAR if os.environ.get(argv_key.LIB_VAR) else ''})")


def perf_analyzer_path() -> str | None:
    """perf_analyzer from PATH or from this interpreter's environment (a venv need not be activated)."""
    return shutil.which("perf_analyzer", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def run_checks() -> list[Check]:
    rows = [Check("python", True, f"{sys.version.split()[0]} at {sys.executable}"),
            Check("blockflow", True, f"{__version__} at {Path(__file__).resolve().parents[2]}")]
    rows += _package_checks()
    rows.append(_torch_check())
    rows.append(_nvml_check())
    rows += _triton_checks()
    rows.append(_argv_key_check())
    rows.append(_nginx_check())
    return rows


def _nginx_check() -> Check:
    try:
        nginx = find_nginx()
    except EnvironmentProblem as exc:
        return Check("nginx (HTTP front door)", False, str(exc))
    if nginx is None:
        return Check("nginx (HTTP front door)", False, "not found; fix: ./scripts/setup.sh, apt-get install nginx, or name "
                     f"the binary in {env.NGINX}")
    return Check("nginx (HTTP front door)", True, str(nginx))
