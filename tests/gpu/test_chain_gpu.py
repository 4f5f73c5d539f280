"""Chains on the GPU (hand_over: chain): links claim CUDA IPC tickets on a thread of their own and
hand theirs on; every request of many concurrent clients gets its unsplit reference's outputs."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from blockflow.clients.client import TaskClient
from blockflow.plan import naming

from .small_plan import served

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chain_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    raw: dict[str, Any] = yaml.safe_load((ROOT / "tests" / "plans" / "chain.yaml").read_text())
    raw["defaults"] = {"placement": "gpu", "max_batch_size": 8, "precision": "fp16", "instances": 2}
    raw["compare"] = []
    with served(tmp_path_factory.mktemp("chain"), yaml.safe_dump(raw)) as server:
        yield server.http_url


def test_a_chain_on_the_gpu_gives_every_concurrent_request_its_references_outputs(chain_url: str) -> None:
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1 + i % 5, 3, 32, 32), dtype=np.float32) for i in range(48)]
    with TaskClient(chain_url) as client:
        want = {(t, i): client.infer(naming.reference_model(t, graph=False), x) for t in ("task_a", "task_b") for i, x in enumerate(xs)}

    def one(job: tuple[str, int]) -> float:
        with TaskClient(chain_url) as c:
            got = c.infer(job[0], xs[job[1]])
        return float(np.abs(got - want[job]).max())

    for _ in range(3):  # links of two instances each, batching the calls of both tasks
        with ThreadPoolExecutor(16) as pool:
            assert max(pool.map(one, list(want))) <= 3e-2  # fp16: each process picks its own cuDNN algorithms
