"""Plan commands: validate, show, generate, plan-memory."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from blockflow.cli.app import JSON, PLAN, app, emit, err, out
from blockflow.triton.flags import CUDA_POOL_MB

if TYPE_CHECKING:
    from blockflow.plan import Plan


@app.command()
@PLAN
@JSON
def validate(plan: Path, as_json: bool) -> None:
    """Check a plan; print every problem with its key path and fix."""
    from blockflow.core.errors import PlanError
    from blockflow.plan import load_plan

    try:
        p = load_plan(plan)
    except PlanError as exc:
        if not as_json:
            raise
        emit({"plan": str(plan), "valid": False, "issues": [{"loc": i.loc, "message": i.message} for i in exc.issues]})
        raise click.exceptions.Exit(exc.exit_code) from None
    if as_json:
        emit({"plan": str(plan), "valid": True, "models": len(p.models), "blocks": len(p.blocks), "tasks": len(p.tasks),
              "warnings": list(p.warnings())})
        return
    for w in p.warnings():
        err.print(f"[yellow]warning[/]: {w}")
    out.print(f"plan {plan} is valid: {len(p.models)} model(s), {len(p.blocks)} block(s), {len(p.tasks)} task(s)")


@app.command()
@click.argument("plan")
@click.option("--cuts", is_flag=True, help="List where the network(s) can be cut instead: PLAN may be a plan file "
              "or a torchvision model name (e.g. mobilenet_v3_large).")
@click.option("--input-shape", default="3,224,224", show_default=True, help="With --cuts and a model name: C,H,W of one input.")
@click.option("--num-classes", type=click.IntRange(1), default=1000, show_default=True, help="With --cuts and a model name.")
@JSON
def show(plan: str, cuts: bool, input_shape: str, num_classes: int, as_json: bool) -> None:
    """Tasks, blocks, what each task shares, and the tensors between blocks; or, with --cuts, a network's legal cuts."""
    from blockflow.core.spec import hop_dtype
    from blockflow.plan import load_plan

    if cuts:
        _show_cuts(plan, input_shape, num_classes, as_json)
        return
    p = load_plan(Path(plan))
    sharing = p.sharing()
    if as_json:
        params = _param_counts(p)
        emit({"plan": plan,
              "tasks": [{"task": t.name, "transports": list(p.transports_of(t)), "path": list(t.path),
                         "shared_blocks": [b for b in t.path if len(sharing[b]) > 1],
                         "hand_overs": [list(pair) for pair in p.task_hand_overs(t)],
                         "hops": [{"shapes": [list(s) for s in p.block_out_shapes(p.blocks[n])],
                                   "dtype": hop_dtype(p.blocks[n].precision)} for n in t.path[:-1]]}
                        for t in p.tasks.values()],
              "blocks": [{"block": b.name, "model": b.model, "stages": [b.first, b.last],
                          "in_shapes": [list(x) for x in p.block_in_shapes(b)], "out_shapes": [list(x) for x in p.block_out_shapes(b)],
                          "parameters": params[b.name], "placement": list(b.placement) if isinstance(b.placement, tuple) else b.placement,
                          "instances": b.instances, "max_batch_size": b.max_batch_size, "precision": b.precision,
                          "cuda_graphs": b.cuda_graphs, "used_by": list(sharing[b.name])} for b in p.blocks.values()]})
        return
    blocks = Table(title="blocks")
    for col in ("block", "model", "stages", "in", "out", "params", "placement", "inst", "batch", "precision", "graphs", "used by"):
        blocks.add_column(col)
    params = _param_counts(p)
    for b in p.blocks.values():
        blocks.add_row(
            b.name, b.model, f"{b.first}" if b.first == b.last else f"{b.first}-{b.last}",
            _shapes(p.block_in_shapes(b)), _shapes(p.block_out_shapes(b)), f"{params[b.name] / 1e6:.2f} M",
            str(list(b.placement) if isinstance(b.placement, tuple) else b.placement), str(b.instances),
            str(b.max_batch_size), b.precision, "on" if b.cuda_graphs else "off",
            ", ".join(sharing[b.name]) or "[yellow]unused[/]",
        )
    tasks = Table(title="tasks")
    for col in ("task", "transport", "path", "shared blocks", "hands over directly", "hop tensors (per sample)"):
        tasks.add_column(col)
    for t in p.tasks.values():
        shared = [b for b in t.path if len(sharing[b]) > 1]
        hops = []
        for name in t.path[:-1]:
            shapes, dtype = p.block_out_shapes(p.blocks[name]), hop_dtype(p.blocks[name].precision)
            hops.append(f"{_shapes(shapes)} {dtype} {_mib(shapes, dtype)}")
        direct = ", ".join(f"{a} ⇒ {b}" for a, b in p.task_hand_overs(t))
        tasks.add_row(t.name, " + ".join(p.transports_of(t)), " → ".join(t.path), ", ".join(shared) or "-", direct or "-",
                      "; ".join(hops) or "-")
    out.print(tasks)
    out.print(blocks)


