"""Shared fixtures: a real tritonserver serving the default plan and the test plans."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    import torch

    from blockflow.plan import Plan
    from blockflow.triton.server import TritonServer

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
SERVED_PLANS = [ROOT / "plans" / "default.yaml", ROOT / "tests" / "plans" / "r18_three_cuts.yaml",
                ROOT / "tests" / "plans" / "r34_late_cuts.yaml", ROOT / "tests" / "plans" / "packed.yaml",
                ROOT / "tests" / "plans" / "uint8_hwc.yaml"]
# tests/plans/fused.yaml is not served here: packed.yaml fuses too (ptrunk0__to__ptrunk1, and a
# two-block head inside a pack), and every served stub costs ~0.5 GB of host memory on a CPU machine.


@pytest.fixture(scope="session", autouse=True)
def _private_endpoints_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Servers the tests start write their endpoints here, never over a developer's own file
    (and client commands the tests run read them from here); a test may point at its own."""
    os.environ["BLOCKFLOW_ENDPOINTS"] = str(tmp_path_factory.mktemp("endpoints") / "endpoints.json")
    yield


@pytest.fixture(scope="session", autouse=True)
def _stage_cache_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every server the tests start keeps built block parts in one directory, so a part built by one
    test's server is loaded by the next one's instead of built again (most of a block process's start-up
    on a CPU machine). The default, each runtime directory's own stages/, is checked by tests/unit/test_stage_cache.py."""
    from blockflow.core import env

    stages = tmp_path_factory.mktemp("stages")
    stages.chmod(0o700)
    with pytest.MonkeyPatch.context() as mp:  # never a developer's own: the session starts empty
        mp.setenv(env.STAGE_CACHE_DIR_VAR, str(stages))
        yield


@pytest.fixture(scope="module", autouse=True)
def _give_memory_back() -> Iterator[None]:
    """After each module, return to the OS what its references took: glibc keeps freed heap pages
    (a module's unsplit references, ~800 MiB, stayed held), and the shared server's ~40 stubs need
    them on a 24 GB CI machine."""
    yield
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextmanager
def own_server(plan: Plan, where: Path, env: dict[str, str] | None = None) -> Iterator[TritonServer]:
    """A real tritonserver of a module's own (free ports) serving ``plan``, its repository written under
    ``where``; ``env``: more environment for it and its block processes."""
    from blockflow.ensemble_gen import generator
    from blockflow.triton.server import ServerOptions, TritonServer

    repo = where / "repo"
    generator.write(generator.render(plan), repo)
    server = TritonServer(ServerOptions.on_free_ports([repo], env=env or {}))
    server.start(float(os.environ.get("BLOCKFLOW_TEST_START_TIMEOUT", "900")))
    try:
        yield server
    finally:
        server.stop()


def in_child(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a spawned child process: what it builds (a module's unsplit references, their
    weights) leaves with it, where the pytest process would keep it beside the shared server's stubs."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def tensor_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``blockflow.bench.agreement.relative_error`` of two tensors, taken on the CPU in NumPy."""
    from blockflow.bench.agreement import relative_error

    return relative_error(got.detach().cpu().numpy(), want.detach().cpu().numpy())


def wait_serve_ready(proc: subprocess.Popen[bytes], log: Path, control: str, http: str, token: str) -> None:
    """Until a ``blockflow serve`` process answers on its control service and Triton's HTTP says ready."""
    import httpx

    deadline = time.monotonic() + float(os.environ.get("BLOCKFLOW_TEST_START_TIMEOUT", "900"))
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{control}/status", headers={"Authorization": f"Bearer {token}"}, timeout=2).status_code == 200 \
                    and httpx.get(f"http://{http}/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"blockflow serve did not become ready:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The modules on the shared server (``served``) run after all the others. That server holds ~40
    # block processes (~0.5 GB of host memory each) until the session ends; a module that starts
    # servers of its own beside it ran a 24 GB CI machine out of memory. Whole modules move, in
    # their order, so module-scoped servers still start once.
    def on_shared(item: pytest.Item) -> bool:  # the session's ``served``, not a module's own of that name
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).get("served", ())
        return bool(defs) and defs[-1].scope == "session"

    shared = {item.path for item in items if on_shared(item)}
    items.sort(key=lambda item: item.path in shared)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; run ./scripts/gpu_test.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class Served:
    """What the session server serves: its URLs and the plans behind it."""

    def __init__(self, server: object, plans: dict[str, object]) -> None:
        from blockflow.triton.server import TritonServer

        assert isinstance(server, TritonServer)
        self.server = server
        self.plans = plans
        self.http = server.http_url
        self.grpc = server.grpc_url


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One real tritonserver (free ports, explicit mode) with every served plan's repository.

    Start-up failures show the server log's tail; teardown stops the server and checks
    that no process of its group is left.
    """
    from blockflow.core.errors import ServerError
    from blockflow.ensemble_gen import generator
    from blockflow.plan import load_plan
    from blockflow.triton.process_group import group_members
    from blockflow.triton.server import ServerOptions, TritonServer

    base = tmp_path_factory.mktemp("served")
    repos, plans = [], {}
    for path in SERVED_PLANS:
        plan = load_plan(path)
        repo = base / path.stem
        generator.write(generator.render(plan), repo)
        repos.append(repo)
        plans[path.stem] = plan
    opts = ServerOptions.on_free_ports(repos, latency_summaries=True)  # test_monitoring reads p50/p99
    server = TritonServer(opts, runtime_dir=base / "runtime")
    (base / "runtime").mkdir(mode=0o700)
    try:
        server.start(timeout=float(os.environ.get("BLOCKFLOW_TEST_START_TIMEOUT", "900")))
    except ServerError as exc:
        pytest.fail(f"tritonserver did not start:\n{exc}", pytrace=False)
    assert server.process is not None
    pgid = server.process.pid
    try:
        yield Served(server, plans)
    finally:
        server.stop()
        left = list(group_members(pgid))
        assert left == [], f"processes left behind by tritonserver: {left}"


def worst_concurrent_error(url: str, tasks: tuple[str, ...], xs: list[Any], threads: int) -> float:
    """Each task's answer to each of ``xs`` from ``threads`` clients at once, against its eager reference's
    (asked first, one at a time): the largest absolute difference."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from blockflow.clients.client import TaskClient
    from blockflow.plan import naming

    with TaskClient(url) as client:
        want = {(t, i): client.infer(naming.reference_model(t, graph=False), x) for t in tasks for i, x in enumerate(xs)}

    def one(job: tuple[str, int]) -> float:
        with TaskClient(url) as c:
            got = c.infer(job[0], xs[job[1]])
        return float(np.abs(got - want[job]).max())

    with ThreadPoolExecutor(threads) as pool:
        return max(pool.map(one, list(want)))
