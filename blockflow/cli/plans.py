"""Plan commands: validate, show (and a network's legal cuts), generate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from blockflow.cli.app import JSON, PLAN, app, emit, err, out

if TYPE_CHECKING:
    from blockflow.plan import Plan, Task


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
    """Tasks (what each takes, shares, answers), blocks, the tensors between them; or, with --cuts, a network's legal cuts."""
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
                         "inputs": [{"name": n, "dtype": d, "shape": list(sh)} for n, d, sh in _task_inputs(p, t)],
                         "outputs": [{"name": n, "dtype": d, "shape": list(sh)} for n, d, sh in _task_outputs(p, t.path[-1])],
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
    for col in ("task", "transport", "path", "shared blocks", "hands over directly", "hop tensors (per sample)", "inputs",
                "outputs"):
        tasks.add_column(col)
    for t in p.tasks.values():
        shared = [b for b in t.path if len(sharing[b]) > 1]
        hops = []
        for name in t.path[:-1]:
            shapes, dtype = p.block_out_shapes(p.blocks[name]), hop_dtype(p.blocks[name].precision)
            hops.append(f"{_shapes(shapes)} {dtype} {_mib(shapes, dtype)}")
        direct = ", ".join(f"{a} ⇒ {b}" for a, b in p.task_hand_overs(t))
        taken = ", ".join(f"{n} {list(sh)}" + ("" if d == "float32" else f" {d}") for n, d, sh in _task_inputs(p, t))
        answer = ", ".join(f"{n} {list(sh)}" + ("" if d == "fp32" else f" {d}") for n, d, sh in _task_outputs(p, t.path[-1]))
        tasks.add_row(t.name, " + ".join(p.transports_of(t)), " → ".join(t.path), ", ".join(shared) or "-", direct or "-",
                      "; ".join(hops) or "-", taken, answer)
    out.print(tasks)
    out.print(blocks)


def _show_cuts(what: str, input_shape: str, num_classes: int, as_json: bool = False) -> None:
    """Every legal cut of the plan's models (or of one torchvision model or exported program), with
    the tensors that would cross it."""
    from blockflow.core import arch, programs
    from blockflow.core.errors import BlockFlowError
    from blockflow.plan import load_plan

    if programs.is_program(what):
        nets: list[tuple[str, str, tuple[int, ...], int]] = [(f"program {what}", str(Path(what).resolve()), (), 0)]
    elif Path(what).suffix in (".yaml", ".yml", ".json") or Path(what).is_file():
        p = load_plan(Path(what))
        nets = [(f"model {name} ({m.program or m.network}, input {list(m.input_shape)})", m.network,
                 tuple(m.input_shape), m.num_classes) for name, m in p.models.items() if m.stage_files is None]
    else:
        if what not in arch.supported_archs():
            raise click.BadParameter(f"{what!r} is neither a plan file, a torchvision model name nor an exported "
                                     f"program ({programs.PROGRAM_SUFFIX})", param_hint="PLAN")
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
        if programs.is_program(name):
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
@click.option("--server", "server_name", default=None, metavar="NAME", help="For a plan that spans servers: the repository of this one.")
@JSON
def generate(plan: Path, output: Path, check: bool, server_name: str | None, as_json: bool) -> None:
    """Generate the Triton model repository for a plan (atomically; same plan, same bytes)."""
    from blockflow.ensemble_gen import generator
    from blockflow.plan import load_plan

    p = load_plan(plan).on_server(server_name)
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


def _task_inputs(p: Plan, task: Task) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, per-sample shape) of what ``task`` takes: its image (as it arrives: float32, uint8
    or encoded; -1 where it varies), then each side input its blocks read (float32 or int64: NumPy's names, as the image's)."""
    from blockflow.core.spec import IMAGE

    model = p.models[p.blocks[task.path[0]].model]
    image = model.image
    return [(IMAGE, image.dtype if image is not None else "float32", model.image_shape),
            *((s.name, "float32" if s.dtype == "fp32" else s.dtype, s.shape) for s in p.task_side_inputs(task))]


def _task_outputs(p: Plan, last: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, per-sample shape; -1 where it varies) of what a task whose path ends in block ``last`` answers."""
    from blockflow.core.spec import LOGITS

    block = p.blocks[last]
    outputs = p.block_outputs(block)
    return [(o.name, o.dtype, o.shape) for o in outputs] or [(LOGITS, "fp32", p.block_out_shape(block))]
