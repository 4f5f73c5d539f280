"""What a client can make a real tritonserver read or write, and the requests that used to stop it.

Against the session's server (tests/conftest.py), over HTTP (through the nginx front door) and gRPC:
- Triton's shared-memory API answers nobody without the shared-memory key: no region of the server's,
  nor a client's own, is registered, for system and CUDA shared memory alike;
- with the key, the server's own regions (the Python backend's stub IPC, TensorMQ's host pools) and
  its runtime files still cannot be registered; a client's own region works, and its faults (an output
  region too small, a region larger than its file, an unregister while in use, 10,000 regions) fail alone;
- every region the server and its blocks made is 0600;
- chunked bodies of many small chunks (which overflowed a Triton 2.51 HTTP worker's stack), 16 MiB
  binary parts and bodies over the front door's limit fail alone, over several task shapes and batches.
After each, the server and every block process are the same processes, and every task still equals its
unsplit reference.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]
import json
import os
import socket
import stat
import threading
from functools import partial
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from blockflow.clients.client import TaskClient
from blockflow.core import env
from blockflow.triton.access import GRPC_SHM_HEADER, SHM_HEADER

from ..conftest import Served

pytestmark = pytest.mark.integration
# (task, its reference, the input's shape): one of each input size the session serves, 32x32 to 224x224.
TASKS = [("p_one", "p_one__ref", (3, 32, 32)), ("t18_one__tensormq", "t18_one__ref", (3, 64, 64)),
         ("cls_a", "cls_a__ref", (3, 224, 224))]


def _processes(served: Served) -> tuple[int, dict[str, list[int]]]:
    proc = served.server.process
    assert proc is not None and proc.poll() is None, "tritonserver exited"
    return proc.pid, {m: sorted(p) for m, p in served.server.stub_processes().items()}


def _server_regions(served: Served) -> list[str]:
    """The /dev/shm names the server and its blocks made: the stubs' IPC regions, TensorMQ's host pools (blocks on
    the CPU; on a GPU a pool is device memory, tests/gpu/test_cuda_shm_doors.py)."""
    prefixes = (env.stub_shm_prefix(os.getpid(), served.server.runtime_dir), env.pool_shm_prefix(served.server.runtime_dir))
    names = sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefixes))
    assert any(n.startswith(prefixes[0]) for n in names), names
    if not torch.cuda.is_available():
        assert any(n.startswith(prefixes[1]) for n in names), names
    return names


def _keys(served: Served) -> tuple[dict[str, str], dict[str, str]]:
    key = served.server.shm_key_file.read_text().strip()
    return {SHM_HEADER: key}, {GRPC_SHM_HEADER: key}


def _assert_unchanged_and_exact(served: Served, before: tuple[int, dict[str, list[int]]]) -> None:
    assert _processes(served) == before, "tritonserver or a block process died or was replaced"
    with TaskClient(served.http) as tc:
        for task, ref, shape in TASKS:
            for batch in (1, 3):
                x = np.random.default_rng(batch).standard_normal((batch, *shape), dtype=np.float32)
                got, want = tc.infer(task, x), tc.infer(ref, x)
                assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4, task


def test_no_region_is_registered_without_the_key(served: Served) -> None:
    before = _processes(served)
    own = shared_memory.SharedMemory(f"client-{os.getpid()}", create=True, size=4096)
    h, g = th.InferenceServerClient(served.http), tg.InferenceServerClient(served.grpc)
    wrong = ({SHM_HEADER: "wrong"}, {GRPC_SHM_HEADER: "wrong"})
    registered = 0
    try:
        for name in [*_server_regions(served), own.name]:
            for headers, grpc_headers in ((None, None), wrong):
                calls = [partial(h.register_system_shared_memory, "x", "/" + name, 4096, headers=headers),
                         partial(g.register_system_shared_memory, "x", "/" + name, 4096, headers=grpc_headers),
                         # Triton checks the key before it looks at the handle.
                         partial(h.register_cuda_shared_memory, "c", "A" * 88, 0, 4096, headers=headers),
                         partial(g.register_cuda_shared_memory, "c", "A" * 88, 0, 4096, headers=grpc_headers)]
                for call in calls:
                    try:
                        call()
                        registered += 1
                    except InferenceServerException as exc:
                        assert "restricted" in str(exc), exc
        for call in (h.get_system_shared_memory_status, h.get_cuda_shared_memory_status, g.get_system_shared_memory_status,
                     h.unregister_system_shared_memory, g.unregister_cuda_shared_memory):
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
    finally:
        own.close()
        own.unlink()
    print("regions registered without the key:", registered)
    assert registered == 0
    _assert_unchanged_and_exact(served, before)


def test_the_servers_own_regions_and_files_are_refused_with_the_key_too(served: Served) -> None:
    before = _processes(served)
    http_key, grpc_key = _keys(served)
    h, g = th.InferenceServerClient(served.http), tg.InferenceServerClient(served.grpc)
    runtime = served.server.runtime_dir
    files = [str(p) for p in (runtime / env.TMQ_DIR).iterdir()] + [str(served.server.shm_key_file), str(runtime / env.ADMIN_KEY_FILE)]
    registered = []
    for name in [*("/" + n for n in _server_regions(served)), *("//" + n for n in _server_regions(served)), *files]:
        for call in (partial(h.register_system_shared_memory, "x", name, 64, headers=http_key),
                     partial(g.register_system_shared_memory, "x", name, 64, headers=grpc_key)):
            try:
                call()
                registered.append(name)
            except InferenceServerException as exc:
                assert "Unable to open shared memory region" in str(exc) or "already in manager" in str(exc), exc
    assert h.get_system_shared_memory_status(headers=http_key) == []
    print(f"server regions and runtime files named: {len(files) + 2 * len(_server_regions(served))}, registered: {len(registered)}")
    assert registered == []
    _assert_unchanged_and_exact(served, before)


def test_every_region_the_server_made_is_its_users_alone(served: Served) -> None:
    regions = _server_regions(served)
    open_to_others = [n for n in regions if stat.S_IMODE((Path("/dev/shm") / n).stat().st_mode) & 0o077]
    print(f"server regions: {len(regions)}, open to other users: {len(open_to_others)}")
    assert open_to_others == []
    runtime = served.server.runtime_dir
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700  # Triton's HTTP socket, keys and TensorMQ's sockets are in it
    for key in (served.server.shm_key_file, runtime / env.ADMIN_KEY_FILE):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600


def _image_request(mod: object, x: np.ndarray, region: str | None, offset: int = 0,
                   out_region: tuple[str, int, int] | None = None) -> dict[str, list[object]]:
    """``infer``'s inputs and outputs: the image in the request or in ``region``, the logits in the answer or in ``out_region``."""
    inp = mod.InferInput("IMAGE", list(x.shape), "FP32")  # type: ignore[attr-defined]
    if region is None:
        inp.set_data_from_numpy(x)
    else:
        inp.set_shared_memory(region, x.nbytes, offset)
    out = mod.InferRequestedOutput("LOGITS")  # type: ignore[attr-defined]
    if out_region is not None:
        out.set_shared_memory(*out_region)
    return {"inputs": [inp], "outputs": [out]}


