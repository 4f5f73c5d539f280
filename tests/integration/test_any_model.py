"""Networks cut at module paths, served by a real tritonserver: every task on every transport gives
its unsplit reference's outputs. A network that is not a ResNet (tests/plans/mobilenet_shared.yaml),
cuts where a skip connection crosses, so each hop carries two tensors (tests/plans/skip_cut.yaml), and
a model of one's own exported with torch.export and cut by BlockFlow (plans/examples/skipnet.yaml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from blockflow.bench.triton_stats import tmq_counters
from blockflow.clients.client import TaskClient
from blockflow.plan import Plan, load_plan, naming

from ..conftest import own_server, worst_concurrent_error

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PLANS = ROOT / "tests" / "plans"


# The program run here, on the CPU, against blocks served where Triton placed them (fp32 on a GPU
# too: the .pt2 blocks were 1.6e-7 off on an H100, TorchScript ones 1.2e-4 before their traced
# allow_tf32 constants were cleared).
CROSS_DEVICE = 1e-5
EXAMPLES = ("skipnet", "skipnet_stages")  # plans/examples: a program cut by BlockFlow; one cut into stage files


def exported_example(name: str, directory: Path, exported: Path) -> Path:
    """plans/examples/NAME.yaml in ``directory``, with the files it names: copies of those the documented
    command wrote in ``exported`` (see ``skipnet_files``)."""
    shutil.copy(ROOT / "plans" / "examples" / f"{name}.yaml", directory)
    shutil.copytree(exported, directory, dirs_exist_ok=True)
    return directory / f"{name}.yaml"


@pytest.fixture(scope="module")
def skipnet_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the documented command writes for both examples (the program, its tuned weights, the stage
    files), written once: the same files for either plan."""
    directory = tmp_path_factory.mktemp("skipnet_files")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "export_example_model.py"), str(directory / "skipnet.pt2"),
                    "--tuned", str(directory / "skipnet_tuned.safetensors"), "--blocks", str(directory / "blocks")],
                   check=True, capture_output=True)
    return directory


# The runtime directories of the servers that hand over beyond the ensemble, by URL, and whether as datagrams.
HAND_OVERS: dict[str, tuple[Path, bool]] = {}
METRICS: dict[str, str] = {}  # their metrics endpoints, by URL


def _receivers_listen(url: str) -> None:
    """Each receiver instance listens on ZeroMQ, and for datagrams too unless they are turned off."""
    tmq, datagrams = HAND_OVERS[url][0] / "tmq", HAND_OVERS[url][1]
    receivers = len(list(tmq.glob("ho*.sock")))
    assert receivers > 0 and len(list(tmq.glob("ho*.dg"))) == (receivers if datagrams else 0)


def _caller(client: Any) -> Callable[[str, str, np.ndarray], np.ndarray]:
    """A direct call to one block over ``client`` (tritonclient's HTTP): its one input in, its tickets out."""
    import tritonclient.http as http

    def call(model: str, name: str, data: np.ndarray) -> np.ndarray:
        inp = http.InferInput(name, list(data.shape), "FP32" if data.dtype == np.float32 else "UINT8")
        inp.set_data_from_numpy(data)
        out = client.infer(model, [inp]).as_numpy("ACTIVATION_OUT")
        assert out is not None
        return out
    return call


def _refuses_a_replay_and_a_forgery(call: Callable[[str, str, np.ndarray], np.ndarray], key: np.ndarray, replayed_to: str) -> None:
    """``key``, taken once already, is refused as a replay by ``replayed_to``, and a copy of it with one
    bit flipped as a forgery by mid_c."""
    with pytest.raises(Exception, match="replayed"):
        call(replayed_to, "ACTIVATION_IN", key)
    forged = key.copy()
    forged[0, 30] ^= 1
    with pytest.raises(Exception, match="signature does not verify"):
        call("mid_c", "ACTIVATION_IN", forged)


# hand_over sends its hand-overs as datagrams, the default. chain_zmq: the same blocks with mid_a and
# mid_b as links (hand_over: chain), its hand-overs over ZeroMQ only (BLOCKFLOW_TMQ_HANDOVER_DGRAM=0):
# between them the two servers run both channels (the unit tests run both for either kind).
@pytest.fixture(scope="module", params=["mobilenet_shared", "skip_cut", "bf16_hops", "hand_over", "chain_zmq", "chain_tail", *EXAMPLES])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Plan, str]]:
    where = tmp_path_factory.mktemp(request.param)
    name = request.param.removesuffix("_zmq")
    plan = load_plan(exported_example(name, where, request.getfixturevalue("skipnet_files")) if name in EXAMPLES
                     else PLANS / f"{name}.yaml")
    zmq_only = {"BLOCKFLOW_TMQ_HANDOVER_DGRAM": "0"} if request.param.endswith("_zmq") else None
    with own_server(plan, where, env=zmq_only) as server:
        if name in ("hand_over", "chain", "chain_tail"):
            HAND_OVERS[server.http_url] = (server.runtime_dir, zmq_only is None)
            METRICS[server.http_url] = server.metrics_url
        yield plan, server.http_url