def _show_cuts(what: str, input_shape: str, num_classes: int, as_json: bool = False) -> None:
    """Every legal cut of the plan's models (or of one torchvision model or exported program), with
    the tensors that would cross it."""
    from blockflow.core import arch
    from blockflow.core.errors import BlockFlowError
    from blockflow.plan import load_plan

    if arch.is_program(what):
        nets: list[tuple[str, str, tuple[int, ...], int]] = [(f"program {what}", str(Path(what).resolve()), (), 0)]
    elif Path(what).suffix in (".yaml", ".yml", ".json") or Path(what).is_file():
        p = load_plan(Path(what))
        nets = [(f"model {name} ({m.program or m.network}, input {list(m.input_shape)})", m.network,
                 tuple(m.input_shape), m.num_classes) for name, m in p.models.items() if m.stage_files is None]
    else:
        if what not in arch.supported_archs():
            raise click.BadParameter(f"{what!r} is neither a plan file, a torchvision model name nor an exported "
                                     f"program ({arch.PROGRAM_SUFFIX})", param_hint="PLAN")
        try:
            shape = tuple(int(x) for x in input_shape.split(","))
        except ValueError:
            raise click.BadParameter("give C,H,W, e.g. 3,224,224", param_hint="--input-shape") from None
        nets = [(f"{what} (input {list(shape)})", what, shape, num_classes)]
    docs = []
    for title, name, shape, classes in nets:
        try:
            found = arch.legal_cuts(name, shape, classes)
        except ValueError as exc:
            raise BlockFlowError(str(exc)) from None
        if as_json:
            docs.append({"network": name, "input_shape": list(found.input_shape),
                         "cuts": [{"cut": c.name, "tensors": [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                                                              for t in c.tensors], "bytes_per_sample": c.bytes_per_sample}
                                  for c in found.cuts]})
            continue
        if arch.is_program(name):
            title += f" (input {list(found.input_shape)})"
        table = Table(title=f"{title}: {len(found.cuts)} legal cuts, in network order")
        for col in ("cut", "tensors per sample", "dtypes", "bytes per sample"):
            table.add_column(col, justify="right" if col == "bytes per sample" else "left")
        for c in found.cuts:
            table.add_row(c.name, _shapes(c.shapes), " + ".join(str(t.dtype).removeprefix("torch.") for t in c.tensors),
                          f"{c.bytes_per_sample:,}")
        out.print(table)
    if as_json:
        emit({"networks": docs})


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape))


def _shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    """The tensors of one hop: ``128×4×4``, or ``64×8×8 + 64×8×8`` when a skip connection crosses it."""
    return " + ".join(map(_shape, shapes))


def _mib(shapes: tuple[tuple[int, ...], ...], dtype: str = "fp32") -> str:
    width = 4 if dtype == "fp32" else 2
    return f"{sum(width * math.prod(s) for s in shapes) / 2**20:.2f} MiB"


def _param_counts(p: Plan) -> dict[str, int]:
    """Parameters per block, counted on the meta device (no memory, no weights)."""

    from blockflow.core import arch, stage_files

    counts: dict[str, int] = {}
    for b in p.blocks.values():
        m = p.models[b.model]
        if m.stage_files is not None:
            parts = [stage_files.load_stage_file(f) for f in m.stage_files[b.first:b.last + 1]]
            counts[b.name] = sum(t.numel() for part in parts for t in part.parameters())
            continue
        net = arch.meta_network(m.network, m.num_classes, m.input_shape)
        stages = arch.slice_stages(net, m.network, m.cut_points, b.first, b.last)
        counts[b.name] = sum(t.numel() for t in stages.parameters())
    return counts


@app.command()
@PLAN
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Repository directory to write.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if OUTPUT differs from the plan.")
@JSON
def generate(plan: Path, output: Path, check: bool, as_json: bool) -> None:
    """Generate the Triton model repository for a plan (atomically; same plan, same bytes)."""
    from blockflow.ensemble_gen import generator
    from blockflow.plan import load_plan

    p = load_plan(plan)
    files = generator.render(p)
    if check:
        differences = generator.diff(files, output)
        if as_json:
            emit({"output": str(output), "up_to_date": not differences, "differences": list(differences)})
            if differences:
                raise click.exceptions.Exit(1)
            return
        if differences:
            err.print(f"{output} is stale for {plan} ({len(differences)} difference(s)); "
                      f"regenerate with: blockflow generate {plan} -o {output}")
            for d in differences[:20]:
                err.print(f"  {d}")
            raise click.exceptions.Exit(1)
        out.print(f"{output} is up to date with {plan}")
        return
    generator.write(files, output)
    if as_json:
        emit({"output": str(output), "models": sorted(generator.model_names(files))})
        return
    out.print(f"wrote {len(generator.model_names(files))} models to {output}")


@app.command("plan-memory")
@click.argument("plan", type=click.Path(path_type=Path), required=False)
@click.option("--gpus", type=click.IntRange(0, 64), default=None, help="GPUs to place on (default: the GPUs NVML sees, at least 1).")
@click.option("--calibration", type=click.Path(path_type=Path, exists=True), default=None,
              help="Constants measured by `python -m blockflow.bench.memory` (default: the calibration BlockFlow ships, fitted on an H100).")
@click.option("--scenarios", "arch", type=click.Choice(["resnet50", "resnet152"]), default=None,
              help="Instead of PLAN: the thesis' eight scenarios (Table 4.4) for this network, N tasks.")
@click.option("--tasks", "n_tasks", type=click.IntRange(1, 10000), default=100, show_default=True, help="N for --scenarios.")
@click.option("--cuda-pool-mb", type=click.IntRange(0), default=CUDA_POOL_MB, show_default=True, help="Triton's CUDA pool per GPU, as `serve` sets it.")
@JSON
def plan_memory(plan: Path | None, gpus: int | None, calibration: Path | None, arch: str | None, n_tasks: int,
                cuda_pool_mb: int, as_json: bool) -> None:
    """Predicted GPU memory per device: the plan as BlockFlow deploys it vs one full model per task."""
    from blockflow.core.nvml import gpu_count
    from blockflow.plan import load_plan, memory

    cal = memory.Calibration.load(calibration or memory.shipped_calibration())
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
        table = Table(title=f"{arch}, N = {n_tasks} tasks, one GPU: predicted MiB (thesis Table 4.4 scenarios)")
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