def test_a_clients_own_region_works_and_its_faults_fail_alone(served: Served) -> None:
    before = _processes(served)
    http_key, grpc_key = _keys(served)
    h, g = th.InferenceServerClient(served.http, network_timeout=120), tg.InferenceServerClient(served.grpc)
    task, ref, shape = TASKS[0]
    x = np.random.default_rng(5).standard_normal((2, *shape), dtype=np.float32)
    want = h.infer(ref, **_image_request(th, x, None)).as_numpy("LOGITS")
    assert want is not None
    out_bytes = want.nbytes
    region = shared_memory.SharedMemory(f"client-in-{os.getpid()}", create=True, size=x.nbytes + out_bytes)
    try:
        np.ndarray(x.shape, np.float32, region.buf)[:] = x
        for client, mod, key in ((h, th, http_key), (g, tg, grpc_key)):
            client.register_system_shared_memory("in", "/" + region.name, x.nbytes + out_bytes, headers=key)
            try:
                # In and out through the region: the logits land after the image.
                client.infer(task, **_image_request(mod, x, "in", out_region=("in", out_bytes, x.nbytes)))
                got = np.ndarray(want.shape, np.float32, region.buf, offset=x.nbytes)
                assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4
                # An output region too small for the logits, and a region past its end: refused.
                with pytest.raises(InferenceServerException, match="should be at least|exceeds|out of bounds|invalid"):
                    client.infer(task, **_image_request(mod, x, "in", out_region=("in", out_bytes - 4, x.nbytes)))
                with pytest.raises(InferenceServerException):
                    client.infer(task, **_image_request(mod, x, "in", offset=out_bytes + 8))
            finally:
                client.unregister_system_shared_memory("in", headers=key)
        # A region larger than its file, and an offset that overflows: refused at registration.
        for size, offset in ((x.nbytes + out_bytes + 1, 0), (64, 2**64 - 32)):
            with pytest.raises(InferenceServerException):
                h.register_system_shared_memory("big", "/" + region.name, size, offset, headers=http_key)
        # Unregistered while a request reads it: the unregister, or the request, fails alone.
        h.register_system_shared_memory("busy", "/" + region.name, x.nbytes, headers=http_key)
        outcome: list[str] = []

        def call() -> None:
            try:
                th.InferenceServerClient(served.http, network_timeout=120).infer(task, **_image_request(th, x, "busy"))
                outcome.append("answered")
            except InferenceServerException as exc:
                outcome.append(str(exc))

        t = threading.Thread(target=call)
        t.start()
        try:
            h.unregister_system_shared_memory("busy", headers=http_key)
        except InferenceServerException as exc:
            assert "in use" in str(exc), exc
        t.join(120)
        h.unregister_system_shared_memory(headers=http_key)
        assert len(outcome) == 1, outcome
    finally:
        region.close()
        region.unlink()
    assert h.get_system_shared_memory_status(headers=http_key) == []
    _assert_unchanged_and_exact(served, before)


