"""On an NVIDIA GPU: precisions and CUDA graphs against the fp32 reference, in-process and served."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from blockflow.backend.runtime import DTYPES, BlockRunner
from blockflow.core import endpoints
from blockflow.core.env import SHM_KEY_FILE_VAR
from blockflow.core.spec import hop_dtype
from blockflow.ensemble_gen.generator import block_spec, reference_spec
from blockflow.plan import load_plan

from .answers import assert_same_answer, rel_err

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {"fp32": 1e-4, "tf32": 1e-2, "fp16": 1e-2, "bf16": 1e-2}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_blocks_on_gpu_match_fp32_cpu_reference(precision: str, graphs: bool) -> None:
    plan = load_plan(ROOT / "plans" / "default.yaml")
    task = plan.tasks["cls_a"]
    cuda = torch.device("cuda", 0)
    runners = []
    for name in task.path:
        spec = block_spec(plan, plan.blocks[name], "triton-gpu")
        # Hops cross in the block's precision (fp16/bf16; fp32 for fp32 and tf32), logits in fp32.
        spec = spec.model_copy(update={"precision": precision, "cuda_graphs": graphs,
                                       "out_dtype": "fp32" if spec.gives_logits else hop_dtype(precision)})
        r = BlockRunner(spec, cuda)
        r.warmup()
        assert r.use_graphs == graphs
        runners.append(r)
    ref = BlockRunner(reference_spec(plan, task, graph=False)[0], torch.device("cpu"))
    for batch in (1, 3, 8):
        x = torch.randn(batch, 3, 224, 224)
        y = x.to(cuda)
        for r in runners:
            y = r.run(y)
            assert y.dtype == (torch.float32 if r.spec.gives_logits else DTYPES[hop_dtype(precision)])  # type: ignore[arg-type]
        assert y.dtype == torch.float32 and y.is_cuda
        err = rel_err(y, ref.run(x))
        assert err <= TOLERANCE[precision], (precision, graphs, batch, err)


def test_graph_replay_does_not_alias_outputs() -> None:
    plan = load_plan(ROOT / "plans" / "default.yaml")
    spec = block_spec(plan, plan.blocks["r50_s3a"], "triton-gpu")
    r = BlockRunner(spec, torch.device("cuda", 0))
    r.warmup()
    x1, x2 = torch.randn(2, 1024, 14, 14, device="cuda"), torch.randn(2, 1024, 14, 14, device="cuda")
    y1 = r.run(x1)
    snapshot = y1.clone()
    r.run(x2)
    assert torch.equal(y1, snapshot)  # a later replay must not overwrite an earlier result


def test_a_checked_hop_reads_new_data_from_the_same_views() -> None:
    """The runner keeps a hop it checked once (the same pool views come back); each replay still reads
    what the input view holds now and writes the output view, as an unchecked run does."""
    plan = load_plan(ROOT / "plans" / "default.yaml")
    spec = block_spec(plan, plan.blocks["r50_s3a"], "tensormq")
    r = BlockRunner(spec, torch.device("cuda", 0))
    r.warmup()
    pool_in = torch.empty(4, 1024, 14, 14, device="cuda", dtype=r.in_dtype)
    pool_out = torch.empty(4, *spec.out_shapes[0], device="cuda", dtype=r.out_dtype)
    x, out = pool_in[1:2], pool_out[2:3]  # views, as a consumer's and a producer's pool give them
    for i in range(3):
        x.copy_(torch.randn(1, 1024, 14, 14, device="cuda"))
        out.fill_(float("nan"))
        r.run_all([x], outs=[out])
        want = r.run_all([x.clone()])[0]  # no outs: the checked path is not taken
        assert torch.equal(out, want), i
    assert len(r._plain) == 1  # checked once, found twice


@pytest.fixture(params=[True, False], ids=["graphs", "eager"])
def image_block(request: pytest.FixtureRequest) -> Iterator[tuple[BlockRunner, np.ndarray]]:
    """A first block (ResNet-50's stem, warmed up, CUDA graphs or eager) and three images' room in a
    /dev/shm segment, where Triton's Python backend puts a request's host inputs."""
    from multiprocessing import shared_memory

    plan = load_plan(ROOT / "plans" / "default.yaml")
    r = BlockRunner(block_spec(plan, plan.blocks["r50_s0"], "tensormq"), torch.device("cuda", 0))
    r.use_graphs = r.use_graphs and request.param
    r.warmup()
    seg = shared_memory.SharedMemory(create=True, size=8 << 20)
    try:
        yield r, np.ndarray((3, 3, 224, 224), dtype=np.float32, buffer=seg.buf)
    finally:
        if r._pins is not None:
            r._pins.close()
        seg.close()
        seg.unlink()


def _busy_gpu() -> None:
    torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]  # ~20 ms of GPU work ahead of the copies


def test_a_host_image_in_shared_memory_is_copied_by_dma_and_waited_for(image_block: tuple[BlockRunner, np.ndarray]) -> None:
    """A first block's image in /dev/shm is page-locked on first sight and copied by DMA (torch's
    own asynchronous copy when eager); ``settle_inputs`` waits for that copy even when it is queued
    behind other GPU work, so memory overwritten after it (Triton's next request) is never read."""
    r, whole = image_block
    x = torch.from_numpy(whole[:1])
    out = torch.empty(1, *r.spec.out_shapes[0], device="cuda", dtype=r.out_dtype)
    if not r.use_graphs:  # an eager block page-locks the region when it first joins several images
        r.join([[torch.from_numpy(whole[i:i + 1]) for i in range(3)]])
        r.settle_inputs()
    for i in range(3):
        x.copy_(torch.randn(1, 3, 224, 224))
        want = r.run_all([x.cuda()])[0]
        _busy_gpu()
        r.run_all([x], outs=[out])
        assert r._dma, i  # page-locked: a DMA (or an asynchronous copy marked after), not the driver's staged copy
        r.settle_inputs()
        x.fill_(float("nan"))  # what Triton's next request would write there
        torch.cuda.synchronize()
        assert torch.equal(out, want), i
    assert r._pins is not None and r._pins.any_pinned


def test_host_images_in_shared_memory_are_joined_by_dma_and_waited_for(image_block: tuple[BlockRunner, np.ndarray]) -> None:
    """A call of several host images joins them on the GPU by one DMA each out of the page-locked
    region, and ``settle_inputs`` waits for those copies (queued behind other GPU work) before
    the memory is reused; a batch the block pads to its bucket (3 to 4) is waited for as well."""
    r, whole = image_block
    parts = [torch.from_numpy(whole[i:i + 1]) for i in range(3)]
    for i in range(2):
        for p in parts:
            p.copy_(torch.randn(1, 3, 224, 224))
        want = r.run_all([torch.cat([p.cuda() for p in parts])])[0]
        _busy_gpu()
        joined = r.join([parts])
        assert r._dma and joined[0].is_cuda and joined[0].shape[0] == 3, i
        got = r.run_all(joined)[0]
        r.settle_inputs()
        _busy_gpu()
        padded = r.run_all([torch.from_numpy(whole)])[0]  # straight from the region, padded to 4
        assert r._dma, i
        r.settle_inputs()
        for p in parts:
            p.fill_(float("nan"))  # what Triton's next requests would write there
        torch.cuda.synchronize()
        assert torch.equal(got, want) and torch.equal(padded, want), i
    heap = [torch.randn(1, 3, 224, 224) for _ in range(2)]  # not shared memory: joined as before
    assert torch.equal(r.join([heap])[0], torch.cat(heap).cuda())


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from blockflow.ensemble_gen import generator
    from blockflow.triton.server import ServerOptions, TritonServer

    repo = tmp_path_factory.mktemp("gpu") / "repo"
    generator.write(generator.render(load_plan(ROOT / "tests" / "plans" / "gpu_precisions.yaml")), repo)
    server = TritonServer(ServerOptions.on_free_ports([repo]))
    server.start(600)
    # The clients of these tests find the shared-memory key as a user's would: through BLOCKFLOW_SHM_KEY_FILE.
    before = os.environ.get(SHM_KEY_FILE_VAR)
    os.environ[SHM_KEY_FILE_VAR] = str(server.shm_key_file)
    try:
        yield server.http_url
    finally:
        server.stop()
        if before is None:
            os.environ.pop(SHM_KEY_FILE_VAR, None)
        else:
            os.environ[SHM_KEY_FILE_VAR] = before


def _cuda_regions(url: str) -> list[Any]:
    """The CUDA shared-memory regions registered with the server (the status call needs the shared-memory key)."""
    import tritonclient.http as th

    return list(th.InferenceServerClient(url).get_cuda_shared_memory_status(headers=endpoints.shm_headers(endpoints.shm_key())))


@pytest.mark.parametrize(("task", "tol"), [("g_fp32_eager", 1e-4), ("g_fp16", 1e-2), ("g_bf16", 1e-2)])
def test_served_precisions_against_their_references(gpu_server: str, task: str, tol: float) -> None:
    from blockflow.clients.client import TaskClient

    with TaskClient(gpu_server) as c:
        for batch in (1, 3, 8):
            x = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224), dtype=np.float32)
            # __ref and __ref_graph run in the task's precision (what a split is timed against);
            # __ref_fp32, there for tasks in another precision, is what accuracy is checked against.
            same = c.infer(f"{task}__ref", x)
            want = c.infer(f"{task}__ref_fp32", x) if tol > 1e-4 else same
            got = c.infer(task, x)
            # Separate processes may pick different cuDNN algorithms: in fp16/bf16 the split and the
            # whole then differ by that precision's rounding (in one process they are equal: blockflow.bench.precision).
            graph_err, split_err, err = rel_err(c.infer(f"{task}__ref_graph", x), same), rel_err(got, same), rel_err(got, want)
            assert graph_err <= tol and split_err <= tol and err <= tol, (task, batch, graph_err, split_err, err)


