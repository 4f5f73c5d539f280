"""Where one request's time goes, block by block: host timestamps and GPU times, one request at a time.

    python -m blockflow.bench.timeline --plan plans/bench_r50.yaml --out bench/results/h100 [--requests 300] [--precision fp16] [--mps]

Starts one server with ``BLOCKFLOW_TRACE_DIR`` set (see backend/trace.py), sends sequential
batch-1 requests to every model of the plan's first task (the monolithic references and each
transport's ensemble), and lines up each request's client send/receive times with every
block's ``execute`` timestamps (CLOCK_MONOTONIC is shared by all processes). Medians of:

- client → first block: HTTP, Triton's ensemble scheduler, the first block's queue;
- in each block: reading inputs, queuing (or running) the work, building responses;
- block → next block: from one ``execute``'s answer (its return, or the response it sent before
  queuing its work) to the next one's entry (Triton's ensemble step, the Python backend's
  messages, the dynamic batcher's queue);
- last block → client: the response path;
- each block's GPU time (CUDA events around its own kernels).

Writes ``timeline.json`` and ``timeline.md``. Compare rows within one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, get_args

from blockflow.bench.harness import commit, device_name, rendered, switches, task_images
from blockflow.bench.plans import in_precision, task_models
from blockflow.bench.report import named_switches
from blockflow.bench.triton_stats import block_breakdown, delta, model_stats
from blockflow.core.env import TRACE_DIR as TRACE_ENV
from blockflow.core.spec import Precision
from blockflow.plan import load_plan
from blockflow.triton.server import ServerOptions, TritonServer


def _client_times(url: str, model: str, x: Any, n: int, warmup: int) -> list[tuple[int, int]]:
    import numpy as np
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url, connection_timeout=60.0, network_timeout=600.0)
    inp = httpclient.InferInput("IMAGE", list(x.shape), "BYTES" if x.dtype == object else "UINT8" if x.dtype == np.uint8 else "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    times = []
    for i in range(warmup + n):
        t0 = time.perf_counter_ns()
        client.infer(model, [inp])  # every output it answers with (LOGITS, or a detector's)
        t1 = time.perf_counter_ns()
        if i >= warmup:
            times.append((t0, t1))
        time.sleep(0.002)  # a pause between requests, as every figure of this bench has had
    client.close()
    return times


def read_traces(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """Model name -> its trace records (all instances, each with the ``process`` whose file it is in), in time order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in directory.glob("*.jsonl"):
        model = path.name.split(".")[0]
        for line in path.read_text().splitlines():
            if line.strip():
                out.setdefault(model, []).append({**json.loads(line), "process": path.name})
    for records in out.values():
        records.sort(key=lambda r: r["t"][0] if isinstance(r["t"], list) else r["t"])
    return out


def step_laps(record: dict[str, Any]) -> list[tuple[str, int]]:
    """The named steps inside one traced ``execute``, in ns: each lap ends a step that began at the
    boundary (phase mark or earlier lap) just before it."""
    bounds = sorted([*record["t"], *(t for _, t in record.get("laps", []))])
    return [(name, t - max(b for b in bounds if b < t)) for name, t in record.get("laps", [])]


def answered(record: dict[str, Any]) -> int:
    """When a traced ``execute`` answered its request: its *run:reply* lap (a block that answered with its
    tickets before queuing its work), else its return."""
    return int(next((t for name, t in record.get("laps", []) if name == "run:reply"), record["t"][3]))


def handed_to(record: dict[str, Any], sent: int) -> int:
    """When a block took what the block before it sent at ``sent``: its entry; or, for a block that entered
    before that (a chain's join, whose request the ensemble gives it as soon as the head answers), the end
    of its *read:decode* lap, where it got the hand-over it waited for."""
    if record["t"][0] >= sent:
        return int(record["t"][0])
    got = next((t for name, t in record.get("laps", []) if name == "read:decode"), None)
    return int(got if got is not None and got > sent else record["t"][0])


