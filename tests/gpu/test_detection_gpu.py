"""Detectors on the GPU: a classifier and a RetinaNet sharing ResNet-50's stem..layer2 in fp16 blocks
(CUDA graphs) on TensorMQ, the RetinaNet's rest in an fp32 block (its heads and NMS eager), 320x320. The
classifier equals its fp32 unsplit reference within fp16's bound; the detector's best boxes are
the reference's (``blockflow.bench.agreement.detections_agree``: the same label, IoU >= 0.9,
score within 0.02), and its count within a few of it (fp16 moves scores near the threshold). The
detector's block replays its traced stages as CUDA graphs and finds what it finds running eagerly; given
each image's ORIGINAL_SIZE, its boxes are in those pixels."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from blockflow.backend.runtime import BlockRunner
from blockflow.bench.agreement import detections_agree, relative_error
from blockflow.clients.client import TaskClient
from blockflow.clients.detections import per_image
from blockflow.core.spec import ORIGINAL_SIZE
from blockflow.ensemble_gen import generator
from blockflow.plan import Plan, load_plan

from .small_plan import served

pytestmark = pytest.mark.gpu
SIZES = torch.tensor([[480, 640], [320, 320], [1080, 1920]])  # each image's ORIGINAL_SIZE (height, width)
PLAN = """
version: 1
name: detect-gpu
models:
  r50: {arch: resnet50, cut_points: [layer2], input_shape: [3, 320, 320], num_classes: 10}
  retina: {arch: retinanet_resnet50_fpn_v2, cut_points: [backbone.body.layer2], input_shape: [3, 320, 320], num_classes: 5,
           input: {original_size: true}}
defaults: {placement: gpu, max_batch_size: 4, precision: fp16}
blocks:
  dg_backbone: {model: r50, stages: 0, weights: {seed: 51}}
  dg_classify: {model: r50, stages: 1, weights: {seed: 51}}
  dg_detect: {model: retina, stages: 1, weights: {seed: 52}, precision: fp32}
tasks:
  dg_cls: {path: [dg_backbone, dg_classify]}
  dg_det: {path: [dg_backbone, dg_detect]}
transport: tensormq
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Plan, str]]:
    where = tmp_path_factory.mktemp("detect_gpu")
    with served(where, PLAN) as s:
        yield load_plan(where / "plan.yaml"), s.http_url


def test_the_classifier_and_the_detector_answer_as_their_fp32_references(server: tuple[Plan, str]) -> None:
    plan, url = server
    x = np.random.default_rng(3).random((2, 3, 320, 320), dtype=np.float32)
    with TaskClient(url) as c:
        logits = c.infer("dg_cls", x)
        found = c.detect("dg_det", x, inputs={ORIGINAL_SIZE: SIZES[:2].numpy()})
    cls_ref = BlockRunner(generator.reference_spec(plan, plan.tasks["dg_cls"], graph=False, fp32=True)[0], torch.device("cuda:0"))
    want = cls_ref.run(torch.from_numpy(x)).cpu().numpy()
    assert relative_error(logits, want) <= 2e-2
    det_spec = generator.reference_spec(plan, plan.tasks["dg_det"], graph=False, fp32=True)[0]
    outputs = BlockRunner(det_spec, torch.device("cuda:0")).run_all([torch.from_numpy(x), SIZES[:2]])
    expected = per_image({o.name: t.cpu().numpy() for o, t in zip(det_spec.task_outputs, outputs, strict=True)})
    for i, (d, w) in enumerate(zip(found, expected, strict=True)):
        print(f"image {i}: served {len(d)} detections, reference {len(w)}")
        assert len(w) > 0 and abs(len(d) - len(w)) <= max(3, len(w) // 20)
    assert detections_agree(found, expected)["best_matched"] == 1.0


def test_the_detector_block_graphs_its_traced_stages_and_runs_its_eager_node_after(server: tuple[Plan, str]) -> None:
    plan, _ = server
    cuda0 = torch.device("cuda:0")
    spec = generator.block_spec(plan, plan.blocks["dg_detect"], "tensormq")
    assert spec.cuda_graphs and spec.outputs
    graphed = BlockRunner(spec, cuda0)
    assert graphed.use_graphs and graphed.tail is not None and not torch.backends.cudnn.benchmark
    eager = BlockRunner(spec.model_copy(update={"cuda_graphs": False}), cuda0)
    assert not eager.use_graphs and eager.tail is None
    graphed.warmup()
    backbone = BlockRunner(generator.block_spec(plan, plan.blocks["dg_backbone"], "tensormq"), cuda0)
    assert backbone.use_graphs
    x = torch.rand(3, 3, 320, 320, generator=torch.Generator().manual_seed(9)) - 0.5
    features = backbone.run_all([x])
    names = [o.name for o in spec.task_outputs]
    found = per_image({n: t.cpu().numpy() for n, t in zip(names, graphed.run_all([*features, SIZES]), strict=True)})
    want = per_image({n: t.cpu().numpy() for n, t in zip(names, eager.run_all([*features, SIZES]), strict=True)})
    assert [len(d) for d in found] == [len(w) for w in want] and all(len(w) > 0 for w in want)
    assert detections_agree(found, want)["best_matched"] == 1.0
    # In the input's pixels without ORIGINAL_SIZE: the same boxes, scaled back.
    plain = BlockRunner(spec.model_copy(update={"side_inputs": ()}), cuda0)
    plain.warmup()
    unscaled = per_image({n: t.cpu().numpy() for n, t in zip(names, plain.run_all(features), strict=True)})
    for d, u, (h, w) in zip(found, unscaled, SIZES.tolist(), strict=True):
        assert len(d) == len(u)
        np.testing.assert_allclose(d.boxes, u.boxes * np.array([w / 320, h / 320] * 2, dtype=np.float32), rtol=1e-3, atol=1e-2)
