"""The ``blockflow`` command line.

Every failure BlockFlow expects (bad plan, missing file, port in use, server
that does not start, bad arguments) ends in a clear message on stderr and a
non-zero exit code, never a traceback.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional

import click
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from blockflow.errors import BlockFlowError, PlanError

if TYPE_CHECKING:
    from collections.abc import Mapping

DEFAULT_PLAN = Path(__file__).resolve().parent.parent / "plans" / "default.yaml"

# Piped output (files, CI logs) gets wide tables instead of 80 columns of wrapped cells.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 220)
out_console = out  # for commands with an `out` parameter
err = Console(stderr=True, soft_wrap=True)


@click.group(name="blockflow", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="blockflow", prog_name="blockflow")
def app() -> None:
    """Serve DNNs cut into shared blocks on NVIDIA Triton."""
    import logging

    from rich.logging import RichHandler

    # Library warnings (e.g. the server watchdog's) on stderr, in the CLI's own style.
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=err, show_time=False, show_path=False)])


PLAN = click.argument("plan", type=click.Path(path_type=Path))


@app.command()
@PLAN
def validate(plan: Path) -> None:
    """Check a plan; print every problem with its key path and fix."""
    from blockflow.plan import load_plan

    p = load_plan(plan)
    for w in p.warnings():
        err.print(f"[yellow]warning[/]: {w}")
    out.print(f"plan {plan} is valid: {len(p.models)} model(s), {len(p.blocks)} block(s), {len(p.tasks)} task(s)")


@app.command()
@PLAN
def show(plan: Path) -> None:
    """Tasks, blocks, what each task shares, and the tensors between blocks."""
    from blockflow.plan import load_plan

    p = load_plan(plan)
    sharing = p.sharing()
    blocks = Table(title="blocks")
    for col in ("block", "model", "stages", "in", "out", "params", "placement", "inst", "batch", "precision", "graphs", "used by"):
        blocks.add_column(col)
    params = _param_counts(p)
    for b in p.blocks.values():
        blocks.add_row(
            b.name, b.model, f"{b.first}" if b.first == b.last else f"{b.first}-{b.last}",
            _shape(p.block_in_shape(b)), _shape(p.block_out_shape(b)), f"{params[b.name] / 1e6:.2f} M",
            str(list(b.placement) if isinstance(b.placement, tuple) else b.placement), str(b.instances),
            str(b.max_batch_size), b.precision, "on" if b.cuda_graphs else "off",
            ", ".join(sharing[b.name]) or "[yellow]unused[/]",
        )
    tasks = Table(title="tasks")
    for col in ("task", "transport", "path", "shared blocks", "hop tensors (fp32, per sample)"):
        tasks.add_column(col)
    for t in p.tasks.values():
        shared = [b for b in t.path if len(sharing[b]) > 1]
        hops = [f"{_shape(p.block_out_shape(p.blocks[b]))} {_mib(p.block_out_shape(p.blocks[b]))}" for b in t.path[:-1]]
        tasks.add_row(t.name, " + ".join(p.transports_of(t)), " → ".join(t.path), ", ".join(shared) or "-", "; ".join(hops) or "-")
    out.print(tasks)
    out.print(blocks)


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape))


def _mib(shape: tuple[int, ...]) -> str:
    n = 4
    for d in shape:
        n *= d
    return f"{n / 2**20:.2f} MiB"


def _param_counts(p: object) -> dict[str, int]:
    import torch

    from blockflow import arch
    from blockflow.plan import Plan

    assert isinstance(p, Plan)
    counts: dict[str, int] = {}
    for b in p.blocks.values():
        m = p.models[b.model]
        with torch.device("meta"):
            import torchvision.models as tvm

            net = getattr(tvm, m.arch)(weights=None, num_classes=m.num_classes)
            stages = arch.slice_stages(net, m.arch, m.cut_points, b.first, b.last)
            counts[b.name] = sum(t.numel() for t in stages.parameters())
    return counts


@app.command()
@PLAN
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Repository directory to write.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if OUTPUT differs from the plan.")
def generate(plan: Path, output: Path, check: bool) -> None:
    """Generate the Triton model repository for a plan (atomically; same plan, same bytes)."""
    from blockflow.plan import load_plan
    from ensemble_gen import generator

    p = load_plan(plan)
    files = generator.render(p)
    if check:
        differences = generator.diff(files, output)
        if differences:
            err.print(f"{output} is stale for {plan} ({len(differences)} difference(s)); "
                      f"regenerate with: blockflow generate {plan} -o {output}")
            for d in differences[:20]:
                err.print(f"  {d}")
            raise click.exceptions.Exit(1)
        out.print(f"{output} is up to date with {plan}")
        return
    generator.write(files, output)
    out.print(f"wrote {len(generator.model_names(files))} models to {output}")


PORT = click.IntRange(0, 65535)


@app.command()
@click.option("--plan", type=click.Path(path_type=Path), default=DEFAULT_PLAN, show_default="plans/default.yaml", help="Plan file.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; 0.0.0.0 exposes the server to the network.")
@click.option("--http-port", type=PORT, default=8000, show_default=True)
@click.option("--grpc-port", type=PORT, default=8001, show_default=True)
@click.option("--metrics-port", type=PORT, default=8002, show_default=True)
@click.option("--repository", type=click.Path(path_type=Path), default=None, help="Where to generate the repository (default: a private runtime dir).")
@click.option("--timeout", type=click.FloatRange(1), default=900.0, show_default=True, help="Seconds to wait for every model to load.")
@click.option("--cuda-pool-mb", type=click.IntRange(64), default=2048, show_default=True,
              help="Triton's CUDA memory pool per GPU; GPU activations between blocks travel through it.")
@click.option("--control-port", type=click.IntRange(0, 65535), default=8003, show_default=True,
              help="Port of the control service (POST /plan …) on --host; 0 turns it off.")
@click.option("--token-file", type=click.Path(path_type=Path), default=None,
              help="File holding the control service's bearer token (default: a new random token, "
                   "written to <runtime dir>/control.token).")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="Where the control service keeps the last plans (default: the runtime dir).")
@click.option("--mps", is_flag=True, help="Run the block processes under a private NVIDIA MPS daemon, so blocks' "
              "kernels share the GPU concurrently (more throughput under load; see README, Benchmarks).")
@click.option("--weights-dir", "weights_dirs", multiple=True, type=click.Path(path_type=Path, file_okay=False),
              help="A directory plans posted to the control service may read weights files from (repeatable; "
                   "default: the served plan's directory).")
@click.option("--load-timeout", type=click.FloatRange(1), default=300.0, show_default=True,
              help="Seconds one model load (a plan change, a block reload) may take before it fails and is rolled back.")
def serve(plan: Path, host: str, http_port: int, grpc_port: int, metrics_port: int, repository: Optional[Path],
          timeout: float, cuda_pool_mb: int, control_port: int, token_file: Optional[Path], state_dir: Optional[Path],
          mps: bool, weights_dirs: tuple[Path, ...], load_timeout: float) -> None:
    """Generate the plan's repository, start tritonserver and serve until Ctrl-C or SIGTERM.

    Plan changes arrive through the control service (`blockflow apply`) and are applied
    through Triton's model control API while the server keeps serving.
    """
    from blockflow.access import write_private
    from blockflow.apply import Applier
    from blockflow.control import ControlServer, Controller, create_app
    from blockflow.plan import load_plan
    from blockflow.server import ServerOptions, TritonServer, check_port, gpu_count, make_runtime_dir
    from blockflow.supervisor import Supervisor
    from ensemble_gen import generator

    p = load_plan(plan)
    gpus = gpu_count()
    device_issues = p.device_issues(gpus)
    if device_issues:
        raise PlanError(device_issues, str(plan))
    for w in p.warnings():
        err.print(f"[yellow]warning[/]: {w}")
    if control_port:
        check_port(host, control_port, "control")
    token = _control_token(token_file) if control_port else ""
    runtime = make_runtime_dir()
    repo = repository or runtime / "model_repository"
    files = generator.render(p)
    generator.write(files, repo)
    hint = "" if mps else mps_hint(files, gpus)
    if hint:
        err.print(f"[cyan]hint[/]: {hint}")
    options = ServerOptions([repo], host, http_port, grpc_port, metrics_port, cuda_pool_mb=cuda_pool_mb, mps=mps)
    server = TritonServer(options, runtime_dir=runtime)
    stop = _install_stop_handlers()
    err.print(f"starting tritonserver with {len(generator.model_names(files))} models from {plan} (log: {server.log_path}) …")
    t0 = time.monotonic()
    control = None
    try:
        server.start(timeout)
        lock = threading.Lock()
        applier = Applier(server.grpc_url, repo, lock=lock, log=lambda m: err.print(f"apply: {m}", markup=False, highlight=False),
                          admin_key=server.admin_key, timeout=load_timeout)
        controller = Controller(applier, state_dir or runtime / "plans", base_dir=plan.parent.resolve(), gpus=gpus,
                                weights_dirs=list(weights_dirs) or None)
        controller.adopt(plan.read_text(encoding="utf-8"), p)
        _print_endpoints(p, server, time.monotonic() - t0)
        if control_port:
            control = ControlServer(create_app(controller, token), host, control_port)
            control.start()
            token_path = token_file or runtime / "control.token"
            if token_file is None:
                write_private(token_path, token)
            out.print(f"  control {control.url} (bearer token in {token_path})")
            out.print(f"  blockflow apply PLAN --url {control.url} --token-file {token_path}")
        # Brings back a dead tritonserver (same plan) and reloads blocks whose process died.
        Supervisor(server, controller, lock, start_timeout=timeout, load_timeout=load_timeout,
                   say=lambda m: err.print(f"[yellow]{escape(m)}[/]")).run(stop)
        err.print("stopping …")
    finally:
        if control is not None:
            control.stop()
        server.stop()
        import shutil

        shutil.rmtree(runtime, ignore_errors=True)
    err.print("stopped; no process left behind")


# From this many block processes on one GPU, `blockflow serve` suggests --mps.
MPS_HINT_PROCESSES = 8


def mps_hint(files: Mapping[str, bytes], gpus: int) -> str:
    """A suggestion to serve under MPS when many block processes of a rendered repository share a GPU, or ''."""
    from collections import Counter

    from blockflow.apply import instances_by_device

    per_gpu: Counter[int | None] = Counter()
    for devices in instances_by_device(files, gpus).values():
        per_gpu.update(devices)
    per_gpu.pop(None, None)  # processes on the CPU
    if not per_gpu:
        return ""
    gpu, count = per_gpu.most_common(1)[0]
    if count < MPS_HINT_PROCESSES:
        return ""
    return (f"{count} block processes share GPU {gpu}; without MPS they take turns on it under load. "
            "--mps lets their kernels run together (2.5x the throughput for a 22-process plan on an H100: "
            "bench/results/h100/scenario2_r50_n20_packs/)")


def _read_secret(path: Path, flag: str) -> str:
    from blockflow.access import read_secret

    try:
        return read_secret(path)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint=flag) from None


def _control_token(token_file: Optional[Path]) -> str:
    """The control service's token: from ``token_file``, $BLOCKFLOW_TOKEN, or a new random one."""
    import os

    from blockflow.access import new_secret

    if token_file is not None:
        token = _read_secret(token_file, "--token-file")
        if len(token) < 16:
            raise click.BadParameter(f"the token in {token_file} is shorter than 16 characters", param_hint="--token-file")
        return token
    return os.environ.get("BLOCKFLOW_TOKEN") or new_secret()