def test_blocks_are_placed_on_the_gpu(gpu_server: str) -> None:
    import tritonclient.http as th

    c = th.InferenceServerClient(gpu_server)
    cfg = c.get_model_config("g_fp16_0")
    assert cfg["instance_group"][0]["kind"] == "KIND_GPU"


@pytest.mark.parametrize("task", ["g_fp32_eager", "g_fp16"])  # eager, and a CUDA graph's input copy
def test_cuda_shared_memory_inputs_match_host_inputs(gpu_server: str, task: str) -> None:

    from blockflow.clients.client import TaskClient

    # The first block takes a CUDA-shm image on the GPU (FORCE_CPU_ONLY_INPUT_TENSORS=no), mapped
    # for the request only: it must copy it before execute returns, and give the host input's answer.
    with TaskClient(gpu_server) as host, TaskClient(gpu_server, input_memory="cuda") as dev:
        for batch in (1, 3, 8, 2):  # the region grows once (1 -> 3 -> 8) and is reused for 2
            x = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224), dtype=np.float32)
            want = host.infer(task, x)
            assert_same_answer(dev.infer(task, x), want)
            assert_same_answer(dev.infer(task, torch.from_numpy(x).cuda()), want)  # never via the host
        regions = _cuda_regions(gpu_server)
        assert len(regions) == 1 and regions[0]["byte_size"] == 8 * 3 * 224 * 224 * 4
    assert _cuda_regions(gpu_server) == []  # unregistered on close


