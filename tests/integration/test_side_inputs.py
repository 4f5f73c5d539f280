"""Task inputs besides the image (side inputs): exported programs of two inputs, cut in two and served
on a real tritonserver of this module's own, on TensorMQ and on Triton's own tensors (triton-cpu). A
side input goes from the task's ensemble to the blocks that read it (the last only, or the first and
the last) and every task answers as its program run whole, at batch 1 and 3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
import yaml

from blockflow.clients.client import TaskClient
from blockflow.core.errors import ClientError
from blockflow.plan import load_plan

from .. import side_programs
from ..conftest import own_server

pytestmark = pytest.mark.integration

TRANSPORTS = ("", "__triton_cpu")  # the plan's own (tensormq), and its comparison variant


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    where = tmp_path_factory.mktemp("side_inputs")
    sized, scaled = side_programs.sized_boxes(where), side_programs.scaled(where)
    plan = where / "plan.yaml"
    plan.write_text(yaml.safe_dump({
        "version": 1, "name": "side-inputs", "compare": ["triton-cpu"], "references": ["eager"],
        "models": {"sized": {"program": sized.name, "cut_points": ["body"]},
                   "scaled": {"program": scaled.name, "cut_points": ["body"]}},
        "defaults": {"placement": "cpu", "max_batch_size": 4},
        "blocks": {"sz_a": {"model": "sized", "stages": 0}, "sz_b": {"model": "sized", "stages": 1},
                   "sc_a": {"model": "scaled", "stages": 0}, "sc_b": {"model": "scaled", "stages": 1}},
        "tasks": {"sized": {"path": ["sz_a", "sz_b"]}, "scaled": {"path": ["sc_a", "sc_b"]}}}))
    with own_server(load_plan(plan), where) as server:
        yield server.http_url, sized, scaled


def _whole(program: Path, image: np.ndarray, side: np.ndarray) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        out = torch.export.load(program).module()(torch.from_numpy(image), torch.from_numpy(side))
    return {k: v.numpy() for k, v in out.items()} if isinstance(out, dict) else {"LOGITS": out.numpy()}


@pytest.mark.parametrize("variant", [*TRANSPORTS, "__ref"])
def test_a_side_input_read_by_the_last_block_answers_as_the_program(served: tuple[str, Path, Path], variant: str) -> None:
    url, sized, _ = served
    task = f"sized{variant}"
    with TaskClient(url) as c:
        for batch in (1, 3):
            rng = np.random.default_rng(batch)
            image = rng.standard_normal((batch, 3, 16, 16), dtype=np.float32)
            size = rng.integers(16, 4000, (batch, 2), dtype=np.int64)
            got = c.infer_outputs(task, image, inputs={"size": size})
            want = _whole(sized, image, size)
            np.testing.assert_allclose(got["boxes"], want["boxes"], rtol=1e-5, atol=1e-4)
            assert got["area"].dtype == np.int64 and np.array_equal(got["area"], want["area"])


@pytest.mark.parametrize("variant", [*TRANSPORTS, "__ref"])
def test_a_side_input_read_by_both_blocks_answers_as_the_program(served: tuple[str, Path, Path], variant: str) -> None:
    url, _, scaled = served
    task = f"scaled{variant}"
    with TaskClient(url) as c:
        for batch in (1, 3):
            rng = np.random.default_rng(10 + batch)
            image = rng.standard_normal((batch, 3, 16, 16), dtype=np.float32)
            scale = rng.uniform(0.5, 2.0, (batch, 1)).astype(np.float32)
            got = c.infer(task, image, inputs={"scale": scale})
            np.testing.assert_allclose(got, _whole(scaled, image, scale)["LOGITS"], rtol=1e-5, atol=1e-5)


def test_the_task_says_what_it_takes_and_a_client_that_sends_otherwise_is_told(served: tuple[str, Path, Path]) -> None:
    url, _, _ = served
    image = np.zeros((2, 3, 16, 16), dtype=np.float32)
    with TaskClient(url) as c:
        with pytest.raises(ClientError, match="size"):
            c.infer_outputs("sized", image)  # the side input is missing
        with pytest.raises(ClientError, match="size"):
            c.infer_outputs("sized", image, inputs={"size": np.zeros((2, 2), dtype=np.float32)})
        with pytest.raises(ClientError, match="nope"):
            c.infer_outputs("sized", image, inputs={"size": np.zeros((2, 2), dtype=np.int64), "nope": image})
    # Past the client's checks, straight to Triton: a batch whose side input has fewer rows is refused
    # (by Triton's own batch check, before any block; the blocks check again), and the task answers the next request.
    raw = httpclient.InferenceServerClient(url.removeprefix("http://"))
    img = httpclient.InferInput("IMAGE", [2, 3, 16, 16], "FP32")
    img.set_data_from_numpy(image)
    side = httpclient.InferInput("size", [1, 2], "INT64")
    side.set_data_from_numpy(np.ones((1, 2), dtype=np.int64))
    with pytest.raises(Exception, match="(?i)size|shape|batch"):
        raw.infer("sized", [img, side])
    raw.close()
    with TaskClient(url) as c:
        got = c.infer_outputs("sized", image, inputs={"size": np.full((2, 2), 10, dtype=np.int64)})
        assert np.array_equal(got["area"], np.full((2, 1), 100))


def test_blockflow_infer_sends_side_inputs_from_npy_files(served: tuple[str, Path, Path], tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    url, _, _ = served
    sizes = tmp_path / "sizes.npy"
    np.save(sizes, np.array([30, 20], dtype=np.int64))  # one sample's, repeated over the batch
    run = subprocess.run([sys.executable, "-m", "blockflow", "infer", "sized", "--random", "--batch", "2", "--url",
                          url.removeprefix("http://"), "--input", f"size={sizes}", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    outputs = json.loads(run.stdout)["outputs"]
    assert [o["area"] for o in outputs] == [[600], [600]]
    bad = subprocess.run([sys.executable, "-m", "blockflow", "infer", "sized", "--random", "--url",
                          url.removeprefix("http://"), "--input", f"sise={sizes}"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "sise" in bad.stderr


def test_perf_analyzer_measures_a_task_with_side_inputs(served: tuple[str, Path, Path], tmp_path: Path) -> None:
    import os
    import shutil
    import subprocess
    import sys

    from blockflow.bench.perf_analyzer import side_input_data
    from blockflow.core.spec import SideInput

    url, _, _ = served
    data = side_input_data(tmp_path / "data", (3, 16, 16), False, (SideInput(name="size", dtype="int64", shape=(2,)),))
    pa = shutil.which("perf_analyzer", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if pa is None:
        pytest.fail("perf_analyzer not found; run ./scripts/setup.sh")
    res = subprocess.run([pa, "-m", "sized", "-u", url.removeprefix("http://"), "-b", "2", "--input-data", str(data),
                          "--concurrency-range", "1", "--measurement-mode", "count_windows", "--measurement-request-count", "5",
                          "--max-trials", "3", "--stability-percentage", "999"], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Throughput" in res.stdout
