"""A pack of whole models (``pack: all``, tests/plans/model_pack.yaml) on a real tritonserver of this
module's own (the shared server's plans fill a 24 GB CPU machine: with two stubs more it thrashed):
each task answers as its unsplit reference (run here, from the spec the generator writes: the plan
serves none), alone and with another member's requests at once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from blockflow.backend.runtime import BlockRunner
from blockflow.bench.agreement import relative_error
from blockflow.clients.client import TaskClient
from blockflow.ensemble_gen import generator
from blockflow.plan import Plan, load_plan

from ..conftest import own_server

pytestmark = pytest.mark.integration
PLAN = Path(__file__).resolve().parents[2] / "tests" / "plans" / "model_pack.yaml"


def _tolerance() -> float:
    # fp32: the pack runs each member's stages as its reference does; on a GPU cuDNN picks
    # batch-dependent algorithms (as tests/integration/test_serving.py allows).
    return 1e-4 if torch.cuda.is_available() else 1e-5


TOL = _tolerance()


def _images(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 64, 64), dtype=np.float32)


class Served:
    def __init__(self, plan: Plan, http: str) -> None:
        self.plan, self.http = plan, http


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    plan = load_plan(PLAN)
    with own_server(plan, tmp_path_factory.mktemp("model_pack")) as server:
        yield Served(plan, server.http_url)


@pytest.fixture(scope="module")
def reference(served: Served) -> dict[str, BlockRunner]:
    """Each task's monolithic reference (what ``references: [eager]`` would serve), on the CPU here."""
    return {t: BlockRunner(generator.reference_spec(served.plan, task, graph=False)[0], torch.device("cpu"))
            for t, task in served.plan.tasks.items()}


def _want(reference: dict[str, BlockRunner], task: str, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return reference[task].run(torch.from_numpy(x)).numpy()  # type: ignore[no-any-return]


def test_the_plan_deploys_one_pack_of_two_and_one_model_alone(served: Served) -> None:
    with TaskClient(served.http) as c:
        ready = {m["name"] for m in c.models() if m["state"] == "READY"}
    assert {"w1__pack", "w3", "w_one", "w_two", "w_three"} <= ready and not {"w1", "w2"} & ready


@pytest.mark.parametrize("task", ["w_one", "w_two", "w_three"])
def test_each_task_answers_as_its_reference(served: Served, reference: dict[str, BlockRunner], task: str) -> None:
    with TaskClient(served.http) as c:
        for batch in (1, 3):
            x = _images(batch, seed=batch)
            got, want = c.infer(task, x), _want(reference, task, x)
            assert got.shape == want.shape == (batch, 10)
            assert relative_error(got, want) <= TOL, (task, batch)


def test_concurrent_requests_to_two_members_get_their_own_answers(served: Served, reference: dict[str, BlockRunner]) -> None:
    """The pack batches both members' requests into one execute; each still runs its own model."""
    import tritonclient.http as httpclient

    pack, tasks = "w1__pack", ("w_one", "w_two")
    stats = httpclient.InferenceServerClient(served.http.removeprefix("http://"))

    def counts() -> tuple[int, int]:
        s = stats.get_inference_statistics(pack)["model_stats"][0]
        return int(s["inference_stats"]["success"]["count"]), int(s["execution_count"])

    jobs = [(tasks[i % 2], _images(1 + i % 3, seed=300 + i)) for i in range(24)]
    expected = [_want(reference, t, x) for t, x in jobs]
    before = counts()

    def call(job: tuple[str, np.ndarray]) -> np.ndarray:
        with TaskClient(served.http) as client:
            return client.infer(*job)

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(call, jobs))
    for (task, _), got, want in zip(jobs, results, expected, strict=True):
        assert relative_error(got, want) <= TOL, task
    # The other member's reference would give other logits: each answer is its own task's.
    assert relative_error(results[0], _want(reference, tasks[1], jobs[0][1])) > 1e-2
    deadline = time.monotonic() + 30  # Triton counts a request once it releases it
    while (after := counts())[0] - before[0] < len(jobs) and time.monotonic() < deadline:
        time.sleep(0.2)
    requests, executions = after[0] - before[0], after[1] - before[1]
    assert requests == len(jobs) and executions < requests, f"the pack should have batched requests together ({executions})"


def test_a_direct_request_without_outputs_gets_every_members_answer(served: Served, reference: dict[str, BlockRunner]) -> None:
    import tritonclient.http as httpclient

    c = httpclient.InferenceServerClient(served.http.removeprefix("http://"))
    x = _images(2, seed=11)
    inp = httpclient.InferInput("IMAGE", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    res = c.infer("w1__pack", [inp])
    assert sorted(o["name"] for o in res.get_response()["outputs"]) == ["LOGITS__w_one", "LOGITS__w_two"]
    for task in ("w_one", "w_two"):
        got = res.as_numpy(f"LOGITS__{task}")
        assert got is not None and relative_error(got, _want(reference, task, x)) <= TOL