def _match(execs: list[dict[str, Any]], window: tuple[int, int]) -> dict[str, Any] | None:
    hits = [e for e in execs if window[0] <= e["t"][0] <= window[1] and len(e["t"]) == 4]
    return hits[0] if len(hits) == 1 else None


def anatomy(times: list[tuple[int, int]], stages: list[str], traces: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median milliseconds of each part of a request's path through ``stages``."""
    execs = {s: [r for r in traces.get(s, []) if r.get("kind") == "execute"] for s in stages}
    parts: dict[str, list[float]] = {}

    def add(key: str, ns: float) -> None:
        parts.setdefault(key, []).append(ns / 1e6)

    matched = 0
    for send, recv in times:
        hits = [_match(execs[s], (send, recv)) for s in stages]
        if any(h is None for h in hits):
            continue
        matched += 1
        add("end_to_end", recv - send)
        add("client_to_first", hits[0]["t"][0] - send)  # type: ignore[index]
        for i, (stage, h) in enumerate(zip(stages, hits, strict=True)):
            assert h is not None
            t = h["t"]
            add(f"{stage}.read", t[1] - t[0])
            add(f"{stage}.run", t[2] - t[1])
            add(f"{stage}.respond", t[3] - t[2])
            add(f"{stage}.execute", t[3] - t[0])
            if "gpu_ms" in h:
                parts.setdefault(f"{stage}.gpu", []).append(float(h["gpu_ms"]))
            for name, ns in step_laps(h):
                add(f"{stage}.{name}", ns)
            if i + 1 < len(stages):
                sent = answered(h)
                add(f"{stage}.hop", handed_to(hits[i + 1], sent) - sent)  # type: ignore[arg-type]
        add("last_to_client", recv - hits[-1]["t"][3])  # type: ignore[index]
    return {"requests": len(times), "matched": matched,
            "median_ms": {k: statistics.median(v) for k, v in parts.items()},
            "p90_ms": {k: sorted(v)[int(0.9 * (len(v) - 1))] for k, v in parts.items()}}


def step_order(stages: list[str], medians: dict[str, float]) -> list[str]:
    """The parts of ``medians`` in a request's order: each block's phases with their steps, the hop after it."""
    order = ["client_to_first"]
    for s in stages:
        read, run, respond = ([k for k in medians if k.startswith(f"{s}.{phase}:")] for phase in ("read", "run", "respond"))  # in step order
        order += [f"{s}.read", *read, f"{s}.run", *run, f"{s}.respond", *respond, f"{s}.execute", f"{s}.gpu", f"{s}.hop"]
    return [k for k in [*order, "last_to_client", "end_to_end"] if k in medians]


def write_report(res: dict[str, Any], path: Path) -> None:
    warm = f"{res['warm_cores_ms']:g} ms" if res.get("warm_cores_ms") else "off"
    L = [f"# Request anatomy — {res['device']}", "",
         f"Plan `{res['plan']}`, task `{res['task']}`, {res.get('precision', 'precision not recorded')}, commit {res.get('commit', '?')}; warm cores {warm}; "
         f"MPS {'on' if res.get('mps') else 'off'}; "
         + named_switches(res)
         + f"{res['requests']} sequential batch-1 HTTP requests per model after a warm-up; medians in ms (host clock, CLOCK_MONOTONIC, shared by all processes).", "",
         "Per block: *read* = inputs decoded, *run* = work queued (or run and synced, where the transport syncs), "
         "*respond* = responses built; *hop* = that block's answer (its return, or the end of *run:reply*) → the next block's "
         "entry (a chain's join, entered before the hand-over, to the end of its *read:decode*: when it got it); *gpu* = CUDA events "
         "around the block's own kernels; *read:X*, *run:X* = steps inside a phase, each from the step before "
         "(TensorMQ: *read:input* the request's tickets; for the first ticket *read:decode* its MAC and fields, "
         "*read:claim* checked and claimed, *read:wait* the stream made to wait on its slot; *read:gather* the "
         "views; *run:reserve* the pool slot; *run:reply* the response sent with the tickets before the work is "
         "queued (a call of one request), until the server has passed it on: one round trip; in a CUDA graph's run *run:checks*, "
         "*run:copy_in* (for a first block with host inputs, the image out of Triton's shared memory: queued as a DMA once that is page-locked), *run:replay*; "
         "*run:graph* the rest of the block into the slot; *run:event* the slot's event; *run:commit* its "
         "claim entry and tickets; *respond:release* the releases of the slots it read handed to its release "
         "thread, *respond:prepare* its preparer thread woken, *respond:settle* a first block's wait for its image's DMA). Traced calls carry their laps and two CUDA event records; "
         "traces before commit e80d901 also carried the tracer's own reading and writing, ~0.1 ms a call.", ""]
    for label, r in res["models"].items():
        m = r["median_ms"]
        L += [f"## {label} (`{r['model']}`): end to end {m.get('end_to_end', float('nan')):.3f} ms "
              f"({r['matched']}/{r['requests']} requests matched)", "",
              "| part | median ms | p90 ms |", "|---|---|---|"]
        for k in step_order(r["stages"], m):
            L.append(f"| {k} | {m[k]:.3f} | {r['p90_ms'][k]:.3f} |")
        if r.get("triton"):
            L += ["", "Triton's statistics over the same requests (per request): "
                  + ", ".join(f"{b['block']} queue {b['queue_ms']:.3f} / compute {b['compute_ms']:.3f}" for b in r["triton"])]
        L.append("")
    path.write_text("\n".join(L) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50.yaml"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--warm-cores-ms", type=float, default=0.0,
                    help="keep the CPUs out of idle this long after each block call (as blockflow serve --warm-cores-ms)")
    ap.add_argument("--precision", choices=get_args(Precision), help="every block in this precision instead of the plan's")
    # A value as well as a flag, so that traced turns can set it per turn (--option=--mps --values off,on).
    ap.add_argument("--mps", nargs="?", const="on", default="off", choices=("on", "off"),
                    help="block processes as clients of a private MPS daemon (as blockflow serve --mps); --mps alone is on")
    args = ap.parse_args()
    mps = args.mps == "on"
    args.out.mkdir(parents=True, exist_ok=True)
    plan = load_plan(args.plan)
    if args.precision is not None:
        plan = in_precision(plan, args.precision)
    task = next(iter(plan.tasks.values()))
    x = task_images(plan, task.name, 1)
    models = task_models(plan, task.name)
    repo = rendered(plan, "bench-timeline-")
    trace = Path(tempfile.mkdtemp(prefix="bench-trace-"))
    runs: dict[str, Any] = {}
    # Every block process traces its calls.
    opts = ServerOptions.on_free_ports([repo], env={TRACE_ENV: str(trace)}, warm_cores_ms=args.warm_cores_ms, mps=mps)
    with TritonServer(opts) as server:
        for label, m in models.items():
            before = model_stats(server.http_url)
            runs[label] = {"model": m["model"], "times": _client_times(server.http_url, m["model"], x, args.requests, args.warmup)}
            runs[label]["triton"] = block_breakdown(delta(model_stats(server.http_url), before), m["blocks"], 1)
            print(f"[timeline] {label}: {args.requests} requests", flush=True)
    traces = read_traces(trace)  # complete once the server has unloaded its models (finalize flushes)
    res: dict[str, Any] = {"device": device_name(), "plan": str(args.plan), "task": task.name, "requests": args.requests,
                           "precision": plan.task_precision(task),
                           "warm_cores_ms": args.warm_cores_ms, "mps": mps, "switches": switches(), "commit": commit(), "models": {}}
    for label, m in models.items():
        stages = m["blocks"] or [m["model"]]
        a = anatomy(runs[label]["times"], stages, traces)
        res["models"][label] = {"model": m["model"], "stages": stages, "triton": runs[label]["triton"], **a}
    res["memory"] = {model: [r for r in recs if r.get("kind") == "memory"] for model, recs in traces.items()}
    (args.out / "timeline.json").write_text(json.dumps(res, indent=2))
    write_report(res, args.out / "timeline.md")
    print((args.out / "timeline.md").read_text())


if __name__ == "__main__":
    main()
