"""A thesis scenario on a real server: GPU memory and latency, BlockFlow vs one full model per task.

    python -m bench.scenarios --arch resnet50 --scenario 1 --tasks 18 --out bench/results/h100/scenario1_r50_n18

The scenario's tasks (thesis Table 4.4: class A runs a whole network of its own, B shares
stages 0-1, C shares stages 0-2) are deployed three ways, one server at a time, on GPU 0:

* ``traditional``: one full model per task;
* ``fused``: BlockFlow with ``fuse: auto``;
* ``packed``: BlockFlow with ``fuse: auto`` and ``pack: heads``.

For each: GPU 0's used memory with the server loaded minus before (NVML), next to what
``blockflow plan-memory`` predicts with the calibrated constants; then closed-loop clients
(``blockflow load``'s generator) over all the tasks, round-robin, batch 1, for throughput and
latency. Writes ``report.md``, ``results.json`` and the plans it served (``plans/``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("traditional", "fused", "packed")


def scenario_plans(arch: str, number: int, n_tasks: int, out: Path) -> dict[str, Path]:
    """The three deployments of the scenario as plan files under ``out``."""
    from blockflow import memory

    shares = memory.SCENARIOS[number]
    raws = {"traditional": memory.scenario_raw(arch, n_tasks, (1.0, 0.0, 0.0), fuse=True),
            "fused": memory.scenario_raw(arch, n_tasks, shares, fuse=True),
            "packed": memory.scenario_raw(arch, n_tasks, shares, fuse=True, pack=True)}
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, raw in raws.items():
        paths[name] = out / f"{arch}_scenario{number}_n{n_tasks}_{name}.yaml"
        paths[name].write_text(f"# bench.scenarios: thesis scenario {number} {shares}, {n_tasks} tasks, deployed {name}\n"
                               + yaml.safe_dump(raw, sort_keys=False))
    return paths


def _gpu_used_mib() -> float:
    """GPU 0's used memory (NVML), or NaN on a machine without one (a dry run of the load part)."""
    from bench.memory import _gpu_used_mib as used

    try:
        return used()
    except Exception:  # pynvml raises its own error classes when there is no driver
        return float("nan")


def run_variant(path: Path, cuda_pool_mb: int, clients: list[int], seconds: float) -> dict[str, Any]:
    """Serve ``path`` alone; measured memory and, per client count, the load summary over all tasks."""
    from blockflow.plan import load_plan
    from blockflow.server import ServerOptions, TritonServer, free_port
    from clients.load import LoadSpec, run_load, summarize
    from ensemble_gen import generator

    plan = load_plan(path)
    repo = Path(tempfile.mkdtemp(prefix="bench-scenario-"))
    generator.write(generator.render(plan), repo)
    shape = plan.block_in_shape(plan.blocks[next(iter(plan.tasks.values())).path[0]])
    before = _gpu_used_mib()
    opts = ServerOptions([repo], http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), cuda_pool_mb=cuda_pool_mb)
    t0 = time.monotonic()
    with TritonServer(opts) as server:
        load_s = time.monotonic() - t0
        time.sleep(3)
        during = _gpu_used_mib()
        stubs = {m: len(p) for m, p in server.stub_processes().items()}
        tasks = list(plan.tasks)
        # Every task once first: no measured request pays a first call.
        asyncio.run(run_load(LoadSpec(server.http_url, tasks, shape, clients=len(tasks), max_requests=2 * len(tasks),  # type: ignore[arg-type]
                                      duration_s=60.0)))
        loads = {}
        for c in clients:
            spec = LoadSpec(server.http_url, tasks, shape, duration_s=seconds, clients=c)  # type: ignore[arg-type]
            start = time.monotonic()
            records = asyncio.run(run_load(spec))
            loads[str(c)] = summarize(records, time.monotonic() - start)["all"]
            print(f"[scenarios] {path.stem}: {c} clients: {loads[str(c)]['throughput']:.0f}/s, "
                  f"p50 {loads[str(c)]['p50']:.2f} ms, p99 {loads[str(c)]['p99']:.2f} ms, errors {loads[str(c)]['errors']:.0f}", flush=True)
    time.sleep(3)
    return {"plan": f"plans/{path.name}", "processes": sum(stubs.values()), "measured_mib": during - before, "load_s": load_s, "load": loads}


def write_report(res: dict[str, Any], path: Path) -> None:
    trad = res["variants"]["traditional"]["measured_mib"]
    L = [f"# Thesis scenario {res['scenario']} ({res['shares']}), {res['arch']}, {res['tasks']} tasks — {res['device']}", "",
         f"Command: `{res['command']}`. One server at a time on GPU 0; memory is NVML's used memory with the server "
         "loaded minus before (the server and its CUDA pool included). Predicted: `blockflow plan-memory` with "
         f"{res['calibration']}.", "",
         "| deployment | processes | measured MiB | predicted MiB | error | measured saving vs traditional | load time s |",
         "|---|---|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        L.append(f"| {name} | {v['processes']} | {v['measured_mib']:,.0f} | {v['predicted_mib']:,.0f} | "
                 f"{v['predicted_mib'] / v['measured_mib'] - 1:+.1%} | {1 - v['measured_mib'] / trad:+.1%} | {v['load_s']:.0f} |")
    L += ["", "Closed-loop clients over all tasks (round-robin), batch 1:", "",
          "| deployment | clients | inferences/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        for c, s in v["load"].items():
            L.append(f"| {name} | {c} | {s['throughput']:.0f} | {s['p50']:.2f} | {s['p99']:.2f} | {s['errors']:.0f} |")
    path.write_text("\n".join(L) + "\n")


def main() -> None:
    import shlex
    import sys

    import torch

    from blockflow import memory
    from blockflow.plan import load_plan

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["resnet50", "resnet152"], default="resnet50")
    ap.add_argument("--scenario", type=int, choices=sorted(memory.SCENARIOS), default=1)
    ap.add_argument("--tasks", type=int, default=18)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--clients", default="1,16", help="closed-loop client counts")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--cuda-pool-mb", type=int, default=2048)
    ap.add_argument("--calibration", type=Path, default=ROOT / "bench" / "results" / "h100" / "memory_calibration.json")
    args = ap.parse_args()
    cal = memory.Calibration.load(args.calibration)
    paths = scenario_plans(args.arch, args.scenario, args.tasks, args.out / "plans")
    res: dict[str, Any] = {"arch": args.arch, "scenario": args.scenario, "shares": [round(x, 3) for x in memory.SCENARIOS[args.scenario]],
                           "tasks": args.tasks, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                           "command": "python -m bench.scenarios " + shlex.join(sys.argv[1:]),
                           "calibration": f"{cal.source} (process {cal.process_mib:.0f} MiB)", "variants": {}}
    for name in args.variants.split(","):
        v = run_variant(paths[name], args.cuda_pool_mb, [int(c) for c in args.clients.split(",")], args.seconds)
        plan = load_plan(paths[name])
        v["predicted_mib"] = memory.per_gpu(memory.modular(plan, 1, cal), 1, cal, args.cuda_pool_mb)[0]
        print(f"[scenarios] {name}: {v['processes']} processes, measured {v['measured_mib']:.0f} MiB, "
              f"predicted {v['predicted_mib']:.0f} MiB", flush=True)
        res["variants"][name] = v
        (args.out / "results.json").write_text(json.dumps(res, indent=2))
    if "traditional" in res["variants"]:
        write_report(res, args.out / "report.md")
        print((args.out / "report.md").read_text())


if __name__ == "__main__":
    main()
