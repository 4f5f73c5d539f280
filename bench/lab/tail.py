"""Tail latency under open-loop (Poisson) load: where do the slow requests come from?

    python -m blockflow.bench.lab.tail --plan plans/bench_r50.yaml --rate 400 --seconds 8 --out DIR [--variants default,trace,nomonitor,mps]

The `rate` section of `blockflow bench` showed, on H100s, a p99 of ~120 ms for the 4-block
`tensormq` pipeline at half the monolithic model's peak rate, where the monolithic CUDA graph
stays under 20 ms. This serves the plan once per *variant* and, in each, sends Poisson arrivals
at ``--rate`` to each chosen model of the plan's first task, twice: with ``blockflow load``
(every request's send time and latency, so slow requests can be placed in time) and with
``perf_analyzer`` at the same rate (the figure the report shows). Variants change one thing each:

- ``default``: the plan as it is (only the chosen models' transports and references are served);
- ``trace``: ``BLOCKFLOW_TRACE_DIR`` set, so every block's ``execute`` calls are timed
  (backend/trace.py): slow executes (and their GPU time) tell apart from waits between them;
- ``nomonitor``: the block monitor off (``monitor_period_s: 0``: its NVML and psutil samples);
- ``mps``: the server's block processes under a private NVIDIA MPS daemon (no time-slicing
  between their CUDA contexts);
- ``gpulogits``: logits handed to Triton on the GPU (``BLOCKFLOW_LOGITS_ON_GPU=1``, the
  behaviour before blocks copied them to the host themselves; see backend/model.py).

Writes ``tail.json``, ``tail.md`` and ``tail.png`` (latency against send time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from blockflow.bench.harness import device_name, rendered
from blockflow.bench.perf_analyzer import perf_analyzer
from blockflow.bench.plans import task_models
from blockflow.bench.timeline import read_traces
from blockflow.bench.triton_stats import block_breakdown, delta, model_stats
from blockflow.clients.load import LoadSpec, run_load, write_csv
from blockflow.core import env as blockflow_env
from blockflow.core.env import TRACE_DIR as TRACE_ENV
from blockflow.plan import Plan, load_plan, parse_plan
from blockflow.triton.server import ServerOptions, TritonServer

VARIANTS = ("default", "trace", "nomonitor", "mps", "gpulogits")
SLOW_MS = 50.0  # a request this slow is counted as a stall (the monolithic graph's p99 is ~15-20 ms)


def _variant_plan(plan: Plan, variant: str, labels: list[str]) -> Plan:
    """``plan`` serving only its first task's models named in ``labels``, changed as ``variant`` says."""
    raw = plan.raw.model_dump(mode="json", exclude_none=True)
    first = next(iter(plan.tasks))
    raw["tasks"] = {first: raw["tasks"][first]}
    raw["compare"] = [t for t in raw.get("compare", []) if t in labels]
    raw["references"] = [r for r in raw.get("references", []) if f"monolithic-{r}" in labels]
    if variant == "nomonitor":
        raw.setdefault("defaults", {})["monitor_period_s"] = 0
    return parse_plan(raw, source=f"{plan.source} ({variant})", base_dir=plan.base_dir)


def _percentiles(ms: np.ndarray) -> dict[str, float]:  # type: ignore[type-arg]
    if not ms.size:
        return {}
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99)),
            "p999": float(np.percentile(ms, 99.9)), "max": float(ms.max()), "slow_share": float((ms > SLOW_MS).mean())}


