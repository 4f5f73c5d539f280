"""Detectors as plan networks (blockflow.core.detection): the wrapper gives what torchvision's own
model gives, its backbone is traced and cut like any network, the eager rest is never cut, and
plans, specs, configs and the client's view of the answer follow."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.models as tvm

from blockflow.clients.detections import per_image
from blockflow.core import arch, detection
from blockflow.core.errors import ClientError, PlanError
from blockflow.ensemble_gen import generator
from blockflow.ensemble_gen.configs import parse_pbtxt
from blockflow.plan import load_plan, parse_plan

ROOT = Path(__file__).resolve().parents[2]
# The families the plan format lists, each at a size its own transform leaves as it is (an SSDlite
# resizes to 320x320 itself).
FAMILIES = {"fasterrcnn_resnet50_fpn_v2": 96, "maskrcnn_resnet50_fpn_v2": 96, "retinanet_resnet50_fpn_v2": 96,
            "fcos_resnet50_fpn": 96, "ssdlite320_mobilenet_v3_large": 320}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_wrapper_and_its_traced_graph_give_what_torchvision_gives(name: str) -> None:
    size = FAMILIES[name]
    net = arch.build_network(name, 5, 7, (3, size, size))
    theirs = tvm.get_model(name, weights=None, num_classes=5, **detection.factory_kwargs(name, (3, size, size)))
    theirs.load_state_dict(net.state_dict(), strict=True)  # the wrapper's weights are keyed as torchvision's
    x = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours, traced, want = net(x), arch.trace(net).module(x), theirs.eval()(list(x))
    names = detection.output_names(name)
    assert len(ours) == len(names) and ours[0].shape == (2, 1)
    for i, w in enumerate(want):
        n = int(ours[0][i, 0])
        assert n == w["boxes"].shape[0] > 0, "seeded weights must detect something"
        assert torch.equal(ours[1][i, :n], w["boxes"]) and torch.equal(ours[2][i, :n], w["scores"])
        assert torch.equal(ours[3][i, :n], w["labels"]) and bool((ours[3][i, n:] == detection.PAD_LABEL).all())
        if "masks" in w:
            assert torch.equal(ours[4][i, :n], w["masks"][:, 0])
    assert all(torch.equal(a, b) for a, b in zip(ours, traced, strict=True))


def test_cuts_fall_in_the_backbone_and_its_pyramid_never_in_the_eager_rest() -> None:
    cuts = arch.legal_cuts("fasterrcnn_resnet50_fpn_v2", (3, 96, 96), 5)
    assert len(cuts.get("backbone").tensors) == 5  # type: ignore[union-attr]  # the five pyramid levels
    assert len(cuts.get("backbone.body.layer2").tensors) == 2  # type: ignore[union-attr]  # its FPN reads layer1 too
    assert not any(c.startswith(("rpn", "roi_heads", "detect")) for c in cuts.names())
    retina = arch.legal_cuts("retinanet_resnet50_fpn_v2", (3, 96, 96), 5)
    assert retina.get("backbone.body.layer2").shapes == ((512, 12, 12),)  # type: ignore[union-attr]  # as ResNet-50's layer2


def test_split_stages_compose_to_the_whole_detector() -> None:
    net = arch.build_network("retinanet_resnet50_fpn_v2", 5, 3, (3, 96, 96))
    cut = ["backbone.body.layer2", "backbone"]
    x = torch.rand(1, 3, 96, 96, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y: tuple[torch.Tensor, ...] = (x,)
        for stage in range(3):
            out = arch.slice_stages(net, "retinanet_resnet50_fpn_v2", cut, stage, stage)(*y)
            y = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        whole = net(x)
    assert all(torch.equal(a, b) for a, b in zip(y, whole, strict=True))


@pytest.mark.parametrize("name", ["retinanet_resnet50_fpn_v2", "maskrcnn_resnet50_fpn_v2"])
def test_a_detectors_last_stages_split_into_a_graphable_prefix_and_its_eager_node(name: str) -> None:
    """On a GPU the runner replays the prefix as CUDA graphs and runs the eager node after it."""
    from blockflow.backend.parts import split_eager_tail

    net = arch.build_network(name, 5, 3, (3, 96, 96))
    cut = ["backbone.body.layer2"]
    x = torch.rand(2, 3, 96, 96, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        first = arch.slice_stages(net, name, cut, 0, 0)
        last = arch.slice_stages(net, name, cut, 1, 1)
        y = first(x)
        y = tuple(y) if isinstance(y, (tuple, list)) else (y,)
        whole = last(*y)
        split = split_eager_tail(last)
        assert split is not None
        prefix, tail = split
        assert not any(n.target in detection.EAGER_NODES for n in prefix.graph.nodes)
        features = prefix(*y)
        assert len(features) == 5  # the pyramid's levels (and its pooled one)
        got = tail(*features)
    assert len(got) == len(whole) and all(torch.equal(a, b) for a, b in zip(got, whole, strict=True))
    assert int(got[0].sum()) > 0, "seeded weights must detect something"
    classifier = arch.slice_stages(arch.build_network("resnet18", 5, 0, (3, 32, 32)), "resnet18", ["layer2"], 1, 1)
    assert split_eager_tail(classifier) is None


def test_keypoint_rcnn_is_refused_with_what_is_served() -> None:
    raw = {"version": 1, "name": "kp", "models": {"m": {"arch": "keypointrcnn_resnet50_fpn", "input_shape": [3, 64, 64]}},
           "blocks": {"b": {"model": "m", "stages": 0}}, "tasks": {"t": {"path": ["b"]}}}
    with pytest.raises(Exception, match="or detection model works"):
        parse_plan(raw)


def test_a_detector_task_declares_its_outputs_in_the_block_and_the_ensemble() -> None:
    plan = load_plan(ROOT / "tests" / "plans" / "detect_families.yaml")
    files = generator.render(plan)
    ens = parse_pbtxt(files["df_mrcnn/config.pbtxt"].decode())
    outs = {o.name: (list(o.dims), o.data_type) for o in ens.output}
    assert list(outs) == ["COUNT", "BOXES", "SCORES", "LABELS", "MASKS"]
    assert outs["BOXES"][0] == [-1, 4] and outs["MASKS"][0] == [-1, 128, 128] and outs["COUNT"][0] == [1]
    last = ens.ensemble_scheduling.step[-1]
    assert dict(last.output_map) == {n: n for n in outs}
    block = parse_pbtxt(files["df_masks/config.pbtxt"].decode())
    assert [o.name for o in block.output] == list(outs)
    # The shared backbone hands its five pyramid levels on as one ticket; the box task has no MASKS.
    assert [o.name for o in parse_pbtxt(files["df_frcnn/config.pbtxt"].decode()).output] == ["COUNT", "BOXES", "SCORES", "LABELS"]
    spec = generator.reference_spec(plan, plan.tasks["df_mrcnn"], graph=False)[0]
    assert [o.name for o in spec.outputs] == list(outs) and spec.parts[0].network is not None  # the Faster R-CNN's backbone


def test_the_three_kind_plan_shares_one_backbone_block() -> None:
    plan = load_plan(ROOT / "tests" / "plans" / "detect_shared.yaml")
    assert plan.sharing()["ds_backbone"] == ["ds_cls", "ds_det", "ds_seg"]
    files = generator.render(plan)
    assert [o.name for o in parse_pbtxt(files["ds_det/config.pbtxt"].decode()).output] == ["COUNT", "BOXES", "SCORES", "LABELS"]
    assert [o.name for o in parse_pbtxt(files["ds_cls/config.pbtxt"].decode()).output] == ["LOGITS"]


def test_the_client_cuts_each_images_detections_to_its_count() -> None:
    outputs = {"COUNT": np.array([[2], [0]]), "BOXES": np.arange(16, dtype=np.float32).reshape(2, 2, 4),
               "SCORES": np.array([[0.9, 0.5], [0.0, 0.0]], dtype=np.float32), "LABELS": np.array([[3, 1], [-1, -1]])}
    first, second = per_image(outputs)
    assert len(first) == 2 and first.labels.tolist() == [3, 1] and first.boxes.shape == (2, 4) and first.masks is None
    assert len(second) == 0 and second.boxes.shape == (0, 4)
    with pytest.raises(ClientError, match="lacks SCORES, LABELS"):
        per_image({"COUNT": outputs["COUNT"], "BOXES": outputs["BOXES"]})


def test_a_detectors_heads_in_fp16_or_bf16_are_refused_its_backbone_is_not() -> None:
    raw = load_plan(ROOT / "tests" / "plans" / "detect_families.yaml").raw.model_dump(mode="json", exclude_none=True)
    raw["blocks"]["df_fpn"]["precision"] = "fp16"  # the backbone: allowed
    parse_plan(raw)
    for precision in ("fp16", "bf16"):
        raw["blocks"]["df_boxes"]["precision"] = precision
        with pytest.raises(PlanError, match=r"blocks\.df_boxes\.precision.*for a detector's last stages"):
            parse_plan(raw)


def test_the_memory_model_gives_a_detectors_last_block_a_graph_pool_for_its_traced_prefix() -> None:
    """Its traced stages replay as CUDA graphs (the runner runs only the eager node eagerly)."""
    from blockflow.plan import load_plan, memory

    plan = load_plan(Path(__file__).resolve().parents[2] / "plans" / "bench_vision.yaml")
    cal = memory.Calibration.load(memory.shipped_calibration("h200"))
    procs = {p.model: p for p in memory.modular(plan, 1, cal)}
    assert procs["detect_rest"].activations_mib > 0 and procs["detect_rest"].overhead_mib == cal.process_mib
    assert procs["backbone"].activations_mib > 0 and procs["segment_rest"].activations_mib > 0


def test_a_detector_given_original_sizes_answers_boxes_in_their_pixels() -> None:
    from blockflow.backend.runtime import BlockRunner
    from blockflow.core.errors import RequestError
    from blockflow.core.spec import ORIGINAL_SIZE

    plan = load_plan(ROOT / "tests" / "plans" / "detect_families.yaml")
    task = plan.tasks["df_fcos_t"]
    files = generator.render(plan)
    last = parse_pbtxt(files["df_fcos_b/config.pbtxt"].decode())
    assert [(i.name, list(i.dims)) for i in last.input][-1] == (ORIGINAL_SIZE, [2])
    assert ORIGINAL_SIZE not in [i.name for i in parse_pbtxt(files["df_fcos_a/config.pbtxt"].decode()).input]
    ens = parse_pbtxt(files["df_fcos_t/config.pbtxt"].decode())
    assert [list(s.input_map) for s in ens.ensemble_scheduling.step][1][-1] == ORIGINAL_SIZE
    assert ORIGINAL_SIZE not in ens.ensemble_scheduling.step[0].input_map
    spec = generator.reference_spec(plan, task, graph=False)[0]
    assert [s.name for s in spec.side_inputs] == [ORIGINAL_SIZE] and all(not p.side_inputs for p in spec.parts)
    sized = BlockRunner(spec, torch.device("cpu"))
    plain = BlockRunner(spec.model_copy(update={"side_inputs": ()}), torch.device("cpu"))
    x = torch.rand(2, 3, 128, 128, generator=torch.Generator().manual_seed(0))
    sizes = torch.tensor([[480, 640], [64, 32]])
    with torch.inference_mode():
        got, want = sized.run_all([x, sizes]), plain.run_all([x])
    assert int(want[0].sum()) > 0 and torch.equal(got[0], want[0]) and torch.equal(got[3], want[3])
    scale = torch.tensor([[640 / 128, 480 / 128] * 2, [32 / 128, 64 / 128] * 2])
    assert torch.allclose(got[1], want[1] * scale[:, None, :])
    for bad in (torch.tensor([[0, 640], [64, 32]]), torch.tensor([[480, 2_000_000], [64, 32]])):
        with pytest.raises(RequestError, match="ORIGINAL_SIZE"):
            sized.run_all([x, bad])


def test_original_size_is_for_detectors() -> None:
    raw = load_plan(ROOT / "tests" / "plans" / "detect_families.yaml").raw.model_dump(mode="json", exclude_none=True)
    raw["models"]["fcn"]["input"] = {"original_size": True}
    with pytest.raises(PlanError, match="original_size is for torchvision's detectors"):
        parse_plan(raw)