def test_concurrent_async_cuda_inputs_each_get_their_own_answer(gpu_server: str) -> None:
    """Calls in flight together on one AsyncTaskClient never share a CUDA region: the server reads
    a request's region while it serves it, so a shared one would hand a request another's images."""
    import asyncio

    from blockflow.clients.client import AsyncTaskClient, TaskClient

    xs = [np.random.default_rng(100 + i).standard_normal((1 + i % 3, 3, 224, 224), dtype=np.float32) for i in range(16)]
    with TaskClient(gpu_server) as host:
        want = [host.infer("g_fp16", x) for x in xs]

    async def rounds() -> tuple[list[list[Any]], int]:
        async with AsyncTaskClient(gpu_server, input_memory="cuda") as c:
            got = [list(await asyncio.gather(*(c.infer("g_fp16", x) for x in xs))) for _ in range(3)]
            return got, len(_cuda_regions(gpu_server))

    got, regions = asyncio.run(rounds())
    for r, answers in enumerate(got):
        for i, (g, w) in enumerate(zip(answers, want, strict=True)):
            # Batched with other requests, a request may run at another batch size than alone (fp16 rounding).
            assert g.shape == w.shape and rel_err(g, w) <= 1e-2, (r, i, rel_err(g, w))
    assert 1 <= regions <= len(xs)  # one per call in flight, reused by the later rounds
    assert _cuda_regions(gpu_server) == []  # all unregistered on close


def test_load_through_cuda_regions(gpu_server: str) -> None:
    """The load generator's closed loop with CUDA shared-memory inputs: every request answered."""
    import asyncio

    from blockflow.clients.load import LoadSpec, run_load

    spec = LoadSpec(gpu_server, ["g_fp16"], (3, 224, 224), clients=8, duration_s=30.0, max_requests=64, input_memory="cuda")
    records = asyncio.run(run_load(spec))
    assert len(records) >= 64 and all(r.ok for r in records), [r.error for r in records if not r.ok][:3]


def test_traced_calls_carry_their_gpu_time(tmp_path: Path) -> None:
    """The tracer's event pairs are reused once read, and each line has the GPU time of its own work."""
    from blockflow.backend.trace import Tracer

    tracer = Tracer(tmp_path, "m", "m_0", torch.device("cuda", 0))
    x = torch.randn(2048, 2048, device="cuda")
    for i in range(40):
        tracer.begin()
        tracer.gpu_begin()
        for _ in range(1 + 10 * (i % 2)):  # odd calls queue 11x the work
            x = torch.tanh(x @ x)
        tracer.end(1)
        if i == 19:
            torch.cuda.synchronize()
            time.sleep(0.5)  # the writer thread reads the first 20 and frees their events
    tracer.close()
    (path,) = tmp_path.glob("m.m_0.*.jsonl")
    gpu = [json.loads(line)["gpu_ms"] for line in path.read_text().splitlines()]
    assert len(gpu) == 40
    assert min(gpu[1::2]) > 3 * max(gpu[2::2])  # not another call's events
    assert len(tracer._free) <= 21  # the last 20 calls reused the first 20 calls' pairs
