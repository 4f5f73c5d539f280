"""A real tritonserver serving the default plan and two test plans, reached with tritonclient."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from blockflow.bench.agreement import relative_error
from blockflow.clients.client import TaskClient
from blockflow.core.errors import ClientError
from blockflow.plan import Plan, naming

from ..conftest import Served

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _tolerance() -> float:
    import torch

    # fp32 on the CPU is bit-for-bit close; on a GPU cuDNN picks batch-dependent algorithms (TF32 off).
    return 1e-4 if torch.cuda.is_available() else 1e-5


TOL = _tolerance()


def images(batch: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, *shape), dtype=np.float32)


def input_shape(plan: Plan, task: str) -> tuple[int, ...]:
    return plan.models[plan.blocks[plan.tasks[task].path[0]].model].image_shape


def task_images(plan: Plan, task: str, batch: int, seed: int) -> np.ndarray:
    """Random images as ``task`` takes them: float32, or uint8 where its plan says so."""
    image = plan.models[plan.blocks[plan.tasks[task].path[0]].model].image
    if image is not None and image.dtype == "uint8":
        return np.random.default_rng(seed).integers(0, 256, (batch, *input_shape(plan, task)), dtype=np.uint8)
    return images(batch, input_shape(plan, task), seed)


def test_every_model_is_ready(served: Served) -> None:
    with TaskClient(served.http) as c:
        states = {m["name"]: m["state"] for m in c.models()}
    from blockflow.ensemble_gen import generator

    for plan in served.plans.values():
        assert isinstance(plan, Plan)
        for name in generator.model_names(generator.render(plan)):
            assert states.get(name) == "READY", (name, states.get(name))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_default_task_answers(served: Served, protocol: str) -> None:
    plan = served.plans["default"]
    assert isinstance(plan, Plan)
    url = served.http if protocol == "http" else served.grpc
    with TaskClient(url, protocol) as c:  # type: ignore[arg-type]
        for task in plan.tasks:
            out = c.infer(task, images(2, input_shape(plan, task), seed=1))
            assert out.shape == (2, 1000) and np.isfinite(out).all()


def _cases(served_plans: list[str]) -> list[tuple[str, str, str]]:
    """(plan, ensemble, reference) for every task and every transport variant."""
    from blockflow.plan import load_plan

    from ..conftest import SERVED_PLANS

    cases = []
    for path in SERVED_PLANS:
        plan = load_plan(path)
        for task in plan.tasks.values():
            for transport in plan.transports_of(task):
                cases.append((path.stem, naming.task_model(task.name, transport, task.transport), task.name))
    return cases


CASES = _cases([])


@pytest.mark.parametrize(("plan_name", "ensemble", "task"), CASES, ids=[c[1] for c in CASES])
def test_ensemble_equals_monolithic_reference(served: Served, plan_name: str, ensemble: str, task: str) -> None:
    plan = served.plans[plan_name]
    assert isinstance(plan, Plan)
    reference = naming.reference_model(task, graph=False)
    with TaskClient(served.http) as c:
        for batch in (1, 3, 8):
            x = task_images(plan, task, batch, seed=batch)
            got, want = c.infer(ensemble, x), c.infer(reference, x)
            assert got.shape == want.shape == (batch, plan.models[plan.blocks[plan.tasks[task].path[-1]].model].num_classes)
            assert relative_error(got, want) <= TOL, (ensemble, batch)


def _concurrent_jobs_match_references(served: Served, jobs: list[tuple[str, np.ndarray]]) -> None:
    """Send ``jobs`` (task, images) from 12 threads at once; each answer must be its task's reference's."""
    with TaskClient(served.http) as c:
        expected = [c.infer(naming.reference_model(t, False), x) for t, x in jobs]

    def call(job: tuple[str, np.ndarray]) -> np.ndarray:
        with TaskClient(served.http) as client:
            return client.infer(*job)

    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(call, jobs))
    for (task, _), got, want in zip(jobs, results, expected, strict=True):
        assert relative_error(got, want) <= TOL, task


def test_concurrent_requests_on_shared_blocks_get_their_own_results(served: Served) -> None:
    tasks = ["cls_a", "cls_b", "det_c"]  # all share r50_s0 and r50_s1
    _concurrent_jobs_match_references(served, [(tasks[i % 3], images(1 + i % 3, (3, 224, 224), seed=100 + i)) for i in range(36)])


@pytest.mark.parametrize(("pack", "tasks"), [("ptrunk0__to__ptrunk1__heads", ("p_one", "p_two")),  # tensormq
                                             ("pmid__heads__triton_cpu", ("p_three", "p_four"))])
def test_a_head_pack_answers_each_task_with_its_own_head(served: Served, pack: str, tasks: tuple[str, str]) -> None:
    """Concurrent requests of a pack's tasks: the pack batches requests of different tasks
    together, and each request still gets its own task's head (the reference's logits)."""
    import tritonclient.http as httpclient

    stats = httpclient.InferenceServerClient(served.http.removeprefix("http://"))

    def counts() -> tuple[int, int]:
        s = stats.get_inference_statistics(pack)["model_stats"][0]
        return int(s["inference_stats"]["success"]["count"]), int(s["execution_count"])

    before = counts()  # the reference calls below do not touch the pack
    _concurrent_jobs_match_references(served, [(tasks[i % 2], images(1 + i % 2, (3, 32, 32), seed=200 + i)) for i in range(24)])
    # Triton counts a request once it releases it, which can be just after the client has its answer.
    deadline = time.monotonic() + 30
    while (after := counts())[0] - before[0] < 24 and time.monotonic() < deadline:
        time.sleep(0.2)
    requests, executions = after[0] - before[0], after[1] - before[1]
    assert requests == 24 and executions < requests, f"the pack should have batched requests together ({executions} executions)"


def test_a_head_pack_runs_the_heads_a_direct_request_names(served: Served) -> None:
    """Called directly, a pack returns the outputs the request names, or every head's when it names none."""
    import tritonclient.http as httpclient

    c = httpclient.InferenceServerClient(served.http.removeprefix("http://"))
    x = images(2, (3, 32, 32), seed=7)
    tensor: np.ndarray = x
    name = "IMAGE"
    for model in ("ptrunk0__to__ptrunk1__triton_cpu", "pmid__triton_cpu"):  # the path up to the pack, by hand
        inp = httpclient.InferInput(name, list(tensor.shape), "FP32")
        inp.set_data_from_numpy(tensor)
        out = c.infer(model, [inp]).as_numpy("ACTIVATION_OUT")
        assert out is not None
        tensor, name = out, "ACTIVATION_IN"
    inp = httpclient.InferInput("ACTIVATION_IN", list(tensor.shape), "FP32")
    inp.set_data_from_numpy(tensor)
    pack = "pmid__heads__triton_cpu"
    one = c.infer(pack, [inp], outputs=[httpclient.InferRequestedOutput("LOGITS__p_four")])
    assert [o["name"] for o in one.get_response()["outputs"]] == ["LOGITS__p_four"]
    both = c.infer(pack, [inp])
    assert sorted(o["name"] for o in both.get_response()["outputs"]) == ["LOGITS__p_four", "LOGITS__p_three"]
    with TaskClient(served.http) as tc:
        for task in ("p_three", "p_four"):
            want = tc.infer(naming.reference_model(task, False), x)
            assert relative_error(both.as_numpy(f"LOGITS__{task}"), want) <= TOL
        assert relative_error(one.as_numpy("LOGITS__p_four"), tc.infer("p_four", x)) <= TOL