@app.command()
@PLAN
@click.option("--url", default="http://127.0.0.1:8003", show_default=True, help="The control service of `blockflow serve`.")
@click.option("--token-file", type=click.Path(path_type=Path), default=None, help="File with the bearer token (else $BLOCKFLOW_TOKEN).")
@click.option("--dry-run", is_flag=True, help="Only print what would change.")
@click.option("--triton-grpc-url", "triton_url", default=None, metavar="HOST:PORT",
              help="Apply straight to the Triton whose gRPC endpoint this is (explicit model control; loads go over gRPC "
                   "so that they never hold up HTTP inference) instead of the control service; needs --repository.")
@click.option("--repository", type=click.Path(path_type=Path), default=None, help="With --triton-grpc-url: the server's BlockFlow model repository.")
@click.option("--admin-key-file", type=click.Path(path_type=Path), default=None,
              help="With --triton-grpc-url: the key of Triton's restricted model-repository API (blockflow serve writes it to "
                   "<runtime dir>/admin.key).")
def apply(plan: Path, url: str, token_file: Optional[Path], dry_run: bool, triton_url: Optional[str], repository: Optional[Path],
          admin_key_file: Optional[Path]) -> None:
    """Make a running server serve PLAN, without stopping it.

    New and changed blocks load first, then the ensembles that use them; removed tasks and
    the blocks no task needs any more are unloaded last. If a load fails, the previous plan
    is restored and keeps serving every task.
    """
    import os

    from blockflow.errors import ApplyError
    from blockflow.plan import load_plan

    p = load_plan(plan)  # a bad plan is refused here, before anything is sent
    if triton_url is not None:
        from blockflow.apply import Applier

        if repository is None:
            raise click.UsageError("--triton-grpc-url needs --repository (the directory the server loads models from)")
        admin_key = _read_secret(admin_key_file, "--admin-key-file") if admin_key_file is not None else ""
        applier = Applier(triton_url, repository, log=lambda m: err.print(m, markup=False, highlight=False), admin_key=admin_key)
        try:
            report = applier.apply(p, dry_run=dry_run)
        finally:
            applier.close()
        lines, steps, seconds = report.diff.lines(), report.steps, report.seconds
    else:
        import httpx

        token = _read_secret(token_file, "--token-file") if token_file is not None else os.environ.get("BLOCKFLOW_TOKEN", "")
        if not token:
            raise click.UsageError("give the control service's token with --token-file or $BLOCKFLOW_TOKEN")
        try:
            r = httpx.post(f"{url.rstrip('/')}/plan", params={"dry_run": str(dry_run).lower()}, content=plan.read_bytes(),
                           headers={"Authorization": f"Bearer {token}", "Content-Type": "application/yaml"}, timeout=1800)
        except httpx.HTTPError as exc:
            raise ApplyError(f"cannot reach the control service at {url}: {exc}") from None
        body: dict[str, Any] = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"error": r.text}
        if r.status_code == 422 and body.get("issues"):
            from blockflow.errors import PlanIssue

            raise PlanError([PlanIssue(i["loc"], i["message"]) for i in body["issues"]], f"{plan} (refused by the server)")
        if r.status_code != 200:
            raise ApplyError(f"{body.get('error') or body.get('detail') or r.text} (HTTP {r.status_code})")
        lines, steps, seconds = body["lines"], body["steps"], body["seconds"]
    for line in lines:
        out.print(line, markup=False, highlight=False)
    if dry_run:
        out.print("(dry run: nothing changed)")
    elif steps:
        out.print(f"[green]applied[/] {p.raw.name!r} in {seconds:.1f} s")


