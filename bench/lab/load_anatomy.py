"""Where each block's time goes under load: traced ``execute`` calls and Triton's phases at concurrency C.

    python -m blockflow.bench.lab.load_anatomy --plan plans/bench_r50.yaml --precision fp16 --out DIR \\
        [--concurrency 32] [--seconds 4] [--input host,cuda-shm] [--mps] [--client-threads 16]

One server with ``BLOCKFLOW_TRACE_DIR`` set (backend/trace.py) serves the plan's first task
split (``tensormq``) and unsplit (the monolithic CUDA graph), nothing else; perf_analyzer drives
each at concurrency C for one window per input path. For every block, over that window:

- from the block's own trace: ``execute`` calls per second, samples per call, the share of the
  window its ``execute`` ran (*busy*), the medians of its phases and laps (as in
  ``bench.timeline``), and the gap between one call's return and the same process's next call;
- from Triton's statistics: per execution, *compute input* (the Python backend's server side
  writing the requests into the stub's shared memory), *compute infer* (the round trip through
  the stub: the stub loading the requests, ``execute``, the responses back) and *compute output*
  (the server side sending the responses on: for the task's last block, the ensemble's own
  response, copied into the client's buffers); queue time per request.

A pipeline whose blocks are busy only part of the window is held back between their calls, and
Triton's phases say on which side. ``--mps`` serves under a private MPS daemon, so the two can be
compared on one machine. Writes ``load_anatomy.json`` and ``load_anatomy.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from blockflow.bench.harness import commit, device_name, rendered
from blockflow.bench.perf_analyzer import INPUTS, perf_analyzer
from blockflow.bench.plans import split_and_graph, task_models
from blockflow.bench.timeline import read_traces, step_laps
from blockflow.bench.triton_stats import delta, model_stats, phases_per_execution
from blockflow.core.env import TRACE_DIR
from blockflow.plan import load_plan
from blockflow.triton.server import ServerOptions, TritonServer


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def block_window(records: list[dict[str, Any]], t0: int, t1: int) -> dict[str, float]:
    """One block's traced ``execute`` calls that began in ``[t0, t1]`` ns (CLOCK_MONOTONIC), summarised."""
    every = [r for r in records if r.get("kind") == "execute" and len(r["t"]) >= 2 and t0 <= r["t"][0] <= t1]
    calls = [r for r in every if len(r["t"]) == 4]  # a link's batch with nothing to run has no phases
    if not calls:
        return {}
    window = (t1 - t0) / 1e9
    out = {"calls_per_s": len(every) / window, "samples_per_call": statistics.mean(r["n"] for r in every),
           "busy": sum(r["t"][-1] - r["t"][0] for r in every) / (t1 - t0)}
    for name, a, b in (("read", 0, 1), ("run", 1, 2), ("respond", 2, 3), ("execute", 0, 3)):
        out[f"{name}_ms"] = _median([(r["t"][b] - r["t"][a]) / 1e6 for r in calls])
    laps: dict[str, list[float]] = {}
    for r in calls:
        for name, ns in step_laps(r):
            laps.setdefault(name, []).append(ns / 1e6)
    out.update({f"{k}_ms": _median(v) for k, v in laps.items()})
    by_process: dict[str, list[dict[str, Any]]] = {}
    for r in calls:
        by_process.setdefault(str(r.get("process")), []).append(r)
    gaps = [(b["t"][0] - a["t"][3]) / 1e6 for rs in by_process.values() for a, b in zip(rs, rs[1:], strict=False)]
    out["gap_ms"] = _median(gaps)
    out["gpu_ms"] = _median([float(r["gpu_ms"]) for r in calls if "gpu_ms" in r])
    return out


