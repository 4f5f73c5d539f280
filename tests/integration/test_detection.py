"""Detectors served on a real tritonserver, each plan on a server of this module's own:
tests/plans/detect_shared.yaml (a classifier, a RetinaNet and a DeepLabV3 sharing ResNet-50's
stem..layer2; on tensormq and triton-cpu) and tests/plans/detect_families.yaml (Faster and Mask
R-CNN sharing a backbone and its FPN, an FCOS whole, an SSDlite split). Every task equals its
unsplit reference (from the spec the generator writes, run in a child process so its weights
leave with it): the same counts, boxes, scores, labels and masks (detectors), logits and maps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blockflow.bench.agreement import relative_error
from blockflow.clients.client import TaskClient
from blockflow.core.errors import ClientError
from blockflow.core.spec import ORIGINAL_SIZE
from blockflow.plan import Plan, load_plan, naming

from ..conftest import in_child, own_server

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PLANS = {"detect_shared": ROOT / "tests" / "plans" / "detect_shared.yaml",
         "detect_families": ROOT / "tests" / "plans" / "detect_families.yaml"}
BATCHES = (1, 3)
TOL = 1e-5


def _images(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).random((batch, 3, 128, 128), dtype=np.float32)


def _sides(plan: Plan, task: str, batch: int) -> dict[str, np.ndarray]:
    """What ``task`` takes besides its images: a detector's ORIGINAL_SIZE (each image's height and width)."""
    names = {s.name for s in plan.task_side_inputs(plan.tasks[task])}
    return {ORIGINAL_SIZE: np.array([[480, 640], [256, 128], [128, 128]], dtype=np.int64)[:batch]} if ORIGINAL_SIZE in names else {}


def _references(plan_path: str) -> dict[tuple[str, int], list[np.ndarray]]:
    """(task, batch) -> the outputs of the task's unsplit reference, in the task's output order."""
    import torch

    from blockflow.backend.runtime import BlockRunner
    from blockflow.ensemble_gen import generator

    plan, out = load_plan(plan_path), {}
    for name, task in plan.tasks.items():
        runner = BlockRunner(generator.reference_spec(plan, task, graph=False)[0], torch.device("cpu"))
        with torch.inference_mode():
            for batch in BATCHES:
                sides = [torch.from_numpy(a) for a in _sides(plan, name, batch).values()]
                out[name, batch] = [y.numpy() for y in runner.run_all([torch.from_numpy(_images(batch)), *sides])]
    return out


@pytest.fixture(scope="module", params=list(PLANS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Plan, str, dict[tuple[str, int], list[np.ndarray]]]]:
    plan = load_plan(PLANS[request.param])
    # Before the server starts, so that the references' weights are gone when its stubs build theirs.
    references = in_child(_references, str(PLANS[request.param]))
    with own_server(plan, tmp_path_factory.mktemp(request.param)) as server:
        yield plan, server.http_url, references


def _check(got: dict[str, np.ndarray], want: list[np.ndarray], names: list[str], where: Any) -> None:
    assert list(got) == names, where
    for name, g, w in zip(names, got.values(), want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (where, name, g.shape, w.shape)
        if np.issubdtype(w.dtype, np.integer):
            assert np.array_equal(g, w), (where, name)
        else:
            assert relative_error(g, w) <= TOL, (where, name)


def test_every_task_equals_its_reference_on_every_transport(served: tuple[Plan, str, dict[tuple[str, int], list[np.ndarray]]]) -> None:
    plan, url, references = served
    checked = 0
    with TaskClient(url) as c:
        for name, task in plan.tasks.items():
            for transport in plan.transports_of(task):
                model = naming.task_model(name, transport, task.transport)
                names = list(c.input_of(model).outputs)
                for batch in BATCHES:
                    got = c.infer_outputs(model, _images(batch), inputs=_sides(plan, name, batch))
                    _check(got, references[name, batch], names, (model, batch))
                    if "COUNT" in got:
                        assert int(got["COUNT"].sum()) > 0, (model, batch)  # seeded weights detect something
                    checked += 1
    assert checked >= 2 * len(plan.tasks)


def test_detections_come_per_image_and_logits_calls_say_what_to_call(served: tuple[Plan, str, dict[tuple[str, int], list[np.ndarray]]]) -> None:
    plan, url, references = served
    task = next(t for t in plan.tasks if "COUNT" in {o.name for o in plan.block_outputs(plan.blocks[plan.tasks[t].path[-1]])})
    with TaskClient(url) as c:
        found = c.detect(task, _images(3))
        with pytest.raises(ClientError, match="not LOGITS: call infer_outputs or detect"):
            c.infer(task, _images(1))
    count, boxes = references[task, 3][0], references[task, 3][1]
    assert [len(d) for d in found] == count[:, 0].tolist()
    for i, d in enumerate(found):
        assert d.boxes.shape == (len(d), 4) and np.allclose(d.boxes, boxes[i, :len(d)], rtol=TOL, atol=1e-4)
        assert bool((d.scores[:-1] >= d.scores[1:]).all())  # best first
        assert (d.masks is not None) == task.endswith("mrcnn")


def test_cli_infer_prints_detections_and_perf_analyzer_measures_a_detector(
        served: tuple[Plan, str, dict[tuple[str, int], list[np.ndarray]]]) -> None:
    plan, url, _ = served
    task = "ds_det" if "ds_det" in plan.tasks else "df_mrcnn"
    res = subprocess.run([sys.executable, "-m", "blockflow", "infer", task, "--random", "--batch", "2", "--url", url,
                          "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout)
    assert len(shown["detections"]) == 2 and shown["detections"][0]["count"] > 0
    assert set(shown["detections"][0]["best"][0]) == {"box", "label", "score"}
    pa = shutil.which("perf_analyzer", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if pa is None:
        pytest.fail("perf_analyzer not found; run ./scripts/setup.sh")
    res = subprocess.run([pa, "-m", task, "-u", url, "-b", "2", "--concurrency-range", "1", "--measurement-mode",
                          "count_windows", "--measurement-request-count", "5", "--max-trials", "3",
                          "--stability-percentage", "999"], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Throughput" in res.stdout


def test_cli_infer_sends_an_image_files_original_size(served: tuple[Plan, str, dict[tuple[str, int], list[np.ndarray]]],
                                                      tmp_path: Path) -> None:
    plan, url, _ = served
    if "df_fcos_t" not in plan.tasks:
        pytest.skip("the families plan's FCOS takes ORIGINAL_SIZE")
    from PIL import Image

    photo = sorted((ROOT / "bench" / "data" / "images").glob("*.jpg"))[0]
    with Image.open(photo) as im:
        width, height = im.size
    as_input = tmp_path / "as_input.npy"
    np.save(as_input, np.array([128, 128], dtype=np.int64))  # the network's own size: boxes as it finds them

    def boxes(*extra: str) -> np.ndarray:
        res = subprocess.run([sys.executable, "-m", "blockflow", "infer", "df_fcos_t", "--image", str(photo), "--url", url,
                              "--json", *extra], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
        assert res.returncode == 0, res.stderr
        return np.array([d["box"] for d in json.loads(res.stdout)["detections"][0]["best"]], dtype=np.float64)

    in_file, in_input = boxes(), boxes("--input", f"ORIGINAL_SIZE={as_input}")
    assert in_file.shape == in_input.shape and len(in_file) > 0
    np.testing.assert_allclose(in_file, in_input * [width / 128, height / 128, width / 128, height / 128], rtol=1e-4, atol=1e-2)
