"""A server's private MPS daemon (``blockflow serve --mps``) on a real GPU: it serves a CUDA client, and
once stopped nothing of it is left, also where its starter is the PID namespace's init (a container's PID 1)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blockflow.triton.mps import CONTROL

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

# In a process of its own made a child subreaper, so that the daemon, which forks away from its
# starter, is re-parented to it as it would be to a container's PID 1.
SCENARIO = r"""
import ctypes, json, os, subprocess, sys, time
from pathlib import Path
from blockflow.triton.mps import MpsDaemon
from blockflow.core.procfs import processes
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER
daemon = MpsDaemon(Path(sys.argv[1]))
daemon.start()
env = {**os.environ, **daemon.env}
client = subprocess.run([sys.executable, "-c", "import torch; print(float(torch.ones(4, device='cuda').sum()))"],
                        env=env, capture_output=True, text=True, timeout=120)
servers = subprocess.run([sys.argv[2]], input="get_server_list\n", env=env, capture_output=True, text=True, timeout=30)
mine = f"CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir}".encode()
def ours():
    out = []
    for pid, fields in processes():
        try:
            if mine in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                out.append((pid, (Path(f"/proc/{pid}/comm")).read_text().strip(), fields[0], int(fields[1]) == os.getpid()))
        except OSError:
            pass
    return out
running = ours()
daemon.stop()
# A zombie's environment reads empty: look for the same PIDs, in any state.
left = [(pid, fields[0]) for pid, fields in processes() if pid in {r[0] for r in running}]
print(json.dumps({"client": client.stdout.strip(), "client_err": client.stderr[-500:], "servers": servers.stdout.split(),
                  "running": running, "left": left}))
"""


@pytest.mark.skipif(shutil.which(CONTROL) is None, reason=f"no {CONTROL} on PATH")
def test_private_mps_daemon_serves_a_client_and_leaves_nothing_when_stopped(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path / "mps"), shutil.which(CONTROL) or CONTROL],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["client"] == "4.0", seen["client_err"]
    assert seen["servers"], "the client's work did not start an MPS server of this daemon"
    # The control daemon ran as a child of the subreaper (re-parented), not a zombie.
    assert any(comm.startswith("nvidia-cuda-mps") and state not in "ZX" and adopted
               for _, comm, state, adopted in seen["running"]), seen["running"]
    assert seen["left"] == [], f"left after stop (zombies included): {seen['left']}"
