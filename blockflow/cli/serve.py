"""``blockflow serve``: the command around :class:`blockflow.control.serve.Serving`."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import click
from rich.table import Table

from blockflow.cli.app import DEFAULT_PLAN, PORT, TRITON_HOME, app, out, read_secret
from blockflow.core import endpoints
from blockflow.core.errors import EnvironmentProblem
from blockflow.triton.flags import CUDA_POOL_MB

if TYPE_CHECKING:
    from blockflow.control.serve import Serving
    from blockflow.plan import Plan, Task
    from blockflow.triton.server import TritonServer

log = logging.getLogger("blockflow.serve")


@app.command()
@click.option("--plan", type=click.Path(path_type=Path), default=DEFAULT_PLAN, show_default="plans/default.yaml", help="Plan file.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; 0.0.0.0 exposes the server to the network.")
@click.option("--http-port", type=PORT, default=8000, show_default=True)
@click.option("--grpc-port", type=PORT, default=8001, show_default=True)
@click.option("--metrics-port", type=PORT, default=8002, show_default=True)
@click.option("--repository", type=click.Path(path_type=Path), default=None, help="Where to generate the repository (default: a private runtime dir).")
@click.option("--timeout", type=click.FloatRange(1), default=900.0, show_default=True, help="Seconds to wait for every model to load.")
@click.option("--cuda-pool-mb", type=click.IntRange(64), default=CUDA_POOL_MB, show_default=True,
              help="Triton's CUDA memory pool per GPU; GPU activations between blocks travel through it.")
@click.option("--control-port", type=click.IntRange(0, 65535), default=8003, show_default=True,
              help="Port of the control service (POST /plan …) on --host; 0 turns it off.")
@click.option("--token-file", type=click.Path(path_type=Path), default=None,
              help="File holding the control service's bearer token (default: a new random token, "
                   "written to <runtime dir>/control.token).")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="Where the control service keeps the last plans (default: the runtime dir).")
@click.option("--mps", is_flag=True, help="Run the block processes under a private NVIDIA MPS daemon, so blocks' "
              "kernels share the GPU concurrently (more throughput under load: docs/performance.md, *Host tuning*).")
@click.option("--warm-cores-ms", type=click.FloatRange(0), default=0.0, show_default=True, metavar="MS",
              help="Keep every CPU of the server out of idle for MS after each block call (pollers at SCHED_IDLE "
                   "priority): lower latency at low load for the CPU time of idle cores; 0 is off. See docs/deploy.md.")
@click.option("--weights-dir", "weights_dirs", multiple=True, type=click.Path(path_type=Path, file_okay=False),
              help="A directory plans posted to the control service may read weights files from (repeatable; "
                   "default: the served plan's directory).")
@click.option("--load-timeout", type=click.FloatRange(1), default=300.0, show_default=True,
              help="Seconds one model load (a plan change, a block reload) may take before it fails and is rolled back.")
@click.option("--tritonserver-arg", "tritonserver_args", multiple=True, metavar="--FLAG[=VALUE]",
              help="Passed to tritonserver as it is (repeatable), e.g. --tritonserver-arg=--log-verbose=1 or "
                   "--tritonserver-arg=--trace-config=rate=100. Flags BlockFlow sets itself (ports, addresses, "
                   "repository, model control, restricted APIs) are refused.")
@click.option("--shm-key-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Where to write the key that opens Triton's shared-memory API to local clients with CUDA or system "
                   "shared-memory inputs (default: <runtime dir>/shm.key, this user's only).")
@click.option("--shm-key-group", default=None, metavar="GROUP",
              help="Let this group's members read the shared-memory key file (0640); its directory must let them in.")
@click.option("--server", "server_name", default=None, metavar="NAME",
              help="Which of the plan's servers this is, for a plan that spans several (its blocks there, its tasks' runs there).")
@click.option("--http-max-body-mb", type=click.IntRange(1), default=None,
              help="The largest HTTP request body the front door lets through (default: 64, or twice the largest "
                   "batch a task of the plan takes, if more).")
@click.option("--latency-summaries", is_flag=True,
              help="Keep each model's p50/p99 latency on the metrics endpoint (for `blockflow status` and the dashboard); "
                   "off by default, as it costs throughput under sustained load (docs/performance.md, *Latency summaries*).")
@TRITON_HOME
def serve(plan: Path, host: str, http_port: int, grpc_port: int, metrics_port: int, repository: Path | None,
          timeout: float, cuda_pool_mb: int, control_port: int, token_file: Path | None, state_dir: Path | None,
          mps: bool, warm_cores_ms: float, weights_dirs: tuple[Path, ...], load_timeout: float, tritonserver_args: tuple[str, ...],
          shm_key_file: Path | None, shm_key_group: str | None, http_max_body_mb: int | None, server_name: str | None,
          latency_summaries: bool) -> None:
    """Generate the plan's repository, start tritonserver and serve until Ctrl-C or SIGTERM.

    Plan changes arrive through the control service (`blockflow apply`) and are applied
    through Triton's model control API while the server keeps serving.
    """
    from blockflow.control.serve import ServeOptions, Serving
    from blockflow.triton.flags import check_extra_args

    try:
        check_extra_args(tritonserver_args)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--tritonserver-arg") from None
    token = _control_token(token_file) if control_port else ""
    serving = Serving(ServeOptions(plan, host, http_port, grpc_port, metrics_port, repository, timeout, cuda_pool_mb,
                                   control_port, token, token_file, state_dir, mps, warm_cores_ms, list(weights_dirs),
                                   load_timeout, list(tritonserver_args), shm_key_file, _group_id(shm_key_group),
                                   http_max_body_mb << 20 if http_max_body_mb else None, server_name,
                                   latency_summaries),
                      say=log.warning, log_apply=lambda m: log.info("apply: %s", m))
    try:
        if serving.resumed is not None:
            log.info("serving plan #%d %r, applied live before serve last stopped (kept in %s); %s is unchanged since",
                     serving.resumed.number, serving.resumed.name, state_dir, plan)
        elif state_dir is None and control_port:
            log.info("plans applied live are kept in the runtime directory and go when serve stops; --state-dir on a "
                     "persistent volume keeps them, and serve then starts again on the last one")
        for w in serving.plan.warnings():
            log.warning(w)
        if serving.hint():
            log.info("hint: %s", serving.hint())
        stop = _install_stop_handlers()
        log.info("starting tritonserver with %d models from %s (log: %s)", serving.model_count, plan, serving.server.log_path)
        written: list[Path] = []

        def publish(svc: Serving) -> None:  # before the control service answers: a caller it answered finds the file
            try:
                written.append(_write_endpoints(svc, plan))
            except (EnvironmentProblem, OSError) as exc:  # the server runs; clients then need flags or variables
                log.warning("endpoints file not written: %s", exc)

        serving.start(ready=publish)
        log.info("ready in %.1f s", serving.seconds_to_ready)
        _print_endpoints(serving, written[0] if written else None)
        serving.run(stop)
        log.info("stopping")
    finally:
        endpoints.remove(os.getpid())
        serving.stop()
    log.info("stopped; no process left behind")


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise click.BadParameter(f"no group named {group!r} on this machine", param_hint="--shm-key-group") from None


def _control_token(token_file: Path | None) -> str:
    """The control service's token: from ``token_file``, $BLOCKFLOW_TOKEN, or a new random one."""
    from blockflow.triton.access import new_secret

    if token_file is not None:
        token = read_secret(token_file, "--token-file")
        if len(token) < 16:
            raise click.BadParameter(f"the token in {token_file} is shorter than 16 characters", param_hint="--token-file")
        return token
    return os.environ.get("BLOCKFLOW_TOKEN") or new_secret()


