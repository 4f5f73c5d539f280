"""The ``plan-memory`` command: predicted GPU memory per device, the plan as BlockFlow deploys it vs
one full model per task."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from blockflow.cli.app import JSON, app, emit, err, out
from blockflow.triton.flags import CUDA_POOL_MB


@app.command("plan-memory")
@click.argument("plan", type=click.Path(path_type=Path), required=False)
@click.option("--gpus", type=click.IntRange(0, 64), default=None, help="GPUs to place on (default: the GPUs NVML sees, at least 1).")
@click.option("--gpu", type=click.Choice(["auto", "h100", "h200"]), default="auto", show_default=True,
              help="Which shipped calibration: auto takes GPU 0's (the H100's where NVML sees no H100 or H200).")
@click.option("--calibration", type=click.Path(path_type=Path, exists=True), default=None,
              help="Constants measured by `python -m blockflow.bench.memory` (instead of a shipped calibration).")
@click.option("--scenarios", "arch", type=click.Choice(["resnet50", "resnet152"]), default=None,
              help="Instead of PLAN: the thesis' eight scenarios (Table 4.4) for this network, N tasks.")
@click.option("--tasks", "n_tasks", type=click.IntRange(1, 10000), default=100, show_default=True, help="N for --scenarios.")
@click.option("--cuda-pool-mb", type=click.IntRange(0), default=CUDA_POOL_MB, show_default=True, help="Triton's CUDA pool per GPU, as `serve` sets it.")
@JSON
def plan_memory(plan: Path | None, gpus: int | None, gpu: str, calibration: Path | None, arch: str | None, n_tasks: int,
                cuda_pool_mb: int, as_json: bool) -> None:
    """Predicted GPU memory per device: the plan as BlockFlow deploys it vs one full model per task."""
    from blockflow.core.nvml import gpu_count, gpu_name
    from blockflow.plan import load_plan, memory

    cal = memory.Calibration.load(calibration or memory.shipped_calibration(gpu_name() if gpu == "auto" else gpu))
    calibration_doc = {"source": cal.source, "process_mib": cal.process_mib, "activation_factor": cal.activation_factor,
                       "server_mib": cal.server_mib, "cuda_pool_mib": cuda_pool_mb}
    if as_json and arch is not None:
        emit({"calibration": calibration_doc, "network": arch, "tasks": n_tasks,
              "scenarios": memory.scenario_table(arch, n_tasks, cal, cuda_pool_mb)})
        return
    if not as_json:
        out.print(f"calibration: {cal.source} (process {cal.process_mib:.0f} MiB, activation factor {cal.activation_factor:.2f}, "
                  f"server {cal.server_mib:.0f} MiB + CUDA pool {cuda_pool_mb} MiB per GPU)")
    if arch is not None:
        table = Table(title=f"{arch}, N = {n_tasks} tasks, one GPU: predicted MiB (thesis Table 4.4 scenarios)",
                      caption=f"fused + packed: pack: all, pack_size {memory.PACK_SIZE} (class B's and C's heads, and "
                              "class A's whole models, in packs)")
        for col in ("scenario", "A / B / C", "modular", "fused", "fused + packed", "traditional", "saving", "saving fused",
                    "saving fused + packed", "processes mod / fused / packed / trad"):
            table.add_column(col, justify="right")
        for r in memory.scenario_table(arch, n_tasks, cal, cuda_pool_mb):
            table.add_row(str(r["scenario"]), f"{r['class_a']:.0%} / {r['class_b']:.0%} / {r['class_c']:.0%}",
                          f"{r['modular_mib']:,.0f}", f"{r['fused_mib']:,.0f}", f"{r['packed_mib']:,.0f}", f"{r['traditional_mib']:,.0f}",
                          f"{r['saving_modular']:+.1%}", f"{r['saving_fused']:+.1%}", f"{r['saving_packed']:+.1%}",
                          f"{r['processes_modular']:.0f} / {r['processes_fused']:.0f} / {r['processes_packed']:.0f} / "
                          f"{r['processes_traditional']:.0f}")
        out.print(table)
        return
    if plan is None:
        raise click.UsageError("give a PLAN, or --scenarios resnet50|resnet152")
    p = load_plan(plan)
    uncalibrated = sorted({m.program or m.network or "stage files" for m in p.models.values() if not m.network.startswith("resnet")})
    if uncalibrated:
        err.print(f"[yellow]warning[/]: the memory model's constants were measured on ResNets only; for "
                  f"{', '.join(uncalibrated)} the figures below are an estimate, not a calibrated prediction "
                  "(calibrate with `python -m blockflow.bench.memory` on plans of that network)")
    n = gpus if gpus is not None else max(1, gpu_count())
    mod, trad = memory.modular(p, n, cal), memory.traditional(p, n, cal)
    m, t = memory.per_gpu(mod, n, cal, cuda_pool_mb), memory.per_gpu(trad, n, cal, cuda_pool_mb)
    if as_json:
        emit({"plan": str(plan), "calibration": calibration_doc, "calibrated": not uncalibrated,
              "processes": [{"model": pr.model, "gpu": pr.gpu, "overhead_mib": pr.overhead_mib, "weights_mib": pr.weights_mib,
                             "cuda_graph_pools_mib": pr.activations_mib, "tensormq_pool_mib": pr.pool_mib, "total_mib": pr.total_mib}
                            for pr in mod],
              "per_gpu": [{"gpu": g, "blockflow_mib": m.get(g, 0), "blockflow_processes": sum(1 for x in mod if x.gpu == g),
                           "traditional_mib": t.get(g, 0), "traditional_processes": sum(1 for x in trad if x.gpu == g)}
                          for g in sorted(set(m) | set(t))]})
        return
    table = Table(title=f"{plan}: predicted GPU memory per process (MiB)")
    for col in ("model", "GPU", "overhead", "weights", "CUDA-graph pools", "TensorMQ pool", "total"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for pr in mod:
        table.add_row(pr.model, str(pr.gpu), f"{pr.overhead_mib:.0f}", f"{pr.weights_mib:.1f}", f"{pr.activations_mib:.1f}",
                      f"{pr.pool_mib:.0f}", f"{pr.total_mib:.0f}")
    out.print(table)
    summary = Table(title="per GPU (MiB, with the server): BlockFlow vs one full model per task")
    for col in ("GPU", "BlockFlow", "processes", "traditional", "processes", "saving"):
        summary.add_column(col, justify="right")
    for g in sorted(set(m) | set(t)):
        summary.add_row(str(g), f"{m.get(g, 0):,.0f}", str(sum(1 for x in mod if x.gpu == g)), f"{t.get(g, 0):,.0f}",
                        str(sum(1 for x in trad if x.gpu == g)), f"{1 - m.get(g, 0) / t[g]:+.1%}" if t.get(g) else "—")
    out.print(summary)
