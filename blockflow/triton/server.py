"""Start, watch and stop a real ``tritonserver`` in explicit model-control mode.

The server runs in its own process session, so stopping it (SIGTERM, then
SIGKILL for the whole group after a grace period) also ends every Python-backend
stub it started; nothing is left behind.

A watchdog thread waits on the server process. Python-backend stubs watch their
parent by PID, and an unreaped (zombie) tritonserver still holds its PID, so
without the watchdog a server that crashed would leave its stubs, and their GPU
memory, alive until someone polled it. The watchdog reaps it at once and ends
the rest of its process group.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

from blockflow.core import env
from blockflow.core.errors import (
    EnvironmentProblem,
    ModelReloadError,
    ServerError,
    TritonApiError,
)
from blockflow.core.nvml import gpu_count
from blockflow.core.runtime_dir import ensure_tensormq, write_private
from blockflow.triton import access, argv_key
from blockflow.triton.api import TritonApi
from blockflow.triton.flags import check_extra_args
from blockflow.triton.front_door import FrontDoor
from blockflow.triton.install import (
    TritonInstall,
    locate,
    prepare_backend_dir,
    server_env,
)
from blockflow.triton.mps import MpsDaemon
from blockflow.triton.options import ServerOptions as ServerOptions  # its users import it from here, beside TritonServer
from blockflow.triton.options import check_port
from blockflow.triton.process_group import (
    die_with_parent,
    drain_then_terminate,
    group_members,
    kill_group,
    reap_orphans,
    stubs_by_model,
)
from blockflow.triton.warm_cores import WarmCores

log = logging.getLogger(__name__)


def make_runtime_dir() -> Path:
    """A private (0700) directory for the backend dir, sockets and logs of one server."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix="blockflow-", dir=base))
    path.chmod(0o700)
    return path


