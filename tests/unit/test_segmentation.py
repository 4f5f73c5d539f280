"""Segmentation networks as plan models, and paths that go on from one model's blocks to another's
(a classifier and a segmenter sharing a ResNet-50 backbone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from blockflow.backend.runtime import BlockRunner
from blockflow.core import arch
from blockflow.core.errors import PlanError
from blockflow.ensemble_gen.generator import block_spec, reference_spec
from blockflow.plan import load_plan, parse_plan

from ..conftest import tensor_error

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
SHAPE = (3, 64, 64)


def test_segmentation_models_are_plan_architectures() -> None:
    assert {"fcn_resnet50", "deeplabv3_resnet50", "deeplabv3_mobilenet_v3_large",
            "lraspp_mobilenet_v3_large"} <= set(arch.supported_archs())
    assert "resnet50" in arch.supported_archs()


@pytest.mark.parametrize(("name", "cut"), [
    ("fcn_resnet50", "backbone.layer2"),
    ("deeplabv3_resnet50", "backbone.layer2"),
    ("deeplabv3_mobilenet_v3_large", "backbone.4"),
    ("lraspp_mobilenet_v3_large", "backbone.6"),  # inside LR-ASPP's skip: two tensors cross
])
def test_stages_compose_to_the_segmentation_network(name: str, cut: str) -> None:
    net = arch.build_network(name, 3, seed=2, input_shape=SHAPE)
    cuts = arch.legal_cuts(name, SHAPE, 3)
    assert cut in cuts.names() and cuts.output_shape == (3, 64, 64)
    x = torch.randn(2, *SHAPE)
    with torch.inference_mode():
        full = net(x)["out"]
        mid = arch.slice_stages(net, name, [cut], 0, 0)(x)
        got = arch.slice_stages(net, name, [cut], 1, 1)(*(mid if isinstance(mid, tuple) else (mid,)))
        whole = arch.slice_stages(net, name, [], 0, 0)(x)
    assert got.shape == (2, 3, 64, 64)
    assert tensor_error(got, full) <= 1e-5 and tensor_error(whole, full) <= 1e-5
    assert [list(s) for s in arch.stage_output_shapes(name, [cut], SHAPE, 3)[-1]] == [[3, 64, 64]]


def test_the_image_size_is_folded_in_and_no_hop_carries_the_image() -> None:
    # LR-ASPP reads its input's size at the end: traced with the size as a constant, no cut has to
    # carry the image along (only its low- and high-level features cross backbone.6).
    cut = arch.legal_cuts("lraspp_mobilenet_v3_large", SHAPE, 3).get("backbone.6")
    assert cut is not None and SHAPE not in cut.shapes and len(cut.shapes) == 2


def _shared(**seg: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "models": {
            "r50": {"arch": "resnet50", "cut_points": ["layer2"], "input_shape": [3, 64, 64], "num_classes": 10},
            "seg": {"arch": "deeplabv3_resnet50", "cut_points": ["backbone.layer2"], "input_shape": [3, 64, 64],
                    "num_classes": 5, **seg},
        },
        "defaults": {"placement": "cpu"},
        "blocks": {"shared": {"model": "r50", "stages": 0, "weights": {"seed": 1}},
                   "r50_tail": {"model": "r50", "stages": 1, "weights": {"seed": 1}},
                   "seg_tail": {"model": "seg", "stages": 1, "weights": {"seed": 2}}},
        "tasks": {"classify": {"path": ["shared", "r50_tail"]}, "segment": {"path": ["shared", "seg_tail"]}},
    }


def test_a_path_across_models_is_accepted_where_the_tensors_match() -> None:
    plan = parse_plan(_shared())
    assert plan.block_out_shape(plan.blocks["seg_tail"]) == (5, 64, 64)
    assert plan.sharing()["shared"] == ["classify", "segment"]


def test_a_path_across_models_is_refused_where_the_tensors_differ() -> None:
    # The segmenter's layer3 is dilated: its output is 8x8 at 64x64, the classifier's 4x4.
    data = _shared(cut_points=["backbone.layer3"])
    data["models"]["r50"]["cut_points"] = ["layer3"]
    with pytest.raises(PlanError) as info:
        parse_plan(data)
    assert ("tasks.segment.path[1]: block 'seg_tail' (model 'seg') takes [1024, 8, 8] but 'shared' (model 'r50') "
            "gives [1024, 4, 4]; a path goes on from one model's block to another's only at a cut where the tensors "
            "match") in str(info.value)


def test_a_path_across_models_of_different_input_shapes_is_refused() -> None:
    # At 60x60 the segmenter's layer2 also gives [512, 8, 8]: the hop matches, the images do not.
    with pytest.raises(PlanError) as info:
        parse_plan(_shared(input_shape=[3, 60, 60]))
    assert ("tasks.segment.path: the models of one path must take the same input_shape, but 'r50' takes [3, 64, 64], "
            "'seg' takes [3, 60, 60]; give them one input_shape") in str(info.value)


def test_the_reference_of_a_path_across_models_equals_its_blocks() -> None:
    plan = parse_plan(_shared())
    task = plan.tasks["segment"]
    spec = reference_spec(plan, task, graph=False)[0]
    assert spec.arch == "deeplabv3_resnet50" and spec.out_shape == (5, 64, 64) and spec.gives_logits
    assert spec.parts[0].network is not None and spec.parts[0].network.arch == "resnet50"
    assert spec.parts[1].network is None
    ref = BlockRunner(spec, CPU)
    runners = [BlockRunner(block_spec(plan, plan.blocks[b], "triton-gpu"), CPU) for b in task.path]
    r50 = arch.build_network("resnet50", 10, 1, SHAPE)
    seg = arch.build_network("deeplabv3_resnet50", 5, 2, SHAPE)
    for batch in (1, 3):
        x = torch.randn(batch, *SHAPE)
        y = x
        for r in runners:
            y = r.run(y)
        with torch.inference_mode():
            # Each part from its own model with its own weights: r50's stem..layer2, seg's rest.
            want = arch.slice_stages(seg, "deeplabv3_resnet50", ["backbone.layer2"], 1, 1)(
                arch.slice_stages(r50, "resnet50", ["layer2"], 0, 0)(x))
        assert y.shape == (batch, 5, 64, 64)
        assert tensor_error(y, ref.run(x)) <= 1e-5 and tensor_error(y, want) <= 1e-5


def test_the_early_stages_of_resnet50_and_its_segmenters_compute_the_same() -> None:
    # torchvision's DeepLabV3/FCN ResNet-50 dilate only layer3 and layer4: with the classifier's
    # weights, their stem..layer2 is the classifier's.
    r50 = arch.build_network("resnet50", 10, 1, SHAPE)
    seg = arch.build_network("deeplabv3_resnet50", 5, 2, SHAPE)
    seg.backbone.load_state_dict({k: v for k, v in r50.state_dict().items() if not k.startswith("fc.")})
    x = torch.randn(2, *SHAPE)
    with torch.inference_mode():
        a = arch.slice_stages(r50, "resnet50", ["layer2"], 0, 0)(x)
        b = arch.slice_stages(seg, "deeplabv3_resnet50", ["backbone.layer2"], 0, 0)(x)
    assert torch.equal(a, b)


def test_the_shipped_example_plan_is_valid() -> None:
    plan = load_plan(ROOT / "plans" / "examples" / "shared_backbone.yaml")
    assert plan.sharing()["backbone"] == ["classify", "segment", "segment_fcn"]
    assert plan.block_out_shape(plan.blocks["deeplab_head"]) == (21, 224, 224)
    assert plan.block_out_shape(plan.blocks["fcn_head"]) == (21, 224, 224)


def test_pixel_shares_rank_the_classes_most_pixels_take() -> None:
    from blockflow.cli.tasks import pixel_shares

    logits = torch.zeros(2, 3, 2, 2)
    logits[0, 2] = 1.0  # every pixel class 2
    logits[1, 1, 0] = 1.0  # top row class 1, bottom row class 0
    assert pixel_shares(logits.numpy()) == [[(2, 1.0)], [(0, 0.5), (1, 0.5)]]
