"""bench, doctor and triton-command."""

from __future__ import annotations

from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from blockflow.cli.app import JSON, TRITON_HOME, app, emit, out_console
from blockflow.core.shipped import shipped


@app.command()
@click.option("--plan", type=click.Path(path_type=Path), default=shipped("plans/bench_r50.yaml"), show_default="plans/bench_r50.yaml",
              help="Plan whose first task is measured on every transport, with its monolithic references.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory for results.json, report.md and the plots.")
@click.option("--quick", is_flag=True, help="Fewer, shorter points: a few minutes on a CPU machine.")
@click.option("--seconds", type=click.FloatRange(0.5), default=None, help="perf_analyzer measurement window per point.")
@click.option("--sections", default=None, help="Comma-separated subset of: batch, concurrency, rate, clients, gpus (default: all).")
@click.option("--concurrency", "concurrencies", default=None, help="Comma-separated concurrency levels (default 1,4,16,32).")
@click.option("--mps", is_flag=True, help="Serve under a private NVIDIA MPS daemon (as `blockflow serve --mps`).")
@click.option("--warm-cores-ms", type=click.FloatRange(0), default=0.0, show_default=True, metavar="MS",
              help="Keep the server's CPUs out of idle for MS after each block call (as `blockflow serve --warm-cores-ms`).")
@click.option("--repeats", type=click.IntRange(1, 20), default=None,
              help="perf_analyzer runs per figure; the report gives their median and spread (default 3; 1 with --quick).")
@click.option("--input", "input_memory", type=click.Choice(["host", "cuda-shm"]), default="host", show_default=True,
              help="How inputs reach the server: in the request, or CUDA shared memory (perf_analyzer --shared-memory cuda, "
                   "which takes the outputs through CUDA shared memory too).")
@click.option("--precision", type=click.Choice(["fp32", "tf32", "fp16", "bf16"]), default=None,
              help="Every block, and the monolithic references, in this precision instead of the plan's.")
@click.option("--client-threads", type=click.IntRange(0, 256), default=0, show_default=True, metavar="N",
              help="perf_analyzer's concurrency loop on N threads (its --async); 0: a thread per request in flight.")
@click.option("--no-gpu-alone", is_flag=True, help="Skip measuring the task's whole network in a plain process first "
                                                   "(results.json meta.gpu_alone, see bench/gpu_alone.py).")
def bench(plan: Path, out: Path, quick: bool, seconds: float | None, sections: str | None, concurrencies: str | None,
          mps: bool, warm_cores_ms: float, repeats: int | None, input_memory: str, precision: str | None, client_threads: int,
          no_gpu_alone: bool) -> None:
    """Measure every transport side by side in one server and write a report (see bench/suite.py)."""
    import signal
    import sys

    from blockflow.bench.suite import SECTIONS, BenchConfig, run_bench

    # Stopped by SIGTERM (its turns process gone, a machine's time out): unwind, so that the server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    cfg = BenchConfig.quick_config(plan, out) if quick else BenchConfig(plan, out)
    cfg.mps = mps
    cfg.warm_cores_ms = warm_cores_ms
    cfg.input = input_memory
    cfg.precision = precision
    cfg.gpu_alone = not no_gpu_alone
    cfg.client_threads = client_threads
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
@TRITON_HOME
@JSON
def doctor(as_json: bool) -> None:
    """Check the environment: versions, server and stub, torch/CUDA, GPUs; one fix per problem."""
    from blockflow.triton.doctor import run_checks

    rows = run_checks()
    if as_json:
        emit({"ok": all(r.ok for r in rows), "checks": [{"check": r.name, "ok": r.ok, "detail": r.detail} for r in rows]})
        if not all(r.ok for r in rows):
            raise click.exceptions.Exit(1)
        return
    table = Table(title="blockflow doctor")
    for col in ("check", "status", "detail / fix"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.name, "[green]ok[/]" if r.ok else "[red]problem[/]", escape(r.detail))
    out_console.print(table)
    if not all(r.ok for r in rows):
        raise click.exceptions.Exit(1)


@app.command("triton-command", context_settings={"ignore_unknown_options": True})
@click.argument("repository", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.argument("tritonserver_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- TRITONSERVER FLAGS]")
@click.option("--backend-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where the Python backend with this Python's stub is put together for the nvidia-pytriton layout "
                   "(default: ~/.cache/blockflow/triton-backends; a container's own backend is used as it is).")
@click.option("--admin-key-file", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="Start in explicit model-control mode, its model-repository, trace and logging APIs behind the key "
                   "in this file (read when the script runs), so `blockflow apply --triton-grpc-url` can change the plan. "
                   "Without it, Triton's default mode: every model loaded, loads refused, those APIs behind a random key.")
@click.option("--shm-key-file", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="Put Triton's shared-memory API (clients' CUDA and system shared-memory regions) behind the key in "
                   "this file (read when the script runs). Without it, behind a random key: no client registers a region.")
@TRITON_HOME
def triton_command(repository: Path, tritonserver_args: tuple[str, ...], backend_dir: Path | None,
                   admin_key_file: Path | None, shm_key_file: Path | None) -> None:
    """Print a shell script that starts tritonserver yourself on a generated REPOSITORY.

    \b
    blockflow generate plans/default.yaml -o repo
    blockflow triton-command repo > start-triton.sh && sh start-triton.sh --http-port=8000
    """
    from blockflow.triton.install import locate, standalone_script, user_cache

    backends = backend_dir or user_cache() / "triton-backends"
    click.echo(standalone_script(locate(), repository, backends, list(tritonserver_args), admin_key_file, shm_key_file),
               nl=False)


@app.command("perf-analyzer", context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def perf_analyzer(args: tuple[str, ...]) -> None:
    """Run Triton's perf_analyzer (from tritonclient) with the libraries it needs; every argument goes to it.

    With ``--shared-memory system|cuda`` it also sends the server's shared-memory key (from the file
    $BLOCKFLOW_SHM_KEY_FILE names, else the local `blockflow serve`'s), kept off its command line."""
    import os
    from pathlib import Path

    from blockflow.core import endpoints, env
    from blockflow.core.errors import EnvironmentProblem
    from blockflow.triton.doctor import perf_analyzer_path
    from blockflow.triton.install import perf_analyzer_env, perf_analyzer_shm_key

    pa = perf_analyzer_path()
    if pa is None:
        raise EnvironmentProblem("perf_analyzer not found; fix: pip install 'blockflow[client]'")
    cmd, run_env = [pa, *args], perf_analyzer_env()
    if _uses_shared_memory(args) and not any(endpoints.SHM_HEADER in a for a in args):
        found = endpoints.read()
        key_file = os.environ.get(env.SHM_KEY_FILE_VAR) or (found.shm_key_file if found is not None else "")
        if key_file:
            cmd, run_env = perf_analyzer_shm_key(cmd, run_env, Path(key_file))
    os.execve(pa, cmd, run_env)


def _uses_shared_memory(args: tuple[str, ...]) -> bool:
    """Whether perf_analyzer's arguments ask for system or CUDA shared memory (``--shared-memory[=]system|cuda``)."""
    for i, a in enumerate(args):
        value = a.partition("=")[2] if a.startswith("--shared-memory=") else (
            args[i + 1] if a == "--shared-memory" and i + 1 < len(args) else "")
        if value in ("system", "cuda"):
            return True
    return False
