"""``BLOCKFLOW_CUDA_SCHEDULE`` on a real GPU: the wait mode set before torch makes its context is the one the
context runs (the driver's flags of the current context; each in a fresh process, as the flag is read when the
context is made), and once the context is made, setting it is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCENARIO = r"""
import sys, torch
from blockflow.core import cuda
cuda.set_schedule(0, sys.argv[1])
torch.ones(1, device="cuda").sum().item()  # the context exists now
torch.cuda.current_stream().synchronize()
print(cuda.schedule())
try:
    cuda.set_schedule(0, "spin")
except Exception as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("mode", ["blocking", "yield", "spin"])
def test_the_wait_mode_set_before_torch_starts_is_the_contexts(mode: str) -> None:
    run = subprocess.run([sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[-2] == mode
    assert lines[-1].startswith("refused:") and "made already" in lines[-1]
