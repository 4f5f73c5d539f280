"""``BLOCKFLOW_CUDA_SCHEDULE`` on a real GPU: the wait mode set before torch makes its context is the one the
context has (each in a fresh process, as the flag is read when the context is made)."""

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
print(cuda.schedule(0))
"""


@pytest.mark.parametrize("mode", ["blocking", "yield", "spin"])
def test_the_wait_mode_set_before_torch_starts_is_the_contexts(mode: str) -> None:
    run = subprocess.run([sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == mode