def test_ten_thousand_regions_register_and_go(served: Served) -> None:
    """10,000 regions of 10,000 files; and one file under a second name, which Triton 2.51 would map through the
    descriptor it closed after the first (the guard keeps that number free: the second registration fails alone)."""
    before = _processes(served)
    _, grpc_key = _keys(served)
    g = tg.InferenceServerClient(served.grpc)
    names = [f"client-many-{os.getpid()}-{i}" for i in range(10_000)]
    for name in names:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 64)
        os.close(fd)
    try:
        for i, name in enumerate(names):
            g.register_system_shared_memory(f"r{i}", "/" + name, 64, headers=grpc_key)
        assert len(g.get_system_shared_memory_status(headers=grpc_key).regions) == 10_000
        with pytest.raises(InferenceServerException, match="Invalid shared memory region"):
            g.register_system_shared_memory("again", "/" + names[0], 64, headers=grpc_key)
        g.unregister_system_shared_memory(headers=grpc_key)
        assert len(g.get_system_shared_memory_status(headers=grpc_key).regions) == 0
    finally:
        g.unregister_system_shared_memory(headers=grpc_key)
        for name in names:
            _posixshmem.shm_unlink("/" + name)
    _assert_unchanged_and_exact(served, before)


def _post(url: str, head: bytes, body_parts: list[bytes]) -> tuple[int, bytes]:
    """One raw HTTP request (``head`` without its blank line, then the body's pieces as they are); the status and body."""
    host, port = url.split(":")
    with socket.create_connection((host, int(port)), timeout=120) as s:
        s.sendall(head + b"\r\n")
        for part in body_parts:
            s.sendall(part)
        data = b""  # the server closes the connection after its answer (Connection: close)
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def _infer_head(task: str, length: bytes, header_len: int) -> bytes:
    return (f"POST /v2/models/{task}/infer HTTP/1.1\r\nHost: blockflow\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {header_len}\r\nConnection: close\r\n").encode() + length


def test_chunked_and_oversized_bodies_fail_alone(served: Served) -> None:
    """A body of ~600k one-byte chunks (which overflowed a Triton 2.51 HTTP worker's stack: SIGSEGV), the same
    in 64 KiB chunks, and a 16 MiB binary part with a Content-Length, 20 requests over three input sizes and every
    batch from 1 to the task's largest; then a body over the front door's limit (413) and 16 MiB over gRPC."""
    before = _processes(served)
    h = th.InferenceServerClient(served.http)
    sent, codes = 0, []
    for i in range(20):
        task, _, shape = TASKS[i % len(TASKS)]
        batch = 1 + i % int(h.get_model_config(task)["max_batch_size"])
        header = json.dumps({"inputs": [{"name": "IMAGE", "shape": [batch, *shape], "datatype": "FP32",
                                         "parameters": {"binary_data_size": 16 << 20}}]}).encode()
        body = header + bytes(16 << 20)
        kind = i % 3
        if kind == 0:  # the crash: each byte its own chunk, for the first 600,000 bytes
            parts = [b"1\r\n" + body[j:j + 1] + b"\r\n" for j in range(600_000)]
            parts = [b"".join(parts[k:k + 10_000]) for k in range(0, len(parts), 10_000)]
            parts.append(f"{len(body) - 600_000:x}\r\n".encode() + body[600_000:] + b"\r\n0\r\n\r\n")
            head = _infer_head(task, b"Transfer-Encoding: chunked\r\n", len(header))
        elif kind == 1:  # chunked in 64 KiB chunks
            parts = [f"{len(body[j:j + 65536]):x}\r\n".encode() + body[j:j + 65536] + b"\r\n" for j in range(0, len(body), 65536)]
            parts.append(b"0\r\n\r\n")
            head = _infer_head(task, b"Transfer-Encoding: chunked\r\n", len(header))
        else:  # a Content-Length
            parts, head = [body], _infer_head(task, f"Content-Length: {len(body)}\r\n".encode(), len(header))
        status, answer = _post(served.http, head, parts)
        codes.append(status)
        assert status == 400 and b"byte size mismatch" in answer, (i, status, answer[:300])
        sent += 1
    # Over the front door's limit: refused before Triton sees it, with a JSON error like Triton's.
    limit = served.server.options.max_body_bytes
    over = bytes(limit + 1)
    status, answer = _post(served.http, _infer_head("p_one", f"Content-Length: {len(over)}\r\n".encode(), 10), [over])
    assert status == 413 and json.loads(answer)["error"].startswith("request body larger than"), (status, answer[:200])
    # gRPC reads an input as one string: 16 MiB for a 12 KiB input is refused by Triton's own check.
    inp = tg.InferInput("IMAGE", [1, 3, 32, 32], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    inp._raw_content = bytes(16 << 20)
    with pytest.raises(InferenceServerException, match="byte size mismatch"):
        tg.InferenceServerClient(served.grpc).infer("p_one", [inp])
    print(f"oversized or chunked requests sent: {sent}, answered 400: {codes.count(400)}; tritonserver restarts: 0")
    _assert_unchanged_and_exact(served, before)
