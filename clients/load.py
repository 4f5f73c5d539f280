"""The thesis' task generator (§4.2) against a BlockFlow server.

* closed loop: N clients, each sends its next request when the previous answer arrives;
* open loop: requests arrive as a Poisson process of rate λ (exponential gaps), whatever
  the server's pace, so queueing shows up in the latencies.

Tasks are chosen round-robin per client (closed) or uniformly at random (open). Every request's
send time, latency, task, batch and outcome is recorded.
"""

from __future__ import annotations

import asyncio
import csv
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from blockflow.clients.client import AsyncTaskClient, Protocol
from blockflow.clients.images import random_jpegs
from blockflow.clients.task_input import TaskInput
from blockflow.core.errors import ClientError
from blockflow.core.spec import LOGITS

Images = npt.NDArray[Any]


@dataclass(frozen=True)
class Record:
    task: str
    batch: int
    sent_s: float  # since the start of the run
    latency_ms: float
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class LoadSpec:
    url: str
    tasks: Sequence[str]
    shape: tuple[int, ...]  # one image's (an encoded task's images are random JPEGs of any size)
    protocol: Protocol = "http"
    batch: int = 1
    duration_s: float = 10.0
    clients: int = 1  # closed loop
    rate: float | None = None  # open loop when set (requests per second)
    max_requests: int | None = None
    seed: int = 0
    input_memory: Literal["host", "cuda"] = "host"  # "cuda": images through CUDA shared-memory regions (AsyncTaskClient)


async def _one(client: AsyncTaskClient, task: str, x: np.ndarray, sides: dict[str, Images], t0: float,  # type: ignore[type-arg]
               out: list[Record]) -> None:
    sent = time.perf_counter()
    try:
        outputs = (await client.input_of(task)).outputs
        if outputs and LOGITS not in outputs:  # a detector's task: every output it answers with
            await client.infer_outputs(task, x, inputs=sides)
        else:
            await client.infer(task, x, inputs=sides)
        out.append(Record(task, x.shape[0], sent - t0, (time.perf_counter() - sent) * 1e3, True))
    except Exception as exc:  # a failed request is a data point, not the end of the run
        out.append(Record(task, x.shape[0], sent - t0, (time.perf_counter() - sent) * 1e3, False, str(exc)[:200]))


async def _inputs(client: AsyncTaskClient, spec: LoadSpec) -> dict[str, tuple[Images, dict[str, Images]]]:
    """Each task's (seeded, random) batch, in the dtype its input takes: standard normal float32, uint8
    noise for a task that takes uint8 images, or noise encoded as JPEG for one that takes encoded images;
    with ones for each of its side inputs (not zeros: a network may divide by a size or a scale)."""
    out: dict[str, tuple[Images, dict[str, Images]]] = {}
    for task in dict.fromkeys(spec.tasks):
        try:
            kind = await client.input_of(task)
        except ClientError:  # its requests fail and say why
            kind = TaskInput()
        rng = np.random.default_rng(spec.seed)
        x = (random_jpegs(spec.batch, seed=spec.seed) if kind.encoded else
             rng.integers(0, 256, (spec.batch, *spec.shape), dtype=np.uint8) if kind.uint8 else
             rng.standard_normal((spec.batch, *spec.shape), dtype=np.float32))
        out[task] = x, {s.name: np.ones((spec.batch, *s.shape), s.dtype) for s in kind.side_inputs}
    return out


async def run_load(spec: LoadSpec, progress: Callable[[int], None] | None = None) -> list[Record]:
    """Run the load described by ``spec``; returns one record per request."""
    rng = random.Random(spec.seed)
    records: list[Record] = []
    limit = spec.max_requests or 10**12
    client = AsyncTaskClient(spec.url, spec.protocol, input_memory=spec.input_memory)
    try:
        xs = await _inputs(client, spec)
        t0 = time.perf_counter()
        deadline = t0 + spec.duration_s
        if spec.rate is None:
            async def worker(i: int) -> None:
                k = i
                while time.perf_counter() < deadline and len(records) < limit:
                    task = spec.tasks[k % len(spec.tasks)]
                    await _one(client, task, *xs[task], t0, records)
                    k += 1
                    if progress:
                        progress(1)

            await asyncio.gather(*(worker(i) for i in range(spec.clients)))
        else:
            pending: set[asyncio.Task[None]] = set()
            next_at = t0
            sent = 0
            while next_at < deadline and sent < limit:
                next_at += rng.expovariate(spec.rate)
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                name = rng.choice(list(spec.tasks))
                task = asyncio.ensure_future(_one(client, name, *xs[name], t0, records))
                if progress:
                    task.add_done_callback(lambda _: progress(1))
                pending.add(task)
                task.add_done_callback(pending.discard)
                sent += 1
            if pending:
                await asyncio.gather(*pending)
    finally:
        await client.close()
    return sorted(records, key=lambda r: r.sent_s)


def write_csv(records: Sequence[Record], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["task", "batch", "sent_s", "latency_ms", "ok", "error"])
        for r in records:
            w.writerow([r.task, r.batch, f"{r.sent_s:.6f}", f"{r.latency_ms:.3f}", int(r.ok), r.error])


def summarize(records: Sequence[Record], duration_s: float) -> dict[str, dict[str, float]]:
    """Per task (and 'all'): requests, errors, throughput (inferences/s), latency p50/p90/p99/mean."""
    out: dict[str, dict[str, float]] = {}
    groups: dict[str, list[Record]] = {"all": list(records)}
    for r in records:
        groups.setdefault(r.task, []).append(r)
    for name, rs in groups.items():
        ok = np.array([r.latency_ms for r in rs if r.ok])
        out[name] = {
            "requests": float(len(rs)),
            "errors": float(sum(not r.ok for r in rs)),
            "throughput": sum(r.batch for r in rs if r.ok) / duration_s if duration_s > 0 else 0.0,
            **({f"p{q}": float(np.percentile(ok, q)) for q in (50, 90, 99)} if ok.size else {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}),
            "mean": float(ok.mean()) if ok.size else float("nan"),
        }
    return out