def _executes(trace_dir: Path, blocks: list[str], t0_ns: int, t1_ns: int) -> dict[str, dict[str, float]]:
    """Per block: its execute calls within [t0, t1]: durations and GPU times (ms percentiles), and the
    median of each phase: reading inputs, queuing the work, building responses, and the gap from one
    call's return to the same process's next call (Triton's input copies, the stub's round trip)."""
    out: dict[str, dict[str, float]] = {}
    traces = read_traces(trace_dir)
    for b in blocks:
        rows = [r for r in traces.get(b, []) if r.get("kind") == "execute" and len(r["t"]) == 4 and t0_ns <= r["t"][0] <= t1_ns]
        if not rows:
            continue
        t = np.array([r["t"] for r in rows], dtype=np.int64)  # entry, inputs read, work queued, return (ns)
        dur = (t[:, 3] - t[:, 0]) / 1e6
        read, queue, respond = (float(x) for x in np.median(np.diff(t, axis=1), axis=0) / 1e6)
        gpu = np.array([float(r["gpu_ms"]) for r in rows if "gpu_ms" in r])
        by_process: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by_process.setdefault(r["process"], []).append(r)
        gaps = [(nxt["t"][0] - prev["t"][3]) / 1e6 for calls in by_process.values() for prev, nxt in pairwise(calls)]
        out[b] = {"executes": float(len(rows)), "mean_batch": float(np.mean([r.get("n", 1) for r in rows])),
                  "execute_p50": float(np.percentile(dur, 50)), "execute_p99": float(np.percentile(dur, 99)),
                  "execute_max": float(dur.max()), "read_p50": read, "queue_p50": queue, "respond_p50": respond,
                  **({"gap_p50": float(np.median(gaps))} if gaps else {}),
                  **({"gpu_p50": float(np.percentile(gpu, 50)), "gpu_p99": float(np.percentile(gpu, 99)), "gpu_max": float(gpu.max())}
                     if gpu.size else {})}
    return out


def run_variant(plan: Plan, variant: str, labels: list[str], rate: float, seconds: float, out: Path) -> dict[str, Any]:
    """Serve ``plan`` as ``variant`` says; per model label, the load's and perf_analyzer's view of ``rate``."""
    plan = _variant_plan(plan, variant, labels)
    task = next(iter(plan.tasks.values()))
    models = {k: v for k, v in task_models(plan, task.name).items() if k in labels}
    c, h, w = plan.block_in_shape(plan.blocks[task.path[0]])
    shape = f"IMAGE:{c},{h},{w}"
    repo = rendered(plan, "bench-tail-")
    trace = None if variant != "trace" else Path(tempfile.mkdtemp(prefix="bench-tail-trace-"))
    env = {TRACE_ENV: str(trace)} if trace else {}
    if variant == "gpulogits":
        env[blockflow_env.LOGITS_ON_GPU] = "1"
    opts = ServerOptions.on_free_ports([repo], mps=variant == "mps", env=env)
    with TritonServer(opts) as server:
        res: dict[str, Any] = {}
        for label, m in models.items():
            perf_analyzer(server.http_url, m["model"], shape, 1, 0.5, 1)  # warm-up
            spec = LoadSpec(server.http_url, [m["model"]], (c, h, w), duration_s=seconds, rate=rate)
            before = model_stats(server.http_url)
            t0 = time.perf_counter_ns()
            records = asyncio.run(run_load(spec))
            t1 = time.perf_counter_ns()
            time.sleep(0.5)  # Triton's statistics lag the responses
            stats = block_breakdown(delta(model_stats(server.http_url), before), m["blocks"] or [m["model"]], 1)
            write_csv(records, out / f"{variant}_{label}.csv")
            ms = np.array([r.latency_ms for r in records if r.ok])
            row: dict[str, Any] = {"model": m["model"], "requests": len(records), "errors": sum(not r.ok for r in records),
                                   "throughput": len(ms) / seconds, "load": _percentiles(ms), "blocks": stats,
                                   "series": [[round(r.sent_s, 4), round(r.latency_ms, 2)] for r in records if r.ok]}
            if trace:
                row["executes"] = _executes(trace, m["blocks"] or [m["model"]], t0, t1)
            pa = perf_analyzer(server.http_url, m["model"], shape, 1, 2.0, rate=rate)
            row["perf_analyzer"] = {k: pa[k] for k in ("p50_ms", "p99_ms", "throughput") if k in pa}
            res[label] = row
            print(f"[tail] {variant:9s} {label:16s} load p50 {row['load'].get('p50', float('nan')):7.2f} "
                  f"p99 {row['load'].get('p99', float('nan')):7.2f} max {row['load'].get('max', float('nan')):7.1f} ms, "
                  f">{SLOW_MS:.0f} ms {row['load'].get('slow_share', 0):.2%}; perf_analyzer p99 {pa.get('p99_ms', float('nan')):.2f}",
                  flush=True)
        return res


