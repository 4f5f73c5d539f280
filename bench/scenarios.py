"""A thesis scenario on a real server: GPU memory and latency, BlockFlow vs one full model per task.

    python -m blockflow.bench.scenarios --arch resnet50 --scenario 1 --tasks 18 --out bench/results/h100/scenario1_r50_n18

The scenario's tasks (thesis Table 4.4: class A runs a whole network of its own, B shares
stages 0-1, C shares stages 0-2) are deployed three ways, one server at a time, on GPU 0:

* ``traditional``: one full model per task;
* ``fused``: BlockFlow with ``fuse: auto``;
* ``packed``: BlockFlow with ``fuse: auto`` and ``pack: heads``;
* ``packed2`` (only when asked for): ``packed`` with two instances of each pack, for the
  throughput that a second process per pack buys.

For each: GPU 0's used memory with the server loaded minus before (NVML), next to what
``blockflow plan-memory`` predicts with the calibrated constants; then closed-loop clients
(``blockflow load``'s generator) over all the tasks, round-robin, batch 1, for throughput and
latency, with the busiest models during each load from Triton's statistics (where the time
goes). Before the load, every task's answers at batch 1 and 3 are compared with its unsplit fp32
model run in this process (``equal``: the largest difference relative to the largest logit, bound
``TOLERANCE`` for the fp32 blocks these plans deploy). Writes ``report.md``, ``results.json`` and
the plans it served (``plans/``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import yaml

from blockflow.bench.agreement import relative_error
from blockflow.bench.harness import gpu_used_mib, rendered, task_images
from blockflow.bench.triton_stats import delta, model_stats
from blockflow.clients.client import TaskClient
from blockflow.clients.load import LoadSpec, run_load, summarize
from blockflow.core import nvml
from blockflow.core.errors import PlanError
from blockflow.core.nvml import gpu_count
from blockflow.ensemble_gen.generator import reference_spec
from blockflow.plan import Plan, load_plan, memory, parse_plan
from blockflow.triton.flags import CUDA_POOL_MB
from blockflow.triton.server import ServerOptions, TritonServer

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("traditional", "fused", "packed")
# How many of the busiest models each load's summary keeps.
BUSIEST = 4
# Served answers against the unsplit fp32 model: fp32 blocks, each in its own process, may pick other
# cuDNN algorithms than the reference (tests/gpu/test_gpu.py bounds fp32 the same).
TOLERANCE = 1e-4


def scenario_plans(arch: str, number: int, n_tasks: int, out: Path) -> dict[str, Path]:
    """The three deployments of the scenario as plan files under ``out``."""
    shares = memory.SCENARIOS[number]
    raws = {"traditional": memory.scenario_raw(arch, n_tasks, (1.0, 0.0, 0.0), fuse=True),
            "fused": memory.scenario_raw(arch, n_tasks, shares, fuse=True),
            "packed": memory.scenario_raw(arch, n_tasks, shares, fuse=True, pack=True)}
    raws["packed2"] = memory.scenario_raw(arch, n_tasks, shares, fuse=True, pack=True)
    for name in _packed_blocks(raws["packed"]):
        raws["packed2"]["blocks"][name]["instances"] = 2
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, raw in raws.items():
        paths[name] = out / f"{arch}_scenario{number}_n{n_tasks}_{name}.yaml"
        paths[name].write_text(f"# blockflow.bench.scenarios: thesis scenario {number} {shares}, {n_tasks} tasks, deployed {name}\n"
                               + yaml.safe_dump(raw, sort_keys=False))
    return paths


def _packed_blocks(raw: dict[str, Any]) -> set[str]:
    """The blocks that ``pack: heads`` puts into packs in the plan ``raw``."""
    return {b.name for pack in parse_plan(raw).head_packs.values() for head in pack.heads for b in head}


def busiest(d: dict[str, dict[str, int]], models: set[str], seconds: float, instances: dict[str, int]) -> list[dict[str, Any]]:
    """The models (not ensembles) that were busiest over a statistics delta of ``seconds``.

    ``busy`` is the fraction of the time the model's instances were executing (1.0: always, the
    bottleneck of a closed loop), from Triton's per-batch-size statistics, which count each
    execution once (the per-request ones weight an execution by its requests, which overstates
    it where bigger batches take longer, as in a head pack); ``batch`` is requests per execution.
    """
    rows: list[dict[str, Any]] = []
    for m in models:
        s = d.get(m, {})
        if not s.get("executions"):
            continue
        busy_ms = s.get("execution_ns", 0) / 1e6
        rows.append({"model": m, "executions": s["executions"], "batch": s["requests"] / s["executions"],
                     "compute_ms": busy_ms / s["executions"], "queue_ms": s.get("queue_ns", 0) / max(1, s["requests"]) / 1e6,
                     "busy": busy_ms / 1e3 / seconds / max(1, instances.get(m, 1))})
    rows.sort(key=lambda r: -r["busy"])
    return rows[:BUSIEST]


def _process_mib(server: Any) -> dict[str, list[float]]:
    """NVML's GPU memory (MiB) of each process of ``server`` on GPU 0, by model (``tritonserver``
    for the server itself); empty without NVML."""
    with nvml.session() as nv:
        if nv is None:  # no driver: a dry run
            return {}
        owners = {pid: model for model, pids in server.stub_processes().items() for pid in pids}
        owners[server.process.pid] = "tritonserver"
        used = nvml.pid_gpu_bytes(nv, nv.nvmlDeviceGetHandleByIndex(0), owners)
        out: dict[str, list[float]] = {}
        for pid, b in sorted(used.items()):
            out.setdefault(owners[pid], []).append(b / 2**20)
        return out


def equality(plan: Plan, url: str) -> dict[str, float]:
    """Each task's largest error (relative to the largest logit) over batches 1 and 3 against its
    unsplit fp32 model, run eagerly on GPU 0 (the CPU without one) in this process."""
    import torch

    from blockflow.backend.runtime import BlockRunner

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    errors: dict[str, float] = {}
    with TaskClient(url) as client:
        for name, task in plan.tasks.items():
            reference = BlockRunner(reference_spec(plan, task, graph=False, fp32=True)[0], device)
            worst = 0.0
            for batch in (1, 3):
                x = task_images(plan, name, batch, seed=batch)
                got = client.infer(name, x)
                with torch.inference_mode():
                    want = reference.run(torch.from_numpy(x)).float().cpu().numpy()
                worst = max(worst, relative_error(got, want))
            errors[name] = worst
            del reference
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next variant's "before" is measured with this process's context only
    return errors


def run_variant(path: Path, cuda_pool_mb: int, clients: list[int], seconds: float, mps: bool = False) -> dict[str, Any]:
    """Serve ``path`` alone; measured memory and, per client count, the load summary over all tasks."""
    plan = load_plan(path)
    repo = rendered(plan, "bench-scenario-")
    shape = plan.block_in_shape(plan.blocks[next(iter(plan.tasks.values())).path[0]])
    before = gpu_used_mib()
    opts = ServerOptions.on_free_ports([repo], cuda_pool_mb=cuda_pool_mb,
                         mps=mps)
    t0 = time.monotonic()
    with TritonServer(opts) as server:
        load_s = time.monotonic() - t0
        time.sleep(3)
        during = gpu_used_mib()
        per_process = _process_mib(server)
        stubs = {m: len(p) for m, p in server.stub_processes().items()}
        tasks = list(plan.tasks)
        errors = equality(plan, server.http_url)
        print(f"[scenarios] {path.stem}: every task against its unsplit fp32 model: largest error "
              f"{max(errors.values()):.2e} ({max(errors, key=errors.__getitem__)}), bound {TOLERANCE:g}", flush=True)
        # Every task once first: no measured request pays a first call.
        asyncio.run(run_load(LoadSpec(server.http_url, tasks, shape, clients=len(tasks), max_requests=2 * len(tasks),
                                      duration_s=60.0)))
        loads = {}
        models = set(stubs)
        for c in clients:
            spec = LoadSpec(server.http_url, tasks, shape, duration_s=seconds, clients=c)
            before_stats = model_stats(server.http_url)
            start = time.monotonic()
            records = asyncio.run(run_load(spec))
            elapsed = time.monotonic() - start
            summary: dict[str, Any] = dict(summarize(records, elapsed)["all"])
            # Triton's statistics lag the responses by a little; the load's last requests may be missing.
            time.sleep(0.5)
            summary["busiest"] = top = busiest(delta(model_stats(server.http_url), before_stats), models, elapsed, stubs)
            loads[str(c)] = summary
            print(f"[scenarios] {path.stem}: {c} clients: {summary['throughput']:.0f}/s, "
                  f"p50 {summary['p50']:.2f} ms, p99 {summary['p99']:.2f} ms, errors {summary['errors']:.0f}"
                  + (f"; busiest {top[0]['model']} {top[0]['busy']:.0%}" if top else ""), flush=True)
    time.sleep(3)
    return {"plan": f"plans/{path.name}", "processes": sum(stubs.values()), "measured_mib": during - before, "load_s": load_s,
            "process_mib": per_process, "equal": errors, "load": loads}


def _saving(measured: float, traditional: float | None) -> str:
    return f"{1 - measured / traditional:+.1%}" if traditional else "-"


def write_report(res: dict[str, Any], path: Path) -> None:
    trad = res["variants"].get("traditional", {}).get("measured_mib")
    L = [f"# Thesis scenario {res['scenario']} ({res['shares']}), {res['arch']}, {res['tasks']} tasks — {res['device']}", "",
         f"Command: `{res['command']}`. One server at a time on GPU 0; memory is NVML's used memory with the server "
         "loaded minus before (the server and its CUDA pool included). Predicted: `blockflow plan-memory` with "
         f"{res['calibration']}.", "",
         "| deployment | processes | measured MiB | predicted MiB | error | measured saving vs traditional | load time s |",
         "|---|---|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        L.append(f"| {name} | {v['processes']} | {v['measured_mib']:,.0f} | {v['predicted_mib']:,.0f} | "
                 f"{v['predicted_mib'] / v['measured_mib'] - 1:+.1%} | {_saving(v['measured_mib'], trad)} | {v['load_s']:.0f} |")
    if "from" in res["variants"].get("traditional", {}):
        L += ["", f"The traditional deployment (the same plan in every scenario) was served by `{res['variants']['traditional']['from']}`'s run."]
    L += ["", f"Every task against its unsplit fp32 model (batches 1 and 3; bound {TOLERANCE:g}):", "",
          "| deployment | tasks | largest error | within the bound |", "|---|---|---|---|"]
    for name, v in res["variants"].items():
        if v.get("equal"):
            worst = max(v["equal"].values())
            L.append(f"| {name} | {len(v['equal'])} | {worst:.2e} | {'yes' if worst <= TOLERANCE else 'no'} |")
    L += ["", "Closed-loop clients over all tasks (round-robin), batch 1:", "",
          "| deployment | clients | inferences/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        for c, s in v["load"].items():
            L.append(f"| {name} | {c} | {s['throughput']:.0f} | {s['p50']:.2f} | {s['p99']:.2f} | {s['errors']:.0f} |")
    L += ["", "Busiest models at the most clients (Triton's statistics over the load): *busy* is the share of the",
          "time its instances were executing, *batch* the requests per execution, *compute* the time per execution.", "",
          "| deployment | clients | model | busy | batch | compute ms | queue ms |", "|---|---|---|---|---|---|---|"]
    for name, v in res["variants"].items():
        c, s = max(v["load"].items(), key=lambda kv: int(kv[0]))
        for r in s.get("busiest", []):
            L.append(f"| {name} | {c} | {r['model']} | {r['busy']:.0%} | {r['batch']:.1f} | {r['compute_ms']:.2f} | {r['queue_ms']:.2f} |")
    if any(v.get("process_mib") for v in res["variants"].values()):
        L += ["", "GPU memory of each process (NVML, MiB; the sum misses what NVML charges to no process):", "",
              "| deployment | model | instances | MiB each |", "|---|---|---|---|"]
        for name, v in res["variants"].items():
            for model, mibs in sorted(v.get("process_mib", {}).items()):
                L.append(f"| {name} | {model} | {len(mibs)} | {', '.join(f'{m:,.0f}' for m in mibs)} |")
    path.write_text("\n".join(L) + "\n")


def main() -> None:
    import shlex
    import sys

    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["resnet50", "resnet152"], default="resnet50")
    ap.add_argument("--scenario", type=int, choices=sorted(memory.SCENARIOS), default=1)
    ap.add_argument("--tasks", type=int, default=18)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="of traditional, fused, packed, packed2")
    ap.add_argument("--clients", default="1,16", help="closed-loop client counts")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--cuda-pool-mb", type=int, default=CUDA_POOL_MB)
    ap.add_argument("--mps", action="store_true", help="block processes as clients of a private MPS daemon (as `blockflow serve --mps`)")
    ap.add_argument("--calibration", type=Path, default=None, help="default: the shipped calibration of GPU 0's kind")
    ap.add_argument("--traditional-from", type=Path,
                    help="results.json of another scenario of the same network and task count: its traditional deployment "
                         "(the same plan: one whole model per task) is reported here instead of serving it again")
    args = ap.parse_args()
    unknown = set(args.variants.split(",")) - {*VARIANTS, "packed2"}
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(sorted(unknown))}; choose from traditional, fused, packed, packed2")
    cal = memory.Calibration.load(args.calibration or memory.shipped_calibration(nvml.gpu_name()))
    paths = scenario_plans(args.arch, args.scenario, args.tasks, args.out / "plans")
    issues = load_plan(paths["packed"]).device_issues(gpu_count())
    if issues:  # the scenario plans place every block on GPU 0
        sys.exit(f"blockflow.bench.scenarios needs a GPU: {PlanError(issues, str(paths['packed']))}")
    res: dict[str, Any] = {"arch": args.arch, "scenario": args.scenario, "shares": [round(x, 3) for x in memory.SCENARIOS[args.scenario]],
                           "tasks": args.tasks, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                           "command": "python -m blockflow.bench.scenarios " + shlex.join(sys.argv[1:]),
                           "calibration": f"{cal.source} (process {cal.process_mib:.0f} MiB)", "variants": {}}
    if args.traditional_from is not None:
        earlier = json.loads(args.traditional_from.read_text())
        same = ((earlier["arch"], earlier["tasks"], earlier["device"]) == (args.arch, args.tasks, res["device"])
                and "traditional" in earlier["variants"])
        if not same:
            sys.exit(f"{args.traditional_from} has no traditional deployment of {args.arch} with {args.tasks} tasks "
                     f"on a {res['device']}")
        res["variants"]["traditional"] = {**earlier["variants"]["traditional"], "from": str(args.traditional_from)}
    for name in args.variants.split(","):
        v = run_variant(paths[name], args.cuda_pool_mb, [int(c) for c in args.clients.split(",")], args.seconds, args.mps)
        plan = load_plan(paths[name])
        v["predicted_mib"] = memory.per_gpu(memory.modular(plan, 1, cal), 1, cal, args.cuda_pool_mb)[0]
        print(f"[scenarios] {name}: {v['processes']} processes, measured {v['measured_mib']:.0f} MiB, "
              f"predicted {v['predicted_mib']:.0f} MiB", flush=True)
        res["variants"][name] = v
        (args.out / "results.json").write_text(json.dumps(res, indent=2))
    write_report(res, args.out / "report.md")
    print((args.out / "report.md").read_text())


if __name__ == "__main__":
    main()
