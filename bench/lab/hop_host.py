"""Host time of one TensorMQ hop, step by step, in-process on one GPU (no Triton).

Two consecutive blocks of a plan's first task (``--blocks``, default its 2nd and 3rd) run as
their instances do in ``blockflow.backend.model``, each in its own process: the producer reserves a pool slot, runs its block into
it and signs tickets; the consumer checks and claims the tickets, waits on the slot's event,
runs its own block into its own pool and queues the release. Each step is timed on the host
(``time.perf_counter_ns``), the GPU drained between iterations (untimed), so the figures are
the Python and driver work each ``execute`` adds, which Triton's "compute infer" contains.

    python -m blockflow.bench.lab.hop_host --plan plans/bench_r50.yaml --precision fp16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]  # re-exported without __all__

from blockflow.backend.runtime import BlockRunner
from blockflow.backend.tensormq.consumer import Consumer
from blockflow.backend.tensormq.producer import Producer
from blockflow.backend.tensormq.ticket import TICKET_BYTES
from blockflow.bench.plans import in_precision
from blockflow.core.runtime_dir import ensure_tensormq
from blockflow.ensemble_gen.generator import block_spec
from blockflow.plan import load_plan


def _setup(plan_path: Path, precision: str | None, blocks: tuple[int, int]) -> tuple[Any, list[str], list[Any]]:
    plan = load_plan(plan_path)
    if precision is not None:
        plan = in_precision(plan, precision)
    task = next(iter(plan.tasks.values()))
    names = [task.path[i] for i in blocks]
    return plan, names, [block_spec(plan, plan.blocks[n], "tensormq") for n in names]


class _Laps:
    def __init__(self) -> None:
        self.steps: dict[str, list[float]] = defaultdict(list)

    def lap(self, name: str, t0: int) -> int:
        now = time.perf_counter_ns()
        self.steps[name].append((now - t0) / 1e3)
        return now


def _block(plan: Any, name: str, spec: Any, runtime: Path) -> tuple[BlockRunner, int, Producer]:
    """One block instance on GPU 0 as ``blockflow.backend.model`` sets it up: its runner (warmed up), its
    stream and its TensorMQ producer."""
    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    runner = BlockRunner(spec, cuda)
    runner.warmup()
    t = plan.raw.tensormq
    producer = Producer(f"{name}/0", runtime, cuda, t.pool_mb * 2**20, t.slots, t.lease_s, t.wait_s, model=name,
                        max_samples=spec.max_batch_size)
    return runner, int(torch.cuda.current_stream(cuda).cuda_stream), producer


def _producer(plan_path: Path, precision: str | None, blocks: tuple[int, int], runtime: Path, batch: int,
              conn: Connection) -> None:
    """The first block, in its own process (CUDA IPC handles do not open in the process that made them)."""
    plan, names, specs = _setup(plan_path, precision, blocks)
    runner, stream, producer = _block(plan, names[0], specs[0], runtime)
    x = torch.randn(batch, *specs[0].in_shape, device=runner.device, dtype=runner.dtype)
    laps = _Laps()
    conn.send("ready")
    try:
        while conn.recv() == "go":
            t0 = time.perf_counter_ns()
            res = producer.reserve_tensors(batch, specs[0].out_shapes, runner.out_dtype)
            t0 = laps.lap("p.reserve", t0)
            runner.run_all([x], outs=res.views)
            t0 = laps.lap("p.run_into_slot", t0)
            tickets = producer.commit(res, stream)
            t0 = laps.lap("p.commit_and_sign", t0)
            raw = torch.from_numpy(np.frombuffer(bytearray(b"".join(tickets)), dtype=np.uint8).reshape(len(tickets), TICKET_BYTES))
            raw = from_dlpack(to_dlpack(raw))  # what crosses pb_utils
            laps.lap("p.tickets_to_tensor", t0)
            conn.send(raw.numpy().tobytes())
        conn.send(dict(laps.steps))
    finally:
        producer.close(drain_s=2.0)


def _replay_only(runner: BlockRunner, batch: int) -> dict[str, Any]:
    """The host time of the consumer's CUDA graph launch alone."""
    g = runner._graphs.get(batch)
    if g is None:
        return {}
    laps = []
    for _ in range(500):
        t0 = time.perf_counter_ns()
        g.graph.replay()
        laps.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
    return {"replay_only_us": statistics.median(laps[50:])}


