"""Transports side by side: one server, every transport variant of a task and its monolithic references.

For each model it runs ``perf_analyzer`` (batch 1 and 8 at concurrency 1, and batch 1 at
concurrency 32) and reads Triton's per-model statistics around each run, so the report
splits an ensemble's latency into block compute and per-hop overhead.

    python -m blockflow.bench.lab.transports --plan plans/bench_r50.yaml --out bench/results/h100
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from blockflow.bench.harness import rendered
from blockflow.bench.perf_analyzer import perf_analyzer
from blockflow.bench.triton_stats import block_breakdown, compute_ms, delta, model_stats
from blockflow.plan import load_plan, naming
from blockflow.triton.server import ServerOptions, TritonServer

CONFIGS = [("b1-c1", 1, 1), ("b8-c1", 8, 1), ("b1-c32", 1, 32)]


def perf(url: str, model: str, shape: str, batch: int, concurrency: int, seconds: int) -> dict[str, Any]:
    return perf_analyzer(url, model, shape, batch, seconds, concurrency=concurrency)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plan", default="plans/bench_r50.yaml")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=int, default=3, help="perf_analyzer measurement window")
    ap.add_argument("--quick", action="store_true", help="batch 1, concurrency 1 only")
    args = ap.parse_args()
    plan = load_plan(args.plan)
    task = next(iter(plan.tasks.values()))
    c, h, w = plan.block_in_shape(plan.blocks[task.path[0]])
    shape = f"IMAGE:{c},{h},{w}"
    variants: dict[str, str] = {str(tr): naming.task_model(task.name, tr, task.transport) for tr in plan.transports_of(task)}
    refs = {f"monolithic-{v}": naming.reference_model(task.name, v == "graph") for v in plan.raw.references}
    blocks = {str(tr): [naming.block_model(b, tr, plan.transport) for b in task.path] for tr in plan.transports_of(task)}
    repo = rendered(plan, "bench-repo-")
    opts = ServerOptions.on_free_ports([repo])
    results: dict[str, Any] = {"plan": str(args.plan), "task": task.name, "path": list(task.path), "runs": {}}
    configs = CONFIGS[:1] if args.quick else CONFIGS
    with TritonServer(opts) as server:
        try:
            import torch

            results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        except ImportError:
            results["device"] = "?"
        models: dict[str, str] = {**refs, **variants}
        for label, batch, conc in configs:
            for name, model in models.items():
                before = model_stats(server.http_url)
                r: dict[str, Any] = dict(perf(server.http_url, model, shape, batch, conc, args.seconds))
                d = delta(model_stats(server.http_url), before)
                if name in refs:
                    r["compute_ms"] = compute_ms(d.get(model, {}))
                if name in blocks:
                    per_block = block_breakdown(d, blocks[name], batch)
                    r["blocks"] = per_block
                    if conc == 1 and "p50_ms" in r:
                        compute = float(sum(float(b["compute_ms"]) for b in per_block))
                        r["block_compute_ms"] = compute
                        r["overhead_per_hop_ms"] = (r["avg_ms"] - compute) / len(per_block)
                        mono = results["runs"].get(label, {}).get("monolithic-graph") or r.get("_mono")
                        if mono and "compute_ms" in mono and len(per_block) > 1:
                            # What the extra ensemble steps cost: the task's non-compute time beyond the
                            # monolithic model's (which pays the request's own HTTP and step overhead once).
                            extra = (r["avg_ms"] - compute) - (mono["avg_ms"] - mono["compute_ms"])
                            r["overhead_per_extra_hop_ms"] = extra / (len(per_block) - 1)
                results["runs"].setdefault(label, {})[name] = r
                print(f"[bench] {label:7s} {name:20s} {json.dumps({k: round(v, 3) for k, v in r.items() if isinstance(v, float)})}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transports.json").write_text(json.dumps(results, indent=2))
    write_report(results, args.out)


def write_report(res: dict[str, Any], out: Path) -> None:
    lines = [f"# Transports side by side — {res['device']}", "",
             f"`python -m blockflow.bench.lab.transports --plan {res['plan']}`: one server; task `{res['task']}` = "
             f"{' → '.join(res['path'])} on every transport, and its monolithic references. perf_analyzer over HTTP; "
             "latencies in ms. Compute = Triton's compute input+infer+output per execution. "
             "'non-compute / block' = (average latency − Σ block compute) / blocks; 'per extra hop' = (that non-compute time "
             "− the monolithic CUDA-graph model's non-compute time) / (blocks − 1): what each additional ensemble step costs.", ""]
    for label, runs in res["runs"].items():
        lines += [f"## {label}", "", "| model | p50 | p99 | avg | throughput (inf/s) | Σ compute | non-compute / block | per extra hop vs monolithic |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in runs.items():
            if "error" in r:
                lines.append(f"| {name} | failed | | | | | |")
                continue
            comp = r.get("block_compute_ms", r.get("compute_ms"))
            cells = [f"{comp:.3f}" if comp is not None else "-"]
            cells += [f"{r[k]:.3f}" if k in r else "-" for k in ("overhead_per_hop_ms", "overhead_per_extra_hop_ms")]
            lines.append(f"| {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['avg_ms']:.3f} | {r['throughput']:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    b1 = res["runs"].get("b1-c1", {})
    if {"tensormq", "triton-gpu", "monolithic-graph"} <= set(b1) and all("p50_ms" in b1[k] for k in ("tensormq", "triton-gpu", "monolithic-graph")):
        t, g, m = b1["tensormq"]["p50_ms"], b1["triton-gpu"]["p50_ms"], b1["monolithic-graph"]["p50_ms"]
        lines += ["## Targets (issue 5)", "",
                  f"- tensormq p50 / monolithic CUDA graph p50 = {t / m:.2f} (target ≤ 1.3)",
                  f"- tensormq p50 / triton-gpu p50 = {t / g:.2f} (target ≤ 0.7)",
                  f"- tensormq cost per extra hop beyond block compute, against the monolithic model's request overhead = "
                  f"{b1['tensormq'].get('overhead_per_extra_hop_ms', float('nan')):.3f} ms; triton-gpu "
                  f"{b1['triton-gpu'].get('overhead_per_extra_hop_ms', float('nan')):.3f} ms (target ≤ 0.30)"]
        sat = res["runs"].get("b1-c32", {})
        if "tensormq" in sat and "monolithic-graph" in sat and "throughput" in sat["tensormq"]:
            lines.append(f"- throughput at concurrency 32: tensormq {sat['tensormq']['throughput']:.0f} vs monolithic graph "
                         f"{sat['monolithic-graph'].get('throughput', float('nan')):.0f} inf/s (target ≥ 1×)")
    (out / "transports.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