def _install_stop_handlers() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _print_endpoints(p: object, server: object, seconds: float) -> None:
    from blockflow.plan import Plan
    from blockflow.server import TritonServer
    from ensemble_gen import naming

    assert isinstance(p, Plan) and isinstance(server, TritonServer)
    out.print(f"[green]ready[/] in {seconds:.1f} s")
    out.print(f"  HTTP    {server.http_url}")
    out.print(f"  gRPC    {server.grpc_url}")
    out.print(f"  metrics {server.metrics_url}")
    table = Table(title="tasks")
    for col in ("task", "ensembles", "path"):
        table.add_column(col)
    for t in p.tasks.values():
        models = [naming.task_model(t.name, tr, t.transport) for tr in p.transports_of(t)]
        models += [naming.reference_model(t.name, v == "graph") for v in p.raw.references]
        table.add_row(t.name, ", ".join(models), " → ".join(t.path))
    out.print(table)
    first = next(iter(p.tasks.values()))
    c, h, w = p.block_in_shape(p.blocks[first.path[0]])
    out.print("try:")
    out.print(f"  blockflow infer {first.name} --random --url {server.http_url}")
    out.print(f"  blockflow infer {first.name} --random --protocol grpc --url {server.grpc_url}")
    from blockflow.doctor import perf_analyzer_path

    out.print(f"  {perf_analyzer_path() or 'perf_analyzer'} -m {first.name} -u {server.http_url} --shape IMAGE:{c},{h},{w} --concurrency-range 1:4 -b 1")
    out.print("Ctrl-C stops the server.")