def measure(plan_path: Path, precision: str | None, blocks: tuple[int, int], iters: int, batch: int,
            profile: Any = None) -> dict[str, Any]:
    """``profile``: a ``cProfile.Profile`` enabled around the consumer's steps (not the producer's)."""
    plan, names, specs = _setup(plan_path, precision, blocks)
    runtime = Path(tempfile.mkdtemp(prefix="bf-hop-", dir=os.environ.get("XDG_RUNTIME_DIR")))
    ensure_tensormq(runtime)
    runner, stream, producer = _block(plan, names[1], specs[1], runtime)
    consumer = Consumer(runtime, runner.device, accepts_from=[names[0]])
    replay = _replay_only(runner, batch)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_producer, args=(plan_path, precision, blocks, runtime, batch, there))
    child.start()
    laps = _Laps()
    try:
        if here.recv() != "ready":
            raise RuntimeError("the producer process did not start")
        for i in range(iters + 50):
            here.send("go")
            # As a block reads them: into a NumPy array (backend/request_inputs.py, ``RequestInputs.read``).
            raw = np.frombuffer(here.recv(), dtype=np.uint8).reshape(batch, TICKET_BYTES)
            if profile is not None and i >= 50:
                profile.enable()
            t0 = time.perf_counter_ns()
            views, releases = consumer.gather_tensors(raw, specs[1].in_shapes, stream)
            t0 = laps.lap("c.gather_verify_claim_wait", t0)
            res = producer.reserve_tensors(batch, specs[1].out_shapes, runner.out_dtype)
            t0 = laps.lap("c.reserve", t0)
            runner.run_all(views, outs=res.views)
            t0 = laps.lap("c.run_into_slot", t0)
            tickets = producer.commit(res, stream)
            t0 = laps.lap("c.commit_and_sign", t0)
            consumer.release_after(releases, stream, producer.done_event(res))  # as a middle block does (backend/tensormq_ends.py)
            laps.lap("c.release_after", t0)
            if profile is not None:
                profile.disable()
            torch.cuda.synchronize()
            producer.abort(res)  # nobody reads this block's tickets here
            del tickets
            if i == 49:
                laps.steps.clear()
        here.send("stop")
        steps = {k: v[50:] for k, v in here.recv().items()}
        steps.update(laps.steps)
    finally:
        child.join(30)
        consumer.close()
        producer.close()
        shutil.rmtree(runtime, ignore_errors=True)
    return {"blocks": names, "precision": specs[0].precision, "batch": batch, "iters": iters, **replay,
            "median_us": {k: statistics.median(v) for k, v in steps.items()},
            "p90_us": {k: float(np.percentile(v, 90)) for k, v in steps.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50.yaml"))
    ap.add_argument("--precision", default=None)
    ap.add_argument("--blocks", default="1,2", help="indices into the task's path: producer,consumer")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile", type=int, default=0, help="print the consumer's N costliest calls (cProfile, tottime)")
    args = ap.parse_args()
    a, b = (int(v) for v in args.blocks.split(","))
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    res = measure(args.plan, args.precision, (a, b), args.iters, args.batch, prof)
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    lines = [f"{k:28s} {v:8.1f} us  (p90 {res['p90_us'][k]:.1f})" for k, v in res["median_us"].items()]
    per_block = sum(v for k, v in res["median_us"].items() if k.startswith("c."))
    lines.append(f"{'consumer block, all steps':28s} {per_block:8.1f} us")
    if "replay_only_us" in res:
        lines.append(f"{'graph replay alone':28s} {res['replay_only_us']:8.1f} us")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hop_host.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