def test_bad_request_fails_alone(served: Served) -> None:
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    with TaskClient(served.http) as c:
        with pytest.raises(ClientError, match=r"must be \[batch, 3, 224, 224\] with a batch of one or more; got shape \[1, 3, 200, 200\]"):
            c.infer("cls_a", images(1, (3, 200, 200), seed=0))  # the client checks first
        raw = th.InferenceServerClient(served.http)
        bad = th.InferInput("IMAGE", [1, 3, 200, 200], "FP32")
        bad.set_data_from_numpy(images(1, (3, 200, 200), seed=0))
        with pytest.raises(InferenceServerException, match="IMAGE"):  # and the server refuses it on its own
            raw.infer("cls_a", [bad])
        with pytest.raises(ClientError, match="not served"):
            c.infer("no_such_task", images(1, (3, 224, 224), seed=0))
        for given in (np.zeros((1, 3, 224, 224), np.uint8), b"\xff\xd8 not a task's"):  # no float32 check on a task it cannot read
            with pytest.raises(ClientError, match="not served"):
                c.infer("no_such_task", given)
        with pytest.raises(ClientError, match="not served"):
            c.infer_outputs("no_such_task", images(1, (3, 224, 224), seed=0))
        assert c.infer("cls_a", images(1, (3, 224, 224), seed=0)).shape == (1, 1000)


