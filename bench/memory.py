"""What a block process's GPU memory is made of, and the memory model's calibration and check.

    python -m blockflow.bench.memory --out bench/results/h100          # on a GPU machine, nothing else running on GPU 0

1. Breakdown: a fresh process per setting builds a block the way a block instance does
   (blockflow.backend.runtime.BlockRunner) and reports GPU 0's used memory after each step: CUDA
   context, weights, warm-up / CUDA-graph capture, and after ``torch.cuda.empty_cache()``.
2. Calibration: real servers (`blockflow serve`'s settings) for several plans; GPU 0's used
   memory with the plan loaded minus before; least squares for the per-process overhead,
   the graph-pool factor and the server's own share (blockflow/plan/memory.py's model).
   ``--refit-from FILE ...`` fits to measurements already made (no GPU).
3. Check: predicted vs measured for every plan, and the thesis' eight scenarios predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blockflow.bench.harness import device_name, gpu_used_mib, rendered
from blockflow.ensemble_gen.generator import reference_spec
from blockflow.plan import load_plan, memory
from blockflow.triton.flags import CUDA_POOL_MB
from blockflow.triton.server import ServerOptions, TritonServer

if TYPE_CHECKING:
    from blockflow.plan import Plan
    from blockflow.plan.memory import Calibration, Process

ROOT = Path(__file__).resolve().parents[1]

def breakdown(plan: Path, blocks: list[str]) -> list[dict[str, Any]]:
    settings = {"default (lazy modules, cuDNN benchmark, graphs)": {},
                "eager module loading": {"CUDA_MODULE_LOADING": "EAGER"},
                "cuDNN benchmark off": {"BF_CUDNN_BENCHMARK": "0"},
                "no CUDA graphs": {"BLOCKFLOW_DISABLE_CUDA_GRAPHS": "1"},
                "expandable segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                "allocator cache kept after warm-up": {"BLOCKFLOW_KEEP_ALLOCATOR_CACHE": "1"}}
    rows = []
    for block in blocks:
        for label, env in settings.items():
            base = gpu_used_mib()
            res = subprocess.run([sys.executable, "-m", "blockflow.bench.children", "memory-steps", str(plan), block, str(base)], capture_output=True, text=True,
                                 env={**os.environ, **env, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
                                 timeout=300, check=False)
            row: dict[str, Any] = {"block": block, "setting": label}
            if res.returncode == 0:
                row.update(json.loads(res.stdout.strip().splitlines()[-1]))
            else:
                row["error"] = res.stderr.strip().splitlines()[-1:] if res.stderr else "?"
            rows.append(row)
            print(f"[memory] breakdown {block:10s} {label:48s} {json.dumps({k: round(v, 1) for k, v in row.items() if isinstance(v, float)})}", flush=True)
            time.sleep(1)
    return rows


def measure_plan(plan_path: Path, cuda_pool_mb: int) -> dict[str, Any]:
    plan = load_plan(plan_path)
    repo = rendered(plan, "bench-memory-")
    before = gpu_used_mib()
    opts = ServerOptions.on_free_ports([repo], cuda_pool_mb=cuda_pool_mb)
    with TritonServer(opts) as server:
        time.sleep(3)
        during = gpu_used_mib()
        stubs = {m: len(p) for m, p in server.stub_processes().items()}
    time.sleep(3)
    return {"plan": _relative(plan_path), "measured_mib": during - before, "processes": sum(stubs.values()), "stubs": stubs}


def _relative(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (results stay valid on another machine)."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _local(plan: str, base: Path | None = None) -> Path:
    """A plan path from a results file: relative to the repository, else to the results file's folder."""
    p = Path(plan)
    candidates: list[Path] = [p, ROOT / p] + ([base / p] if base is not None else [])
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"plan {plan} of a results file is not in this checkout")