def _install_stop_handlers() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _write_endpoints(serving: Serving, plan: Path) -> Path:
    server = serving.server
    found = endpoints.Endpoints(http=server.http_url, grpc=server.grpc_url, metrics=server.metrics_url,
                                control=serving.control.url if serving.control is not None else "",
                                token_file=str(serving.token_path or ""), pid=os.getpid(), plan=str(plan),
                                shm_key_file=str(server.shm_key_file))
    return endpoints.write(found)


def _print_endpoints(serving: Serving, written: Path | None) -> None:
    from blockflow.plan import naming

    p, server = serving.plan, serving.server
    out.print(f"[green]ready[/] in {serving.seconds_to_ready:.1f} s")
    out.print(f"  HTTP    {server.http_url}")
    out.print(f"  gRPC    {server.grpc_url}")
    out.print(f"  metrics {server.metrics_url}")
    if written is not None:
        out.print(f"  (in {written}, where blockflow infer, load, status and apply find them)")
    from blockflow.plan import crossing

    table = Table(title="tasks" if p.server is None else f"tasks: server {p.server}'s part")
    for col in ("task", "ensembles", "path"):
        table.add_column(col)
    starts_here = []  # tasks whose clients call this server
    for t in p.tasks.values():
        runs = list(enumerate(crossing.runs(p, t)))
        here = [(i, blocks) for i, (where, blocks) in runs if p.server is None or where == p.server]
        for i, blocks in here:  # a plan of servers: only the runs this server serves, and where each goes on
            if i == 0:
                starts_here.append(t)
                models = [naming.task_model(t.name, tr, t.transport) for tr in p.transports_of(t)] + p.reference_models(t)
            else:
                models = [naming.run_ensemble(t.name, i)]
            onward = f" → (server {runs[i + 1][1][0]})" if i + 1 < len(runs) else ""
            table.add_row(t.name, ", ".join(models), " → ".join(blocks) + onward)
    out.print(table)
    if starts_here:
        _print_tries(starts_here[0], p, server)
    else:
        out.print("(no task starts on this server: the servers before it call it)")
    if serving.control is not None:
        out.print(f"  control {serving.control.url} (bearer token in {serving.token_path})")
        out.print(f"  blockflow apply PLAN --url {serving.control.url} --token-file {serving.token_path}")
    out.print("Ctrl-C stops the server.")


