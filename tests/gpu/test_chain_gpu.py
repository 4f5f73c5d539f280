"""Chains on the GPU (hand_over: chain): links claim CUDA IPC tickets on a thread of their own and
hand theirs on; a chain that ends its task answers through its head; every request of many concurrent
clients gets its unsplit reference's outputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from ..conftest import worst_concurrent_error
from .small_plan import served

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["chain", "chain_tail"])
def chain_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, tuple[str, ...]]]:
    raw: dict[str, Any] = yaml.safe_load((ROOT / "tests" / "plans" / f"{request.param}.yaml").read_text())
    raw["defaults"] = {"placement": "gpu", "max_batch_size": 8, "precision": "fp16", "instances": 2}
    raw["blocks"] = {name: {k: v for k, v in b.items() if k != "instances"} for name, b in raw["blocks"].items()}
    raw["compare"] = []
    with served(tmp_path_factory.mktemp(request.param), yaml.safe_dump(raw)) as server:
        yield server.http_url, tuple(sorted(raw["tasks"]))


def test_a_chain_on_the_gpu_gives_every_concurrent_request_its_references_outputs(chain_url: tuple[str, tuple[str, ...]]) -> None:
    url, tasks = chain_url
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((1 + i % 5, 3, 32, 32), dtype=np.float32) for i in range(48)]
    for _ in range(3):  # links of two instances each, batching the calls of both tasks
        # fp16: each process picks its own cuDNN algorithms.
        assert worst_concurrent_error(url, tasks, xs, threads=16) <= 3e-2
