"""Tasks of several kinds sharing a backbone (tests/plans/segment_shared.yaml, on a server of this
module's own): a ResNet-50 classifier and a DeepLabV3 ResNet-50 segmenter run one copy of stem..layer2,
and an LR-ASPP MobileNetV3 segmenter split inside its backbone runs alone. Each task equals its
unsplit reference (from the spec the generator writes: the plan serves none, to keep the server's
memory down) and the network built from torchvision, both run in a child process; clients and
``blockflow infer`` take maps."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from blockflow.backend.runtime import BlockRunner
from blockflow.bench.agreement import relative_error
from blockflow.clients.client import TaskClient
from blockflow.core import arch
from blockflow.core.spec import ModelSpec
from blockflow.ensemble_gen import generator
from blockflow.plan import Plan, load_plan

from ..conftest import in_child, own_server

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "tests" / "plans" / "segment_shared.yaml"
SHAPE = (3, 64, 64)
BATCHES = (1, 3)
TOL = 1e-5
# task -> its output per image, and how it is computed here: (arch, classes, seed, cuts, first, last) per part
EXPECTED = {
    "sb_classify_t": ((10,), [("resnet50", 10, 41, ["layer2"], 0, 1)]),
    "sb_segment_t": ((5, 64, 64), [("resnet50", 10, 41, ["layer2"], 0, 0),
                                   ("deeplabv3_resnet50", 5, 42, ["backbone.layer2"], 1, 1)]),
    "sb_lraspp_t": ((4, 64, 64), [("lraspp_mobilenet_v3_large", 4, 43, ["backbone.6"], 0, 1)]),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Plan, str]]:
    plan = load_plan(PLAN)
    with own_server(plan, tmp_path_factory.mktemp("segment_shared")) as server:
        yield plan, server.http_url


def _here(task: str, x: np.ndarray) -> np.ndarray:
    y: tuple[torch.Tensor, ...] = (torch.from_numpy(x),)
    with torch.inference_mode():
        for name, classes, seed, cuts, first, last in EXPECTED[task][1]:
            net = arch.build_network(name, classes, seed, SHAPE)
            out = arch.slice_stages(net, name, cuts, first, last)(*y)
            y = tuple(out) if isinstance(out, tuple) else (out,)
    return y[0].numpy()  # type: ignore[no-any-return]


def _images(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).standard_normal((batch, *SHAPE), dtype=np.float32)


def _references(plan_path: str) -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """(task, batch) -> its unsplit reference's output and the network's computed here."""
    plan, out = load_plan(plan_path), {}
    for task in EXPECTED:
        spec = ModelSpec.model_validate_json(generator.reference_spec(plan, plan.tasks[task], graph=False)[0].to_json())
        reference = BlockRunner(spec, torch.device("cpu"))
        for batch in BATCHES:
            x = _images(batch)
            out[task, batch] = reference.run(torch.from_numpy(x)).numpy(), _here(task, x)
    return out


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    # In a child process: the weights it builds (~800 MiB) leave with it, where the pytest process
    # would keep them beside the shared server's stubs.
    return in_child(_references, str(PLAN))


@pytest.mark.parametrize("task", list(EXPECTED))
def test_each_task_equals_its_reference_and_the_network(served: tuple[Plan, str],
                                                        references: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]],
                                                        task: str) -> None:
    with TaskClient(served[1]) as c:
        for batch in BATCHES:
            got = c.infer(task, _images(batch))
            ref, here = references[task, batch]
            assert got.shape == ref.shape == (batch, *EXPECTED[task][0])
            assert relative_error(got, ref) <= TOL, (task, batch)
            assert relative_error(got, here) <= TOL, (task, batch)


def test_the_shared_block_is_one_model_serving_both_tasks(served: tuple[Plan, str]) -> None:
    plan, url = served
    files = generator.render(plan)
    assert sum(1 for k in files if k.endswith("/config.pbtxt") and k.startswith("sb_shared")) == 1
    for task in ("sb_classify_t", "sb_segment_t"):
        assert 'model_name: "sb_shared"' in files[f"{task}/config.pbtxt"].decode()
    with TaskClient(url) as c:
        states = {m["name"]: m["state"] for m in c.models()}
        assert states["sb_shared"] == "READY"
        x = np.random.default_rng(5).standard_normal((2, *SHAPE), dtype=np.float32)
        cls, seg = c.infer("sb_classify_t", x), c.infer("sb_segment_t", x)
    assert cls.shape == (2, 10) and seg.shape == (2, 5, 64, 64)


def test_cli_infer_prints_a_segmentation_summary(served: tuple[Plan, str], tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(png)
    res = subprocess.run([sys.executable, "-m", "blockflow", "infer", "sb_segment_t", "--image", str(png), "--url",
                          served[1]], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    assert "sb_segment_t sample 0: segmentation 64×64, 5 classes; by pixel share:" in res.stdout
    assert "%)" in res.stdout and "p50" in res.stdout