@app.command()
@click.argument("task")
@click.option("--image", type=click.Path(path_type=Path), default=None, help="An image file (JPEG/PNG), resized and normalized like ImageNet.")
@click.option("--random", "random_input", is_flag=True, help="Use a random input (seeded).")
@click.option("--batch", type=click.IntRange(1, 1024), default=1, show_default=True, help="Batch size.")
@click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True)
@click.option("--url", default=None, help="host:port (default 127.0.0.1:8000 for http, :8001 for grpc).")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True, help="Send the request this many times; report latency percentiles.")
def infer(task: str, image: Optional[Path], random_input: bool, batch: int, protocol: str, url: Optional[str], repeat: int) -> None:
    """Send images to a task; print its top-5 classes and the latency."""
    import numpy as np

    from clients.client import TaskClient, top_k

    if (image is None) == (not random_input):
        raise click.UsageError("give exactly one of --image FILE or --random")
    url = url or ("127.0.0.1:8000" if protocol == "http" else "127.0.0.1:8001")
    with TaskClient(url, protocol) as client:  # type: ignore[arg-type]
        shape = _task_input_shape(client, task)
        if image is not None:
            x = _load_image(image, shape[1], shape[2])
            x = np.repeat(x[None], batch, axis=0)
        else:
            x = np.random.default_rng(0).standard_normal((batch, *shape), dtype=np.float32)
        latencies = []
        for _ in range(repeat):
            result = client.infer_timed(task, x)
            latencies.append(result.latency_ms)
    names = _class_names(result.logits.shape[1])
    for row, best in enumerate(top_k(result.logits, 5)):
        out.print(f"[bold]{task}[/] sample {row}: " + ", ".join(f"{names[i] if names else i} ({p:.3f})" for i, p in best))
    lat = np.array(latencies)
    out.print(f"latency over {repeat} request(s) ({protocol}, batch {batch}): p50 {np.percentile(lat, 50):.2f} ms, "
              f"p99 {np.percentile(lat, 99):.2f} ms, min {lat.min():.2f} ms")


