"""Where the real Triton server lives, and the environment its Python stubs need.

The server comes from PyPI inside the ``nvidia-pytriton`` wheel::

    site-packages/pytriton/tritonserver/bin/tritonserver
    site-packages/pytriton/tritonserver/backends/python/{libtriton_python.so,triton_python_backend_utils.py}
    site-packages/pytriton/tritonserver/python_backend_stubs/3.X/triton_python_backend_stub
    site-packages/nvidia_pytriton.libs/            (the server's and stub's shared libraries)

``BLOCKFLOW_TRITON_HOME`` may point at another ``tritonserver`` directory of the
same layout (the GPU bundle does). The stub for the running Python goes into a
backend directory of our own; the stub embeds ``libpython3.X.so.1.0`` and finds
the environment's packages through ``PATH`` (a venv's ``pyvenv.cfg``); it does
not reliably honour ``PYTHONPATH``, so every generated ``model.py`` puts the roots
of ``BLOCKFLOW_PYTHONPATH`` on ``sys.path`` before importing the block runtime.
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys
from dataclasses import dataclass
from pathlib import Path

from blockflow.core import env as blockflow_env
from blockflow.core.errors import EnvironmentProblem

HOME_ENV = blockflow_env.TRITON_HOME
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TritonInstall:
    home: Path

    @property
    def server(self) -> Path:
        return self.home / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.home.parent.parent / "nvidia_pytriton.libs"

    @property
    def python_backend(self) -> Path:
        return self.home / "backends" / "python"

    def stub(self, version: tuple[int, int] = (sys.version_info.major, sys.version_info.minor)) -> Path:
        return self.home / "python_backend_stubs" / f"{version[0]}.{version[1]}" / "triton_python_backend_stub"

    def problems(self) -> list[str]:
        """Every missing piece, each with its fix."""
        out = []
        if not self.server.is_file():
            out.append(f"tritonserver binary missing at {self.server}; run ./scripts/setup.sh")
        if not (self.python_backend / "libtriton_python.so").is_file():
            out.append(f"Python backend missing at {self.python_backend}; run ./scripts/setup.sh")
        if not self.stub().is_file():
            out.append(f"no Python-backend stub for Python {sys.version_info.major}.{sys.version_info.minor} "
                       f"at {self.stub()}; use Python 3.8-3.13")
        if not self.libs.is_dir():
            out.append(f"server libraries missing at {self.libs}; reinstall nvidia-pytriton")
        return out


def locate() -> TritonInstall:
    """Find the Triton installation, or raise :class:`EnvironmentProblem` with the fix."""
    env = os.environ.get(HOME_ENV)
    if env:
        install = TritonInstall(Path(env).resolve())
    else:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise EnvironmentProblem("Triton server not found: the nvidia-pytriton package is not installed; "
                                     f"run ./scripts/setup.sh (or set {HOME_ENV})")
        install = TritonInstall(Path(list(spec.submodule_search_locations)[0]) / "tritonserver")
    problems = install.problems()
    if problems:
        raise EnvironmentProblem("; ".join(problems))
    return install


def prepare_backend_dir(install: TritonInstall, runtime_dir: Path) -> Path:
    """A backend directory whose ``python/`` holds the Python backend plus the stub for this Python."""
    backends = runtime_dir / "backends"
    python = backends / "python"
    python.mkdir(parents=True, exist_ok=True)
    for src in (*install.python_backend.glob("*.so"), install.python_backend / "triton_python_backend_utils.py", install.stub()):
        link = python / src.name
        if not link.exists():
            # A link keeps the stub's $ORIGIN-relative RPATH pointing at the wheel's libraries.
            link.symlink_to(src)
    return backends


def stub_pythonpath() -> list[str]:
    """Import roots a block process needs: this project and every site-packages of this interpreter."""
    roots = [str(PROJECT_ROOT)]
    roots += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    roots += [p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p) and Path(p).is_dir()]
    roots += [p for p in site.getsitepackages() if Path(p).is_dir()]
    return list(dict.fromkeys(roots))


def server_env(install: TritonInstall, runtime_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [str(install.libs), env.get("LD_LIBRARY_PATH", "")] if p)
    roots = os.pathsep.join(stub_pythonpath())
    env["PYTHONPATH"] = roots
    env[blockflow_env.PYTHONPATH] = roots  # read by every generated model.py (see ensemble_gen.generator)
    env["PYTHONUNBUFFERED"] = "1"
    # A stub importing model.py would write 1/__pycache__/ into the repository; Triton then sees the
    # model as modified and reloads it whenever a model that depends on it is loaded (blockflow apply).
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env[blockflow_env.RUNTIME_DIR] = str(runtime_dir)
    return env