def _tolerance(plan: Plan, task: str) -> float:
    """A path equals its reference, which runs each part in its block's precision. On a GPU each
    process picks its own cuDNN algorithms, so a fp16/bf16 path and its reference differ by that
    rounding there (an H100: batch 3 of bf16_hops); on the CPU they are equal."""
    precisions = {plan.blocks[b].precision for b in plan.tasks[task].path}
    if precisions & {"fp16", "bf16"} and torch.cuda.is_available():
        return 3e-2
    return 1e-5


@pytest.mark.parametrize("batch", [1, 3])
def test_every_task_on_every_transport_equals_its_reference(served: tuple[Plan, str], batch: int) -> None:
    plan, url = served
    x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32), dtype=np.float32)
    with TaskClient(url) as client:
        for task in plan.tasks.values():
            want = client.infer(naming.reference_model(task.name, graph=False), x)
            for transport in plan.transports_of(task):
                got = client.infer(naming.task_model(task.name, transport, task.transport), x)
                err = float(np.abs(got - want).max() / np.abs(want).max())
                assert got.shape == (batch, 10) and err <= _tolerance(plan, task.name), (task.name, transport, err)
                if any(plan.blocks[b].precision != "fp32" for b in task.path):  # and within bf16's rounding of fp32
                    fp32 = client.infer(naming.fp32_reference(task.name), x)
                    assert float(np.abs(got - fp32).max() / np.abs(fp32).max()) <= 3e-2, (task.name, transport)
        a = client.infer("task_a", x)
        b = client.infer("task_b", x) if "task_b" in plan.tasks else None
    if b is not None and plan.raw.name != "skipnet-stages":  # there, every task runs the same weights
        assert not np.allclose(a, b, rtol=1e-3, atol=0), "the two heads have different weights, so the tasks answer differently"


def test_an_exported_model_cut_or_pre_cut_equals_the_program_run_whole(served: tuple[Plan, str]) -> None:
    plan, url = served
    if plan.raw.name not in ("skipnet", "skipnet-stages"):
        pytest.skip("for the exported example only")
    program = torch.export.load(str(Path(plan.source).parent / "skipnet.pt2")).module()
    x = np.random.default_rng(7).standard_normal((3, 3, 32, 32), dtype=np.float32)
    with torch.no_grad():
        want = program(torch.from_numpy(x)).numpy()
    own = [t for t in plan.tasks.values() if t.name != "task_b" or plan.raw.name == "skipnet-stages"]  # skipnet's task_b: tuned head
    with TaskClient(url) as client:
        for task in own:
            for transport in plan.transports_of(task):
                got = client.infer(naming.task_model(task.name, transport, task.transport), x)
                err = float(np.abs(got - want).max() / np.abs(want).max())
                assert err <= CROSS_DEVICE, (task.name, transport, err)


def test_hops_cross_in_the_precision_of_the_block_before_them(served: tuple[Plan, str]) -> None:
    plan, url = served
    if plan.raw.name != "bf16-hops":
        pytest.skip("for the bf16 plan only")
    import tritonclient.http as http

    client = http.InferenceServerClient(url.removeprefix("http://"))
    try:
        def types(model: str) -> tuple[list[str], list[str]]:
            cfg = client.get_model_config(model)
            return [t["data_type"] for t in cfg["input"]], [t["data_type"] for t in cfg["output"]]

        cpu = naming.transport_suffix("triton-cpu")
        assert types(f"trunk{cpu}") == (["TYPE_FP32"], ["TYPE_BF16", "TYPE_BF16"])  # the image in; two bf16 tensors out
        assert types(f"head_a{cpu}") == (["TYPE_BF16", "TYPE_BF16"], ["TYPE_FP32"])  # an fp32 head takes bf16
        assert types(f"head_b{cpu}") == (["TYPE_BF16", "TYPE_BF16"], ["TYPE_FP32"])  # logits stay fp32
        assert types("task_a") == (["TYPE_FP32"], ["TYPE_FP32"])
    finally:
        client.close()


def test_direct_handing_on_serves_concurrent_clients_and_refuses_replayed_or_forged_keys(served: tuple[Plan, str]) -> None:
    plan, url = served
    if plan.raw.name != "hand-over":
        pytest.skip("for the hand-over plan only")
    import tritonclient.http as http

    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((1 + i % 3, 3, 32, 32), dtype=np.float32) for i in range(24)]
    # Requests of both tasks batched together in every block.
    assert worst_concurrent_error(url, ("task_a", "task_b"), xs, threads=8) <= 1e-4
    _receivers_listen(url)

    client = http.InferenceServerClient(url.removeprefix("http://"))

    call = _caller(client)

    try:
        key = call("stem", "IMAGE", xs[0][:1])  # a ticket of the task's first block: mid_b's key
        call("mid_a", "ACTIVATION_IN", key)  # claims it and hands mid_b its own ticket under it
        call("mid_b", "ACTIVATION_IN", key)
        _refuses_a_replay_and_a_forgery(call, key, replayed_to="mid_b")
        with pytest.raises(Exception, match="did not hand over"):  # mid_b never saw this key: the commit wait, then a clear error
            call("mid_c", "ACTIVATION_IN", call("stem", "IMAGE", xs[0][:1]))
    finally:
        client.close()
    assert worst_concurrent_error(url, ("task_a",), xs[:2], threads=1) <= 1e-4  # and the tasks serve on