def _blockflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "blockflow", *args], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sync_and_async_clients_are_twins(served: Served, protocol: str) -> None:
    """The same surface and answers; Triton's per-request options pass through; errors carry the
    server's status and whether a retry can help."""
    import asyncio

    from blockflow.clients.client import AsyncTaskClient
    from blockflow.core.errors import Unreachable
    from blockflow.triton.options import free_port

    url = served.http if protocol == "http" else served.grpc
    x = images(2, (3, 224, 224), seed=5)
    options = {"headers": {"x-caller": "twins"}, "priority": 1, "timeout_s": 60.0}
    with TaskClient(url, protocol) as c:  # type: ignore[arg-type]
        assert c.is_ready() and "cls_a" in {m["name"] for m in c.models()}
        shape = c.input_shape("cls_a")
        sync = c.infer_timed("cls_a", x, request_id="sync-1", **options)  # type: ignore[arg-type]
        with pytest.raises(ClientError) as wrong:
            c.infer("nope", x)
    assert sync.request_id == "sync-1" and wrong.value.status is not None and not wrong.value.retryable

    async def twin() -> tuple[tuple[int, int, int], object, ClientError]:
        async with AsyncTaskClient(url, protocol) as a:  # type: ignore[arg-type]
            assert await a.is_ready() and "cls_a" in {m["name"] for m in await a.models()}
            got = await a.infer_timed("cls_a", x, request_id="async-1", **options)  # type: ignore[arg-type]
            try:
                await a.infer("nope", x)
            except ClientError as exc:
                return await a.input_shape("cls_a"), got, exc
        raise AssertionError("an unknown task answered")

    async_shape, got, async_wrong = asyncio.run(twin())
    assert async_shape == shape and got.request_id == "async-1"  # type: ignore[attr-defined]
    np.testing.assert_array_equal(got.logits, sync.logits)  # type: ignore[attr-defined]
    assert async_wrong.status == wrong.value.status and not async_wrong.retryable
    nothing = f"127.0.0.1:{free_port()}"
    with TaskClient(nothing, protocol, timeout_s=5) as c, pytest.raises(Unreachable) as down:  # type: ignore[arg-type]
        c.infer("cls_a", x)
    assert down.value.retryable


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cli_infer(served: Served, protocol: str) -> None:
    url = served.http if protocol == "http" else served.grpc
    res = _blockflow("infer", "det_c", "--random", "--batch", "2", "--protocol", protocol, "--url", url, "--repeat", "3")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("det_c sample") == 2
    assert "p50" in res.stdout


def test_cli_infer_unknown_task_is_one_line(served: Served) -> None:
    res = _blockflow("infer", "nope", "--random", "--url", served.http)
    assert res.returncode == 5
    assert "Traceback" not in res.stderr
    assert "task 'nope' is not served" in res.stderr and "cls_a" in res.stderr


