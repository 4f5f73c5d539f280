"""The HTTP front door: nginx on the server's public HTTP port, Triton's own HTTP on a Unix socket.

Why it exists: Triton 2.51's HTTP front end reads a request body through ``alloca`` of one
``evbuffer_iovec`` per buffer segment (``http_server.cc``, ``EVBufferToInput``), and a chunked
body (``Transfer-Encoding: chunked``) arrives as one segment per chunk. A request of ~500,000
small chunks (16 MiB in 32-byte chunks) overflows the worker thread's 8 MiB stack before any
check runs: SIGSEGV, and every request in flight is lost. No 2.51 option bounds it
(``--http-max-input-size`` came in 2.59 and is checked after the ``alloca``; upstream fixed the
``alloca`` in 2.60). A body with a ``Content-Length`` is read into one segment and is safe.

So nginx listens where clients connect: it reads each request's body whole
(``proxy_request_buffering``, in memory up to the limit), refuses one larger than
``max_body_bytes`` (413), and hands Triton the body with a ``Content-Length``. Triton's HTTP
listens on ``<runtime dir>/triton-http.sock``, inside the server's 0700 runtime directory, so no
other user reaches it behind nginx's back. Errors nginx answers itself (413, 502 while Triton
restarts, 504) carry a JSON body like Triton's, ``{"error": "..."}``.

nginx is found as ``BLOCKFLOW_NGINX``, else beside this Python (``scripts/setup.sh`` puts
Debian's binary in ``.venv/bin``), else on ``PATH`` or in ``/usr/sbin``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from blockflow.core import env
from blockflow.core.errors import EnvironmentProblem, ServerError
from blockflow.triton.process_group import die_with_parent, kill_group, reap_orphans

SOCKET_NAME = "triton-http.sock"
DIR_NAME = "front-door"
# Triton 2.59's own default for --http-max-input-size: what a body may hold unless the plan needs more.
DEFAULT_MAX_BODY_BYTES = 64 << 20


def find_nginx() -> Path | None:
    """The nginx binary to run, or None."""
    named = os.environ.get(env.NGINX)
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EnvironmentProblem(f"{env.NGINX}={named} is not an executable file")
        return path
    for candidate in (Path(sys.executable).parent / "nginx", shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def _json_error(code: int, text: str) -> str:
    """A named location that answers ``code`` with Triton's JSON error form (``text``: no quotes, backslashes or $)."""
    assert not any(c in text for c in '"\\$'), text
    return f'        location @e{code} {{ default_type application/json; return {code} "{{\\"error\\":\\"{text}\\"}}"; }}'


def config(root: Path, host: str, port: int, upstream: Path, max_body_bytes: int, workers: int) -> str:
    """nginx's configuration: every path in ``root``, Triton's socket as the one upstream."""
    user = pwd.getpwuid(os.geteuid()).pw_name
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    temp = "\n".join(f"    {k}_temp_path {root / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""# Written by blockflow.triton.front_door for one tritonserver; nginx reads nothing else.
{f"user {user};" if os.geteuid() == 0 else "# not root: nginx's workers run as this user"}
worker_processes {workers};
pid {root / "nginx.pid"};
error_log {root / "error.log"} warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    server_tokens off;
{temp}
    client_max_body_size {max_body_bytes};
    client_body_buffer_size {max_body_bytes};
    keepalive_timeout 600s;
    keepalive_requests 1000000;
    upstream triton {{
        server unix:{upstream};
        keepalive 256;
        keepalive_requests 1000000;
        keepalive_timeout 600s;
    }}
    server {{
        listen {listen} backlog=4096;
        location / {{
            proxy_pass http://triton;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_request_buffering on;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
            error_page 413 = @e413;
            error_page 502 = @e502;
            error_page 504 = @e504;
        }}
{_json_error(413, f"request body larger than {max_body_bytes} bytes, the limit of this server's HTTP front door")}
{_json_error(502, "tritonserver does not answer (starting or restarting); try again")}
{_json_error(504, "tritonserver did not answer in time")}
    }}
}}
"""


class FrontDoor:
    """nginx in front of one tritonserver's HTTP: :meth:`start` before the server, :meth:`stop` after it."""

    def __init__(self, runtime_dir: Path, host: str, port: int, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.root = runtime_dir / DIR_NAME
        self.upstream = runtime_dir / SOCKET_NAME
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def triton_address(self) -> str:
        """What Triton's ``--http-address`` is given: its Unix socket."""
        return f"unix:{self.upstream}"

    def start(self, timeout: float = 30.0) -> None:
        nginx = find_nginx()
        if nginx is None:
            raise EnvironmentProblem(
                "nginx not found: BlockFlow puts it in front of Triton's HTTP port (Triton 2.51 crashes on a chunked "
                "request of many small chunks); run ./scripts/setup.sh (it puts Debian's nginx in .venv/bin), install "
                f"nginx, or name the binary in {env.NGINX}")
        self.root.mkdir(mode=0o700, exist_ok=True)
        self.upstream.unlink(missing_ok=True)
        conf = self.root / "nginx.conf"
        conf.write_text(config(self.root, self.host, self.port, self.upstream, self.max_body_bytes,
                               min(8, os.cpu_count() or 1)))
        log = (self.root / "nginx.log").open("wb")
        try:
            self.process = subprocess.Popen([str(nginx), "-p", str(self.root), "-c", str(conf), "-e", str(self.root / "error.log"),
                                             "-g", "daemon off;"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=die_with_parent)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"nginx (the HTTP front door) exited with code {self.process.returncode} at start-up:\n"
                                  f"{self.log_tail()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise ServerError(f"nginx (the HTTP front door) did not listen on {self.host}:{self.port} within {timeout:g} s:\n"
                          f"{self.log_tail()}")

    def log_tail(self, lines: int = 12) -> str:
        text = []
        for name in ("nginx.log", "error.log"):
            try:
                text += (self.root / name).read_text(errors="replace").splitlines()
            except OSError:
                pass
        return "\n".join(text[-lines:]) or "(no log)"

    def stop(self) -> None:
        """SIGQUIT (nginx's graceful stop: requests in flight finish; the master waits for its workers), then
        SIGKILL to its whole group after 10 s; workers left to this process (``serve`` as PID 1) are reaped."""
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGQUIT)
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        kill_group(proc.pid)
        proc.wait()
        reap_orphans(proc.pid)
        self.upstream.unlink(missing_ok=True)
