"""An NVIDIA MPS control daemon private to one server (``blockflow serve --mps``).

Without MPS, each block process has its own CUDA context and the GPU time-slices between
them: kernels of different blocks never overlap. Under MPS the block processes' kernels share
the GPU concurrently. On an H100 (docs/performance.md) that raised the 4-block ResNet-50's
throughput at concurrency 32 from 0.85x to 1.20x the monolithic CUDA-graph model's; per-process
memory did not change.

The daemon gets its own pipe and log directories inside the server's private runtime directory
(``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``), so only this server's processes use
it, another MPS daemon on the machine is left alone, and no device setting changes. It is told
to quit when the server stops.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from blockflow.core.errors import EnvironmentProblem
from blockflow.triton.process_group import reap_adopted

CONTROL = "nvidia-cuda-mps-control"


class MpsDaemon:
    def __init__(self, directory: Path) -> None:
        self.pipe_dir = directory / "pipe"
        self.log_dir = directory / "log"
        self._binary: str | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a process needs in its environment to be an MPS client of this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def start(self) -> None:
        binary = shutil.which(CONTROL)
        if binary is None:
            raise EnvironmentProblem(f"--mps needs {CONTROL} (part of the NVIDIA driver's utilities) on PATH; "
                                     "serve without --mps, or install the driver utilities")
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        res = subprocess.run([binary, "-d"], env={**os.environ, **self.env}, stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=30, check=False)
        if res.returncode != 0:
            raise EnvironmentProblem(f"{CONTROL} -d failed ({res.returncode}): {(res.stderr or res.stdout).strip()[:300]}")
        self._binary = binary

    def stop(self) -> None:
        if self._binary is None:
            return
        subprocess.run([self._binary], input="quit\n", env={**os.environ, **self.env}, capture_output=True, text=True,
                       timeout=30, check=False)
        self._binary = None
        # The daemon and its servers, where they were handed to this process (a container's PID 1):
        # each server restart would otherwise leave them as zombies.
        reap_adopted(CONTROL, timeout=10, environ=f"CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir}")
