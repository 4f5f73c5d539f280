"""First-call latency of an eager (no CUDA graphs) block at every batch size, unpadded vs padded.

    python -m blockflow.bench.lab.eager_shapes --out bench/results/h100/eager_shapes.md

Dynamic batching hands a block any batch size up to ``max_batch_size``. With cuDNN benchmark
mode each new input shape starts an algorithm search. ``BlockRunner`` therefore runs eager
batches padded to their warmed-up bucket. Each variant runs in a fresh process, warmed up the
way a block instance is; every size runs twice, and the first and the second call are timed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from blockflow.backend.runtime import BlockRunner
from blockflow.ensemble_gen.generator import reference_spec
from blockflow.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("unpadded", "padded")


def call_times(plan_path: str, task_name: str, variant: str) -> dict[int, list[float]]:
    """First- and second-call latency (ms) of an eager, unsplit block at every batch size 1-32."""
    import torch

    plan = load_plan(plan_path)
    padded = variant == "padded"
    spec = reference_spec(plan, plan.tasks[task_name], graph=False)[0].model_copy(update={"max_batch_size": 32})
    runner = BlockRunner(spec, torch.device("cuda", 0))
    runner.warmup()
    out: dict[int, list[float]] = {}
    for b in range(1, 33):
        x = torch.randn(b, *spec.in_shape, device="cuda")
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.inference_mode():
                runner.run(x) if padded else runner._eager([x])
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        out[b] = times
    return out


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, default=ROOT / "plans" / "bench_r50.yaml")
    ap.add_argument("--task", default="r50")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", choices=VARIANTS, help="measure one variant here and print it as one JSON line (each variant runs in a "
                                                      "fresh process: a clean CUDA context)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(call_times(str(args.plan), args.task, args.child)))
        return
    if args.out is None:
        ap.error("--out is required")
    res = {}
    for variant in VARIANTS:
        run = subprocess.run([sys.executable, "-m", "blockflow.bench.lab.eager_shapes", "--plan", str(args.plan), "--task", args.task,
                              "--child", variant], capture_output=True, text=True, check=True, timeout=900, cwd=ROOT)
        res[variant] = json.loads(run.stdout.strip().splitlines()[-1])
    L = [f"# Eager ResNet-50 (`{args.task}` of `{args.plan.name}`, unsplit, fp32) on {torch.cuda.get_device_name(0)}: "
         "call latency per batch size, ms", "",
         "Warmed up at buckets 1, 2, 4, 8, 16, 32 (as a block instance is); *unpadded* runs the batch as it is "
         "(the behaviour before), *padded* runs it at its bucket (`BlockRunner.run` now).", "",
         "| batch | unpadded: 1st call | unpadded: 2nd call | padded: 1st call | padded: 2nd call |", "|---|---|---|---|---|"]
    for b in res["padded"]:
        u, p = res["unpadded"][b], res["padded"][b]
        L.append(f"| {b} | {u[0]:.1f} | {u[1]:.1f} | {p[0]:.1f} | {p[1]:.1f} |")
    total = {v: sum(t[0] for t in r.values()) for v, r in res.items()}
    L += ["", f"Sum of first calls over batch sizes 1-32: unpadded {total['unpadded']:.0f} ms, padded {total['padded']:.0f} ms."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(L) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
