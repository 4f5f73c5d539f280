"""JPEG/PNG files' bytes on the GPU: nvJPEG's batched decode against the CPU's libjpeg, the decoder's
GPU path (padded rows), and a served encoded task (two fp16 blocks on TensorMQ) against its unsplit
reference on the same bytes (uint8 rows padded to the longest: a JPEG, a PNG, files of different
lengths in one request); a bad file fails its own request and the next is answered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as nnf
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from blockflow.backend.image_decode import ImageDecoder
from blockflow.bench.perf_analyzer import SAMPLE_IMAGES
from blockflow.core.errors import ClientError

from .small_plan import plan_text, served

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda:0")
JPEG = SAMPLE_IMAGES / "grace_hopper.jpg"  # 512x600, 4:2:0
PNG = SAMPLE_IMAGES / "Minduka_Present_Blue_Pack.png"
# nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's: most pixels agree within a level or
# two, a few at sharp colour edges differ more. Measured on grace_hopper.jpg (H200, r24.10 stub's
# torchvision, 2026-11-29): mean 0.668, p99.9 19.0, max 46 levels; the bounds leave some room.
MEAN_LEVELS, P999_LEVELS = 1.0, 24.0
TASK = "enc_gpu"


def _bytes(path: Path) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def test_nvjpeg_decodes_as_the_cpu_does_within_a_few_levels() -> None:
    cpu = decode_image(_bytes(JPEG), mode=ImageReadMode.RGB)
    [gpu] = decode_jpeg([_bytes(JPEG)], mode=ImageReadMode.RGB, device=DEV)
    assert gpu.is_cuda and gpu.dtype == torch.uint8 and gpu.shape == cpu.shape == (3, 600, 512)
    diff = (gpu.cpu().int() - cpu.int()).abs().float()
    mean, p999, top = float(diff.mean()), float(diff.flatten().quantile(0.999)), float(diff.max())
    print(f"nvJPEG vs CPU decode of {JPEG.name}: mean {mean:.3f}, p99.9 {p999:.1f}, max {top:.0f} levels")
    assert mean <= MEAN_LEVELS and p999 <= P999_LEVELS, (mean, p999, top)


def test_the_decoder_batches_jpegs_through_nvjpeg_and_pngs_through_the_cpu() -> None:
    jpeg, png = JPEG.read_bytes(), PNG.read_bytes()
    padded = png + bytes(len(jpeg) - len(png))  # as a request's row: padded to its longest file
    got = ImageDecoder((3, 224, 224), DEV).decode([[jpeg, padded], [jpeg[: len(jpeg) // 2] + bytes(99)], [jpeg]])
    first, bad, last = got
    assert isinstance(first, torch.Tensor) and first.is_cuda and first.shape == (2, 3, 224, 224)
    assert "truncated JPEG" in str(bad) and isinstance(last, torch.Tensor)
    [nv] = decode_jpeg([_bytes(JPEG)], mode=ImageReadMode.RGB, device=DEV)
    want = nnf.interpolate(nv[None].float(), size=(224, 224), mode="bilinear", antialias=True)[0].round().clamp(0, 255)
    # The JPEG went through nvJPEG (the CPU's decode differs by a few levels), the PNG through the CPU.
    assert torch.equal(first[0], want.to(torch.uint8)) and torch.equal(last[0], first[0])
    cpu_png = decode_image(_bytes(PNG), mode=ImageReadMode.RGB).to(DEV)
    png_want = nnf.interpolate(cpu_png[None].float(), size=(224, 224), mode="bilinear", antialias=True)[0].round().clamp(0, 255)
    assert torch.equal(first[1], png_want.to(torch.uint8))


@pytest.fixture(scope="module")
def encoded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    plan = plan_text("encoded-gpu", TASK, ("enc_g0", "enc_g1"), seed=5).replace(
        "num_classes: 10}", "num_classes: 10, input: {dtype: encoded}}")
    assert "dtype: encoded" in plan
    with served(tmp_path_factory.mktemp("encoded"), plan) as server:
        yield server.http_url


def test_served_encoded_task_equals_its_unsplit_reference_on_the_same_bytes(encoded_server: str) -> None:
    from blockflow.clients.client import TaskClient
    from blockflow.clients.images import image_files

    files = image_files([JPEG, PNG, JPEG])  # uint8 [3, L]: the PNG's row padded to the JPEG's length
    assert files.shape == (3, len(JPEG.read_bytes()))
    with TaskClient(encoded_server) as c:
        kind = c.input_of(TASK)
        assert kind.encoded and (kind.datatype, kind.shape) == ("UINT8", (-1,))
        got, ref = c.infer(TASK, files), c.infer(f"{TASK}__ref_graph", files)
        one = c.infer(TASK, JPEG.read_bytes())  # a JPEG alone
        png = c.infer(TASK, PNG.read_bytes())  # a PNG alone: a shorter row than the JPEG's
        with pytest.raises(ClientError, match="truncated JPEG") as bad:
            c.infer(TASK, [JPEG.read_bytes()[:5000]])
        after = c.infer(TASK, files[:1])
    assert bad.value.status == "400"
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert got.shape == (3, 10) and err <= 1e-2, err  # fp16 blocks in separate processes (cuDNN may pick other algorithms)
    np.testing.assert_allclose(got[0], got[2], atol=1e-3, rtol=0)
    np.testing.assert_allclose(one, got[:1], atol=1e-2, rtol=0)
    np.testing.assert_allclose(png, got[1:2], atol=1e-2, rtol=0)
    np.testing.assert_allclose(after, one, atol=1e-3, rtol=0)
