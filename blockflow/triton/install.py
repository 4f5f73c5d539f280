"""Where the real Triton server lives, and the environment its Python stubs need.

Two layouts are found. The ``nvidia-pytriton`` wheel (what ``scripts/setup.sh`` installs)::

    site-packages/pytriton/tritonserver/bin/tritonserver
    site-packages/pytriton/tritonserver/backends/python/{libtriton_python.so,triton_python_backend_utils.py}
    site-packages/pytriton/tritonserver/python_backend_stubs/3.X/triton_python_backend_stub
    site-packages/nvidia_pytriton.libs/            (the server's and stub's shared libraries)

NVIDIA's ``nvcr.io/nvidia/tritonserver:<yy.mm>-py3`` containers (``/opt/tritonserver``)::

    bin/tritonserver  lib/  backends/python/{libtriton_python.so,triton_python_backend_stub,...}

``--triton-home`` (``BLOCKFLOW_TRITON_HOME``) names either; without it, ``tritonserver`` on
``PATH`` (a container) and then the wheel are tried. The wheel's stubs live apart from its
backend, so the stub for the running Python goes into a backend directory of our own; a
container's stub is in its backend already, built for the container's Python. The stub embeds
``libpython3.X.so.1.0`` and finds the environment's packages through ``PATH`` (a venv's
``pyvenv.cfg``); it does not reliably honour ``PYTHONPATH``, so every generated ``model.py`` puts
the roots of ``BLOCKFLOW_PYTHONPATH`` on ``sys.path`` before importing the block runtime.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import site
import sys
from dataclasses import dataclass
from pathlib import Path

from blockflow.core import env as blockflow_env
from blockflow.core.errors import EnvironmentProblem
from blockflow.core.nvml import gpu_count
from blockflow.triton import access, argv_key
from blockflow.triton.access import restricted_args as access_args
from blockflow.triton.flags import CUDA_POOL_MB

HOME_ENV = blockflow_env.TRITON_HOME
PROJECT_ROOT = Path(__file__).resolve().parents[2]
STUB = "triton_python_backend_stub"


@dataclass(frozen=True)
class TritonInstall:
    home: Path

    @property
    def layout(self) -> str:
        """``container`` (NVIDIA's image: the stub inside the Python backend) or ``pytriton`` (the wheel)."""
        return "container" if (self.home / "backends" / "python" / STUB).is_file() else "pytriton"

    @property
    def server(self) -> Path:
        return self.home / "bin" / "tritonserver"

    @property
    def libs(self) -> Path:
        return self.home / "lib" if self.layout == "container" else self.home.parent.parent / "nvidia_pytriton.libs"

    @property
    def python_backend(self) -> Path:
        return self.home / "backends" / "python"

    def stub(self, version: tuple[int, int] = (sys.version_info.major, sys.version_info.minor)) -> Path:
        if self.layout == "container":
            return self.python_backend / STUB
        return self.home / "python_backend_stubs" / f"{version[0]}.{version[1]}" / STUB

    def stub_python(self) -> str | None:
        """The Python version (``3.12``) the stub embeds, read from its ELF; None if it names none."""
        try:
            found = re.search(rb"libpython(3\.\d+)\.so", self.stub().read_bytes())
        except OSError:
            return None
        return found.group(1).decode() if found else None

    def problems(self) -> list[str]:
        """Every missing piece, each with its fix."""
        fix = "run ./scripts/setup.sh" if self.layout == "pytriton" else f"check --triton-home ({self.home})"
        out = []
        if not self.server.is_file():
            out.append(f"tritonserver binary missing at {self.server}; {fix}")
        if not (self.python_backend / "libtriton_python.so").is_file():
            out.append(f"Python backend missing at {self.python_backend}; {fix}")
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if not self.stub().is_file():
            out.append(f"no Python-backend stub for Python {here} at {self.stub()}; use Python 3.11-3.13")
        elif self.layout == "container" and self.stub_python() not in (None, here):
            out.append(f"the Python-backend stub {self.stub()} is built for Python {self.stub_python()}, this is {here}; "
                       f"install BlockFlow into that Python (python{self.stub_python()} -m pip install blockflow)")
        if not self.libs.is_dir():
            out.append(f"server libraries missing at {self.libs}; {fix}")
        return out


def locate(home: Path | None = None) -> TritonInstall:
    """Find the Triton installation, or raise :class:`EnvironmentProblem` with the fix.

    ``home`` (``--triton-home``), else ``$BLOCKFLOW_TRITON_HOME``, else the directory above the
    ``tritonserver`` on ``PATH`` when it is a container layout, else the nvidia-pytriton wheel.
    """
    named = home or (Path(os.environ[HOME_ENV]) if os.environ.get(HOME_ENV) else None)
    if named is not None:
        install = TritonInstall(named.resolve())
    else:
        on_path = shutil.which("tritonserver")
        found = TritonInstall(Path(on_path).resolve().parent.parent) if on_path else None
        if found is not None and found.layout == "container":
            install = found
        else:
            spec = importlib.util.find_spec("pytriton")
            if spec is None or not spec.submodule_search_locations:
                raise EnvironmentProblem("Triton server not found: no tritonserver on PATH and no nvidia-pytriton package; "
                                         f"run ./scripts/setup.sh, or name it with --triton-home (or {HOME_ENV})")
            install = TritonInstall(Path(list(spec.submodule_search_locations)[0]) / "tritonserver")
    problems = install.problems()
    if problems:
        raise EnvironmentProblem("; ".join(problems))
    return install


def prepare_backend_dir(install: TritonInstall, runtime_dir: Path) -> Path:
    """A backend directory whose ``python/`` holds the Python backend plus the stub for this Python
    (under ``runtime_dir``; a container's own backend directory already has both)."""
    if install.layout == "container":
        return install.home / "backends"
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


def user_cache() -> Path:
    """BlockFlow's directory in the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "blockflow"


def stub_environment(install: TritonInstall) -> tuple[dict[str, str], dict[str, str]]:
    """What ``tritonserver``'s Python stubs need, whoever starts it: directories to put first on
    ``PATH``-like variables, and variables to set."""
    first = {"PATH": str(Path(sys.executable).parent), "LD_LIBRARY_PATH": str(install.libs)}
    fixed = {
        blockflow_env.PYTHONPATH: os.pathsep.join(stub_pythonpath()),  # read by every generated model.py
        # A stub importing model.py would write 1/__pycache__/ into the repository; Triton then sees the
        # model as modified and reloads it whenever a model that depends on it is loaded (blockflow apply).
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    return first, fixed


def server_env(install: TritonInstall, runtime_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    first, fixed = stub_environment(install)
    for name, value in first.items():
        env[name] = os.pathsep.join(p for p in (value, env.get(name, "")) if p)
    env.update(fixed)
    env["PYTHONPATH"] = fixed[blockflow_env.PYTHONPATH]
    env["PYTHONUNBUFFERED"] = "1"
    env[blockflow_env.RUNTIME_DIR] = str(runtime_dir)
    return env


def standalone_script(install: TritonInstall, repository: Path, backend_base: Path, extra_args: list[str],
                      admin_key_file: Path | None = None, shm_key_file: Path | None = None) -> str:
    """A POSIX shell script that starts ``tritonserver`` by hand on a generated ``repository``,
    with the environment the block processes need (``blockflow triton-command``).

    With ``admin_key_file``, the server starts in explicit model-control mode (``blockflow apply
    --triton-grpc-url`` can change its plan) with its restricted APIs behind the key in that file,
    read when the server starts; without it, in Triton's default mode, where loads are refused and
    those APIs are behind a random key nobody has. Either key reaches Triton through the argv-key
    library (:mod:`blockflow.triton.argv_key`), not on its command line (see :func:`argv_key.library`
    for where it may go there). With ``shm_key_file``, Triton's shared-memory API is behind the key in that
    file; without it, behind a random key nobody has (no client registers a region). It listens on
    loopback unless told otherwise, and what it creates (its shared-memory regions included) is its
    user's alone (umask 077; see ``shm_guard.c``).

    TensorMQ needs no variable: its block processes share a private runtime directory derived
    from the repository's path (:mod:`blockflow.core.runtime_dir`).
    """
    backends = prepare_backend_dir(install, backend_base)
    # Only what the stub needs; PATH and LD_LIBRARY_PATH keep what the shell has after ours.
    first, fixed = stub_environment(install)
    exports = [f'{k}={shlex.quote(v)}"${{{k}:+:${k}}}"' for k, v in first.items()]
    exports += [f"{k}={shlex.quote(v)}" for k, v in fixed.items()]
    args = [
        f"--model-repository={repository.resolve()}",
        f"--backend-directory={backends}",
        "--disable-auto-complete-config",
        # Loopback unless the flags after the script say otherwise (tritonserver takes a flag's last value).
        "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
        # See ServerOptions.cuda_pool_mb: GPU tensors between Triton and the blocks need the pool.
        *[f"--cuda-memory-pool-byte-size={gpu}:{CUDA_POOL_MB * 2**20}" for gpu in range(gpu_count())],
        *(["--model-control-mode=explicit", "--load-model=*"] if admin_key_file is not None else []),
        # The stubs' regions under a name Triton's shared-memory API may not open (shm_guard.c).
        f"--backend-config=python,shm-region-prefix-name={blockflow_env.stub_shm_prefix(0, repository.resolve())}",
        *extra_args,
    ]
    # The model-repository, trace and logging APIs are always behind a key, and so is the shared-memory API:
    # the one in its key file, or, without one, a random key made at each start and given to nobody (Triton's
    # trace settings can write files wherever the server may). With the argv-key library, the keys are put into
    # tritonserver's arguments inside the process and never appear in /proc/<pid>/cmdline; without it (only where
    # /proc hides other users' processes, or the operator accepts it), the shell reads them onto the command line.
    keys = ((argv_key.ADMIN_KEY_FILE_VAR, argv_key.ADMIN_PLACEHOLDER, "key", admin_key_file),
            (argv_key.SHM_KEY_FILE_VAR, argv_key.SHM_PLACEHOLDER, "shm_key", shm_key_file))
    shim = argv_key.library()
    key_lines = ["umask 077"]
    if shim is not None:
        lib = shlex.quote(str(shim))
        key_lines += [f'[ -r {lib} ] || {{ echo "{shim} is missing: run blockflow triton-command again" >&2; exit 1; }}',
                      f'export {argv_key.PRELOAD_VAR}="${{LD_PRELOAD:-}}"',
                      f'export LD_PRELOAD={lib}"${{LD_PRELOAD:+:$LD_PRELOAD}}"']
        key_lines += [f"export {var}={shlex.quote(str(path.resolve()))}" if path is not None else f"unset {var}"
                      for var, _, _, path in keys]
        restricted = " " + " ".join(map(shlex.quote, access_args(argv_key.ADMIN_PLACEHOLDER, argv_key.SHM_PLACEHOLDER)))
    else:
        key_lines += [f"{name}=\"$(cat {shlex.quote(str(path.resolve()))})\"" if path is not None
                      else f"{name}=\"$(od -An -tx1 -N32 /dev/urandom | tr -d ' \\n')\"" for _, _, name, path in keys]
        restricted = " " + " ".join(access_args('"$key"', '"$shm_key"'))
    lines = ["#!/bin/sh",
             f"# tritonserver ({install.layout} layout at {install.home}) serving {repository.resolve()};",
             "# written by `blockflow triton-command`. Further tritonserver flags may follow on this script's command line."]
    lines += [f"export {e}" for e in exports]
    lines += key_lines
    lines.append(" ".join(["exec", shlex.quote(str(install.server)), *map(shlex.quote, args)]) + restricted + ' "$@"')
    return "\n".join(lines) + "\n"


def perf_analyzer_shm_key(cmd: list[str], env: dict[str, str], shm_key_file: Path) -> tuple[list[str], dict[str, str]]:
    """``cmd`` (a perf_analyzer command line) and ``env`` with the server's shared-memory key sent on its calls, so
    that ``--shared-memory system|cuda`` may register regions: ``-H`` as an HTTP header and as gRPC metadata alike
    (each protocol ignores the other's). The key stays off its command line as it does off tritonserver's: the
    argv-key library swaps it in for a placeholder (where there is none, :func:`argv_key.library` says whether it
    may go there)."""
    lib = argv_key.library()
    value = argv_key.SHM_PLACEHOLDER if lib is not None else shm_key_file.read_text().strip()
    flags = ["-H", f"{access.SHM_HEADER}:{value}", "-H", f"{access.GRPC_SHM_HEADER}:{value}"]
    return [cmd[0], *flags, *cmd[1:]], env if lib is None else argv_key.preload_env(env, lib, None, shm_key_file)


def perf_analyzer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment ``perf_analyzer`` from the tritonclient wheel runs in.

    It wants ``libb64.so.0d`` and ``libcudart.so.12`` by those names; the nvidia-pytriton wheel
    carries both under mangled ones (``libb64-<hash>.so.0d``). A directory of links with the plain
    names (in the user's cache) goes first on ``LD_LIBRARY_PATH``. Without a Triton install the
    environment is returned as it is.
    """
    env = dict(os.environ if base is None else base)
    try:
        libs = locate().libs
    except EnvironmentProblem:
        return env
    links = user_cache() / "perf-analyzer-libs"
    links.mkdir(parents=True, exist_ok=True)
    for plain, pattern in (("libb64.so.0d", "libb64-*.so.0d"), ("libcudart.so.12", "libcudart-*.so.12*")):
        found = sorted(libs.glob(pattern))
        link = links / plain
        if found and not (link.is_symlink() and link.resolve() == found[0].resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(found[0])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(links), str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    return env
