"""Programs the benchmarks run in a fresh process each (a clean CUDA context per measurement):

    python -m blockflow.bench.children memory-steps PLAN BLOCK BASELINE_MIB

Each prints one JSON line: its result.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from blockflow.backend.runtime import BlockRunner
from blockflow.core import nvml
from blockflow.ensemble_gen.generator import segment_spec
from blockflow.plan import load_plan


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
    kind, *rest = argv or ["--help"]
    if kind == "memory-steps" and len(rest) == 3:
        print(json.dumps(memory_steps(rest[0], rest[1], float(rest[2]))))
    elif kind in ("-h", "--help"):
        print(__doc__)
    else:
        raise SystemExit(f"not a child program: {' '.join(argv)!r}; the programs:\n{__doc__}")


if __name__ == "__main__":
    main(sys.argv[1:])
