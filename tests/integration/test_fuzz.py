"""Fuzzing a real tritonserver: malformed requests to every task, random, mutated, replayed and
redirected tickets to every TensorMQ block. Each fails alone with a 4xx; no process dies, and every
task still equals its unsplit reference afterwards.

Counts are modest in CI (N = 300 requests, N / 4 ticket rounds of 6 bad tickets each);
``BLOCKFLOW_FUZZ_N=4000`` sends 4,000 requests and 6,000 bad tickets (figures in
docs/security.md).
"""

from __future__ import annotations

import http.client
import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th

from blockflow.clients.client import TaskClient
from blockflow.triton import argv_key
from blockflow.triton.access import ADMIN_HEADER, SHM_HEADER, grpc_admin_headers

from ..conftest import Served

pytestmark = pytest.mark.integration
N = int(os.environ.get("BLOCKFLOW_FUZZ_N", "300"))
# Tasks of the served test plans (small inputs: the CPU runs them quickly) and their references.
TASKS = {"t18_one__tensormq": ("t18_one__ref", (3, 64, 64)), "t18_two__tensormq": ("t18_two__ref", (3, 64, 64)),
         "t18_one": ("t18_one__ref", (3, 64, 64)), "t18_one__triton_cpu": ("t18_one__ref", (3, 64, 64)),
         "p_one": ("p_one__ref", (3, 32, 32)), "p_two": ("p_two__ref", (3, 32, 32)), "p_three": ("p_three__ref", (3, 32, 32))}


def _stubs(served: Served) -> dict[str, list[int]]:
    return {m: sorted(p) for m, p in served.server.stub_processes().items()}


