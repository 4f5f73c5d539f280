"""bench and doctor."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from blockflow.cli.app import app, out_console


@app.command()
@click.option("--plan", type=click.Path(path_type=Path), default=Path("plans/bench_r50.yaml"), show_default=True,
              help="Plan whose first task is measured on every transport, with its monolithic references.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory for results.json, report.md and the plots.")
@click.option("--quick", is_flag=True, help="Fewer, shorter points: a few minutes on a CPU machine.")
@click.option("--seconds", type=click.FloatRange(0.5), default=None, help="perf_analyzer measurement window per point.")
@click.option("--sections", default=None, help="Comma-separated subset of: batch, concurrency, rate, clients, gpus (default: all).")
@click.option("--concurrency", "concurrencies", default=None, help="Comma-separated concurrency levels (default 1,4,16,32).")
@click.option("--mps", is_flag=True, help="Serve under a private NVIDIA MPS daemon (as `blockflow serve --mps`).")
@click.option("--repeats", type=click.IntRange(1, 20), default=None,
              help="perf_analyzer runs per figure; the report gives their median and spread (default 3; 1 with --quick).")
@click.option("--input", "input_memory", type=click.Choice(["host", "cuda-shm"]), default="host", show_default=True,
              help="How inputs reach the server: in the request, or CUDA shared memory (perf_analyzer --shared-memory cuda).")
@click.option("--precision", type=click.Choice(["fp32", "tf32", "fp16", "bf16"]), default=None,
              help="Every block, and the monolithic references, in this precision instead of the plan's.")
def bench(plan: Path, out: Path, quick: bool, seconds: float | None, sections: str | None, concurrencies: str | None,
          mps: bool, repeats: int | None, input_memory: str, precision: str | None) -> None:
    """Measure every transport side by side in one server and write a report (see bench/suite.py)."""
    from bench.suite import SECTIONS, BenchConfig, run_bench

    cfg = BenchConfig.quick_config(plan, out) if quick else BenchConfig(plan, out)
    cfg.mps = mps
    cfg.input = input_memory
    cfg.precision = precision
    if repeats is not None:
        cfg.repeats = repeats
    if seconds is not None:
        cfg.seconds = seconds
    if sections is not None:
        cfg.sections = [x.strip() for x in sections.split(",") if x.strip()]
        unknown = set(cfg.sections) - set(SECTIONS)
        if unknown:
            raise click.BadParameter(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}", param_hint="--sections")
    if concurrencies is not None:
        try:
            cfg.concurrencies = sorted({int(x) for x in concurrencies.split(",")})
        except ValueError:
            raise click.BadParameter("give integers, e.g. 1,8,32", param_hint="--concurrency") from None
    where = run_bench(cfg, log=lambda line: out_console.print(line, markup=False, highlight=False))
    out_console.print(f"[green]done[/]: {where / 'report.md'}, {where / 'results.json'}")


@app.command()
def doctor() -> None:
    """Check the environment: versions, server and stub, torch/CUDA, GPUs; one fix per problem."""
    from blockflow.triton.doctor import run_checks

    rows = run_checks()
    table = Table(title="blockflow doctor")
    for col in ("check", "status", "detail / fix"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.name, "[green]ok[/]" if r.ok else "[red]problem[/]", escape(r.detail))
    out_console.print(table)
    if not all(r.ok for r in rows):
        raise click.exceptions.Exit(1)


