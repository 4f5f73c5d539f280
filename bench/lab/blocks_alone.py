"""Each block of a task's path alone on the GPU, against the task's whole network: does a split cost GPU time?

    python -m blockflow.bench.lab.blocks_alone --plan plans/bench_r50_speed.yaml --precision fp16 \\
        --sizes 8,16,32 --out DIR

In one plain process, no server (as ``blockflow.bench.gpu_alone`` measures the whole network): every
block of the plan's first task (``--task``) as its instance builds it (:class:`BlockRunner` from the
block's TensorMQ spec: its input converted to its precision and layout, its output converted back to
the hop's row-major dtype, inside its CUDA graph), then the task's unsplit CUDA graph, each CUDA graph
replay at each batch size timed with CUDA events (the median). ``DIR/blocks_alone.json`` and
``.md``: each block's ms, their sum, and the sum against the whole network.

Served under load, a split spends more of the GPU per image than its unsplit model (one H200: 95%
busy for 0.87x the throughput). A sum near the whole network's says the blocks' own kernels and
conversions do not cost it, so sharing the GPU between processes does; a sum well above it says
where. ``--device cpu`` runs the same steps eagerly on the CPU (the host clock), to try it without a GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from blockflow.bench.gpu_alone import GRAPHS_OFF, batch_times


def measure(plan_path: Path, task_name: str | None, precision: str | None, sizes: tuple[int, ...],
            device: str = "cuda") -> dict[str, Any]:
    """Each block's and the whole network's median ms per batch size (``{"blocks": {name: {size: ms}},
    "whole": {size: ms}, ...}``); a size that did not fit the GPU is under ``skipped``."""
    import torch

    from blockflow.backend.runtime import BlockRunner
    from blockflow.bench.plans import in_precision
    from blockflow.core.spec import ModelSpec
    from blockflow.ensemble_gen.generator import block_spec, reference_spec
    from blockflow.plan import load_plan

    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no GPU visible to torch (--device cpu runs the blocks on the CPU)")
    plan = load_plan(plan_path)
    if precision is not None:
        plan = in_precision(plan, precision)
    task = plan.tasks[task_name] if task_name is not None else next(iter(plan.tasks.values()))
    where = torch.device("cuda", 0) if cuda else torch.device("cpu")
    largest = {"max_batch_size": max(sizes)}
    specs = {name: block_spec(plan, plan.blocks[name], "tensormq") for name in task.path}
    whole, _ = reference_spec(plan, task, graph=True)
    out: dict[str, Any] = {"task": task.name, "path": list(task.path), "precision": plan.task_precision(task),
                           "device": torch.cuda.get_device_name(0) if cuda else "cpu", "cuda_graph": cuda,
                           "sizes": list(sizes), "skipped": {}}

    def timed(label: str, spec: ModelSpec) -> dict[str, float]:
        runner = BlockRunner(spec.model_copy(update=largest), where)
        if cuda and not runner.use_graphs:  # a block's time alone is its graph's
            raise SystemExit(GRAPHS_OFF)
        ms, skipped = batch_times(runner, sizes, cuda)
        del runner
        if cuda:
            torch.cuda.empty_cache()
        if skipped:
            out["skipped"][label] = skipped
        return ms

    out["blocks"] = {name: timed(name, spec) for name, spec in specs.items()}
    out["whole"] = timed("the whole network", whole)  # a label no block's name can clash with
    measured = [str(b) for b in sizes if all(str(b) in m for m in [*out["blocks"].values(), out["whole"]])]
    out["sum"] = {b: sum(m[b] for m in out["blocks"].values()) for b in measured}
    out["sum_over_whole"] = {b: out["sum"][b] / out["whole"][b] for b in measured}
    return out


def report(res: dict[str, Any], command: str) -> str:
    """``blocks_alone.md``: one row per block and batch size, then the sum and the whole network."""
    sizes = [str(b) for b in res["sizes"]]
    lines = [f"# Blocks alone against the whole network: {res['device']}", "",
             f"`{command}`; task `{res['task']}` = {' → '.join(res['path'])}, {res['precision']}, "
             f"{'CUDA graph replays timed with CUDA events' if res['cuda_graph'] else 'eager on the CPU, host clock'}, "
             "median ms per batch.", "",
             "| model | " + " | ".join(f"batch {b}" for b in sizes) + " |", "|---" * (1 + len(sizes)) + "|"]

    def cells(ms: dict[str, float]) -> str:
        return " | ".join(f"{ms[b]:.3f}" if b in ms else "—" for b in sizes)

    lines += [f"| {name} | {cells(ms)} |" for name, ms in res["blocks"].items()]
    lines += [f"| sum of the blocks | {cells(res['sum'])} |", f"| whole network | {cells(res['whole'])} |",
              "| sum / whole | " + " | ".join(f"{res['sum_over_whole'][b]:.2f}×" if b in res["sum_over_whole"] else "—"
                                           for b in sizes) + " |"]
    lines += [f"- {label}: batch {b} not measured ({why})" for label, s in res["skipped"].items() for b, why in s.items()]
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, default=Path("plans/bench_r50_speed.yaml"))
    ap.add_argument("--task", default=None, help="the task whose path is measured (default: the plan's first)")
    ap.add_argument("--precision", choices=["fp32", "tf32", "fp16", "bf16"], default=None, help="every block in it (default: the plan's)")
    ap.add_argument("--sizes", default="8,16,32", help="batch sizes, comma-separated")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: eager, host clock (to try it)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        sizes = tuple(sorted({int(s) for s in args.sizes.split(",")}))
    except ValueError:
        ap.error(f"--sizes takes batch sizes separated by commas, not {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        ap.error("--sizes takes batch sizes of 1 or more")
    res = measure(args.plan, args.task, args.precision, sizes, args.device)
    command = "python -m blockflow.bench.lab.blocks_alone " + shlex.join(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "blocks_alone.json").write_text(json.dumps(res, indent=1))
    (args.out / "blocks_alone.md").write_text(report(res, command))
    print((args.out / "blocks_alone.md").read_text())


if __name__ == "__main__":
    main()
