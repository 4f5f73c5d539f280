"""The life of ``blockflow serve``: start a Triton on a plan, keep it serving, stop it cleanly.

:class:`Serving` is what the command runs, without the command line: tests and embedding
programs drive it the same way (``start``, ``run`` until an event is set, ``stop``).

Start-up, in order: check the plan against the GPUs present, render and write the repository,
start ``tritonserver`` (explicit model control, every model loaded), wire the applier and the
plan history, then the control service. ``run`` hands over to the :class:`Supervisor`.
``stop`` ends the control service, then the server and everything it started, and removes the
runtime directory.
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from blockflow.control.apply import Applier, instances_by_device
from blockflow.control.service import Controller, ControlServer, Entry, create_app, entry_text, resumable
from blockflow.control.supervisor import Supervisor
from blockflow.core import env
from blockflow.core.errors import PlanError
from blockflow.core.nvml import gpu_count
from blockflow.core.runtime_dir import write_private
from blockflow.ensemble_gen import generator, rendered
from blockflow.ensemble_gen.rendered import RenderedRepository
from blockflow.plan import Plan, load_plan, parse_plan_text
from blockflow.triton.flags import CUDA_POOL_MB
from blockflow.triton.front_door import DEFAULT_MAX_BODY_BYTES
from blockflow.triton.options import check_port
from blockflow.triton.server import ServerOptions, TritonServer, make_runtime_dir

# From this many block processes on one GPU, `blockflow serve` suggests --mps.
MPS_HINT_PROCESSES = 8


@dataclass
class ServeOptions:
    """What ``blockflow serve`` takes (its options, with the same defaults)."""

    plan: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    repository: Path | None = None  # default: <runtime dir>/model_repository
    timeout: float = 900.0  # every model loaded at start-up
    cuda_pool_mb: int = CUDA_POOL_MB
    control_port: int = 8003  # 0: no control service
    token: str = ""  # the control service's bearer token (required when control_port is set)
    token_file: Path | None = None  # where the token is kept; default: <runtime dir>/control.token, written here
    state_dir: Path | None = None  # default: <runtime dir>/plans
    mps: bool = False
    warm_cores_ms: float = 0.0  # keep the CPUs out of idle this long after each block execute (blockflow.triton.warm_cores)
    weights_dirs: list[Path] = field(default_factory=list)  # default: the plan's directory
    load_timeout: float = 300.0  # one model load during a plan change or a block reload
    tritonserver_args: list[str] = field(default_factory=list)  # passed through (checked: triton.flags.check_extra_args)
    shm_key_file: Path | None = None  # where the shared-memory key is written; default: <runtime dir>/shm.key
    shm_key_group: int | None = None  # a gid whose members may read it (0640)
    max_body_bytes: int | None = None  # the HTTP front door's limit; default: front_door_limit(plan)
    server: str | None = None  # which of the plan's servers this is (a plan that spans several: blockflow.plan.crossing)
    latency_summaries: bool = False  # Triton's p50/p99 per model on the metrics endpoint (triton.options.ServerOptions)


def front_door_limit(plan: Plan) -> int:
    """The largest HTTP request body the plan's tasks need, with room: twice the largest batch a task takes, as
    fp32 (binary inputs), and never less than the front door's default (JSON-encoded inputs of smaller tasks).
    Fixed at start-up: a plan applied later whose tasks take more needs ``serve --http-max-body-mb``."""
    largest = 0
    for task in plan.tasks.values():
        first = plan.blocks[task.path[0]]
        largest = max(largest, first.max_batch_size * 4 * math.prod(plan.block_in_shape(first)))
    return max(DEFAULT_MAX_BODY_BYTES, 2 * largest)


def mps_hint(repository: RenderedRepository, gpus: int) -> str:
    """A suggestion to serve under MPS when many block processes of a rendered repository share a GPU, or ''."""
    per_gpu: Counter[int | None] = Counter()
    for devices in instances_by_device(repository, gpus).values():
        per_gpu.update(devices)
    per_gpu.pop(None, None)  # processes on the CPU
    if not per_gpu:
        return ""
    gpu, count = per_gpu.most_common(1)[0]
    if count < MPS_HINT_PROCESSES:
        return ""
    return (f"{count} block processes share GPU {gpu}; without MPS they take turns on it under load. "
            "--mps lets their kernels run together (2.5x the throughput for a 22-process plan on an H100: "
            "docs/performance.md)")


class Serving:
    """One served plan: a ``tritonserver``, its applier and plan history, and the control service
    (:mod:`blockflow.control.service`)."""

    def __init__(self, options: ServeOptions, say: Callable[[str], None] = print,
                 log_apply: Callable[[str], None] | None = None) -> None:
        self.options = options
        self.say = say  # warnings and hints, for a person
        self._log_apply = log_apply or (lambda m: say(f"apply: {m}"))
        self.plan: Plan = load_plan(options.plan).on_server(options.server)
        self.plan_file_text = options.plan.read_text(encoding="utf-8")
        self.plan_text = self.plan_file_text  # what is served: the plan file's, or the one resumed from --state-dir
        self.resumed: Entry | None = resumable(options.state_dir, self.plan_file_text) if options.state_dir else None
        if self.resumed is not None:
            self.plan_text = entry_text(self.resumed)
            self.plan = parse_plan_text(self.plan_text, source=f"plan #{self.resumed.number} of {options.state_dir}",
                                        base_dir=options.plan.parent.resolve(), weights_dirs=options.weights_dirs or None
                                        ).on_server(options.server)
        self.gpus = gpu_count()
        issues = self.plan.device_issues(self.gpus)
        if issues:
            raise PlanError(issues, str(options.plan))
        if options.control_port:
            check_port(options.host, options.control_port, "control")
        self.runtime = make_runtime_dir()
        self.repository = options.repository or self.runtime / env.REPOSITORY_DIR
        self.rendered = rendered.render(self.plan)
        o = options
        self.server = TritonServer(ServerOptions([self.repository], o.host, o.http_port, o.grpc_port, o.metrics_port,
                                                 cuda_pool_mb=o.cuda_pool_mb, mps=o.mps, warm_cores_ms=o.warm_cores_ms,
                                                 latency_summaries=o.latency_summaries,
                                                 extra_args=list(o.tritonserver_args), shm_key_file=o.shm_key_file,
                                                 shm_key_group=o.shm_key_group,
                                                 max_body_bytes=o.max_body_bytes or front_door_limit(self.plan)),
                                   runtime_dir=self.runtime)
        self.lock = threading.Lock()  # one plan change at a time; the supervisor waits for it
        self.controller: Controller | None = None
        self.control: ControlServer | None = None
        self.token_path: Path | None = None
        self.seconds_to_ready = 0.0

    @property
    def model_count(self) -> int:
        return len(self.rendered.models)

    def hint(self) -> str:
        """Advice on how this plan would serve better here (today: MPS), or ''."""
        return "" if self.options.mps else mps_hint(self.rendered, self.gpus)

    def start(self, ready: Callable[[Serving], None] | None = None) -> None:
        """Write the repository, start the server with every model loaded, then the control service.

        ``ready`` runs once the server serves and before the control service answers (``serve``
        writes its endpoints file there): a caller that got an answer from ``/status`` finds it.
        """
        o = self.options
        t0 = time.monotonic()
        generator.write(self.rendered.files, self.repository)
        self.server.start(o.timeout)
        applier = Applier(self.server.grpc_url, self.repository, lock=self.lock, log=self._log_apply,
                          admin_key=self.server.admin_key, timeout=o.load_timeout)
        self.controller = Controller(applier, o.state_dir or self.runtime / env.PLANS_DIR, base_dir=o.plan.parent.resolve(),
                                     gpus=self.gpus, weights_dirs=o.weights_dirs or None, server=o.server)
        self.controller.kept = o.state_dir is not None
        self.controller.resumed_from = self.resumed.number if self.resumed is not None else None
        self.controller.adopt(self.plan_text, self.plan, started_from=self.plan_file_text)
        if o.control_port:
            self.control = ControlServer(create_app(self.controller, o.token), o.host, o.control_port)
            self.token_path = o.token_file or self.runtime / env.CONTROL_TOKEN_FILE
            if o.token_file is None:
                write_private(self.token_path, o.token)
        if ready is not None:
            ready(self)
        if self.control is not None:
            self.control.start()
        self.seconds_to_ready = time.monotonic() - t0

    def run(self, stop: threading.Event) -> None:
        """Keep serving until ``stop`` is set: restart a dead server, reload blocks whose process died."""
        assert self.controller is not None, "start() first"
        Supervisor(self.server, self.controller, self.lock, start_timeout=self.options.timeout,
                   load_timeout=self.options.load_timeout, say=self.say).run(stop)

    def stop(self) -> None:
        """Stop the control service and the server (every process it started), remove the runtime directory."""
        try:
            if self.control is not None:
                self.control.stop()
        finally:
            self.server.stop()
            shutil.rmtree(self.runtime, ignore_errors=True)
