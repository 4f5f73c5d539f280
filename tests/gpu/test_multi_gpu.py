"""A task whose blocks span two GPUs gives the monolithic model's outputs, on TensorMQ and triton-gpu."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from blockflow.clients.client import TaskClient
from blockflow.ensemble_gen import generator
from blockflow.plan import load_plan
from blockflow.triton.server import ServerOptions, TritonServer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_task_spanning_two_gpus_matches_reference(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    repo = tmp_path / "repo"
    generator.write(generator.render(load_plan(ROOT / "tests" / "plans" / "gpu_two_gpus.yaml")), repo)
    with TritonServer(ServerOptions.on_free_ports([repo])) as server:
        with TaskClient(server.http_url) as c:
            for batch in (1, 3, 8):
                x = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224), dtype=np.float32)
                want = c.infer("span__ref", x)
                for model in ("span", "span__triton_gpu"):
                    got = c.infer(model, x)
                    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4, (model, batch)
