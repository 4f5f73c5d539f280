"""What the block monitor costs: p50 latency of the same task with the monitor on and off.

One server runs plans/bench_monitor.yaml (the task twice, on separate blocks; the monitor
samples at its default period, 2 s, on one copy and is off on the other). perf_analyzer
measures the two in turns (``--rounds`` times each, batch 1, concurrency 1), so drifts of
the machine hit both alike; the report gives each round and the median ratio.

    python -m blockflow.bench.monitor_overhead --out bench/results/h100
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from blockflow.bench.harness import rendered
from blockflow.bench.perf_analyzer import perf_analyzer
from blockflow.plan import load_plan
from blockflow.triton.server import ServerOptions, TritonServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plan", default="plans/bench_monitor.yaml")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=4, help="perf_analyzer measurement window")
    args = ap.parse_args()
    plan = load_plan(args.plan)
    c, h, w = plan.block_in_shape(plan.blocks[plan.tasks["monitored"].path[0]])
    repo = rendered(plan, "bench-monitor-")
    opts = ServerOptions.on_free_ports([repo])
    rounds: list[dict[str, Any]] = []
    with TritonServer(opts) as server:
        for task in ("monitored", "unmonitored"):  # warm both before measuring
            perf_analyzer(server.http_url, task, f"IMAGE:{c},{h},{w}", 1, 2, concurrency=1)
        for i in range(args.rounds):
            row: dict[str, Any] = {"round": i + 1}
            for task in (("monitored", "unmonitored") if i % 2 == 0 else ("unmonitored", "monitored")):
                row[task] = perf_analyzer(server.http_url, task, f"IMAGE:{c},{h},{w}", 1, args.seconds, concurrency=1)
            rounds.append(row)
            print(f"[monitor] round {i + 1}: on {row['monitored'].get('p50_ms')} ms, off {row['unmonitored'].get('p50_ms')} ms", flush=True)
    ok = [r for r in rounds if "p50_ms" in r["monitored"] and "p50_ms" in r["unmonitored"]]
    ratios = [r["monitored"]["p50_ms"] / r["unmonitored"]["p50_ms"] for r in ok]
    import torch

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "rounds": rounds,
              "median_ratio": statistics.median(ratios) if ratios else None,
              "median_p50_on_ms": statistics.median(r["monitored"]["p50_ms"] for r in ok) if ok else None,
              "median_p50_off_ms": statistics.median(r["unmonitored"]["p50_ms"] for r in ok) if ok else None}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "monitor_overhead.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Block monitor overhead — {result['device']}", "",
             "Same 4-block ResNet-50 task (tensormq, CUDA graphs, batch 1, concurrency 1), monitor at its default period (2 s) vs off,",
             "measured in alternating turns in one server (`python -m blockflow.bench.monitor_overhead`).", "",
             "| round | p50 on (ms) | p50 off (ms) | on/off |", "|---|---|---|---|"]
    for r in ok:
        lines.append(f"| {r['round']} | {r['monitored']['p50_ms']:.3f} | {r['unmonitored']['p50_ms']:.3f} | "
                     f"{r['monitored']['p50_ms'] / r['unmonitored']['p50_ms']:.3f} |")
    if ratios:
        lines += ["", f"Median p50: on {result['median_p50_on_ms']:.3f} ms, off {result['median_p50_off_ms']:.3f} ms; "
                      f"median ratio {result['median_ratio']:.3f} (overhead {100 * (result['median_ratio'] - 1):+.1f}%)."]
    (args.out / "monitor_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