class TritonServer:
    """One ``tritonserver`` process. Use as a context manager, or call :meth:`start` / :meth:`stop`."""

    def __init__(self, options: ServerOptions, runtime_dir: Path | None = None, install: TritonInstall | None = None) -> None:
        self.options = options
        self.install = install or locate()
        self._own_runtime = runtime_dir is None
        self.runtime_dir = runtime_dir or make_runtime_dir()
        self.log_path = self.runtime_dir / env.SERVER_LOG
        self.process: subprocess.Popen[bytes] | None = None
        self.mps = MpsDaemon(self.runtime_dir / "mps") if options.mps else None
        self.warm_cores = WarmCores(self.runtime_dir / env.ACTIVITY_STAMP, options.warm_cores_ms) if options.warm_cores_ms > 0 else None
        # Set by the watchdog once the server process has exited (and been reaped), for any reason.
        self.exited = threading.Event()
        self._stopping = False
        self.admin_key = options.admin_key or access.new_secret()
        self.shm_key = options.shm_key or access.new_secret()
        self.front_door = (FrontDoor(self.runtime_dir, options.host, options.http_port, options.max_body_bytes)
                           if options.front_door else None)

    @property
    def admin_headers(self) -> dict[str, str]:
        """Headers that open Triton's restricted APIs (load, unload, repository index, trace, logging)."""
        return access.admin_headers(self.admin_key)

    def api(self, timeout: float = 900.0) -> TritonApi:
        """This server's API: the open calls over HTTP, the model-repository calls over gRPC with the admin key."""
        return TritonApi(self.http_url, self.grpc_url, self.admin_key, timeout)

    @property
    def admin_key_file(self) -> Path:
        return self.runtime_dir / access.ADMIN_KEY_FILE

    @property
    def shm_key_file(self) -> Path:
        """The file local clients read the shared-memory key from (they send it to register regions)."""
        return self.options.shm_key_file or self.runtime_dir / access.SHM_KEY_FILE

    @property
    def http_url(self) -> str:
        return f"{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.host}:{self.options.metrics_port}/metrics"

    def command(self) -> list[str]:
        o = self.options
        backends = prepare_backend_dir(self.install, self.runtime_dir)
        cmd = [str(self.install.server)]
        cmd += [f"--model-repository={r}" for r in o.repositories]
        cmd += [
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            *[f"--load-model={m}" for m in o.load],
            "--disable-auto-complete-config",
            *([f"--http-address={o.host}", f"--http-port={o.http_port}"] if self.front_door is None
              else [f"--http-address={self.front_door.triton_address}", "--http-port=0"]),
            f"--grpc-address={o.host}", f"--grpc-port={o.grpc_port}",
            f"--metrics-address={o.host}", f"--metrics-port={o.metrics_port}",
            # The user's own --log-verbose (a pass-through argument) replaces this one.
            *([] if any(a.startswith("--log-verbose") for a in o.extra_args) else [f"--log-verbose={o.log_verbose}"]),
            # Without the argv-key library, the keys themselves: only where /proc hides them, or the operator accepts it.
            *(access.restricted_args(self.admin_key, self.shm_key) if argv_key.library() is None
              else access.restricted_args(argv_key.ADMIN_PLACEHOLDER, argv_key.SHM_PLACEHOLDER)),
            # p50/p99 per model on the metrics endpoint (nv_inference_request_summary_us), for `blockflow status`.
            *(["--metrics-config=summary_latencies=true", f"--metrics-config=summary_quantiles={o.latency_quantiles}"]
              if o.latency_summaries else []),
            "--exit-timeout-secs=20",
            *[f"--cuda-memory-pool-byte-size={gpu}:{o.cuda_pool_mb * 2**20}" for gpu in range(gpu_count())],
            # Named shm regions let us find (and remove) what a killed stub left in /dev/shm.
            f"--backend-config=python,shm-region-prefix-name={env.stub_shm_prefix(os.getpid(), self.runtime_dir)}",
            "--backend-config=python,shm-default-byte-size=8388608",
            "--backend-config=python,shm-growth-byte-size=33554432",
            *check_extra_args(o.extra_args),
        ]
        return cmd

    def start(self, timeout: float = 300.0) -> None:
        o = self.options
        if problems := env.switch_problems({**os.environ, **o.env}):  # before anything starts: every block would fail its load
            raise EnvironmentProblem("; ".join(problems))
        for what, port in (("HTTP", o.http_port), ("gRPC", o.grpc_port), ("metrics", o.metrics_port)):
            check_port(o.host, port, what)
        cmd = self.command()
        ensure_tensormq(self.runtime_dir)
        write_private(self.admin_key_file, self.admin_key)
        write_private(self.shm_key_file, self.shm_key, group=o.shm_key_group)
        environ = server_env(self.install, self.runtime_dir)
        environ.update(o.env)
        shim = argv_key.library()
        if shim is not None:
            environ = argv_key.preload_env(environ, shim, self.admin_key_file, self.shm_key_file)
        if self.warm_cores is not None:
            self.warm_cores.start()
            environ.update(self.warm_cores.env)
            log.info("warm cores: %d pollers at SCHED_IDLE keep CPUs %s out of idle for %g ms after each block call",
                     len(self.warm_cores.cpus), ",".join(map(str, self.warm_cores.cpus)), o.warm_cores_ms)
        logfile = self.log_path.open("wb")
        try:
            if self.front_door is not None:
                self.front_door.start()
            if self.mps is not None:
                self.mps.start()
                environ.update(self.mps.env)
            # umask 077: what the server and its block processes create is their user's alone (the Python
            # backend's regions, which it fchmod()s to 0644, are kept 0600 by the preloaded shm_guard.c).
            self.process = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=environ, start_new_session=True, preexec_fn=die_with_parent, umask=0o077)
        except BaseException:
            self._stop_companions()
            raise
        finally:
            logfile.close()
        self._stopping = False
        self.exited.clear()
        threading.Thread(target=self._watch, args=(self.process,), name="tritonserver-watchdog", daemon=True).start()
        try:
            self.wait_ready(timeout)
            if shim is not None:
                self._check_key_is_not_the_placeholder()
        except BaseException:
            self.stop()
            raise

    def _check_key_is_not_the_placeholder(self) -> None:
        """Fail closed: had the library not loaded, Triton's key would be the placeholder, a public string."""
        try:
            TritonApi(grpc_url=self.grpc_url, admin_key=argv_key.ADMIN_PLACEHOLDER, timeout=10.0).index()
        except TritonApiError as exc:
            if "restricted" in str(exc):
                return  # refused, as it must be
            raise ServerError(f"could not check tritonserver's admin key against the placeholder: {exc}") from exc
        raise ServerError(f"tritonserver took {argv_key.ADMIN_PLACEHOLDER} as its admin key: the library that puts the real key "
                          f"in its arguments ({argv_key.library()}, LD_PRELOAD) did not run; it was stopped")

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        """Reap the server as soon as it exits; if nobody asked it to, end the stubs it leaves."""
        code = proc.wait()
        if not self._stopping:
            # Its stubs would notice the reaped parent within seconds, but a stub stuck in a CUDA
            # call or a long execute might not: SIGKILL the group, so their GPU memory comes back now.
            kill_group(proc.pid)
            # The tail goes into serve's own log: a restart starts the server's log afresh, and
            # what made it exit (an abort's message, a signal's backtrace) is in its last lines.
            log.error("tritonserver (pid %d) exited unexpectedly with code %s; its block processes were killed "
                      "(log: %s); its last lines:\n%s", proc.pid, code, self.log_path, self.log_tail(12))
        self.exited.set()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        return "\n".join(text[-lines:])

    def log_size(self) -> int:
        """The server log's size now: pass it to :meth:`log_since` to read what is logged after."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int, lines: int) -> list[str]:
        """The last ``lines`` non-blank lines the server logged after ``offset`` (a :meth:`log_size`)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()][-lines:]

    def errors_in_log(self) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        keys = ("failed to load", "Error", "error:", "Traceback", "address already in use")
        return [line for line in text if line.startswith("E") or any(k in line for k in keys)][-15:]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                details = "\n".join(self.errors_in_log()) or self.log_tail()
                raise ServerError(f"tritonserver exited with code {self.process.returncode} during start-up "
                                  f"(log: {self.log_path}):\n{details}")
            if self.api(timeout=2.0).ready():
                return
            time.sleep(0.25)
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s (log: {self.log_path}):\n{self.log_tail()}")

    def stub_processes(self) -> dict[str, list[int]]:
        """Model name -> PIDs of its live Python-backend stub processes (one per instance)."""
        return {} if self.process is None else stubs_by_model(self.process.pid)

    def heal(self, expected: dict[str, int], timeout: float = 300.0) -> list[str]:
        """Reload (through the model control API) every model with fewer live stubs than ``expected``.

        Triton's Python backend does not restart a stub that died: its requests fail until the
        model is loaded again. Returns the models reloaded; a load that fails or takes longer than
        ``timeout`` raises :class:`ModelReloadError`.
        """
        live = self.stub_processes()
        reloaded = []
        for model, count in expected.items():
            if len(live.get(model, [])) < count:
                # Triton loads a model again only if its files changed since the last load, and
                # for a config that changed it only updates what changed in place (2.51); a newer
                # file in the version directory makes it replace the model's instances.
                for repo in self.options.repositories:
                    for code in (Path(repo) / model).glob("*/model.py"):
                        os.utime(code)
                try:
                    self.api(timeout).load(model)
                except TritonApiError as exc:
                    raise ModelReloadError(model, f"block {model!r} lost a process and could not be reloaded: {exc}") from exc
                reloaded.append(model)
        return reloaded

    def stop(self, grace: float = 25.0) -> None:
        """SIGTERM the server (it unloads models and ends its stubs), then SIGKILL its whole process group."""
        proc = self.process
        if proc is None:
            self._stop_companions()
            return
        self._stopping = True
        if proc.poll() is None:
            until = time.monotonic() + grace  # the whole stop, however far the drain gets
            # A server that answers does in milliseconds; a hung one gets SIGTERM after 5 s.
            drained = drain_then_terminate(proc, self.api(timeout=min(grace, 5.0)), grace)
            try:
                # Once every model is unloaded, all Triton still waits for is idle HTTP connections
                # (a client's keep-alive): up to its exit timeout, with nothing left to finish.
                proc.wait(0.5 if drained else max(0.5, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        kill_group(proc.pid)
        proc.wait()
        # SIGKILLed stubs can take seconds to die while the driver tears down their CUDA contexts.
        deadline = time.monotonic() + 30
        while any(True for _ in group_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        reap_orphans(proc.pid)  # what is left of them, where this process is the container's init
        self._remove_shm()
        self.process = None
        self._stop_companions()
        if self._own_runtime:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def _stop_companions(self) -> None:
        """Stop what runs beside the server, once it is gone: the MPS daemon (after every client, the stubs), the
        warm-core pollers, the HTTP front door (the server drained its requests through it)."""
        for companion in (self.mps, self.warm_cores, self.front_door):
            if companion is not None:
                companion.stop()

    def _remove_shm(self) -> None:
        # The Python backend's regions, and TensorMQ host pools of stubs that were killed.
        for prefix in (env.stub_shm_prefix(os.getpid(), self.runtime_dir), env.pool_shm_prefix(self.runtime_dir)):
            for path in Path("/dev/shm").glob(prefix + "*"):
                path.unlink(missing_ok=True)

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
