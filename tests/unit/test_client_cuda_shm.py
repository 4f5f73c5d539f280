"""Without a GPU, CUDA shared-memory inputs fail with a clear error (the GPU path: tests/gpu/test_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockflow.clients.client import AsyncTaskClient, TaskClient
from blockflow.core.errors import ClientError


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU; tests/gpu covers it")
def test_cuda_inputs_without_a_gpu_name_the_fix() -> None:
    with TaskClient("127.0.0.1:1", input_memory="cuda") as c:  # no server needed: the check comes first
        with pytest.raises(ClientError, match="input_memory='host'"):
            c.infer("any", np.zeros((1, 3, 32, 32), np.float32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU; tests/gpu covers it")
def test_async_cuda_inputs_without_a_gpu_name_the_fix() -> None:
    import asyncio

    async def call() -> None:
        async with AsyncTaskClient("127.0.0.1:1", input_memory="cuda") as c:
            with pytest.raises(ClientError, match="input_memory='host'"):
                await c.infer("any", np.zeros((1, 3, 32, 32), np.float32))

    asyncio.run(call())


def test_unknown_input_memory_is_refused() -> None:
    with pytest.raises(ClientError, match="'host' or 'cuda'"):
        TaskClient("127.0.0.1:1", input_memory="pinned")  # type: ignore[arg-type]
