"""What every benchmark shares: a plan rendered into a fresh repository, served by a real
``tritonserver`` on free loopback ports (``ServerOptions.on_free_ports``), stopped afterwards.

    with served(load_plan("plans/bench_r50.yaml"), "bench-x-", cuda_pool_mb=1024) as server:
        perf_analyzer(server.http_url, ...)
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from blockflow.bench import stamp
from blockflow.clients.images import random_jpegs
from blockflow.core import env, nvml
from blockflow.ensemble_gen import generator
from blockflow.plan import Plan
from blockflow.triton.server import ServerOptions, TritonServer


def rendered(plan: Plan, prefix: str = "bench-") -> Path:
    """The plan's model repository, written to a new temporary directory."""
    repo = Path(tempfile.mkdtemp(prefix=prefix))
    generator.write(generator.render(plan), repo)
    return repo


@contextmanager
def served(plan: Plan, prefix: str = "bench-", start_timeout: float = 900.0, **options: Any) -> Iterator[TritonServer]:
    """A server running ``plan`` (every model loaded unless ``load=`` says otherwise), for the ``with`` body."""
    server = TritonServer(ServerOptions.on_free_ports([rendered(plan, prefix)], **options))
    server.start(start_timeout)
    try:
        yield server
    finally:
        server.stop()


def commit() -> str:
    """The commit a report names: ``$BLOCKFLOW_COMMIT``, else that of a stamp this tree matches
    (:mod:`blockflow.bench.stamp`, the GPU machines' copies), else git's, marked ``-dirty`` when the
    tree differs from it."""
    return os.environ.get(env.COMMIT) or stamp.verified() or stamp.describe() or "unknown"


def switches() -> dict[str, str]:
    """The behaviour switches (``blockflow.core.env.SWITCHES``) set in this environment, which the server's
    block processes inherit: a result records them, so a turn run with one set says so in its own data."""
    return {name: os.environ[name] for name in env.SWITCHES if name in os.environ}


def write_results(out: Path, result: dict[str, Any], report: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """``results.json`` and ``report.md`` (``report`` of the results) in ``out``; returns ``result``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "report.md").write_text(report(result))
    return result


def device_name() -> str:
    """GPU 0's name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def gpu_used_mib(index: int = 0) -> float:
    """Memory in use on GPU ``index`` (MiB, NVML's figure); NaN without NVML (a dry run on the CPU)."""
    with nvml.session() as nv:
        if nv is None:
            return float("nan")
        return float(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(index)).used) / 2**20


def task_images(plan: Plan, task: str, n: int, seed: int = 0) -> npt.NDArray[np.generic]:
    """``n`` seeded random images as ``task`` takes them: uint8 noise in its layout for a task whose model
    takes uint8 images, noise at the network's size encoded as JPEG (uint8 ``[n, L]``, one file per row)
    for one that takes encoded images, else standard normal float32 (already "normalized")."""
    model = plan.models[plan.blocks[plan.tasks[task].path[0]].model]
    rng = np.random.default_rng(seed)
    if model.input is not None and model.input.dtype == "encoded":
        return random_jpegs(n, model.input_shape[1], model.input_shape[2], seed)
    if model.input is not None and model.input.dtype == "uint8":
        return rng.integers(0, 256, (n, *model.image_shape), dtype=np.uint8)
    return rng.standard_normal((n, *model.image_shape), dtype=np.float32)