def _task_input_shape(client: object, task: str) -> tuple[int, int, int]:
    from blockflow.errors import ClientError
    from clients.client import TaskClient

    assert isinstance(client, TaskClient)
    try:
        meta = client._client.get_model_metadata(task)
    except Exception as exc:
        names = [m["name"] for m in client.models() if m.get("state") == "READY"]
        raise ClientError(f"task {task!r} is not served at {client.url} (ready models: {', '.join(names) or 'none'})") from exc
    inputs = meta["inputs"] if isinstance(meta, dict) else [{"shape": list(i.shape)} for i in meta.inputs]
    dims = [int(d) for d in inputs[0]["shape"]][-3:]
    return dims[0], dims[1], dims[2]


def _load_image(path: Path, height: int, width: int) -> "np.ndarray":  # type: ignore[name-defined]  # noqa: F821
    import numpy as np
    import torch
    from PIL import Image, UnidentifiedImageError
    from torchvision.transforms.v2 import functional as F

    if not path.is_file():
        raise BlockFlowError(f"image file not found: {path}")
    try:
        with Image.open(path) as im:
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError) as exc:
        raise BlockFlowError(f"cannot decode image {path}: {exc}") from exc
    img = torch.from_numpy(rgb.copy()).permute(2, 0, 1)
    img = F.resize(img, [height, width], antialias=True)
    x = F.normalize(img.to(torch.float32) / 255.0, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    return np.ascontiguousarray(x.numpy(), dtype=np.float32)


def _class_names(n: int) -> list[str]:
    if n != 1000:
        return []
    from torchvision.models import ResNet50_Weights

    return list(ResNet50_Weights.IMAGENET1K_V2.meta["categories"])


@app.command()
@click.option("--task", "tasks", multiple=True, required=True, help="Task to load (repeat for several).")
@click.option("--url", default=None, help="host:port (default 127.0.0.1:8000 for http, :8001 for grpc).")
@click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True)
@click.option("--clients", type=click.IntRange(1, 4096), default=1, show_default=True, help="Closed loop: concurrent clients.")
@click.option("--rate", type=click.FloatRange(min=0.001), default=None, help="Open loop: Poisson arrivals per second (instead of --clients).")
@click.option("--batch", type=click.IntRange(1, 1024), default=1, show_default=True)
@click.option("--duration", type=click.FloatRange(min=0.1), default=10.0, show_default=True, help="Seconds of load.")
@click.option("--max-requests", type=click.IntRange(1), default=None, help="Stop after this many requests.")
@click.option("--out", "csv_path", type=click.Path(path_type=Path), default=None,
              help="CSV of every request (task, batch, send time, latency, outcome).")