def test_cli_infer_image_file(served: Served, tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(png)
    res = _blockflow("infer", "cls_a", "--image", str(png), "--url", served.http)
    assert res.returncode == 0, res.stderr
    assert "cls_a sample 0" in res.stdout


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_smoke(served: Served, protocol: str, tmp_path: Path) -> None:
    pa = shutil.which("perf_analyzer", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if pa is None:
        pytest.fail("perf_analyzer not found; run ./scripts/setup.sh")
    url = served.http if protocol == "http" else served.grpc
    csv = tmp_path / "pa.csv"
    res = subprocess.run(
        [pa, "-m", "t18_one", "-u", url, "-i", protocol, "--shape", "IMAGE:3,64,64", "-b", "1",
         "--concurrency-range", "2", "--measurement-mode", "count_windows", "--measurement-request-count", "20",
         "--max-trials", "3", "--stability-percentage", "999", "-f", str(csv)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Throughput" in res.stdout
    assert csv.read_text().startswith("Concurrency")


@pytest.mark.parametrize("mode", [["--clients", "3"], ["--rate", "25"]], ids=["closed-loop", "poisson"])
def test_cli_load(served: Served, mode: list[str], tmp_path: Path) -> None:
    import csv as csvmod

    out = tmp_path / "lat.csv"
    res = _blockflow("load", "--task", "t18_one", "--task", "t18_two__tensormq", "--url", served.http,
                     "--duration", "2", "--out", str(out), *mode)
    assert res.returncode == 0, res.stderr
    rows = list(csvmod.DictReader(out.open()))
    assert len(rows) >= 10 and {r["task"] for r in rows} == {"t18_one", "t18_two__tensormq"}
    assert all(r["ok"] == "1" for r in rows)
    for text in ("t18_one", "t18_two__tensormq", "all", "p99 ms"):
        assert text in res.stdout


def test_cli_load_unknown_task_is_one_line(served: Served) -> None:
    res = _blockflow("load", "--task", "nope", "--url", served.http, "--duration", "1")
    assert res.returncode == 5 and "Traceback" not in res.stderr and "task 'nope' is not served" in res.stderr


def test_a_crashed_block_fails_alone_and_is_reloaded(served: Served) -> None:
    import os
    import signal
    import time

    server = served.server
    expected = {m: len(p) for m, p in server.stub_processes().items()}
    # One process per instance: one on a CPU machine, one per GPU with placement auto.
    assert expected.get("r34_head", 0) >= 1 and expected.get("r50_s0", 0) >= 1
    os.kill(server.stub_processes()["r34_head"][0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while len(server.stub_processes().get("r34_head", [])) == expected["r34_head"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(server.stub_processes().get("r34_head", [])) < expected["r34_head"]
    x = images(2, (3, 64, 64), seed=5)
    with TaskClient(served.http) as c:
        # The server and every other block keep serving while one block is down.
        assert c.infer("cls_a", images(1, (3, 224, 224), seed=1)).shape == (1, 1000)
        assert server.heal(expected) == ["r34_head"]
        assert server.heal(expected) == []  # healthy again: nothing to do
        got, want = c.infer("t34", x), c.infer("t34__ref", x)
    assert relative_error(got, want) <= TOL
    assert server.process is not None and server.process.poll() is None


def test_sigusr2_writes_a_block_process_stacks_to_the_server_log(served: Served) -> None:
    """`kill -USR2 <block pid>`: every thread's Python stack in the server's log; the block keeps serving."""
    import os
    import signal
    import time

    server = served.server
    pid = server.stub_processes()["r50_s0"][0]
    before = server.log_path.stat().st_size
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 10
    dump = ""
    while "server_watch.py" not in dump and time.monotonic() < deadline:
        time.sleep(0.1)
        with server.log_path.open("rb") as log:
            log.seek(before)
            dump = log.read().decode(errors="replace")
    # faulthandler's format: one "Thread 0x..." block per thread, the one it interrupted first; the
    # server watch waits in its loop.
    assert "Thread 0x" in dump and 'File "' in dump and "server_watch.py" in dump, dump[-2000:]
    assert pid in server.stub_processes()["r50_s0"]
    with TaskClient(served.http) as c:
        assert c.infer("cls_a", images(1, (3, 224, 224), seed=1)).shape == (1, 1000)
