"""A task that takes JPEG/PNG files' bytes (tests/plans/encoded.yaml, on a server of this module's own):
its block decodes and resizes them and answers as the uint8 task of the same weights does for the
decoded image (several files in one request: uint8 rows padded to the longest); a bad file
fails its own request alone; ``blockflow infer --image`` sends the file as it is and perf_analyzer
sends real JPEGs through its ``--input-data``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as nnf
from torchvision.io import ImageReadMode, decode_image

from blockflow.bench.perf_analyzer import SAMPLE_IMAGES, encoded_input_data
from blockflow.clients.client import AsyncTaskClient, TaskClient
from blockflow.clients.images import image_files
from blockflow.core.errors import ClientError
from blockflow.plan import load_plan, naming

from ..conftest import own_server

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TASK, U8_TASK = "enc_task", "enc_u8_task"  # same network and weights; enc_u8_task takes uint8 HWC [32, 32, 3]
JPEG = SAMPLE_IMAGES / "grace_hopper.jpg"
PNG = SAMPLE_IMAGES / "Minduka_Present_Blue_Pack.png"
ATOL = 1e-4


class Served:
    def __init__(self, http: str, grpc: str) -> None:
        self.http, self.grpc = http, grpc


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with own_server(load_plan(ROOT / "tests" / "plans" / "encoded.yaml"), tmp_path_factory.mktemp("encoded")) as server:
        yield Served(server.http_url, server.grpc_url)


def _hwc(path: Path) -> np.ndarray:
    """The file as the block makes it: decoded to RGB, resized to 32x32 (bilinear, antialiased, in float, rounded)."""
    x = decode_image(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8), mode=ImageReadMode.RGB)
    x = nnf.interpolate(x[None].float(), size=(32, 32), mode="bilinear", antialias=True)[0].round().clamp(0, 255)
    return x.to(torch.uint8).permute(1, 2, 0).contiguous().numpy()  # type: ignore[no-any-return]


def _blockflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "blockflow", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, check=False)


def test_jpeg_and_png_answer_as_the_uint8_task_for_the_decoded_image(served: Served) -> None:
    files = image_files([JPEG, PNG])
    with TaskClient(served.http) as c:
        kind = c.input_of(TASK)
        assert (kind.datatype, kind.shape, kind.encoded) == ("UINT8", (-1,), True)
        assert files.shape == (2, len(JPEG.read_bytes()))  # the PNG's row padded to the JPEG's length
        want = c.infer(U8_TASK, np.stack([_hwc(JPEG), _hwc(PNG)]))
        got = c.infer(TASK, files)
        ref = c.infer(naming.reference_model(TASK, False), files)
        one = c.infer(TASK, JPEG.read_bytes())
        with pytest.raises(ClientError, match="takes encoded images"):
            c.infer(TASK, np.stack([_hwc(JPEG)]))
        with pytest.raises(ClientError, match="not encoded files' bytes"):
            c.infer(U8_TASK, files)
    with TaskClient(served.grpc, "grpc") as g:
        over_grpc = g.infer(TASK, files)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(ref, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(one, want[:1], atol=ATOL, rtol=0)
    np.testing.assert_allclose(over_grpc, want, atol=ATOL, rtol=0)


def test_a_bad_file_fails_its_own_request_alone(served: Served) -> None:
    jpeg = JPEG.read_bytes()
    truncated, gif = jpeg[: len(jpeg) // 2], b"GIF89a" + bytes(100)

    async def together() -> list[object]:
        # Sent at once: the block's 50 ms batching window takes them into one call, mostly.
        async with AsyncTaskClient(served.http) as a:
            return await asyncio.gather(a.infer(TASK, jpeg), a.infer(TASK, [jpeg, truncated]), a.infer(TASK, gif),
                                        a.infer(TASK, [jpeg, jpeg]), return_exceptions=True)

    good, bad_batch, bad_gif, pair = asyncio.run(together())
    with TaskClient(served.http) as c:
        want = c.infer(U8_TASK, _hwc(JPEG)[None])
        after = c.infer(TASK, jpeg)  # the next request is answered
    assert isinstance(bad_batch, ClientError) and bad_batch.status == "400" and "image 1 of the request is a truncated JPEG" in str(bad_batch)
    assert isinstance(bad_gif, ClientError) and bad_gif.status == "400" and "neither a JPEG nor a PNG" in str(bad_gif)
    for logits in (good, after):
        assert isinstance(logits, np.ndarray)
        np.testing.assert_allclose(logits, want, atol=ATOL, rtol=0)
    assert isinstance(pair, np.ndarray)
    np.testing.assert_allclose(pair, np.repeat(want, 2, axis=0), atol=ATOL, rtol=0)


def test_cli_sends_the_file_and_perf_analyzer_real_jpegs(served: Served, tmp_path: Path) -> None:
    with TaskClient(served.http) as c:
        want = c.infer(TASK, JPEG.read_bytes())
    res = _blockflow("infer", TASK, "--image", str(JPEG), "--url", served.http, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["top5"][0][0]["index"] == int(np.argmax(want[0]))
    res = _blockflow("infer", TASK, "--random", "--batch", "2", "--url", served.http)
    assert res.returncode == 0 and "enc_task sample 1" in res.stdout, res.stderr
    pa = shutil.which("perf_analyzer", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if pa is None:
        pytest.fail("perf_analyzer not found; run ./scripts/setup.sh")
    data = encoded_input_data(tmp_path / "images.json")
    res = subprocess.run(
        # No --shape: each entry of the data file gives its own ([L], the files padded to the longest).
        [pa, "-m", TASK, "-u", served.http, "--input-data", str(data), "-b", "2", "--concurrency-range", "1",
         "--measurement-mode", "count_windows", "--measurement-request-count", "10", "--max-trials", "3",
         "--stability-percentage", "999"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Throughput" in res.stdout