@click.option("--seed", type=int, default=0, show_default=True)
def load(tasks: tuple[str, ...], url: Optional[str], protocol: str, clients: int, rate: Optional[float], batch: int,
         duration: float, max_requests: Optional[int], csv_path: Optional[Path], seed: int) -> None:
    """Closed-loop clients or open-loop Poisson arrivals over tasks; per-request latencies and a summary."""
    import asyncio

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from clients.client import TaskClient
    from clients.load import LoadSpec, run_load, summarize, write_csv

    url = url or ("127.0.0.1:8000" if protocol == "http" else "127.0.0.1:8001")
    with TaskClient(url, protocol) as client:  # type: ignore[arg-type]
        shapes = {t: _task_input_shape(client, t) for t in tasks}
    if len(set(shapes.values())) > 1:
        raise click.UsageError(f"tasks take different input shapes {shapes}; load them in separate runs")
    spec = LoadSpec(url, tasks, next(iter(shapes.values())), protocol, batch, duration, clients, rate, max_requests, seed)  # type: ignore[arg-type]
    mode = f"open loop, Poisson λ={rate}/s" if rate else f"closed loop, {clients} client(s)"
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} requests"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        tid = bar.add_task(f"{mode} on {', '.join(tasks)}", total=None)
        t0 = time.monotonic()
        records = asyncio.run(run_load(spec, lambda n: bar.advance(tid, n)))
        elapsed = time.monotonic() - t0
    if csv_path is not None:
        write_csv(records, csv_path)
    table = Table(title=f"{mode}, batch {batch}, {elapsed:.1f} s ({protocol})")
    for col in ("task", "requests", "errors", "inferences/s", "p50 ms", "p90 ms", "p99 ms", "mean ms"):
        table.add_column(col, justify="right" if col != "task" else "left")
    for name, s in summarize(records, elapsed).items():
        table.add_row(name, f"{s['requests']:.0f}", f"{s['errors']:.0f}", f"{s['throughput']:.1f}", f"{s['p50']:.2f}",
                      f"{s['p90']:.2f}", f"{s['p99']:.2f}", f"{s['mean']:.2f}")
    err.print(f"{len(records)} requests" + (f" (per-request latencies in {csv_path})" if csv_path else ""))
    out.print(table)


