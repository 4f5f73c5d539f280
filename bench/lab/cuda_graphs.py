"""CUDA graphs against eager execution, per block of a plan and per task's monolithic model.

In-process (no Triton): each measurement times ``BlockRunner.run`` exactly as a block instance
calls it (input copy, compute, fp32 output copy) with CUDA events, median of many runs.

    python -m blockflow.bench.lab.cuda_graphs --plan plans/default.yaml --out bench/results/h100
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from blockflow.backend.runtime import BlockRunner
from blockflow.core.spec import ModelSpec
from blockflow.ensemble_gen.generator import block_spec, reference_spec
from blockflow.plan import load_plan


def time_ms(runner: BlockRunner, batch: int, iters: int) -> float:
    x = torch.randn(batch, *runner.spec.in_shape, device=runner.device)
    for _ in range(10):
        runner.run(x)
    samples = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        runner.run(x)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return float(statistics.median(samples))


def measure(spec: ModelSpec, batches: list[int], iters: int) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for mode, graphs in (("eager", False), ("graph", True)):
        runner = BlockRunner(spec.model_copy(update={"cuda_graphs": graphs}), torch.device("cuda", 0))
        runner.warmup()
        out[mode] = {b: time_ms(runner, b, iters) for b in batches}
        del runner
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plan", default="plans/default.yaml")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    plan = load_plan(args.plan)
    rows: list[dict[str, Any]] = []
    for name in plan.used_blocks():
        spec = block_spec(plan, plan.blocks[name], "triton-gpu")
        rows.append({"model": name, "kind": "block", **measure(spec, batches, args.iters)})
    for task in plan.tasks.values():
        spec, _ = reference_spec(plan, task, graph=False)
        rows.append({"model": f"{task.name} (monolithic)", "kind": "monolithic", **measure(spec, batches, args.iters)})
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0)
    meta = {"device": device, "torch": torch.__version__, "plan": str(args.plan), "iters": args.iters, "precision": "fp32 (TF32 off)"}
    (args.out / "cuda_graphs.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# CUDA graphs vs eager — {device}", "", f"`python -m blockflow.bench.lab.cuda_graphs --plan {args.plan}`; "
             f"torch {torch.__version__}; fp32, TF32 off; median of {args.iters} runs of `BlockRunner.run` (CUDA events).", "",
             "| model | " + " | ".join(f"eager b{b} (ms) | graph b{b} (ms) | speed-up b{b}" for b in batches) + " |",
             "|---|" + "---|---|---|" * len(batches)]
    for r in rows:
        cells = []
        for b in batches:
            e, g = r["eager"][b], r["graph"][b]
            cells.append(f"{e:.3f} | {g:.3f} | {e / g:.2f}×")
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    (args.out / "cuda_graphs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
