"""Tasks that take JPEG/PNG files' bytes (``input: {dtype: encoded}``): the plan's checks, the configs
(uint8 ``[-1]``, ragged-batched, wherever the image goes), the decoder on the CPU (padded rows cut at
their file's end, formats, resize, what it refuses), the block fed the decoded batch, the client's
checks and perf_analyzer's input data."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as nnf
import yaml
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.backend import image_decode
from blockflow.backend.image_decode import ImageDecoder, file_of
from blockflow.backend.runtime import BlockRunner
from blockflow.bench.harness import task_images
from blockflow.bench.perf_analyzer import SAMPLE_IMAGES, encoded_input_data
from blockflow.clients.images import image_files, padded_files, random_jpegs
from blockflow.clients.task_input import TaskInput
from blockflow.core.errors import ClientError, PlanError, RequestError
from blockflow.core.spec import IMAGENET_MEAN, IMAGENET_STD, ImageInput
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.generator import block_spec, reference_spec
from blockflow.ensemble_gen.rendered import parse_pbtxt
from blockflow.plan import load_plan, parse_plan

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
JPEG = SAMPLE_IMAGES / "grace_hopper.jpg"  # 512x600
PNG = SAMPLE_IMAGES / "Minduka_Present_Blue_Pack.png"  # 128x128, RGBA


def _plan(input_: str) -> object:
    return yaml.safe_load(f"""
version: 1
models:
  r18: {{arch: resnet18, cut_points: [layer2], input_shape: [3, 32, 48], num_classes: 10, input: {input_}}}
defaults: {{placement: cpu, precision: fp16}}
blocks:
  a: {{model: r18, stages: 0}}
  b: {{model: r18, stages: 1}}
tasks:
  t: {{path: [a, b]}}
references: [eager, graph]
""")


def _encoded(im: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def _fitted(data: bytes, h: int, w: int) -> torch.Tensor:
    """What the decoder gives for one file: torchvision's CPU decode, resized in float and rounded."""
    x = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    if tuple(x.shape[1:]) != (h, w):
        x = nnf.interpolate(x[None].float(), size=(h, w), mode="bilinear", antialias=True)[0].round().clamp(0, 255).to(torch.uint8)
    return x


def test_plan_takes_encoded_images_as_padded_uint8_rows_everywhere_the_image_goes() -> None:
    plan = parse_plan(_plan("{dtype: encoded}"))
    spec = block_spec(plan, plan.blocks["a"], "tensormq")
    assert spec.image == ImageInput(dtype="encoded", mean=IMAGENET_MEAN, std=IMAGENET_STD)  # imagenet by default
    assert spec.in_shape == (-1,) and plan.models["r18"].image_shape == (-1,)
    assert block_spec(plan, plan.blocks["b"], "tensormq").image is None
    configs = {path: parse_pbtxt(data.decode()) for path, data in generator.render(plan).items() if path.endswith("config.pbtxt")}
    takes = {path.split("/")[0]: cfg.input[0] for path, cfg in configs.items() if cfg.input[0].name == "IMAGE"}
    # The block, the ensembles, both references and the eager fp32 one (the task runs in fp16).
    assert {"a", "t", "t__ref", "t__ref_graph", "t__ref_fp32"} <= set(takes)
    assert all(i.data_type == mc.TYPE_UINT8 and list(i.dims) == [-1] for i in takes.values())
    # Requests of different lengths batch together in the blocks; the ensembles do not batch.
    assert {m for m, i in takes.items() if i.allow_ragged_batch} == {"a", "t__ref", "t__ref_graph", "t__ref_fp32"}
    assert configs["a/config.pbtxt"].parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "yes"
    none = parse_plan(_plan("{dtype: encoded, normalize: none}"))
    assert block_spec(none, none.blocks["a"], "tensormq").image == ImageInput(dtype="encoded")


@pytest.mark.parametrize(("input_", "says"), [
    ("{dtype: encoded, layout: HWC}", "decoded to CHW"),
    ("{dtype: jpeg}", "dtype"),
])
def test_plan_refuses_encoded_hwc(input_: str, says: str) -> None:
    with pytest.raises(PlanError, match=says):
        parse_plan(_plan(input_))


