"""A task that takes uint8 HWC images (tests/plans/uint8_hwc.yaml, served by the shared server): its
first block normalises them on its device, and the split, its unsplit reference and the float32
network given the image normalised by hand answer alike; clients send uint8 as it is and refuse
floats; ``blockflow infer --image``, ``blockflow load`` and perf_analyzer send uint8 images."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from blockflow.clients.client import AsyncTaskClient, TaskClient
from blockflow.clients.images import load_image, load_image_uint8
from blockflow.core import arch
from blockflow.core.errors import ClientError
from blockflow.core.spec import IMAGENET_MEAN, IMAGENET_STD
from blockflow.plan import naming

from ..conftest import Served

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TASK = "u8_task"
SEED, SHAPE = 3, (3, 32, 32)  # tests/plans/uint8_hwc.yaml: both blocks' seed, the model's input_shape
ATOL = 1e-4


def _float_network(chw: np.ndarray) -> np.ndarray:
    """The whole network of the plan's weights given float32 images: what a float32 plan answers."""
    net = arch.build_network("resnet18", 10, SEED, SHAPE)
    with torch.inference_mode():
        return net(torch.from_numpy(np.ascontiguousarray(chw))).numpy()  # type: ignore[no-any-return]


def _by_hand(chw_u8: np.ndarray) -> np.ndarray:
    mean = np.array(IMAGENET_MEAN, np.float32).reshape(1, 3, 1, 1)
    std = np.array(IMAGENET_STD, np.float32).reshape(1, 3, 1, 1)
    return ((chw_u8.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)


def _blockflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "blockflow", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, check=False)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_split_equals_reference_and_float_network(served: Served, protocol: str) -> None:
    hwc = np.random.default_rng(7).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    want = _float_network(_by_hand(hwc.transpose(0, 3, 1, 2)))
    url = served.http if protocol == "http" else served.grpc
    with TaskClient(url, protocol) as c:  # type: ignore[arg-type]
        kind = c.input_of(TASK)
        assert (kind.datatype, kind.shape, kind.layout) == ("UINT8", (32, 32, 3), "HWC")
        split = c.infer(TASK, hwc)
        ref = c.infer(naming.reference_model(TASK, False), hwc)
        one = c.infer(TASK, hwc[:1])
        with pytest.raises(ClientError, match="takes uint8 images"):
            c.infer(TASK, hwc.astype(np.float32))
        with pytest.raises(ClientError, match=r"must be \[batch, 32, 32, 3\]"):
            c.infer(TASK, np.ascontiguousarray(hwc.transpose(0, 3, 1, 2)))
    np.testing.assert_allclose(split, ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(split, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(one, want[:1], atol=ATOL, rtol=0)

    async def twin() -> np.ndarray:
        async with AsyncTaskClient(url, protocol) as a:  # type: ignore[arg-type]
            with pytest.raises(ClientError, match="takes uint8 images"):
                await a.infer(TASK, hwc.astype(np.float32))
            return await a.infer(TASK, hwc)

    np.testing.assert_allclose(asyncio.run(twin()), split, atol=ATOL, rtol=0)


def test_image_file_as_uint8_and_cli(served: Served, tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(png)
    hwc = load_image_uint8(png, 32, 32, "HWC")
    assert hwc.dtype == np.uint8 and hwc.shape == (32, 32, 3)
    np.testing.assert_array_equal(load_image_uint8(png, 32, 32), hwc.transpose(2, 0, 1))
    with TaskClient(served.http) as c:
        got = c.infer(TASK, hwc[None])
    np.testing.assert_allclose(got, _float_network(load_image(png, 32, 32)[None]), atol=ATOL, rtol=0)
    res = _blockflow("infer", TASK, "--image", str(png), "--url", served.http, "--json")
    assert res.returncode == 0, res.stderr
    top = json.loads(res.stdout)["top5"][0][0]
    assert top["index"] == int(np.argmax(got[0]))
    res = _blockflow("infer", TASK, "--random", "--batch", "2", "--url", served.http)
    assert res.returncode == 0 and "u8_task sample 1" in res.stdout, res.stderr
    res = _blockflow("load", "--task", TASK, "--url", served.http, "--max-requests", "5", "--duration", "20", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tasks"][TASK]["errors"] == 0


def test_perf_analyzer_sends_uint8(served: Served, tmp_path: Path) -> None:
    pa = shutil.which("perf_analyzer", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if pa is None:
        pytest.fail("perf_analyzer not found; run ./scripts/setup.sh")
    res = subprocess.run(
        [pa, "-m", TASK, "-u", served.http, "--shape", "IMAGE:32,32,3", "-b", "1", "--concurrency-range", "1",
         "--measurement-mode", "count_windows", "--measurement-request-count", "20", "--max-trials", "3",
         "--stability-percentage", "999"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Throughput" in res.stdout
