"""`blockflow serve` with every filesystem read-only but one tmpfs, as the Helm chart runs it
(``readOnlyRootFilesystem``, an ``emptyDir`` for temporary files, a memory ``emptyDir`` at /dev/shm).

A private mount namespace (``unshare -m``, needs root) mounts a tmpfs as the only writable
directory, remounts ``/`` read-only (the checkout and the virtual environment with it; /dev/shm
is its own mount and stays writable, as in the pod) and starts ``blockflow serve`` there with
``TMPDIR`` and ``HOME`` on the tmpfs, as the chart sets them. Anything that writes elsewhere
fails the start, a request or the stop.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from blockflow.clients.client import TaskClient
from blockflow.triton.options import free_port
from blockflow.triton.process_group import group_members

from ..conftest import ROOT

pytestmark = pytest.mark.integration
PLAN = """version: 1
name: read-only-root
models:
  r18: {arch: resnet18, cut_points: [layer2], input_shape: [3, 32, 32], num_classes: 10}
defaults: {placement: cpu, max_batch_size: 4}
blocks:
  front: {model: r18, stages: 0, weights: {seed: 1}}
  back: {model: r18, stages: 1, weights: {seed: 1}}
tasks:
  ro: {path: [front, back]}
transport: tensormq
references: [eager]
"""
# In the namespace: a tmpfs at /tmp as the chart's emptyDir (the Python backend makes its
# directories under /tmp whatever TMPDIR says), what this test runs from kept visible where it is
# (CI may clone the checkout under /tmp; the GPU machines unpack Triton and packages there), then
# every mount but the kernel's and /tmp read-only, then serve.
SETUP = r"""set -e
mount --bind /tmp "$KEEP"
mount -t tmpfs -o size=4g,mode=1777 tmpfs /tmp
for p in $(printf '%s' "$RESTORE" | tr ':' ' '); do
  mkdir -p "$p"; mount --bind "$KEEP/${p#/tmp/}" "$p"
done
awk '{print $2}' /proc/self/mounts | while read -r m; do
  case "$m" in /proc*|/sys*|/dev*|/tmp) ;; *) mount -o remount,bind,ro "$m" 2>/dev/null || true ;; esac
done
if touch /blockflow-ro-probe "$ROOTDIR/.blockflow-ro-probe" 2>/dev/null; then echo "still writable" >&2; exit 97; fi
printf '%s' "$PLAN" > /tmp/plan.yaml
exec "$@"
"""


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False).returncode == 0


def test_serve_runs_on_a_read_only_root(tmp_path: Path) -> None:
    if not _can_unshare():  # a container without CAP_SYS_ADMIN: the capability is the machine's, not ours
        pytest.skip("needs root and mount namespaces (unshare -m) to make the filesystems read-only")
    keep = Path(tempfile.mkdtemp(prefix="blockflow-ro-", dir="/var/tmp"))  # where /tmp stays reachable, inside only
    http, grpc, metrics, control = free_port(), free_port(), free_port(), free_port()
    token = "read-only-root-test-token-0123456789"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BLOCKFLOW_", "XDG_", "TMP")) or k == "BLOCKFLOW_TRITON_HOME"}
    # The checkout, the Python and Triton (with its libraries beside it) this test runs, where they sit
    # under /tmp: their top directory there is bound back, read-only like the rest.
    mine = [ROOT, Path(sys.prefix), *map(Path, filter(None, env.get("PYTHONPATH", "").split(os.pathsep))),
            Path(env.get("BLOCKFLOW_TRITON_HOME", "/"))]
    restore = sorted({str(Path(*r.parts[:3])) for r in (m.resolve() for m in mine) if len(r.parts) > 2 and r.parts[1] == "tmp"})
    # HOME on the writable volume, as the chart sets it (caches of torch and CUDA go there).
    env |= {"KEEP": str(keep), "ROOTDIR": str(ROOT), "RESTORE": ":".join(restore), "PLAN": PLAN, "HOME": "/tmp/home",
            "BLOCKFLOW_TOKEN": token, "PYTHONDONTWRITEBYTECODE": "1"}
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", SETUP, "sh",
                             sys.executable, "-m", "blockflow", "serve", "--plan", "/tmp/plan.yaml", f"--http-port={http}",
                             f"--grpc-port={grpc}", f"--metrics-port={metrics}", f"--control-port={control}"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        # Ready is serve's word ("ready in ..." once the control service listens too), not Triton's:
        # Triton answers ready a moment before serve has started its control service.
        while b"ready in" not in (tmp_path / "serve.log").read_bytes():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready in 600 s"
            time.sleep(1)
        with TaskClient(f"127.0.0.1:{http}", timeout_s=30) as client:
            assert client.is_ready()
            x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
            split, whole = client.infer("ro", x), client.infer("ro__ref", x)
        np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-5)
        # The control service keeps its plans and answers from the tmpfs too.
        r = httpx.get(f"http://127.0.0.1:{control}/status", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
    text = (tmp_path / "serve.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "Read-only file system" not in text, text[-3000:]
    assert list(group_members(proc.pid)) == []
    keep.rmdir()
