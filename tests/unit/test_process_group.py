"""Reaping a daemon that was handed to this process, as ``blockflow serve`` is as a container's PID 1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

# In a process of its own, made a child subreaper (what PID 1 is for a PID namespace): two "daemons"
# (copies of sleep named like MPS's control daemon; ours quits after 0.3 s, another server's runs on)
# and an unrelated sleep are started in the background by a shell that exits at once, so all are
# re-parented to it, as `nvidia-cuda-mps-control -d` is.
SCENARIO = r"""
import ctypes, json, os, subprocess, sys, time
from pathlib import Path
from blockflow.triton.process_group import reap_adopted
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER
daemon = sys.argv[1]
subprocess.run(["sh", "-c", f"D=/ours '{daemon}' 0.3 & D=/theirs '{daemon}' 60 & sleep 0.3 &"], check=True)
def children():
    out = {}
    for e in Path("/proc").iterdir():
        try:
            if e.name.isdigit() and int((e / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                out[int(e.name)] = (e / "comm").read_text().strip()
        except OSError:
            pass
    return out
deadline = time.monotonic() + 10
while sorted((adopted := children()).values()) != ["nvidia-cuda-mps", "nvidia-cuda-mps", "sleep"] and time.monotonic() < deadline:
    time.sleep(0.01)  # until each has exec'd (a forked shell is named sh until then)
start = time.monotonic()
reaped = reap_adopted("nvidia-cuda-mps-control", timeout=20, environ="D=/ours")
took = time.monotonic() - start
left = children()
for pid in left:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps({"adopted": sorted(adopted.values()), "reaped": [adopted.get(p) for p in reaped], "left": sorted(left.values()),
                  "took": took}))
"""


def test_a_daemon_handed_to_this_process_is_reaped_and_nothing_else(tmp_path: Path) -> None:
    daemon = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", daemon)
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(daemon)], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["adopted"] == ["nvidia-cuda-mps", "nvidia-cuda-mps", "sleep"]  # all re-parented to it
    assert seen["reaped"] == ["nvidia-cuda-mps"]  # ours, once it exited
    assert seen["left"] == ["nvidia-cuda-mps", "sleep"] and seen["took"] < 20  # the other's was not waited for
