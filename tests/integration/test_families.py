"""Eight torchvision families, each cut twice and served by a real tritonserver: two tasks share
the first two stages, each with its own head, and every task on every transport (TensorMQ,
triton-cpu) equals the unsplit network computed here, at batch 1 and 3.

The cuts fall a third and two thirds of the way through each network's legal cuts; most carry
several tensors (a skip connection, a squeeze-and-excitation input, DenseNet's concatenated
features). One server per family, started in turn, keeps the 2-core CI machine's memory small.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from blockflow.clients.client import TaskClient
from blockflow.core import arch
from blockflow.plan import Plan, naming, parse_plan

from ..conftest import own_server

pytestmark = pytest.mark.integration

# family: (torchvision name, input shape, two cuts)
FAMILIES: dict[str, tuple[str, tuple[int, int, int], tuple[str, str]]] = {
    "mobilenet": ("mobilenet_v3_small", (3, 32, 32), ("features.5.block.1.2", "features.8")),
    "efficientnet": ("efficientnet_b0", (3, 32, 32), ("features.4.0.block.2.fc2", "features.5.2")),
    "convnext": ("convnext_tiny", (3, 32, 32), ("features.3", "features.5.6.block.2")),
    "vit": ("vit_b_16", (3, 32, 32), ("encoder.layers.encoder_layer_3.mlp", "encoder.layers.encoder_layer_8")),
    "swin": ("swin_t", (3, 64, 64), ("features.3.1", "features.5.2.norm1")),
    "densenet": ("densenet121", (3, 32, 32), ("features.denseblock2.denselayer3.conv2",
                                             "features.denseblock3.denselayer6.conv1")),
    "regnet": ("regnet_y_400mf", (3, 32, 32), ("trunk_output.block3.block3-1.f.a.0",
                                              "trunk_output.block4.block4-0.f.se.fc2")),
    "resnext": ("resnext50_32x4d", (3, 32, 32), ("layer2.2.conv1", "layer3.3.bn3")),
}
TRUNK_SEED, HEAD_B_SEED = 5, 6
GPU = torch.cuda.is_available()
# On the CPU the served blocks and the network here run the same kernels; on a GPU the blocks run
# cuDNN (TF32 off) against this CPU reference, whose summation order differs.
TOLERANCE = 1e-4 if GPU else 1e-5


def family_plan(name: str) -> dict[str, Any]:
    net, shape, cuts = FAMILIES[name]
    return {
        "version": 1,
        "name": f"family-{name}",
        "models": {"m": {"arch": net, "cut_points": list(cuts), "input_shape": list(shape), "num_classes": 10}},
        "defaults": {"placement": "auto", "max_batch_size": 4},
        "blocks": {
            "trunk": {"model": "m", "stages": [0, 1], "weights": {"seed": TRUNK_SEED}},
            "head_a": {"model": "m", "stages": 2, "weights": {"seed": TRUNK_SEED}},
            "head_b": {"model": "m", "stages": 2, "weights": {"seed": HEAD_B_SEED}},
        },
        "tasks": {"task_a": {"path": ["trunk", "head_a"]}, "task_b": {"path": ["trunk", "head_b"]}},
        "transport": "tensormq",
        "compare": ["triton-gpu", "triton-cpu"] if GPU else ["triton-cpu"],
        "tensormq": {"pool_mb": 16, "slots": 32},
    }


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Plan, str]]:
    plan = parse_plan(family_plan(request.param), source=f"family {request.param}")
    with own_server(plan, tmp_path_factory.mktemp(request.param)) as server:
        yield request.param, plan, server.http_url


def _unsplit(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """Each task's answer computed here: task_a is the whole network of the trunk's seed; task_b
    runs that network's first two stages, then the last stage of the network of its own seed."""
    net_name, shape, cuts = FAMILIES[name]
    a = arch.build_network(net_name, 10, TRUNK_SEED, shape)
    b = arch.build_network(net_name, 10, HEAD_B_SEED, shape)
    with torch.inference_mode():
        inputs = torch.from_numpy(x)
        trunk = arch.slice_stages(a, net_name, cuts, 0, 1)(inputs)
        head_b = arch.slice_stages(b, net_name, cuts, 2, 2)(*(trunk if isinstance(trunk, tuple) else (trunk,)))
        return {"task_a": a(inputs).numpy(), "task_b": head_b.numpy()}


@pytest.mark.parametrize("batch", [1, 3])
def test_every_task_on_every_transport_equals_the_unsplit_network(served: tuple[str, Plan, str], batch: int) -> None:
    name, plan, url = served
    shape = FAMILIES[name][1]
    x = np.random.default_rng(batch).standard_normal((batch, *shape), dtype=np.float32)
    want = _unsplit(name, x)
    assert not np.allclose(want["task_a"], want["task_b"], rtol=1e-3, atol=0), "the heads have different weights"
    with TaskClient(url) as client:
        for task in plan.tasks.values():
            for transport in plan.transports_of(task):
                got = client.infer(naming.task_model(task.name, transport, task.transport), x)
                err = float(np.abs(got - want[task.name]).max() / np.abs(want[task.name]).max())
                assert got.shape == (batch, 10) and err <= TOLERANCE, (name, task.name, transport, err)


def test_the_plans_share_their_trunk_and_cut_where_tensors_cross() -> None:
    # What the served test stands on: each plan is valid, both tasks use one trunk, and most cuts carry several tensors.
    widths = []
    for name in FAMILIES:
        plan = parse_plan(family_plan(name))
        assert plan.sharing()["trunk"] == ["task_a", "task_b"]
        widths += [len(s) for s in plan.stage_shapes["m"][:2]]
    assert sum(w > 1 for w in widths) >= 8, widths