def write_report(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = [f"# Tail latency under Poisson arrivals — {res['device']}", "",
         f"Plan `{res['plan']}`, {res['rate']:g} requests/s for {res['seconds']:g} s per model (`blockflow load`, open loop), "
         f"then perf_analyzer at the same rate. Stall: a request over {SLOW_MS:g} ms. One server per variant; "
         "compare within this report.", "",
         "| variant | model | load p50 | p90 | p99 | p99.9 | max ms | stalls | perf_analyzer p50 / p99 ms | served/s |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for v, models in res["variants"].items():
        for label, r in models.items():
            q, pa = r["load"], r["perf_analyzer"]
            L.append(f"| {v} | {label} | {q.get('p50', 0):.2f} | {q.get('p90', 0):.2f} | {q.get('p99', 0):.2f} | {q.get('p999', 0):.2f} | "
                     f"{q.get('max', 0):.1f} | {q.get('slow_share', 0):.2%} | {pa.get('p50_ms', float('nan')):.2f} / "
                     f"{pa.get('p99_ms', float('nan')):.2f} | {r['throughput']:.0f} |")
    L += ["", "## Per block (Triton's mean queue and compute per request; traced execute calls: duration, its phases, "
          "the gap to the same process's next call, and GPU time, ms)", "",
          "| variant | model | block | queue | compute | executes | mean batch | execute p50 / p99 / max | read / queue / respond p50 "
          "| gap p50 | GPU p50 / p99 / max |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v, models in res["variants"].items():
        for label, r in models.items():
            ex = r.get("executes", {})
            names = [b["block"] for b in r["blocks"]] or list(ex)
            stats = {b["block"]: b for b in r["blocks"]}
            for b in names:
                s, e = stats.get(b, {}), ex.get(b, {})
                L.append(f"| {v} | {label} | {b} | {s.get('queue_ms', float('nan')):.2f} | {s.get('compute_ms', float('nan')):.2f} | "
                         f"{e.get('executes', 0):.0f} | {e.get('mean_batch', float('nan')):.2f} | "
                         f"{e.get('execute_p50', float('nan')):.2f} / {e.get('execute_p99', float('nan')):.2f} / {e.get('execute_max', float('nan')):.1f} | "
                         f"{e.get('read_p50', float('nan')):.2f} / {e.get('queue_p50', float('nan')):.2f} / {e.get('respond_p50', float('nan')):.2f} | "
                         f"{e.get('gap_p50', float('nan')):.2f} | "
                         f"{e.get('gpu_p50', float('nan')):.2f} / {e.get('gpu_p99', float('nan')):.2f} / {e.get('gpu_max', float('nan')):.1f} |")
    (out / "tail.md").write_text("\n".join(L) + "\n")
    variants = list(res["variants"])
    labels = sorted({label for models in res["variants"].values() for label in models})
    fig, axes = plt.subplots(len(variants), 1, figsize=(10, 2.6 * len(variants)), squeeze=False, sharex=True)
    for ax, v in zip(axes[:, 0], variants, strict=True):
        for label in labels:
            series = res["variants"][v].get(label, {}).get("series", [])
            if series:
                t, lat = zip(*series, strict=True)
                ax.scatter(t, lat, s=3, label=label)
        ax.set_yscale("log")
        ax.set_ylabel("latency ms")
        ax.set_title(f"{v}: {res['rate']:g}/s Poisson")
        ax.legend(loc="upper right", fontsize=7, markerscale=3)
    axes[-1, 0].set_xlabel("send time s")
    fig.tight_layout()
    fig.savefig(out / "tail.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50.yaml"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rate", type=float, default=400.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--variants", default="default,trace,nomonitor,mps")
    ap.add_argument("--models", default="tensormq,triton-gpu,monolithic-graph", help="model labels of bench (see blockflow bench)")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    plan = load_plan(args.plan)
    labels = [m for m in args.models.split(",") if m]
    served = task_models(plan, next(iter(plan.tasks)))
    missing = sorted(set(labels) - set(served))
    if missing:
        ap.error(f"model(s) {missing} are not in {args.plan}'s first task; it has {', '.join(served)}")
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"plan": str(args.plan), "rate": args.rate, "seconds": args.seconds, "variants": {}, "device": device_name()}
    for v in variants:
        res["variants"][v] = run_variant(plan, v, labels, args.rate, args.seconds, args.out)
        (args.out / "tail.json").write_text(json.dumps(res))
    write_report(res, args.out)
    print((args.out / "tail.md").read_text())


if __name__ == "__main__":
    main()