def test_a_chains_links_serve_concurrent_clients_and_refuse_requests_of_their_own(served: tuple[Plan, str]) -> None:
    plan, url = served
    if plan.raw.name != "chain":
        pytest.skip("for the chain plan only")
    import tritonclient.http as http

    rng = np.random.default_rng(12)
    xs = [rng.standard_normal((1 + i % 4, 3, 32, 32), dtype=np.float32) for i in range(32)]
    # Both tasks' requests run through the links together, batched across calls.
    assert worst_concurrent_error(url, ("task_a", "task_b"), xs, threads=8) <= 1e-4
    _receivers_listen(url)
    # The links count what they ran on the metrics endpoint (published each second); Triton's statistics see nothing.
    images = 2 * sum(len(x) for x in xs)
    links = _counted(url, "mid_a", "link_samples", images)
    assert links.get("link_samples", 0) >= images and 1 <= links.get("link_batches", 0) <= links["link_samples"], links
    stem = tmq_counters(METRICS[url]).get("stem")
    assert stem is not None and "pool_waits" in stem and "link_samples" not in stem  # the head is no link
    client = http.InferenceServerClient(url.removeprefix("http://"))
    try:
        ticket = http.InferInput("ACTIVATION_IN", [1, 256], "UINT8")
        ticket.set_data_from_numpy(np.zeros((1, 256), dtype=np.uint8))
        with pytest.raises(Exception, match="is a link of a chain"):
            client.infer("mid_a", [ticket])

        call = _caller(client)
        # The join takes a key once and refuses a forged one at once.
        key = call("stem", "IMAGE", xs[0][:1])  # the head hands its ticket on to the links: the join's key
        assert call("mid_c", "ACTIVATION_IN", key).shape == (1, 256)
        _refuses_a_replay_and_a_forgery(call, key, replayed_to="mid_c")
    finally:
        client.close()
    assert worst_concurrent_error(url, ("task_b",), xs[:2], threads=1) <= 1e-4  # and the tasks serve on


def _counted(url: str, model: str, counter: str, at_least: int, timeout_s: float = 10.0) -> dict[str, int]:
    """``model``'s TensorMQ counters once ``counter`` reaches ``at_least`` (the blocks publish them each second), or as
    they stand after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (counts := tmq_counters(METRICS[url]).get(model, {})).get(counter, 0) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return counts


def test_a_chain_that_ends_its_task_answers_through_its_head(served: tuple[Plan, str]) -> None:
    plan, url = served
    if plan.raw.name != "chain_tail":
        pytest.skip("for the chain_tail plan only")
    import tritonclient.http as http

    rng = np.random.default_rng(13)
    xs = [rng.standard_normal((1 + i % 4, 3, 32, 32), dtype=np.float32) for i in range(32)]
    # Requests of 1-4 images from 8 threads: both stem instances wait for answers, both tail instances send them.
    assert worst_concurrent_error(url, ("task_a",), xs, threads=8) <= 1e-4
    images = sum(len(x) for x in xs)
    tail = _counted(url, "tail", "link_samples", images)
    assert tail.get("link_samples", 0) >= images, tail  # the tail ran every image, as a link
    stem = _counted(url, "stem", "chain_answered", len(xs))
    # Every request answered by the head with its tail's answers, none failed, no answer lost on the way back.
    assert stem.get("chain_answered", 0) >= len(xs) and stem.get("chain_failed", 0) == 0, stem
    assert tail.get("chain_answers_lost", -1) == 0, tail
    client = http.InferenceServerClient(url.removeprefix("http://"))
    try:
        ticket = http.InferInput("ACTIVATION_IN", [1, 256], "UINT8")
        ticket.set_data_from_numpy(np.zeros((1, 256), dtype=np.uint8))
        with pytest.raises(Exception, match="is a link of a chain"):
            client.infer("tail", [ticket])
        # The head called directly answers as its task does: the chain runs behind it.
        image = http.InferInput("IMAGE", [2, 3, 32, 32], "FP32")
        image.set_data_from_numpy(xs[1])
        got = client.infer("stem", [image]).as_numpy("LOGITS")
        want = client.infer("task_a__ref", [image]).as_numpy("LOGITS")
        assert got is not None and want is not None and got.shape == (2, 10)
        assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4
    finally:
        client.close()
