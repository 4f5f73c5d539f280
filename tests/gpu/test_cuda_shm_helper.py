"""On an NVIDIA GPU: CUDA shared-memory input regions from tritonclient's helper and from BlockFlow's driver calls
(blockflow.clients.cuda_shm picks the helper where it runs). Both give the host input's answer for numpy and torch
CUDA images, wait for images still being made on another stream, and are unregistered and freed on close; with the
helper, numpy images need no torch. The helper's tests skip, saying why, where it does not run (tritonclient before
2.73 on cuda-python 13, as the GPU bundle's 2.50)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from blockflow.clients import cuda_shm
from blockflow.clients.client import TaskClient
from blockflow.core import endpoints
from blockflow.triton.server import TritonServer

from .answers import assert_same_answer
from .small_plan import plan_text, served

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
PLAN = plan_text("gpu-cuda-regions", "regions", ('h0', 'h1'), seed=5)


def _helper() -> Any:
    helper, why_not = cuda_shm.tritonclient_helper()
    if helper is None:
        pytest.skip(f"tritonclient's CUDA shared-memory helper does not run here ({why_not}); the regions are allocated by hand")
    return helper


@pytest.fixture(params=["tritonclient", "blockflow"])
def allocated_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "tritonclient":
        _helper()
    else:
        monkeypatch.setattr(cuda_shm, "tritonclient_helper", lambda: (None, "this test allocates by hand"))
    return str(request.param)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    with served(tmp_path_factory.mktemp("regions"), PLAN) as s:
        yield s


def _key(s: TritonServer) -> str:
    return s.shm_key_file.read_text().strip()


def _regions(s: TritonServer) -> list[Any]:
    import tritonclient.http as th

    return list(th.InferenceServerClient(s.http_url).get_cuda_shared_memory_status(headers=endpoints.shm_headers(_key(s))))


def _images(batch: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    return np.random.default_rng(batch).standard_normal((batch, 3, 64, 64), dtype=np.float32)


def test_regions_give_the_host_inputs_answer_and_are_freed_on_close(server: TritonServer, allocated_by: str) -> None:
    helper = cuda_shm.tritonclient_helper()[0]
    with TaskClient(server.http_url) as host, TaskClient(server.http_url, input_memory="cuda", shm_key=_key(server)) as dev:
        for batch in (1, 3, 2):  # the region grows once (1 -> 3) and is reused for 2
            x = _images(batch)
            want = host.infer("regions", x)
            assert_same_answer(dev.infer("regions", x), want)
            assert_same_answer(dev.infer("regions", torch.from_numpy(x).cuda()), want)  # device to device
        assert dev._region is not None and dev._region.allocated_by == allocated_by
        regions = _regions(server)
        assert len(regions) == 1 and regions[0]["byte_size"] == 3 * 3 * 64 * 64 * 4
        if helper is not None:
            assert len(helper.allocated_shared_memory_regions()) == 1  # the smaller one was given back
    assert _regions(server) == []  # unregistered on close
    if helper is not None:
        assert helper.allocated_shared_memory_regions() == []  # and freed


def test_images_still_being_made_on_another_stream_are_waited_for(server: TritonServer, allocated_by: str) -> None:
    x = _images(2)
    on_gpu = torch.from_numpy(x).cuda()
    with TaskClient(server.http_url) as host, TaskClient(server.http_url, input_memory="cuda", shm_key=_key(server)) as dev:
        want = host.infer("regions", x)
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)  # type: ignore[no-untyped-call]  # ~50 ms of GPU work ahead of the images
            images = on_gpu * 1.0  # written only after the sleep, on this stream
            got = dev.infer("regions", images)
        assert dev._region is not None and dev._region.allocated_by == allocated_by
        assert_same_answer(got, want)


def test_numpy_images_through_the_helper_need_no_torch(server: TritonServer, tmp_path: Path) -> None:
    _helper()
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch fails
        "import numpy as np\n"
        "from blockflow.clients.client import TaskClient\n"
        "x = np.random.default_rng(3).standard_normal((3, 3, 64, 64), dtype=np.float32)\n"
        f"with TaskClient({server.http_url!r}, input_memory='cuda', shm_key={_key(server)!r}) as c:\n"
        "    y = c.infer('regions', x)\n"
        "    assert c._region is not None and c._region.allocated_by == 'tritonclient'\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, y)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    with TaskClient(server.http_url) as host:
        assert_same_answer(np.load(tmp_path / "y.npy"), host.infer("regions", _images(3)))
    assert _regions(server) == []