def _print_tries(first: Task, p: Plan, server: TritonServer) -> None:
    """Commands to try ``first`` with, on ``server``."""
    from blockflow.core.spec import ORIGINAL_SIZE
    from blockflow.triton.doctor import perf_analyzer_path

    model = p.models[p.blocks[first.path[0]].model]
    image = ",".join(map(str, model.image_shape))  # [H, W, 3] for HWC tasks
    out.print("try:")
    # A task's inputs besides the image come from .npy files (docs/plan.md, "Task inputs besides the image");
    # `infer` gives a detector's ORIGINAL_SIZE itself (the image's).
    taken = p.task_side_inputs(first)
    sides = "".join(f" --input {s.name}={s.name}.npy" for s in taken if s.name != ORIGINAL_SIZE)
    out.print(f"  blockflow infer {first.name} --random{sides} --url {server.http_url}")
    out.print(f"  blockflow infer {first.name} --random{sides} --protocol grpc --url {server.grpc_url}")
    images = f" --shape IMAGE:{image}"
    write = "from pathlib import Path; from blockflow.bench.perf_analyzer import "
    if image == "-1":  # encoded images need real files' bytes (random ones fail as not JPEG/PNG); the data gives their shape
        images = " --input-data images.json"
        load, given = "", ""
        if taken:  # the data file gives every input: the side inputs too (ones)
            load = f"from blockflow.plan import load_plan; p = load_plan({p.source!r}); "
            given = f", sides=p.task_side_inputs(p.tasks[{first.name!r}])"
        out.print(f"  python -c \"{write}encoded_input_data; {load}encoded_input_data(Path('images.json'){given})\"")
    elif taken:  # random int64 would be no valid side input (a size): a directory of one sample per input
        images = " --input-data inputs"
        uint8 = model.image is not None and model.image.dtype == "uint8"
        out.print(f"  python -c \"{write}side_input_data; from blockflow.plan import load_plan; p = load_plan({p.source!r}); "
                  f"side_input_data(Path('inputs'), {tuple(model.image_shape)}, {uint8}, p.task_side_inputs(p.tasks[{first.name!r}]))\"")
    out.print(f"  {perf_analyzer_path() or 'perf_analyzer'} -m {first.name} -u {server.http_url} --concurrency-range 1:4 -b 1{images}")
