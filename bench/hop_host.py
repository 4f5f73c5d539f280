"""Host time of one TensorMQ hop, step by step, in-process on one GPU (no Triton).

Two consecutive blocks of a plan's first task (``--blocks``, default its 2nd and 3rd) run as
their instances do in ``backend.model``: the producer reserves a pool slot, runs its block into
it and signs tickets; the consumer checks and claims the tickets, waits on the slot's event,
runs its own block into its own pool and queues the release. Each step is timed on the host
(``time.perf_counter_ns``), the GPU drained between iterations (untimed), so the figures are
the Python and driver work each ``execute`` adds, which Triton's "compute infer" contains.

    python -m bench.hop_host --plan plans/bench_r50.yaml --precision fp16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]  # re-exported without __all__

from backend.runtime import BlockRunner
from backend.tensormq.consumer import Consumer
from backend.tensormq.producer import Producer
from backend.tensormq.ticket import TICKET_BYTES
from bench.suite import in_precision
from blockflow.plan import load_plan
from blockflow.triton.server import prepare_tensormq
from ensemble_gen.generator import block_spec


def measure(plan_path: Path, precision: str | None, blocks: tuple[int, int], iters: int, batch: int) -> dict[str, Any]:
    plan = load_plan(plan_path)
    if precision is not None:
        plan = in_precision(plan, precision)
    task = next(iter(plan.tasks.values()))
    names = [task.path[i] for i in blocks]
    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    specs = [block_spec(plan, plan.blocks[n], "tensormq") for n in names]
    runners = [BlockRunner(s, cuda) for s in specs]
    for r in runners:
        r.warmup()
    stream = int(torch.cuda.current_stream(cuda).cuda_stream)
    runtime = Path(tempfile.mkdtemp(prefix="bf-hop-", dir=os.environ.get("XDG_RUNTIME_DIR")))
    prepare_tensormq(runtime)
    t = plan.raw.tensormq
    producers = [Producer(f"{n}/0", runtime, cuda, t.pool_mb * 2**20, t.slots, t.lease_s, t.wait_s, model=n,
                          max_samples=s.max_batch_size) for n, s in zip(names, specs, strict=True)]
    consumer = Consumer(runtime, cuda, accepts_from=[names[0]])
    x = torch.randn(batch, *specs[0].in_shape, device=cuda, dtype=runners[0].dtype)
    steps: dict[str, list[float]] = defaultdict(list)

    def lap(name: str, t0: int) -> int:
        now = time.perf_counter_ns()
        steps[name].append((now - t0) / 1e3)
        return now

    try:
        for i in range(iters + 50):
            t0 = time.perf_counter_ns()
            # ---- producer block: reserve, run into the slot, commit, tickets as Triton's tensor
            res = producers[0].reserve_tensors(batch, specs[0].out_shapes, runners[0].out_dtype)
            t0 = lap("p.reserve", t0)
            runners[0].run_all([x], outs=res.views)
            t0 = lap("p.run_into_slot", t0)
            tickets = producers[0].commit(res, stream)
            t0 = lap("p.commit_and_sign", t0)
            raw = torch.from_numpy(np.frombuffer(bytearray(b"".join(tickets)), dtype=np.uint8).reshape(len(tickets), TICKET_BYTES))
            raw = from_dlpack(to_dlpack(raw))  # what crosses pb_utils both ways
            t0 = lap("p.tickets_to_tensor", t0)
            # ---- consumer block: check and claim, wait on the event, run into its own slot, release
            views, releases = consumer.gather_tensors(raw, specs[1].in_shapes, stream)
            t0 = lap("c.gather_verify_claim_wait", t0)
            res2 = producers[1].reserve_tensors(batch, specs[1].out_shapes, runners[1].out_dtype)
            t0 = lap("c.reserve", t0)
            runners[1].run_all(views, outs=res2.views)
            t0 = lap("c.run_into_slot", t0)
            tickets2 = producers[1].commit(res2, stream)
            t0 = lap("c.commit_and_sign", t0)
            consumer.release_after(releases, stream)
            t0 = lap("c.release_after", t0)
            torch.cuda.synchronize()
            producers[1].abort(res2)  # nobody reads block 2's tickets here
            del tickets2
            if i < 50:
                steps.clear()
    finally:
        consumer.close()
        for p in producers:
            p.close()
    return {"blocks": names, "precision": specs[0].precision, "batch": batch, "iters": iters,
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
    args = ap.parse_args()
    a, b = (int(v) for v in args.blocks.split(","))
    res = measure(args.plan, args.precision, (a, b), args.iters, args.batch)
    lines = [f"{k:28s} {v:8.1f} us  (p90 {res['p90_us'][k]:.1f})" for k, v in res["median_us"].items()]
    per_block = sum(v for k, v in res["median_us"].items() if k.startswith("c."))
    lines.append(f"{'consumer block, all steps':28s} {per_block:8.1f} us")
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hop_host.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
