"""Tasks that take uint8 (or HWC) images: the plan's ``input``, the specs and configs it gives, and
the block's conversion on the device, which must give what the float32 path gives on the image
normalised by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tritonclient.grpc import model_config_pb2 as mc

from blockflow.backend.image_input import ImageConversion
from blockflow.backend.runtime import BlockRunner
from blockflow.core.errors import PlanError, RequestError
from blockflow.core.spec import IMAGENET_MEAN, IMAGENET_STD, ImageInput
from blockflow.ensemble_gen.configs import python_model_config
from blockflow.ensemble_gen.generator import block_spec, reference_spec
from blockflow.plan import load_plan, parse_plan

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
PLAN = ROOT / "tests" / "plans" / "uint8_hwc.yaml"
MEAN = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def by_hand(chw_u8: torch.Tensor) -> torch.Tensor:
    """torchvision's normalisation, as a client of a float32 task does it."""
    return (chw_u8.to(torch.float32) / 255.0 - MEAN) / STD


def _plan(input_: str) -> object:
    return yaml.safe_load(f"""
version: 1
models:
  r18: {{arch: resnet18, cut_points: [layer2], input_shape: [3, 32, 48], num_classes: 10, input: {input_}}}
defaults: {{placement: cpu}}
blocks:
  a: {{model: r18, stages: 0}}
  b: {{model: r18, stages: 1}}
tasks:
  t: {{path: [a, b]}}
""")


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_conversion_matches_normalising_by_hand(layout: str) -> None:
    x = torch.randint(0, 256, (4, 3, 32, 48), dtype=torch.uint8)
    given = x.permute(0, 2, 3, 1).contiguous() if layout == "HWC" else x
    conv = ImageConversion(ImageInput(dtype="uint8", layout=layout, mean=IMAGENET_MEAN, std=IMAGENET_STD),  # type: ignore[arg-type]
                           CPU, torch.float32)
    y = conv(given)
    assert y.dtype == torch.float32 and y.shape == (4, 3, 32, 48) and y.is_contiguous()
    torch.testing.assert_close(y, by_hand(x), atol=2e-6, rtol=0)


def test_conversion_without_normalisation_and_in_the_blocks_dtype() -> None:
    x = torch.randint(0, 256, (2, 32, 48, 3), dtype=torch.uint8)
    y = ImageConversion(ImageInput(dtype="uint8", layout="HWC"), CPU, torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, (x.permute(0, 3, 1, 2).float() / 255).to(torch.bfloat16))
    f = torch.randn(2, 32, 48, 3)
    torch.testing.assert_close(ImageConversion(ImageInput(layout="HWC"), CPU, torch.float32)(f), f.permute(0, 3, 1, 2))


def test_plan_input_defaults_and_shapes() -> None:
    plan = parse_plan(_plan("{dtype: uint8, layout: HWC}"))
    spec = block_spec(plan, plan.blocks["a"], "tensormq")
    assert spec.image == ImageInput(dtype="uint8", layout="HWC", mean=IMAGENET_MEAN, std=IMAGENET_STD)
    assert spec.in_shape == (32, 48, 3) and plan.models["r18"].input_shape == [3, 32, 48]
    assert block_spec(plan, plan.blocks["b"], "tensormq").image is None  # only what takes the image is told
    ref = reference_spec(plan, plan.tasks["t"], graph=False)[0]
    assert ref.image == spec.image and ref.in_shape == (32, 48, 3)
    cfg = python_model_config("a", spec, plan.blocks["a"])
    assert cfg.input[0].data_type == mc.TYPE_UINT8 and list(cfg.input[0].dims) == [32, 48, 3]
    custom = parse_plan(_plan("{dtype: uint8, mean: [0.5, 0.5, 0.5], std: [0.25, 0.25, 0.25]}"))
    assert block_spec(custom, custom.blocks["a"], "tensormq").image == ImageInput(
        dtype="uint8", mean=(0.5,) * 3, std=(0.25,) * 3)
    # float32 CHW without normalisation is the default: a spec without the field, bytes as before.
    plain = parse_plan(_plan("{dtype: float32, layout: CHW}"))
    spec = block_spec(plain, plain.blocks["a"], "tensormq")
    assert spec.image is None and '"image"' not in spec.to_json()


@pytest.mark.parametrize(("input_", "says"), [
    ("{dtype: uint8, colour: rgb}", "colour"),
    ("{dtype: int8}", "dtype"),
    ("{layout: WHC}", "layout"),
    ("{dtype: uint8, mean: [0.5, 0.5, 0.5]}", "mean and std together"),
    ("{normalize: imagenet}", "are for uint8"),
    ("{dtype: uint8, normalize: imagenet, mean: [0.5, 0.5, 0.5], std: [0.2, 0.2, 0.2]}", "either normalize"),
    ("{dtype: uint8, mean: [0.5, 0.5, 0.5], std: [0.2, 0, 0.2]}", "positive"),
    ("{dtype: uint8, mean: [0.5, 0.5], std: [0.2, 0.2]}", "mean"),
])
def test_plan_input_refuses_what_it_does_not_know(input_: str, says: str) -> None:
    with pytest.raises(PlanError, match=says):
        parse_plan(_plan(input_))


def test_uint8_split_equals_reference_and_float_path() -> None:
    plan = load_plan(PLAN)
    task = plan.tasks["u8_task"]
    runners = [BlockRunner(block_spec(plan, plan.blocks[b], "triton-gpu"), CPU) for b in task.path]
    ref = BlockRunner(reference_spec(plan, task, graph=False)[0], CPU)
    float_plan = parse_plan(yaml.safe_load(PLAN.read_text().replace("input: {dtype: uint8, layout: HWC, normalize: imagenet}", "")))
    assert block_spec(float_plan, float_plan.blocks["u8_a"], "triton-gpu").image is None
    floats = BlockRunner(reference_spec(float_plan, float_plan.tasks["u8_task"], graph=False)[0], CPU)
    x = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8)
    hwc = x.permute(0, 2, 3, 1).contiguous()
    y = hwc
    for r in runners:
        y = r.run(y)
    torch.testing.assert_close(y, ref.run(hwc), atol=1e-5, rtol=0)
    torch.testing.assert_close(y, floats.run(by_hand(x)), atol=1e-4, rtol=0)
    with pytest.raises(RequestError, match="takes torch.uint8"):
        runners[0].run(hwc.float())


def test_like_for_like_bench_plan_takes_uint8() -> None:
    plan = load_plan(ROOT / "plans" / "bench_r50_u8.yaml")
    first = plan.blocks[plan.tasks[next(iter(plan.tasks))].path[0]]
    spec = block_spec(plan, first, "tensormq")
    assert spec.image is not None and spec.image.dtype == "uint8" and spec.in_shape == (3, 224, 224)
    assert np.isclose(spec.image.mean, IMAGENET_MEAN).all()