def _distinct(measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per plan text and measurement: results files that re-ran a plan with the same
    result (a later run of some of the same variants) would otherwise weigh it twice."""
    seen: set[tuple[str, float]] = set()
    out = []
    for m in measured:
        key = (_local(m["plan"]).read_text().split("\n", 1)[-1], round(float(m["measured_mib"])))
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def _measured_in(path: Path) -> list[dict[str, Any]]:
    """Measured plans in a results file, with plan paths made local."""
    data = json.loads(path.read_text())
    if "variants" in data:  # blockflow.bench.scenarios
        # A variant reported "from" another run (--traditional-from) is counted where it was measured.
        rows = [{"plan": v["plan"], "measured_mib": v["measured_mib"], "processes": v["processes"]}
                for v in data["variants"].values() if "from" not in v]
    else:
        rows = [{"plan": m["plan"], "measured_mib": m["measured_mib"],
                 "processes": m.get("processes", sum(m.get("stubs", {}).values()))} for m in data["plans"]]
    for r in rows:
        r["plan"] = _relative(_local(r["plan"], path.parent))
    return rows


def _design(plan_path: Path) -> tuple[float, list[float]]:
    """A plan on GPU 0 as the fit sees it: (fixed MiB: weights + pools, [1 server, processes with
    CUDA graphs, processes without, CUDA-graph pool MiB at factor 1])."""
    plan = load_plan(plan_path)
    unit = memory.Calibration(process_mib=0.0, activation_factor=1.0, eager_process_mib=0.0, server_mib=0.0, pack_head_factor=0.0)
    heads = memory.Calibration(process_mib=0.0, activation_factor=0.0, eager_process_mib=0.0, server_mib=0.0, pack_head_factor=1.0)
    procs = memory.modular(plan, 1, unit) + _references(plan, unit)
    graphs = float(sum(p.cuda_graphs for p in procs))
    return (sum(p.weights_mib + p.pool_mib for p in procs),
            [1.0, graphs, len(procs) - graphs, sum(p.activations_mib for p in procs),
             sum(p.activations_mib for p in memory.modular(plan, 1, heads))])


def _fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    import numpy as np

    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    return [float(c) for c in coef]


def _references(plan: Plan, cal: Calibration) -> list[Process]:
    """Reference models a plan also serves (measured servers run them too), deployed as the generator deploys them."""
    out = []
    for task in plan.tasks.values():
        blocks = [plan.blocks[b] for b in task.path]
        for graph, fp32 in plan.reference_variants(task):
            _, deploy = reference_spec(plan, task, graph, fp32)
            out.append(memory._process(plan, deploy.name, [blocks], deploy, 0, 0.0, cal))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cuda-pool-mb", type=int, default=CUDA_POOL_MB)
    ap.add_argument("--plans", nargs="*", default=["plans/default.yaml", "plans/default_fused.yaml", "plans/bench_r50.yaml",
                                                   "tests/plans/fused.yaml", "tests/plans/r18_three_cuts.yaml"])
    ap.add_argument("--skip-breakdown", action="store_true")
    ap.add_argument("--refit-from", type=Path, nargs="*", default=[],
                    help="fit to measurements in these files instead of measuring (memory.json of this tool, "
                         "results.json of blockflow.bench.scenarios); no GPU needed")
    ap.add_argument("--breakdown-only", action="store_true", help="only the standalone per-step breakdown (breakdown.json)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    if not args.skip_breakdown and not args.refit_from:
        result["breakdown"] = breakdown(ROOT / "plans" / "default.yaml", ["r50_s0", "r50_s3a"])
    if args.breakdown_only:
        (args.out / "breakdown.json").write_text(json.dumps(result, indent=2))
        return
    if args.refit_from:
        # No GPU needed: fit to plans measured earlier (blockflow.bench.memory's memory.json, blockflow.bench.scenarios' results.json).
        measured = _distinct([m for f in args.refit_from for m in _measured_in(f)])
        device = "; ".join(sorted({str(json.loads(f.read_text()).get("device", "")) for f in args.refit_from} - {""})) or "earlier runs"
    else:
        measured = []
        for p in args.plans:
            m = measure_plan(ROOT / p, args.cuda_pool_mb)
            print(f"[memory] plan {p}: {m['measured_mib']:.0f} MiB over {m['processes']} processes", flush=True)
            measured.append(m)
        device = device_name()
    result["device"] = device
    result["plans"] = measured
    # measured - weights - pools - CUDA pool = server + graph processes * process + eager processes * eager
    #                                           + factor * CUDA-graph pools at factor 1
    rows, ys, fixed = [], [], []
    for m in measured:
        f, row = _design(_local(m["plan"]))
        rows.append(row)
        fixed.append(f)
        ys.append(m["measured_mib"] - f - args.cuda_pool_mb)
    server, process, eager, factor, head_factor = _fit(rows, ys)
    cal = memory.Calibration(process_mib=process, activation_factor=max(0.0, factor), eager_process_mib=eager, server_mib=server,
                             pack_head_factor=max(0.0, head_factor), source=f"fitted to {len(measured)} plans on {device} ({time.strftime('%Y-%m-%d')})")
    cal.save(args.out / "memory_calibration.json")
    checks = []
    for k, m in enumerate(measured):
        plan = load_plan(_local(m["plan"]))
        pred = memory.per_gpu(memory.modular(plan, 1, cal) + _references(plan, cal), 1, cal, args.cuda_pool_mb)[0]
        # Leave-one-out: the constants fitted without this plan predict it (an out-of-sample check).
        coef = _fit(rows[:k] + rows[k + 1:], ys[:k] + ys[k + 1:]) if len(rows) > len(rows[k]) else [float("nan")] * len(rows[k])
        loo = fixed[k] + args.cuda_pool_mb + sum(c * x for c, x in zip(coef, rows[k], strict=True))
        checks.append({"plan": m["plan"], "processes": m["processes"], "measured_mib": m["measured_mib"],
                       "predicted_mib": pred, "error": pred / m["measured_mib"] - 1,
                       "loo_predicted_mib": loo, "loo_error": loo / m["measured_mib"] - 1})
    result["calibration"] = cal.__dict__
    result["checks"] = checks
    result["scenarios"] = {arch: memory.scenario_table(arch, 100, cal, args.cuda_pool_mb) for arch in ("resnet50", "resnet152")}
    (args.out / "memory.json").write_text(json.dumps(result, indent=2))
    write_report(result, args.out / "memory.md")
    print((args.out / "memory.md").read_text())


def write_report(res: dict[str, Any], path: Path) -> None:
    cal = res["calibration"]
    L = [f"# GPU memory — {cal['source']}", ""]
    if res.get("breakdown"):
        L += ["## What one block process holds (GPU 0 used memory, MiB, cumulative after each step)", "",
              "| block | setting | context | + weights | + warm-up/graphs | after empty_cache | torch allocated | torch reserved |",
              "|---|---|---|---|---|---|---|---|"]
        for r in res["breakdown"]:
            if "error" in r:
                L.append(f"| {r['block']} | {r['setting']} | failed: {r['error']} | | | | | |")
                continue
            L.append(f"| {r['block']} | {r['setting']} | {r['context']:.0f} | {r['weights']:.0f} | {r['warmup']:.0f} | "
                     f"{r['empty_cache']:.0f} | {r['torch_allocated']:.0f} | {r['torch_reserved']:.0f} |")
        L.append("")
    L += ["## Model", "", f"process overhead {cal['process_mib']:.0f} MiB with CUDA graphs, {cal.get('eager_process_mib', float('nan')):.0f} MiB "
          f"without; CUDA-graph pools {cal['activation_factor']:.2f} x max batch x largest tensor per sample "
          f"(each further head of a pack: {cal.get('pack_head_factor', cal['activation_factor']):.2f} x); "
          f"server {cal['server_mib']:.0f} MiB (+ its CUDA pool)", "",
          "## Predicted vs measured (whole plan on GPU 0, server included)", "",
          "*Left out*: predicted by the constants fitted to every other plan (an out-of-sample check).", "",
          "| plan | processes | measured MiB | predicted MiB | error | left out: predicted | left out: error |",
          "|---|---|---|---|---|---|---|"]
    for c in res["checks"]:
        L.append(f"| {c['plan']} | {c['processes']} | {c['measured_mib']:.0f} | {c['predicted_mib']:.0f} | {c['error']:+.1%} | "
                 f"{c.get('loo_predicted_mib', float('nan')):.0f} | {c.get('loo_error', float('nan')):+.1%} |")
    for arch, rows in res.get("scenarios", {}).items():
        L += ["", f"## Thesis scenarios (Table 4.4), {arch}, N = 100 tasks, one GPU (predicted MiB)", "",
              "| scenario | A / B / C | modular | fuse: auto | fuse: auto, pack: heads | traditional | saving | saving, fused | "
              "saving, fused + packed | processes (fused + packed / traditional) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            L.append(f"| {r['scenario']} | {r['class_a']:.0%} / {r['class_b']:.0%} / {r['class_c']:.0%} | {r['modular_mib']:,.0f} | "
                     f"{r['fused_mib']:,.0f} | {r['packed_mib']:,.0f} | {r['traditional_mib']:,.0f} | {r['saving_modular']:+.1%} | "
                     f"{r['saving_fused']:+.1%} | {r['saving_packed']:+.1%} | "
                     f"{r['processes_packed']:.0f} / {r['processes_traditional']:.0f} |")
    path.write_text("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