def write_report(res: dict[str, Any], path: Path) -> None:
    L = [f"# Blocks under load — {res['device']}", "",
         f"Plan `{res['plan']}`, task `{res['task']}`, {res['precision']}, commit {res['commit']}, {res['date']}; "
         f"MPS {'on' if res['mps'] else 'off'}; perf_analyzer over HTTP, batch 1, concurrency {res['concurrency']}"
         + (f" on {res['client_threads']} client threads" if res.get("client_threads") else "") + ", "
         f"one {res['seconds']:g} s window per input path; tracing on.", "",
         "*samples/call*: from the block's trace (a link's batches included; Triton's count without a trace); "
         "*busy*: share of the window the block's `execute` (a link: its batch) ran; *gap*: one call's return to the same process's next; "
         "Triton's *input* / *infer* / *output*: ms per execution (server side before the stub, the stub round trip, "
         "server side after it); *queue*: ms per request.", ""]
    for key, run in res["runs"].items():
        pa = run["perf_analyzer"]
        L += [f"## {key}: {pa.get('throughput', float('nan')):.0f}/s, p50 {pa.get('p50_ms', float('nan')):.2f} ms", "",
              "| block | calls/s | samples/call | busy | execute ms | gap ms | Triton input | infer | output | queue |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for block, b in run["blocks"].items():
            tr, tc = b["triton"], b["trace"]
            L.append(f"| {block} | {tc.get('calls_per_s', 0):.0f} | {tc.get('samples_per_call', tr['samples_per_execution']):.1f} | {tc.get('busy', 0):.0%} | "
                     f"{tc.get('execute_ms', float('nan')):.3f} | {tc.get('gap_ms', float('nan')):.3f} | "
                     f"{tr['compute_input_ms']:.3f} | {tr['compute_infer_ms']:.3f} | {tr['compute_output_ms']:.3f} | "
                     f"{tr['queue_ms_per_request']:.3f} |")
        steps = sorted({k for b in run["blocks"].values() for k in b["trace"] if ":" in k})
        if steps:
            L += ["", "Steps inside `execute` (median ms): " + "; ".join(
                f"{block} " + ", ".join(f"{k[:-3]} {b['trace'][k]:.3f}" for k in steps if k in b["trace"])
                for block, b in run["blocks"].items() if any(k in b["trace"] for k in steps))]
        L.append("")
    path.write_text("\n".join(L) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50.yaml"))
    ap.add_argument("--precision", default=None, help="serve every block in this precision (default: the plan's)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--input", default="host,cuda-shm", help=f"comma-separated client input paths ({', '.join(INPUTS)})")
    ap.add_argument("--mps", action="store_true", help="serve under a private MPS daemon")
    ap.add_argument("--client-threads", type=int, default=0,
                    help="perf_analyzer sends asynchronously from this many threads (as `blockflow bench --client-threads`)")
    args = ap.parse_args()
    inputs = [i for i in args.input.split(",") if i]
    if unknown := [i for i in inputs if i not in INPUTS]:
        ap.error(f"unknown --input {', '.join(unknown)}; choose from {', '.join(INPUTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    plan = split_and_graph(load_plan(args.plan), args.precision)
    task = next(iter(plan.tasks.values()))
    c, h, w = plan.block_in_shape(plan.blocks[task.path[0]])
    shape = f"IMAGE:{c},{h},{w}"
    models = {k: v for k, v in task_models(plan, task.name).items() if k in ("monolithic-graph", "tensormq")}
    trace = Path(tempfile.mkdtemp(prefix="bench-load-trace-"))
    windows: dict[str, tuple[int, int, dict[str, Any], dict[str, dict[str, float]], list[str]]] = {}
    opts = ServerOptions.on_free_ports([rendered(plan, "bench-load-")], env={TRACE_DIR: str(trace)}, mps=args.mps)
    with TritonServer(opts) as server:
        for inp in inputs:
            for label, m in models.items():
                stages = m["blocks"] or [m["model"]]
                # A window first, so every graph, mapping and pool is warm before the measured one.
                perf_analyzer(server.http_url, m["model"], shape, 1, 1.0, args.concurrency, input_memory=inp, output_bytes=400_000,
                              shm_key_file=server.shm_key_file, client_threads=args.client_threads)
                before, t0 = model_stats(server.http_url), time.monotonic_ns()
                pa = perf_analyzer(server.http_url, m["model"], shape, 1, args.seconds, args.concurrency, input_memory=inp,
                                   output_bytes=400_000, shm_key_file=server.shm_key_file, client_threads=args.client_threads)
                t1, d = time.monotonic_ns(), delta(model_stats(server.http_url), before)
                windows[f"{label}, {inp} inputs"] = (t0, t1, pa, {s: phases_per_execution(d[s]) for s in stages}, stages)
                print(f"[load_anatomy] {label}, {inp}: {pa}", flush=True)
    traces = read_traces(trace)  # complete once the server has unloaded its models (finalize flushes)
    res: dict[str, Any] = {"device": device_name(), "plan": str(args.plan), "task": task.name, "precision": plan.task_precision(task),
                           "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mps": args.mps,
                           "concurrency": args.concurrency, "client_threads": args.client_threads, "seconds": args.seconds, "runs": {}}
    for key, (t0, t1, pa, phases, stages) in windows.items():
        res["runs"][key] = {"perf_analyzer": pa, "blocks": {s: {"triton": phases[s], "trace": block_window(traces.get(s, []), t0, t1)}
                                                            for s in stages}}
    (args.out / "load_anatomy.json").write_text(json.dumps(res, indent=2))
    write_report(res, args.out / "load_anatomy.md")
    print((args.out / "load_anatomy.md").read_text())


if __name__ == "__main__":
    main()
