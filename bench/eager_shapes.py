"""First-call latency of an eager (no CUDA graphs) block at every batch size, unpadded vs padded.

    python -m blockflow.bench.eager_shapes --out bench/results/h100/eager_shapes.md

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, default=ROOT / "plans" / "bench_r50.yaml")
    ap.add_argument("--task", default="r50")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {}
    for variant in ("unpadded", "padded"):
        run = subprocess.run([sys.executable, "-m", "blockflow.bench.children", "eager-shapes", str(args.plan), args.task, variant], capture_output=True, text=True,
                             check=True, timeout=900, cwd=ROOT)
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
