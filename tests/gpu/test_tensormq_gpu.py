"""TensorMQ over CUDA IPC between real processes on a GPU (and across two GPUs when there are two)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from blockflow.backend.tensormq.consumer import Consumer
from blockflow.backend.tensormq.producer import Producer
from blockflow.core.runtime_dir import ensure_tensormq

pytestmark = pytest.mark.gpu


def _produce(runtime: str, device: int, conn: mp.connection.Connection, early: bool) -> None:
    torch.cuda.set_device(device)
    prod = Producer("gpu-producer/0", Path(runtime), torch.device("cuda", device), 64 << 20, 16, 30, 5)
    b = 0
    while conn.recv() == "batch":
        r = prod.reserve((4, 256, 56, 56), torch.float32)
        if early:  # the tickets leave before the work is even queued (a block's one-request call)
            conn.send(prod.issue(r))
            time.sleep(0.02)  # so that the consumer holds them before the commit
        # A long kernel chain before the event is recorded: the consumer must wait on the GPU, not read early.
        x = torch.full((4, 256, 56, 56), float(b), device=f"cuda:{device}")
        for _ in range(50):
            x = x * 1.0001
        r.view.copy_(x)
        stream = torch.cuda.current_stream(device).cuda_stream
        tickets = prod.commit(r, stream)
        conn.send(float(x[0, 0, 0, 0].item()) if early else (tickets, float(x[0, 0, 0, 0].item())))
        b += 1
    prod.usage()  # reads the releases in the claim table
    conn.send(prod.stats.releases)
    prod.close()


@pytest.mark.parametrize(("consumer_gpu", "early"), [(0, False), (1, False), (0, True)], ids=["same-gpu", "other-gpu", "early-tickets"])
def test_cuda_ipc_tickets_between_processes(tmp_path: Path, consumer_gpu: int, early: bool) -> None:
    """Exact data across processes; with ``early``, each batch's tickets reach the consumer before the
    producer queued its work, and the consumer waits for the commit, then for the event on its stream."""
    if consumer_gpu >= torch.cuda.device_count():
        pytest.skip("needs two GPUs")
    runtime = Path("/tmp") / f"bf-gpu-{os.getpid()}-{consumer_gpu}-{int(early)}"
    runtime.mkdir(mode=0o700)
    ensure_tensormq(runtime)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_produce, args=(str(runtime), 0, there, early))
    proc.start()
    device = torch.device("cuda", consumer_gpu)
    torch.cuda.set_device(device)
    consumer = Consumer(runtime, device)
    try:
        stream = torch.cuda.current_stream(device).cuda_stream
        for b in range(20):
            here.send("batch")
            assert here.poll(60), f"producer process gave no tickets (alive: {proc.is_alive()}, exit {proc.exitcode})"
            tickets, expected = (here.recv(), None) if early else here.recv()
            raw = torch.frombuffer(bytearray(b"".join(tickets)), dtype=torch.uint8).view(len(tickets), 256)
            x, releases = consumer.gather(raw, (256, 56, 56), stream)
            got = x.to(device).clone()
            if early:
                assert here.poll(60)
                expected = here.recv()
            consumer.release_after(releases, stream)
            assert torch.all(got == expected), (b, float(got.min()), expected)
        consumer.flush()
        assert consumer.stats.commit_waits >= (10 if early else 0)
        assert consumer.stats.handle_opens == 1 + 16  # one segment and 16 events, once
        assert consumer.stats.hellos == 1
        time.sleep(0.3)
        here.send("stop")
        assert here.poll(30) and here.recv() == 80  # every sample released
    finally:
        consumer.close()
        proc.join(30)
