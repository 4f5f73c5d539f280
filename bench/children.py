"""Programs the benchmarks run in a fresh process each (a clean CUDA context per measurement):

    python -m blockflow.bench.children eager-shapes PLAN TASK unpadded|padded
    python -m blockflow.bench.children memory-steps PLAN BLOCK BASELINE_MIB

Each prints one JSON line: its result.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from blockflow.backend.runtime import BlockRunner
from blockflow.core import nvml
from blockflow.ensemble_gen.generator import reference_spec, segment_spec
from blockflow.plan import load_plan


def eager_shapes(plan_path: str, task_name: str, variant: str) -> dict[int, list[float]]:
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


def memory_steps(plan_path: str, block_name: str, baseline_mib: float) -> dict[str, Any]:
    """GPU memory (MiB above ``baseline_mib``, NVML's figure) after each step of a block's start-up."""
    import torch

    def used() -> float:
        # NVML's figure, as for the baseline: CUDA's total - free counts differently (H100: ~470 MiB apart).
        torch.cuda.synchronize()
        return nvml.used_mib(0) - baseline_mib

    plan = load_plan(plan_path)
    block = plan.blocks[block_name]
    steps: dict[str, Any] = {}
    torch.zeros(1, device="cuda:0")
    steps["context"] = used()
    free, total = torch.cuda.mem_get_info(0)
    steps["context_cuda_total_minus_free"] = (total - free) / 2**20 - baseline_mib
    no_benchmark = os.environ.get("BF_CUDNN_BENCHMARK") == "0"
    if no_benchmark:
        torch.backends.cudnn.benchmark = False
    spec, _ = segment_spec(plan, (block,), plan.transport)
    runner = BlockRunner(spec, torch.device("cuda", 0))
    if no_benchmark:  # the runner turns it on for itself
        torch.backends.cudnn.benchmark = False
    steps["weights"] = used()
    runner.warmup()  # warmup() itself empties the allocator cache unless told not to
    steps["warmup"] = used()
    torch.cuda.empty_cache()
    steps["empty_cache"] = used()
    steps["torch_allocated"] = torch.cuda.memory_allocated() / 2**20
    steps["torch_reserved"] = torch.cuda.memory_reserved() / 2**20
    return steps


def main(argv: list[str]) -> None:
    kind, *rest = argv
    if kind == "eager-shapes":
        print(json.dumps(eager_shapes(rest[0], rest[1], rest[2])))
    elif kind == "memory-steps":
        print(json.dumps(memory_steps(rest[0], rest[1], float(rest[2]))))
    else:
        raise SystemExit(f"unknown child program {kind!r}; see python -m blockflow.bench.children --help")


if __name__ == "__main__":
    main(sys.argv[1:])