@app.command()
@click.option("--url", default="127.0.0.1:8000", show_default=True, help="Triton's HTTP endpoint.")
@click.option("--metrics-url", default=None, help="Triton's metrics endpoint (default: the --url host, port 8002).")
@click.option("--interval", type=click.FloatRange(0.2), default=2.0, show_default=True, help="Seconds between the two samples rates are computed from.")
@click.option("--watch", is_flag=True, help="Refresh the tables every --interval seconds until Ctrl-C.")
@click.option("--json", "as_json", is_flag=True, help="Print one sample as JSON instead of tables.")
def status(url: str, metrics_url: Optional[str], interval: float, watch: bool, as_json: bool) -> None:
    """Tasks (ready, request rate, p50/p99) and blocks (instances, device, memory, utilisation, queue and compute time)."""
    import json

    import httpx
    from rich.live import Live

    from blockflow.status import block_rows, snapshot, task_rows

    host = url.removeprefix("http://").rsplit(":", 1)[0]
    murl = metrics_url or f"http://{host}:8002/metrics"
    with httpx.Client(timeout=30) as client:
        prev = snapshot(url, murl, client)
        time.sleep(interval)
        cur = snapshot(url, murl, client)
        if as_json:
            out.print_json(json.dumps({"tasks": task_rows(prev, cur), "blocks": block_rows(prev, cur)}))
            return
        if not watch:
            out.print(_status_tables(task_rows(prev, cur), block_rows(prev, cur)))
            return
        with Live(Group(), console=out, refresh_per_second=4) as live:
            try:
                while True:
                    live.update(_status_tables(task_rows(prev, cur), block_rows(prev, cur)))
                    time.sleep(interval)
                    prev, cur = cur, snapshot(url, murl, client)
            except KeyboardInterrupt:
                pass


