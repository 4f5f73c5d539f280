"""The Python-backend model every generated block and reference model runs.

One instance is one stub process. ``initialize`` reads the model's spec from
its config (parameter ``blockflow.spec``), builds the block on the instance's
device, warms it up and, for TensorMQ, opens its producer pool and consumer.
``execute`` runs every request of the call as one batch (this is where dynamic
batching across tasks that share the block pays off) and gives each request its
own rows; a request that cannot be read fails alone with a clear error. A head
pack (``pack: heads``) holds several tasks' heads and runs, per request, the
heads whose outputs it asks for.

Tensors cross the stub boundary by DLPack in both directions: the Python
backend mishandles numpy 2 arrays, and DLPack keeps GPU tensors on the GPU.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]  # re-exported without __all__

from blockflow.backend import instance_args
from blockflow.backend.device_inputs import DeviceInputs
from blockflow.backend.monitor import BlockMonitor, metric_labels
from blockflow.backend.replies import EarlyReply, Packed, error, failed_response, failure_code, packer, split, ticket_tensor
from blockflow.backend.runtime import DTYPES, BlockRunner
from blockflow.backend.server_watch import ServerWatch
from blockflow.backend.stage_cache import StageCache
from blockflow.backend.tensormq.consumer import Consumer
from blockflow.backend.tensormq.handover import Relay
from blockflow.backend.tensormq.metrics import TmqMetrics
from blockflow.backend.tensormq.producer import Producer
from blockflow.backend.trace import Tracer, trace_dir
from blockflow.core import also_accepts, env, runtime_dir
from blockflow.core.activity import ActivityStamp
from blockflow.core.errors import BlockError, RequestError
from blockflow.core.spec import ACTIVATION_IN, ACTIVATION_OUT, IMAGE, LOGITS, activation_names

# How long an unloading producer waits for its outstanding tickets to be released (never past the lease).
DRAIN_S = 10.0


class TritonPythonModel:
    """Triton's entry points for one block instance."""

    def initialize(self, args: dict[str, str]) -> None:
        # Where a block's start-up time goes (the stub's start and imports, building, warming up),
        # written on its ready line: live plan changes wait for it.
        t0 = time.monotonic()
        started = max(0.0, time.time() - psutil.Process().create_time())
        # First: a block whose server dies while it builds or warms up exits too.
        self.watch = ServerWatch(f"{args['model_name']} instance {args['model_instance_name']}")
        # `kill -USR2 <block pid>`: every thread's Python stack to the stub's stderr (the server's log),
        # written by the signal handler without the GIL, so it also shows a block whose threads hang.
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        config = json.loads(args["model_config"])
        self.spec = spec = instance_args.spec_from_config(config)
        self.device = instance_args.device(args)
        # Triton tensor names: a TensorMQ hop is one ticket per sample whatever it carries; other
        # hops have one tensor per value that crosses the cut.
        tmq = spec.transport == "tensormq"
        self.in_names = [IMAGE] if spec.takes_image else activation_names(ACTIVATION_IN, 1 if tmq else len(spec.in_shapes))
        self.out_names = [LOGITS] if spec.gives_logits else activation_names(ACTIVATION_OUT, 1 if tmq else len(spec.out_shapes))
        self.out_name = self.out_names[0]
        # Logits leave the GPU here, in the process that made them, with one copy per execute.
        # Handed to Triton on the GPU, they cost a CUDA IPC hand-off and a device-to-host copy in
        # the server's own CUDA context (its HTTP and gRPC responses need them in host memory);
        # without MPS that context waits for a time slice behind the block processes, which made
        # the last block the pipeline's bottleneck under load (bench/results/h100/tail/).
        logits_on_gpu = os.environ.get(env.LOGITS_ON_GPU) == "1"
        self.to_host = self.device.type == "cuda" and (spec.transport == "triton-cpu" or (spec.gives_logits and not logits_on_gpu))
        self.logger = pb_utils.Logger
        # Under --warm-cores-ms: each execute tells the server's CPU pollers that requests are flowing.
        stamp = os.environ.get(env.ACTIVITY_FILE)
        self.activity: ActivityStamp | None = None
        if stamp:
            try:
                self.activity = ActivityStamp(Path(stamp), writable=True)
            except (OSError, ValueError) as exc:  # the pollers then sleep: slower, never wrong
                self.logger.log_warn(f"blockflow: {args['model_name']}: {env.ACTIVITY_FILE}={stamp} unusable ({exc}); "
                                     "the server's CPU pollers will not see this block's requests")
        directory = trace_dir()
        self.tracer = Tracer(directory, args["model_name"], args["model_instance_name"], self.device) if directory else None
        # Handed to the consumer, the runner and the producer, which time the hop's finer steps with it.
        self.lap = self.tracer.lap if self.tracer is not None else None
        if self.tracer is not None:
            self.tracer.memory("start", cuda_module_loading=os.environ.get("CUDA_MODULE_LOADING"))
            if self.device.type == "cuda":
                torch.zeros(1, device=self.device)
                self.tracer.memory("context")
        # A runner per output: a head pack (several tasks' heads in this one process) has one per
        # task's head; every other model has one.
        cache = StageCache.of_runtime_dir()
        if spec.heads:
            self.runners = {out: BlockRunner(s, self.device, cache) for out, s in spec.head_specs()}
        else:
            self.runners = {self.out_name: BlockRunner(spec, self.device, cache)}
        self.runner = next(iter(self.runners.values()))
        t_built = time.monotonic()
        # The stream every block's work goes on (torch's current stream, fixed for the instance's
        # life); read once here, as each lookup costs a torch call on the request path.
        self.stream = int(torch.cuda.current_stream(self.device).cuda_stream) if self.device.type == "cuda" else 0
        if self.tracer is not None:
            self.tracer.memory("weights")
        # A pack's heads run one after another on one stream, so their CUDA graphs share one memory pool.
        pool = torch.cuda.graph_pool_handle() if spec.heads and self.runner.use_graphs else None
        for runner in self.runners.values():
            runner.warmup(pool)
        t_warm = time.monotonic()
        if self.tracer is not None:
            self.tracer.memory("warmup")
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        # A call of one request answers it with its tickets before queuing its GPU work (replies.EarlyReply).
        # A sender of direct hand-overs answers after its commit (backend/tensormq/handover.py).
        answers_early = not spec.heads and os.environ.get(env.TMQ_EARLY) != "0" and not (spec.hand_over and spec.hand_over.to)
        self.relay: Relay | None = None
        if spec.transport == "tensormq" and spec.tensormq is not None:
            # BLOCKFLOW_RUNTIME_DIR under `blockflow serve`; beside the repository under a tritonserver started by hand.
            runtime = runtime_dir.locate(Path(args["model_repository"]).parent)
            runtime_dir.ensure_tensormq(runtime)
            if not spec.gives_logits:
                t = spec.tensormq
                self.producer = Producer(f"{args['model_name']}/{args['model_instance_name']}", runtime, self.device,
                                         t.pool_mb * 2**20, t.slots, t.lease_s, t.wait_s, model=args["model_name"],
                                         max_samples=spec.max_batch_size, claim_s=t.claim_window_s,
                                         prepare=os.environ.get(env.TMQ_PREPARE) != "0", pack=packer(self.out_name if answers_early else None))
                self.watch.on_gone(self.producer.remove_files)
            if not spec.takes_image:
                self.consumer = Consumer(runtime, self.device, accepts_from=spec.accepts_from,
                                         also_accepts=Path(args["model_repository"]) / also_accepts.FILE)
            self.relay = Relay.open(runtime, args["model_name"], spec.hand_over, self.consumer, self.producer is not None,
                                    spec.tensormq.claim_window_s)
            if self.relay is not None:
                self.watch.on_gone(self.relay.remove_files)
            if self.tracer is not None:
                self.tracer.memory("tensormq")
        self.sender = self.relay.out if self.relay is not None else None  # of direct hand-overs
        # Outputs handed to Triton (on the GPU, or copied to the host without blocking) need one
        # sync per execute; TensorMQ tickets need none (consumers wait on the slot's event).
        self.sync_outputs = self.device.type == "cuda" and self.producer is None
        self.early = self.producer is not None and answers_early
        self.committed: int | None = None  # the event of the current call's last committed pool slot
        # Images that arrive on a GPU (CUDA shared memory) are copied into this block's memory.
        self.device_inputs = DeviceInputs(self.device) if spec.takes_image and self.device.type == "cuda" else None
        self.pins_host_inputs = any(r.pins_host_inputs for r in self.runners.values())  # see BlockRunner.settle_inputs
        self.metrics: TmqMetrics | None = None
        self.monitor: BlockMonitor | None = None
        labels = metric_labels(args["model_name"], args["model_instance_name"], self.device)
        if (self.producer or self.consumer) and hasattr(pb_utils, "MetricFamily"):
            self.metrics = TmqMetrics(pb_utils, labels, self.producer, self.consumer)  # on a thread of its own
        if spec.monitor_period_s > 0 and hasattr(pb_utils, "MetricFamily"):
            self.monitor = BlockMonitor(pb_utils, labels, self.device, spec.monitor_period_s)
            if self.tracer is not None:
                self.tracer.memory("monitor")
        self.logger.log_info(
            f"blockflow: {args['model_name']} instance {args['model_instance_name']} ready on {self.device} "
            f"(stages {spec.first_stage}-{spec.last_stage}{f', {len(spec.heads)} heads' if spec.heads else ''}, {spec.precision}, "
            f"graphs={'on' if self.runner.use_graphs else 'off'}, transport={spec.transport}); "
            f"start-up s: process and imports {started:.2f}, build {t_built - t0:.2f}, warm-up {t_warm - t_built:.2f}, "
            f"rest {time.monotonic() - t_warm:.2f}"
        )

    def _input(self, request: Any, releases: list[Any]) -> list[torch.Tensor]:
        """A request's input tensors (the tensors its tickets name, for TensorMQ)."""
        tensors = []
        for name in self.in_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                raise RequestError(f"request has no input {name!r}")
            tensors.append(tensor)
        if self.consumer is not None:
            # Tickets are 256 host bytes: NumPy takes them through the tensor's own DLPack export in
            # ~5 us, where torch.utils.dlpack.from_dlpack took ~30 us inside a stub (2-core host).
            # Not as_numpy(): that is a copy the stub made when it loaded the request, and with the
            # H100 machine's NumPy it held the same wrong bytes on every request.
            tickets = np.from_dlpack(tensors[0]) if tensors[0].is_cpu() else from_dlpack(tensors[0].to_dlpack())
            if self.tracer is not None:
                self.tracer.lap("read:input")
            gather = self.consumer.gather_tensors
            views, rel = (gather(tickets, self.spec.in_shapes, self.stream, self.lap) if self.relay is None else
                          self.relay.read(tickets, lambda t: gather(t, self.spec.in_shapes, self.stream, self.lap)))
            if self.tracer is not None:
                self.tracer.lap("read:gather")
            releases.extend(rel)
            return views
        xs = [from_dlpack(t.to_dlpack()) for t in tensors]
        dtype = torch.float32 if self.spec.takes_image else DTYPES[self.spec.in_dtype]
        for name, x, shape in zip(self.in_names, xs, self.spec.in_shapes, strict=True):
            if x.dtype != dtype or tuple(x.shape[1:]) != shape or x.shape[0] != xs[0].shape[0]:
                raise RequestError(f"input {name!r} is {x.dtype} {list(x.shape)}; "
                                   f"expected {dtype} [{int(xs[0].shape[0])}, {', '.join(map(str, shape))}]")
        return xs

    def execute(self, requests: list[Any]) -> list[Any]:
        if self.activity is not None:
            self.activity.touch(len(requests))
        if self.tracer is None:
            return self._execute(requests)
        self.tracer.begin()
        responses = self._execute(requests)
        self.tracer.end(len(requests))
        return responses

    def _execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        self.committed = None
        sender = self.sender
        if self.relay is not None:
            self.relay.begin()  # a sender's keys and a receiver's wait start afresh with each call
        batch: list[list[torch.Tensor]] = []  # each request's input tensors
        owners: list[int] = []
        releases: list[Any] = []
        for i, request in enumerate(requests):
            try:
                batch.append(self._input(request, releases))
                owners.append(i)
            except RequestError as exc:  # fails this request alone: the caller's fault (HTTP 400), or its ticket's producer's
                responses[i] = pb_utils.InferenceResponse(error=error(str(exc), failure_code(exc)))
        if not batch:
            return responses
        outputs: list[list[Any]] = [[] for _ in batch]  # each request's output tensors
        failed: set[int] = set()  # positions in ``batch``
        early = EarlyReply(requests[0], self.out_name) if self.early and len(requests) == 1 and owners else None
        synced = False
        try:
            try:
                if self.device_inputs is not None and self.device_inputs.own(batch) and self.tracer is not None:
                    self.tracer.lap("read:own")
            except Exception as exc:  # a copy that cannot run fails this call's requests, never the stub
                self._fail(responses, owners, batch, range(len(batch)), exc)
                return responses
            if self.tracer is not None:
                self.tracer.mark()  # inputs read
                self.tracer.gpu_begin()
            for name, ks in self._groups(requests, owners).items():
                sizes = [int(batch[k][0].shape[0]) for k in ks]
                try:
                    runner = self.runners[name]
                    joined = batch[ks[0]] if len(ks) == 1 else runner.join([[batch[k][j] for k in ks]
                                                                            for j in range(len(batch[ks[0]]))])
                    results = self._run(runner, joined, early)
                    if early is not None and early.sent:
                        continue  # answered with its tickets already
                    names = [name] if len(results) == 1 else self.out_names
                    for out_name, result in zip(names, results, strict=True):
                        for k, rows in zip(ks, split(result, sizes), strict=True):
                            outputs[k].append(pb_utils.Tensor.from_dlpack(out_name, to_dlpack(rows)))
                except Exception as exc:  # a failed batch (in a pack, one head's) fails its requests, never the stub
                    failed.update(ks)
                    self._fail(responses, owners, batch, ks, exc)
            if self.sync_outputs:
                try:
                    # Triton reads the outputs once execute returns, so their kernels (and copies to
                    # the host) must be done by then. One wait for the whole call: a pack queues every
                    # head's work first.
                    torch.cuda.current_stream(self.device).synchronize()
                    synced = True  # what read the producers' slots is done too: release them now
                except Exception as exc:
                    rest = [k for k in range(len(batch)) if k not in failed]
                    failed.update(rest)
                    self._fail(responses, owners, batch, rest, exc)
            if self.tracer is not None:
                self.tracer.mark()  # work done (TensorMQ: queued)
            if early is not None and early.sent:
                responses[0] = None  # answered already (even if its batch then failed): one response per request
                return responses
            for k, i in enumerate(owners):
                if k not in failed:
                    responses[i] = pb_utils.InferenceResponse(output_tensors=outputs[k])
        finally:
            if sender is not None:
                sender.finish("the batch failed before its tickets were issued")
            if self.pins_host_inputs:
                self._settle_inputs()
            if self.consumer is not None and releases:
                # Release the producers' slots once the GPU work that read them is done (see blockflow.backend.tensormq):
                # at once after the stream's sync; else after this block's own slot event, recorded at its
                # commit after that work (one driver call less); else after an event recorded now.
                self.consumer.release_after(releases, None if synced else self.stream, None if failed else self.committed)
                if self.tracer is not None:
                    self.tracer.lap("respond:release")
            if self.producer is not None:
                self.producer.prepare_ahead()  # the next small batch's slot and tickets, while this block waits
                if self.tracer is not None:
                    self.tracer.lap("respond:prepare")
        return responses

    def _settle_inputs(self) -> None:
        """Before ``execute`` returns, what reads the requests' host inputs must be done (Triton frees them)."""
        waited = False
        for runner in self.runners.values():
            try:
                waited = runner.settle_inputs() or waited
            except BlockError as exc:  # the GPU failed: the call's outcome is decided already
                self.logger.log_error(f"blockflow: {self.spec.name}: waiting for the input copies failed: {exc!r}")
        if waited and self.tracer is not None:
            self.tracer.lap("respond:settle")

    def _groups(self, requests: list[Any], owners: list[int]) -> dict[str, list[int]]:
        """Output name -> positions in the batch of the requests that want it.

        A model has one output, except a head pack: an ensemble step asks only for the outputs in
        its output map, so a task's request runs its own head; a direct request that names no
        output gets every head's.
        """
        if not self.spec.heads:
            return {self.out_name: list(range(len(owners)))}
        groups: dict[str, list[int]] = {}
        for k, i in enumerate(owners):
            for name in requests[i].requested_output_names() or self.runners:
                groups.setdefault(name, []).append(k)  # Triton refuses outputs the config does not list
        return groups

    def _fail(self, responses: list[Any], owners: list[int], batch: list[list[torch.Tensor]], ks: Iterable[int],
              exc: Exception) -> None:
        """Fail the requests at positions ``ks`` of ``batch`` (``owners[k]`` in ``responses``) with ``exc``."""
        positions = list(ks)
        samples = sum(int(batch[k][0].shape[0]) for k in positions)
        self.logger.log_error(f"blockflow: {self.spec.name}: batch of {samples} failed: {exc!r}")
        for k in positions:
            responses[owners[k]] = failed_response(exc, self.spec.name)

    def _run(self, runner: BlockRunner, xs: list[torch.Tensor], early: EarlyReply | None = None) -> list[torch.Tensor]:
        """One batch through ``runner``: its outputs (on the host for logits and triton-cpu), or TensorMQ tickets.

        ``early``: sends the tickets as the call's response before the GPU work is queued (a
        failure after that marks them failed: their consumer refuses them)."""
        if self.producer is None:
            outs = runner.run_all(xs)
            # Into pinned memory (torch's caching host allocator) without blocking; _execute waits once.
            return [out.to("cpu", non_blocking=True) for out in outs] if self.to_host else outs
        # TensorMQ: write straight into a pool slot, record its event, hand out tickets. No host sync.
        tracer = self.tracer
        reservation = self.producer.reserve_tensors(int(xs[0].shape[0]), self.spec.out_shapes, runner.out_dtype)
        if tracer is not None:
            tracer.lap("run:reserve")
        # A prepared reservation's tickets come packed (by the preparer thread, between two calls).
        packed: Packed | None = reservation.packed
        handed = packed.tensor if packed is not None else None  # the tickets as the block hands them on
        try:
            sender = self.sender
            if early is not None or sender is not None:
                tickets = self.producer.issue(reservation)  # marks them handed on early, also when packed
                handed = ticket_tensor(tickets) if handed is None else handed
                if sender is not None:
                    sender.send(tickets)
                if early is not None:
                    early(handed, packed.response if packed is not None else None)
                if tracer is not None:
                    tracer.lap("run:reply")
            runner.run_all(xs, outs=reservation.views, lap=self.lap)
        except BaseException:
            self.producer.abort(reservation)
            raise
        if tracer is not None:
            tracer.lap("run:graph")
        tickets = self.producer.commit(reservation, self.stream, self.lap)
        self.committed = self.producer.done_event(reservation)
        if tracer is not None:
            tracer.lap("run:commit")
        return [handed if handed is not None else ticket_tensor(tickets)]

    def finalize(self) -> None:
        self.watch.close()
        if self.activity is not None:
            self.activity.close()
        if self.tracer is not None:
            self.tracer.close()
        if self.monitor is not None:
            self.monitor.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.relay is not None:
            self.relay.close()
        if self.consumer is not None:
            self.consumer.close()  # sends the releases still queued
        if self.producer is not None:
            # Triton unloads an instance once its own requests are done, but tickets it issued may
            # still be on their way to the next block (a plan update, a reload): wait for them.
            self.producer.close(drain_s=DRAIN_S)
        self.runner = None  # type: ignore[assignment]
        self.runners = {}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
