"""Concurrency stress check: do concurrent requests on shared blocks get exactly their own results?

Starts one server for the plan, computes every request's expected outputs (every output a task
answers: logits, or a detector's boxes, scores, labels and counts) from the task's monolithic
reference (the plan's ``references``: eager, else its CUDA graph; sequentially), then replays all requests concurrently and counts mismatches. A diagnostic, not a test: prints one line per round. ``--input cuda`` sends the
concurrent requests' images through CUDA shared memory (one region per worker thread), so they
reach the first blocks on the GPU; ``--input host,cuda`` runs the rounds for each on one server.
The expected logits always come from host inputs.

    python -m blockflow.bench.stress --plan plans/default.yaml --jobs 120 --workers 16 [--input host,cuda] [--server-arg=...]
"""

from __future__ import annotations

import argparse
import os
import queue
import threading
from pathlib import Path

import numpy as np

from blockflow.bench.agreement import relative_error
from blockflow.bench.harness import task_images
from blockflow.clients.client import TaskClient
from blockflow.ensemble_gen import generator
from blockflow.plan import load_plan, naming
from blockflow.triton.server import ServerOptions, TritonServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plan", default="plans/default.yaml")
    ap.add_argument("--jobs", type=int, default=120)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--label", default="")
    ap.add_argument("--input", default="host",
                    help="where the concurrent requests' images travel: host, cuda (CUDA shared memory), or both: host,cuda")
    args = ap.parse_args()
    inputs = [m.strip() for m in args.input.split(",") if m.strip()]
    if not inputs or set(inputs) - {"host", "cuda"}:
        ap.error(f"--input takes host, cuda or host,cuda; not {args.input!r}")
    plan = load_plan(args.plan)
    if not plan.raw.references:
        ap.error(f"{args.plan} serves no unsplit reference to check the answers against: add references: [eager] or [graph]")
    graph = "eager" not in plan.raw.references  # either one answers as the unsplit network
    tasks = [t for t in plan.tasks if len(plan.tasks[t].path) > 1]
    repo = Path(os.environ.get("TMPDIR", "/tmp")) / f"stress-repo-{os.getpid()}"
    generator.write(generator.render(plan), repo)
    opts = ServerOptions.on_free_ports([repo], extra_args=args.server_arg)
    jobs = [(tasks[i % len(tasks)], task_images(plan, tasks[i % len(tasks)], 1 + i % 3, seed=i)) for i in range(args.jobs)]
    with TritonServer(opts) as server:
        with TaskClient(server.http_url) as c:
            expected = [c.infer_outputs(naming.reference_model(t, graph), x) for t, x in jobs]

        for memory in inputs:
            for r in range(args.rounds):
                results = _round(server.http_url, memory, jobs, args.workers, server.shm_key)
                errs = [difference(g, w) for g, w in zip(results, expected, strict=True)]
                bad = sum(1 for e in errs if not e <= 1e-4)
                print(f"[stress {args.label}] {memory} inputs, round {r}: {bad}/{len(jobs)} mismatched, max rel err {max(errs):.3g}",
                      flush=True)


def difference(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:  # type: ignore[type-arg]
    """The largest difference between two answers, relative to each float output's largest value;
    inf where an output is missing, its shape differs, or an integer output differs at all."""
    worst = 0.0
    for name, w in want.items():
        g = got.get(name)
        if g is None:
            return float("inf")
        if not np.issubdtype(w.dtype, np.floating):
            worst = max(worst, 0.0 if np.array_equal(g, w) else float("inf"))
        else:
            worst = max(worst, relative_error(g, w))
    return worst


def _round(url: str, memory: str, jobs: list[tuple[str, np.ndarray]], workers: int,  # type: ignore[type-arg]
           shm_key: str) -> list[dict[str, np.ndarray]]:  # type: ignore[type-arg]
    """Every job once, by ``workers`` threads; the answers in job order.

    Each thread makes, uses and closes a client of its own: a CUDA region serves one request at a
    time, and tritonclient's HTTP client (gevent) cannot be used or closed from another thread.
    """
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(jobs)):
        todo.put(i)
    results: list[dict[str, np.ndarray] | None] = [None] * len(jobs)  # type: ignore[type-arg]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with TaskClient(url, input_memory="cuda" if memory == "cuda" else "host", shm_key=shm_key) as client:
                while True:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    results[i] = client.infer_outputs(*jobs[i])
        except BaseException as exc:  # reported after the round, with the others'
            errors.append(exc)

    threads = [threading.Thread(target=work, name=f"stress-{k}") for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {workers} workers failed; the first: {errors[0]!r}") from errors[0]
    return [r for r in results if r is not None]

if __name__ == "__main__":
    main()