def _raw_infer(url: str, model: str, header: bytes, binary: bytes = b"", content_type: str = "application/json") -> tuple[int, bytes]:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = header + binary
    headers = {"Content-Type": content_type}
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(header))
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _malformed(rng: random.Random, task: str, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """One malformed or hostile request for ``task``: (JSON header, binary part)."""
    kind = rng.randrange(12)
    dims = [1, *shape]
    good = np.zeros(dims, np.float32).tobytes()

    def header(inputs: list[dict[str, object]]) -> bytes:
        return json.dumps({"inputs": inputs}).encode()

    def binary_input(shape_: list[int], dtype: str, size: int, name: str = "IMAGE") -> dict[str, object]:
        return {"name": name, "shape": shape_, "datatype": dtype, "parameters": {"binary_data_size": size}}

    if kind == 0:  # wrong shape
        bad = [1, shape[0], shape[1] + rng.randint(1, 9), shape[2]]
        return header([binary_input(bad, "FP32", 4 * int(np.prod(bad)))]), bytes(4 * int(np.prod(bad)))
    if kind == 1:  # wrong dtype
        dtype = rng.choice(["FP16", "INT64", "UINT8", "BOOL", "INT8"])
        size = {"FP16": 2, "INT64": 8, "UINT8": 1, "BOOL": 1, "INT8": 1}[dtype] * int(np.prod(dims))
        return header([binary_input(dims, dtype, size)]), bytes(size)
    if kind == 2:  # batch above max_batch_size
        b = rng.randint(9, 64)
        return header([binary_input([b, *shape], "FP32", len(good) * b)]), good * b
    if kind == 3:  # zero batch
        return header([binary_input([0, *shape], "FP32", 0)]), b""
    if kind == 4:  # NaN / Inf pixels: a valid request with invalid numbers (answered, never a crash)
        x = np.full(dims, rng.choice([np.nan, np.inf, -np.inf]), np.float32)
        return header([binary_input(dims, "FP32", x.nbytes)]), x.tobytes()
    if kind == 5:  # huge declared shape, tiny body
        return header([binary_input([1, 3, 1 << 20, 1 << 20], "FP32", 16)]), bytes(16)
    if kind == 6:  # oversized binary part: declared and sent
        size = rng.choice([1 << 20, 16 << 20])
        return header([binary_input(dims, "FP32", size)]), bytes(size)
    if kind == 7:  # declared size and body disagree
        return header([binary_input(dims, "FP32", len(good) + rng.randint(1, 4096))]), good
    if kind == 8:  # malformed JSON
        return rng.choice([b"{", b"{\"inputs\": [", b"[]", b"null", b"{\"inputs\": 3}", bytes(rng.getrandbits(8) for _ in range(64))]), b""
    if kind == 9:  # negative, missing or non-numeric dims
        return header([{"name": "IMAGE", "shape": rng.choice([[-1, *shape], [1], "x", [1.5, 3, 3, 3]]), "datatype": "FP32",
                        "data": [0.0]}]), b""
    if kind == 10:  # unknown or missing input
        return header([binary_input(dims, "FP32", len(good), name=rng.choice(["NOPE", "ACTIVATION_IN", ""]))]), good
    # JSON data of the wrong length
    return header([{"name": "IMAGE", "shape": dims, "datatype": "FP32", "data": [1.0] * rng.randint(0, 50)}]), b""


def test_malformed_requests_to_every_task_fail_alone(served: Served) -> None:
    rng = random.Random(20261123)
    before = _stubs(served)
    codes: Counter[int] = Counter()
    wrong: list[tuple[str, int, bytes]] = []
    tasks = sorted(TASKS)
    for i in range(N):
        task = tasks[i % len(tasks)]
        header, binary = _malformed(rng, task, TASKS[task][1])
        status, body = _raw_infer(served.http, task, header, binary)
        codes[status] += 1
        # Triton 2.51's HTTP front end answers a header it cannot parse as JSON with 500 (its own code,
        # before any model runs); every other refusal is a 4xx (503 only for a full pool).
        triton_parse_error = status == 500 and body.startswith((b'{"error":"Unable to parse', b'{"error":"failed to parse'))
        if (status >= 500 and status != 503 and not triton_parse_error) or b"Traceback" in body:
            wrong.append((task, status, body[:300]))
    # gRPC: the same kinds through tritonclient's own encoder
    c = tg.InferenceServerClient(served.grpc)
    for task in tasks[:3]:
        for shape, dtype in (([1, 3, 5, 5], "FP32"), ([1, *TASKS[task][1]], "FP16"), ([9, *TASKS[task][1]], "FP32")):
            inp = tg.InferInput("IMAGE", shape, dtype)
            inp.set_data_from_numpy(np.zeros(shape, np.float16 if dtype == "FP16" else np.float32))
            with pytest.raises(Exception, match="INVALID_ARG|StatusCode.INVALID_ARGUMENT|expected|batch"):
                c.infer(task, [inp])
    print("HTTP status counts:", dict(codes))
    assert not wrong, wrong[:10]
    assert served.server.process is not None and served.server.process.poll() is None
    assert _stubs(served) == before, "a block process died or was replaced"
    _assert_tasks_exact(served)


def _ticket(c: th.InferenceServerClient, block: str, x: np.ndarray) -> np.ndarray:
    inp = th.InferInput("IMAGE", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = c.infer(block, [inp]).as_numpy("ACTIVATION_OUT")
    assert out is not None
    return out


def _send(c: th.InferenceServerClient, block: str, tickets: np.ndarray) -> tuple[bool, Any]:
    """(True, the block's output) or (False, the error's text)."""
    inp = th.InferInput("ACTIVATION_IN", list(tickets.shape), "UINT8")
    inp.set_data_from_numpy(tickets)
    try:
        result = c.infer(block, [inp])
    except Exception as exc:
        return False, str(exc)
    return True, result.as_numpy(result.get_response()["outputs"][0]["name"])


def test_random_mutated_replayed_and_redirected_tickets_are_refused(served: Served) -> None:
    """Tickets a client got by calling block models directly: each is accepted once, by a block its
    producer feeds; every replay, redirect, mutation or random ticket is refused with a 400."""
    rng = random.Random(7)
    c = th.InferenceServerClient(served.http, network_timeout=120)
    before = _stubs(served)
    x = np.random.default_rng(1).standard_normal((1, 3, 64, 64), dtype=np.float32)
    outcomes: Counter[str] = Counter()
    rounds = max(1, N // 4)
    for _ in range(rounds):
        # r18_a feeds r18_b only; r18_b feeds r18_c1 and r18_c2 (tests/plans/r18_three_cuts.yaml).
        first = _ticket(c, "r18_a__tensormq", x)
        ok, msg = _send(c, "r18_c1__tensormq", first)  # redirected: r18_a does not feed r18_c1
        assert not ok and "[400]" in msg and "redirected ticket" in msg, msg
        outcomes["redirected"] += 1
        ok, mid = _send(c, "r18_b__tensormq", first)  # its rightful use, after the redirect failed
        assert ok and isinstance(mid, np.ndarray)
        for target in ("r18_b__tensormq", "r18_b__tensormq"):  # replayed: to the same block, twice
            ok, msg = _send(c, target, first)
            assert not ok and "[400]" in msg and "replayed" in msg, msg
            outcomes["replayed"] += 1
        assert _send(c, "r18_c2__tensormq", mid)[0]
        ok, msg = _send(c, "r18_c1__tensormq", mid)  # replayed to the block's other consumer
        assert not ok and "replayed" in msg, msg
        outcomes["replayed to another consumer"] += 1
        mutated = first.copy()
        for _ in range(rng.randint(1, 6)):
            mutated[0, rng.randrange(256)] ^= 1 << rng.randrange(8)
        ok, msg = _send(c, "r18_b__tensormq", mutated)
        assert not ok and "[400]" in msg, msg
        outcomes["mutated"] += 1
        junk = np.frombuffer(bytes(rng.getrandbits(8) for _ in range(256 * rng.randint(1, 3))), np.uint8).reshape(-1, 256)
        ok, msg = _send(c, rng.choice(["r18_b__tensormq", "r18_c1__tensormq", "r18_c2__tensormq"]), junk.copy())
        assert not ok and "[400]" in msg, msg
        outcomes["random"] += 1
    print("refused tickets:", dict(outcomes))
    assert _stubs(served) == before
    _assert_tasks_exact(served)


def test_the_model_repository_api_needs_the_admin_key(served: Served, tmp_path: Path) -> None:
    """Load, unload and the index over HTTP and gRPC: refused without the key, also a load that
    carries its own model.py (the file override) — so no caller can make the server run its code."""
    import base64

    marker = tmp_path / "ran"
    evil = f"open({str(marker)!r}, 'w').write('x')\nclass TritonPythonModel:\n    pass\n".encode()
    config = json.dumps({"name": "evil", "backend": "python"})
    host, port = served.http.split(":")
    refused = 0
    for headers in ({}, {ADMIN_HEADER: "wrong"}, {ADMIN_HEADER.upper(): ""}):
        for path, body in (("/v2/repository/index", b"{}"), ("/v2/repository/models/r18_c1__tensormq/unload", b"{}"),
                           ("/v2/repository/models/evil/load", json.dumps({"parameters": {
                               "config": config, "file:1/model.py": base64.b64encode(evil).decode()}}).encode()),
                           ("/v2/trace/setting", b'{"trace_file": "/tmp/x"}'), ("/v2/logging", b"{}")):
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("POST", path, body=body, headers=headers)
            r = conn.getresponse()
            r.read()
            conn.close()
            assert r.status == 403, (path, headers, r.status)
            refused += 1
    g = tg.InferenceServerClient(served.grpc)
    for call in (lambda: g.get_model_repository_index(), lambda: g.unload_model("r18_c1__tensormq"),
                 lambda: g.load_model("evil", config=config, files={"file:1/model.py": evil}),
                 lambda: g.unload_model("r18_c1__tensormq", headers=grpc_admin_headers("wrong"))):
        with pytest.raises(Exception, match="restricted|PERMISSION_DENIED|UNAVAILABLE"):
            call()
        refused += 1
    assert not marker.exists()
    assert refused == 19
    # What task clients need stays open; the admin key opens the rest.
    assert th.InferenceServerClient(served.http).is_model_ready("r18_c1__tensormq")
    index = th.InferenceServerClient(served.http).get_model_repository_index(headers=served.server.admin_headers)
    assert any(m["name"] == "r18_c1__tensormq" for m in index)
    assert g.get_model_repository_index(headers=grpc_admin_headers(served.server.admin_key)).models


def test_the_admin_key_is_not_on_tritonservers_command_line(served: Served) -> None:
    """/proc/<pid>/cmdline is readable by every local user: the key reaches Triton inside the process
    (blockflow.triton.argv_key), and the placeholder standing in for it opens nothing."""
    if argv_key.library() is None:
        pytest.skip(f"no argv-key library ({argv_key.find()}), and /proc's hidepid or the operator lets the key go on the command line")
    assert served.server.process is not None
    pid = served.server.process.pid
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert served.server.admin_key.encode() not in cmdline and served.server.shm_key.encode() not in cmdline
    assert cmdline.count(argv_key.ADMIN_PLACEHOLDER.encode()) == 2  # HTTP's and gRPC's restricted APIs
    assert cmdline.count(argv_key.SHM_PLACEHOLDER.encode()) == 2
    host, port = served.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v2/repository/index", body=b"{}", headers={ADMIN_HEADER: argv_key.ADMIN_PLACEHOLDER})
    assert conn.getresponse().status == 403
    conn.close()
    with pytest.raises(Exception, match="restricted"):
        th.InferenceServerClient(served.http).get_system_shared_memory_status(headers={SHM_HEADER: argv_key.SHM_PLACEHOLDER})
    with pytest.raises(Exception, match="restricted"):
        tg.InferenceServerClient(served.grpc).get_model_repository_index(headers=grpc_admin_headers(argv_key.ADMIN_PLACEHOLDER))
    # The block processes tritonserver started do not carry the library.
    stubs = [p for pids in served.server.stub_processes().values() for p in pids]
    assert stubs and not [p for p in stubs if b"argv-key" in Path(f"/proc/{p}/environ").read_bytes()]


def _assert_tasks_exact(served: Served) -> None:
    with TaskClient(served.http) as tc:
        for task, (ref, shape) in TASKS.items():
            for batch in (1, 3):
                x = np.random.default_rng(batch).standard_normal((batch, *shape), dtype=np.float32)
                got, want = tc.infer(task, x), tc.infer(ref, x)
                assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4, task