def _status_tables(tasks: list[dict[str, object]], blocks: list[dict[str, object]]) -> Group:
    def num(v: object, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def ready(v: object) -> str:
        return "[green]ready[/]" if v else "[red]not ready[/]"

    t = Table(title="tasks")
    for col in ("task", "state", "req/s", "failed", "p50 ms", "p99 ms"):
        t.add_column(col, justify="left" if col in ("task", "state") else "right")
    for r in tasks:
        t.add_row(str(r["task"]), ready(r["ready"]), num(r["rate"], ".1f"), str(r["failed"]), num(r["p50_ms"], ".2f"), num(r["p99_ms"], ".2f"))
    b = Table(title="blocks")
    for col in ("block", "state", "inst", "device", "GPU MiB", "RSS MiB", "GPU util", "CPU", "req/s", "queue ms", "compute ms"):
        b.add_column(col, justify="left" if col in ("block", "state", "device") else "right")
    for r in blocks:
        b.add_row(str(r["block"]), ready(r["ready"]), str(r["instances"]), str(r["device"]), num(r["gpu_mem_mib"], ".0f"),
                  num(r["rss_mib"], ".0f"), num(r["gpu_util"], ".0%"), num(r["cpu_util"], ".0%"), num(r["rate"], ".1f"),
                  num(r["queue_ms"], ".2f"), num(r["compute_ms"], ".2f"))
    return Group(t, b)


@app.command()
@click.option("--plan", type=click.Path(path_type=Path), default=Path("plans/bench_r50.yaml"), show_default=True,
              help="Plan whose first task is measured on every transport, with its monolithic references.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory for results.json, report.md and the plots.")
@click.option("--quick", is_flag=True, help="Fewer, shorter points: a few minutes on a CPU machine.")
@click.option("--seconds", type=click.FloatRange(0.5), default=None, help="perf_analyzer measurement window per point.")
@click.option("--sections", default=None, help="Comma-separated subset of: batch, concurrency, rate, clients, gpus (default: all).")
@click.option("--concurrency", "concurrencies", default=None, help="Comma-separated concurrency levels (default 1,4,16,32).")
@click.option("--mps", is_flag=True, help="Serve under a private NVIDIA MPS daemon (as `blockflow serve --mps`).")
def bench(plan: Path, out: Path, quick: bool, seconds: Optional[float], sections: Optional[str], concurrencies: Optional[str],
          mps: bool) -> None:
    """Measure every transport side by side in one server and write a report (see bench/suite.py)."""
    from bench.suite import SECTIONS, BenchConfig, run_bench

    cfg = BenchConfig.quick_config(plan, out) if quick else BenchConfig(plan, out)
    cfg.mps = mps
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


@app.command("plan-memory")
@click.argument("plan", type=click.Path(path_type=Path), required=False)
@click.option("--gpus", type=click.IntRange(0, 64), default=None, help="GPUs to place on (default: the GPUs NVML sees, at least 1).")
@click.option("--calibration", type=click.Path(path_type=Path, exists=True), default=None,
              help="Constants measured by `python -m bench.memory` (default: bench/results/h100/memory_calibration.json if present).")
@click.option("--scenarios", "arch", type=click.Choice(["resnet50", "resnet152"]), default=None,
              help="Instead of PLAN: the thesis' eight scenarios (Table 4.4) for this network, N tasks.")
@click.option("--tasks", "n_tasks", type=click.IntRange(1, 10000), default=100, show_default=True, help="N for --scenarios.")
@click.option("--cuda-pool-mb", type=click.IntRange(0), default=2048, show_default=True, help="Triton's CUDA pool per GPU, as `serve` sets it.")
def plan_memory(plan: Optional[Path], gpus: Optional[int], calibration: Optional[Path], arch: Optional[str], n_tasks: int,
                cuda_pool_mb: int) -> None:
    """Predicted GPU memory per device: the plan as BlockFlow deploys it vs one full model per task."""
    from blockflow import memory
    from blockflow.plan import load_plan
    from blockflow.server import gpu_count

    default_cal = Path(__file__).resolve().parent.parent / "bench" / "results" / "h100" / "memory_calibration.json"
    cal_path = calibration or (default_cal if default_cal.is_file() else None)
    cal = memory.Calibration.load(cal_path) if cal_path else memory.Calibration()
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
    n = gpus if gpus is not None else max(1, gpu_count())
    mod, trad = memory.modular(p, n, cal), memory.traditional(p, n, cal)
    table = Table(title=f"{plan}: predicted GPU memory per process (MiB)")
    for col in ("model", "GPU", "overhead", "weights", "CUDA-graph pools", "TensorMQ pool", "total"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for pr in mod:
        table.add_row(pr.model, str(pr.gpu), f"{pr.overhead_mib:.0f}", f"{pr.weights_mib:.1f}", f"{pr.activations_mib:.1f}",
                      f"{pr.pool_mib:.0f}", f"{pr.total_mib:.0f}")
    out.print(table)
    m, t = memory.per_gpu(mod, n, cal, cuda_pool_mb), memory.per_gpu(trad, n, cal, cuda_pool_mb)
    summary = Table(title="per GPU (MiB, with the server): BlockFlow vs one full model per task")
    for col in ("GPU", "BlockFlow", "processes", "traditional", "processes", "saving"):
        summary.add_column(col, justify="right")
    for g in sorted(set(m) | set(t)):
        summary.add_row(str(g), f"{m.get(g, 0):,.0f}", str(sum(1 for x in mod if x.gpu == g)), f"{t.get(g, 0):,.0f}",
                        str(sum(1 for x in trad if x.gpu == g)), f"{1 - m.get(g, 0) / t[g]:+.1%}" if t.get(g) else "—")
    out.print(summary)


@app.command()
def doctor() -> None:
    """Check the environment: versions, server and stub, torch/CUDA, GPUs; one fix per problem."""
    from blockflow.doctor import run_checks

    rows = run_checks()
    table = Table(title="blockflow doctor")
    for col in ("check", "status", "detail / fix"):
        table.add_column(col)
    for r in rows:
        table.add_row(r.name, "[green]ok[/]" if r.ok else "[red]problem[/]", escape(r.detail))
    out.print(table)
    if not all(r.ok for r in rows):
        raise click.exceptions.Exit(1)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, turning every expected error into one clear message."""
    if argv is None and len(sys.argv) == 1:
        argv = ["--help"]
    try:
        rv = app.main(args=argv, prog_name="blockflow", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        err.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        ctx = getattr(exc, "ctx", None)
        where = f" (see: blockflow {ctx.info_name} --help)" if ctx is not None and ctx.info_name != "blockflow" else " (see: blockflow --help)"
        err.print(f"blockflow: error: {exc.format_message()}{where}", markup=False, highlight=False)
        sys.exit(exc.exit_code)
    except PlanError as exc:
        err.print(f"blockflow: {exc}", markup=False, highlight=False)
        sys.exit(exc.exit_code)
    except BlockFlowError as exc:
        err.print(f"blockflow: error: {exc}", markup=False, highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
