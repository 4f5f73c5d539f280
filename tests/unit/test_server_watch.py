"""The block process's server watch, with real processes: a 'server' killed by SIGKILL and left
unreaped (a zombie, which python_backend's own ``kill(pid, 0)`` check takes for alive)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from blockflow.backend.server_watch import stub_arguments
from blockflow.core.procfs import exiting

# The 'block': a watch with one clean-up, says its pid, then would sleep for a minute.
BLOCK = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from blockflow.backend.server_watch import ServerWatch
    watch = ServerWatch("test block", period_s=0.1)
    watch.on_gone(lambda: Path(sys.argv[-1]).write_text("cleaned"))
    watch.on_gone(lambda: 1 / 0)  # a failing clean-up does not stop the exit
    print(os.getpid(), flush=True)
    time.sleep(60)
""")
# The 'server': starts the block (directly, or through a launcher process that stays between them,
# with a stub's command line that names the server), says the block's pid, and waits to be killed.
SERVER = textwrap.dedent("""
    import os, subprocess, sys, time
    code, marker, launcher = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    log = open(marker + ".log", "w")
    if launcher:  # argv as python_backend gives a stub: ... SHM_REGION DEFAULT GROWTH PARENT_PID ...
        stub = ["/opt/x/triton_python_backend_stub", "-c", code, "8388608", "33554432", str(os.getpid()), marker]
        cmd = [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[2:], executable=sys.argv[1])",
               sys.executable, *stub]
    else:
        cmd = [sys.executable, "-c", code, marker]
    block = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, stderr=log)
    assert block.stdout is not None
    print(block.stdout.readline().strip(), flush=True)
    time.sleep(60)
""")


@contextmanager
def a_server_and_its_block(tmp_path: Path, launcher: bool = False) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """A 'server' process, its 'block' (watched) pid, and the file the block's clean-up writes."""
    marker = tmp_path / "cleaned"
    server = subprocess.Popen([sys.executable, "-c", SERVER, BLOCK, str(marker), "1" if launcher else "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        yield server, int(server.stdout.readline()), marker
    finally:
        server.kill()  # its block follows within a period
        server.wait()


@pytest.mark.parametrize("launcher", [False, True], ids=["server-is-parent", "launcher-between"])
def test_a_block_exits_and_cleans_up_when_its_server_is_killed_and_left_a_zombie(tmp_path: Path, launcher: bool) -> None:
    with a_server_and_its_block(tmp_path, launcher) as (server, block, marker):
        if launcher:
            assert psutil.Process(block).ppid() != server.pid
        assert not exiting(block)
        os.kill(server.pid, signal.SIGKILL)
        # Not reaped: the server stays a zombie while the block is watched.
        deadline = time.monotonic() + 10
        while not exiting(block) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert psutil.Process(server.pid).status() == psutil.STATUS_ZOMBIE
        assert exiting(block), "the block process outlived its killed server"
        assert marker.read_text() == "cleaned"
        said = Path(f"{marker}.log").read_text()
        assert f"test block: tritonserver (pid {server.pid}) has exited" in said
        assert "clean-up failed: ZeroDivisionError" in said


def test_a_watch_in_a_live_server_stays_quiet(tmp_path: Path) -> None:
    with a_server_and_its_block(tmp_path) as (_, block, marker):
        time.sleep(0.5)  # five periods
        assert not exiting(block) and not marker.exists()


def test_the_stub_command_line_gives_the_server_and_the_region() -> None:
    argv = [b"/opt/tritonserver/backends/python/triton_python_backend_stub", b"/repo/trunk/1/model.py",
            b"triton_python_backend_shm_region_4f1c", b"8388608", b"33554432", b"4242", b"/opt/tritonserver/backends/python",
            b"336", b"trunk_0_0", b"/opt/tritonserver/backends/python"]
    assert stub_arguments(b"\0".join(argv)) == (4242, "triton_python_backend_shm_region_4f1c")
    assert stub_arguments(b"\0".join([b"/usr/bin/python3", *argv[1:]])) == (None, None)  # not a stub
    assert stub_arguments(b"\0".join(argv[:5])) == (None, None)
    assert stub_arguments(b"\0".join([*argv[:2], b"../escape", *argv[3:]])) == (4242, None)  # never a path