def test_decodes_jpeg_and_png_and_resizes_to_the_network() -> None:
    jpeg, png = JPEG.read_bytes(), PNG.read_bytes()
    [both] = ImageDecoder((3, 32, 48), CPU).decode([[jpeg, png]])
    assert isinstance(both, torch.Tensor) and both.dtype == torch.uint8 and both.shape == (2, 3, 32, 48)
    assert torch.equal(both[0], _fitted(jpeg, 32, 48)) and torch.equal(both[1], _fitted(png, 32, 48))
    # At the network's size: the decoded pixels as they are (a lossless PNG: exactly its RGB values).
    rgb = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    [same] = ImageDecoder((3, 32, 48), CPU).decode([[_encoded(Image.fromarray(rgb), "PNG")]])
    assert isinstance(same, torch.Tensor)
    np.testing.assert_array_equal(same[0].permute(1, 2, 0).numpy(), rgb)
    assert (same[0].int() - torch.from_numpy(rgb).permute(2, 0, 1).int()).abs().max() == 0


def test_bad_images_fail_their_own_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    jpeg = JPEG.read_bytes()
    gif = _encoded(Image.new("RGB", (8, 8)), "GIF")
    # A PNG whose header claims 8000x6000 pixels (48 M): refused from its header, never decoded.
    png = bytearray(_encoded(Image.new("RGB", (8, 8)), "PNG"))
    png[16:24] = struct.pack(">II", 8000, 6000)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    cmyk = _encoded(Image.new("CMYK", (16, 16), (0, 255, 0, 0)), "JPEG")  # magenta; decoded on the CPU, like PNGs
    corrupt = bytearray(PNG.read_bytes())  # its chunks whole, its compressed pixels not
    idat = corrupt.index(b"IDAT") + 8
    corrupt[idat:idat + 64] = bytes(64)
    got = ImageDecoder((3, 32, 32), CPU).decode([[jpeg], [jpeg, jpeg[: len(jpeg) // 2]], [gif], [bytes(png)], [],
                                                 [jpeg[:-2]], [bytes(corrupt)], [cmyk], [b"\xff\xd8\xff" + b"\0" * 50],
                                                 [PNG.read_bytes()[:-40]]])
    assert [type(g).__name__ for g in got] == ["Tensor", *["RequestError"] * 6, "Tensor", *["RequestError"] * 2]
    messages = [str(g) for g in got if isinstance(g, RequestError)]
    assert "image 1 of the request is a truncated JPEG" in messages[0]
    assert "neither a JPEG nor a PNG" in messages[1]
    assert "8000x6000 pixels, over the limit of 40000000" in messages[2]
    assert "no image" in messages[3] and "truncated JPEG" in messages[4]
    assert "cannot be decoded" in messages[5] and ".cpp" not in messages[5]
    assert "unreadable header" in messages[6]
    assert "image 0 of the request is a truncated PNG" in messages[7]
    assert isinstance(got[7], torch.Tensor) and got[7][0, :, 0, 0].tolist() == [255, 0, 255]
    monkeypatch.setattr(image_decode, "MAX_BYTES", len(jpeg) - 1)
    [big] = ImageDecoder((3, 32, 32), CPU).decode([[jpeg]])
    assert isinstance(big, RequestError) and "over the limit" in str(big)


def test_a_padded_row_is_cut_to_exactly_its_file_and_a_row_without_an_end_fails_alone() -> None:
    jpeg, png = JPEG.read_bytes(), PNG.read_bytes()
    rows = padded_files([jpeg, png])  # the PNG row: its file, then zeros up to the JPEG's length
    assert rows.shape == (2, len(jpeg)) and not rows[1, len(png):].any()
    assert file_of(rows[0].tobytes(), 0) == jpeg and file_of(rows[1].tobytes(), 1) == png
    # Whatever follows a file's end is ignored, not only zeros.
    assert file_of(png + b"\xff" * 9, 0) == png and file_of(jpeg + b"junk", 0) == jpeg
    [x] = ImageDecoder((3, 32, 48), CPU).decode([[r.tobytes() for r in rows]])
    assert isinstance(x, torch.Tensor) and torch.equal(x[0], _fitted(jpeg, 32, 48)) and torch.equal(x[1], _fitted(png, 32, 48))
    # A row whose file has no end (cut short, then padded) fails its own request; the others are answered.
    cut_png, cut_jpeg = padded_files([jpeg, png[:-12]]), padded_files([jpeg[: len(jpeg) // 2], png])
    got = ImageDecoder((3, 32, 48), CPU).decode([[rows[0].tobytes()], [r.tobytes() for r in cut_png],
                                                 [r.tobytes() for r in cut_jpeg], [rows[1].tobytes()]])
    assert [type(g).__name__ for g in got] == ["Tensor", "RequestError", "RequestError", "Tensor"]
    assert "image 1 of the request is a truncated PNG" in str(got[1])
    assert "image 0 of the request is a truncated JPEG" in str(got[2])
    assert torch.equal(got[3][0], x[1])  # type: ignore[index]


def test_the_first_block_and_the_reference_take_the_decoded_batch() -> None:
    plan = parse_plan(_plan("{dtype: encoded}"))
    first = BlockRunner(block_spec(plan, plan.blocks["a"], "triton-cpu").model_copy(update={"precision": "fp32"}), CPU)
    assert first.in_shapes == ((3, 32, 48),) and first.in_dtype == torch.uint8
    ref = BlockRunner(reference_spec(plan, plan.tasks["t"], graph=False, fp32=True)[0], CPU)
    [x] = ImageDecoder((3, 32, 48), CPU).decode([[JPEG.read_bytes(), PNG.read_bytes()]])
    assert isinstance(x, torch.Tensor)
    assert ref.run(x).shape == (2, 10) and first.run(x).shape[0] == 2


def test_client_sends_files_as_padded_uint8_rows_for_an_encoded_task_and_arrays_for_the_others() -> None:
    kind = TaskInput.of({"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [-1, -1]}]})
    assert kind.encoded and kind.shape == (-1,) and not kind.uint8
    pixels = TaskInput.of({"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [-1, 32, 32, 3]}]})
    assert pixels.uint8 and not pixels.encoded and pixels.layout == "HWC"
    jpeg, png = JPEG.read_bytes(), PNG.read_bytes()
    files = image_files([JPEG, PNG])
    assert files.dtype == np.uint8 and files.shape == (2, len(jpeg)) and files[0].tobytes() == jpeg
    assert files[1, :len(png)].tobytes() == png and not files[1, len(png):].any()
    for given in (files, [jpeg, png], (jpeg, png), torch.from_numpy(files)):
        sent = kind.check("t", given)
        assert str(sent.dtype).removeprefix("torch.") == "uint8" and tuple(sent.shape) == (2, len(jpeg))
        assert bytes(np.asarray(sent)[1, :len(png)]) == png
    assert kind.check("t", jpeg).shape == (1, len(jpeg))
    with pytest.raises(ClientError, match="takes encoded images.*image_files"):
        kind.check("t", np.zeros((1, 3, 32, 32), np.uint8))  # a 4-D uint8 array is pixels, not files
    with pytest.raises(ClientError, match="takes encoded images.*float32"):
        kind.check("t", np.zeros((2, 100), np.float32))
    with pytest.raises(ClientError, match="non-empty bytes"):
        kind.check("t", [b""])
    with pytest.raises(ClientError, match="one or more JPEG or PNG"):
        kind.check("t", np.zeros((0, 10), np.uint8))
    u8 = TaskInput("UINT8", (3, 32, 32))
    with pytest.raises(ClientError, match="takes uint8 image arrays, not encoded"):
        u8.check("t", files)
    with pytest.raises(ClientError, match="takes uint8 image arrays, not encoded"):
        u8.check("t", [jpeg])
    with pytest.raises(ClientError, match="image file not found"):
        image_files([ROOT / "no-such.jpg"])
    with pytest.raises(ClientError, match="no image files"):
        padded_files([])
    jpegs = random_jpegs(3, 24, 40, seed=1)
    assert jpegs.dtype == np.uint8 and jpegs.shape[0] == 3
    assert Image.open(io.BytesIO(jpegs[2].tobytes())).size == (40, 24)


def test_a_list_of_images_is_one_batch_and_a_mixed_list_or_no_array_is_refused_clearly() -> None:
    u8, f32 = TaskInput("UINT8", (3, 32, 32)), TaskInput("FP32", (3, 32, 32))
    images = [np.full((3, 32, 32), i, np.uint8) for i in range(3)]
    got = u8.check("t", images)
    assert got.shape == (3, 3, 32, 32) and got.dtype == np.uint8 and int(got[2].max()) == 2
    assert u8.check("t", tuple(torch.zeros((3, 32, 32), dtype=torch.uint8) for _ in range(2))).shape == (2, 3, 32, 32)
    assert f32.check("t", [np.zeros((3, 32, 32), np.float32)]).shape == (1, 3, 32, 32)
    with pytest.raises(ClientError, match="one shape and dtype each"):
        u8.check("t", [images[0], np.zeros((3, 16, 16), np.uint8)])
    with pytest.raises(ClientError, match="one shape and dtype each"):
        u8.check("t", [images[0], images[1].astype(np.float32)])
    with pytest.raises(ClientError, match="the list is empty"):
        u8.check("t", [])
    with pytest.raises(ClientError, match="on one device"):
        u8.check("t", [torch.zeros((3, 32, 32), dtype=torch.uint8), torch.zeros((3, 32, 32), dtype=torch.uint8, device="meta")])
    with pytest.raises(ClientError, match="with a batch of one or more; got shape \\[0, 3, 32, 32\\]"):
        u8.check("t", np.zeros((0, 3, 32, 32), np.uint8))
    with pytest.raises(ClientError, match="must be an array .* got int"):
        u8.check("t", 7)


def test_bench_inputs_for_an_encoded_task_are_jpeg_files(tmp_path: Path) -> None:
    plan = load_plan(ROOT / "plans" / "bench_r50_jpeg.yaml")
    x = task_images(plan, "r50", 2, seed=3)
    assert x.dtype == np.uint8 and x.ndim == 2 and x.shape[0] == 2
    with Image.open(io.BytesIO(x[0].tobytes())) as im:
        assert im.format == "JPEG" and im.size == (224, 224)
    data = json.loads(encoded_input_data(tmp_path / "images.json").read_text())["data"]
    jpegs = [p.read_bytes() for p in sorted(SAMPLE_IMAGES.glob("*.jpg"))]
    longest = max(map(len, jpegs))
    assert len(data) == len(jpegs) >= 2
    for entry, jpeg in zip(data, jpegs, strict=True):
        raw = base64.b64decode(entry["IMAGE"]["b64"])  # the uint8 tensor's raw bytes: the file, then zeros
        assert entry["IMAGE"]["shape"] == [longest] and len(raw) == longest
        assert raw[:len(jpeg)] == jpeg and not any(raw[len(jpeg):])
    total = sum(p.stat().st_size for p in SAMPLE_IMAGES.iterdir())
    assert len(list(SAMPLE_IMAGES.iterdir())) <= 5 and total <= 300_000  # the images and their README


def test_images_for_a_task_whose_metadata_could_not_be_read_go_as_they_are() -> None:
    kind, x = TaskInput.given("t", np.zeros((2, 3, 8, 8), np.uint8))
    assert (kind.datatype, x.dtype, x.flags.c_contiguous) == ("UINT8", np.uint8, True)
    kind, x = TaskInput.given("t", np.zeros((2, 3, 8, 8), np.float64)[..., ::2])
    assert (kind.datatype, x.dtype, x.flags.c_contiguous) == ("FP32", np.float32, True)
    kind, x = TaskInput.given("t", [b"ab", b"c"])
    assert kind.encoded and x.tolist() == [[97, 98], [99, 0]]
    kind, x = TaskInput.given("t", np.array([b"ab", b"c"], dtype=object))
    assert kind.encoded and x.tolist() == [[97, 98], [99, 0]]
    kind, x = TaskInput.given("t", np.zeros((2, 5), np.uint8))  # rows: files
    assert kind.encoded
    kind, x = TaskInput.given("t", [np.zeros((3, 8, 8), np.uint8)] * 2)  # a list of arrays keeps its dtype
    assert (kind.datatype, x.shape) == ("UINT8", (2, 3, 8, 8))
    kind, x = TaskInput.given("t", [[[[0, 0.5]]], [[[1, 2]]]])  # nested lists of numbers: one array, whatever each number
    assert (kind.datatype, x.dtype, x.shape) == ("FP32", np.float32, (2, 1, 1, 2))
    kind, x = TaskInput.given("t", [torch.zeros((3, 8, 8), dtype=torch.uint8)] * 2)  # a list of tensors stays torch
    assert isinstance(x, torch.Tensor) and (kind.datatype, tuple(x.shape)) == ("UINT8", (2, 3, 8, 8))
    for bad in (np.array(["ab", "c"]), np.array([b"ab", 3], dtype=object), ["ab", "cd"]):
        with pytest.raises(ClientError, match="must be an array of numbers"):
            TaskInput.given("t", bad)
    # A list is one batch by the same rules as for a task whose metadata was read (TaskInput.check).
    with pytest.raises(ClientError, match="must hold one shape and dtype each"):
        TaskInput.given("t", [np.zeros(3), np.zeros(2)])
    with pytest.raises(ClientError, match="the list is empty"):
        TaskInput.given("t", [])
    for empty in (np.zeros((0, 3, 8, 8), np.uint8), np.float32(1)):  # no image: said here, not as a 0-byte region
        with pytest.raises(ClientError, match="no image in it"):
            TaskInput.given("t", empty)
