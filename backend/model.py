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

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import psutil
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack  # type: ignore[attr-defined]  # re-exported without __all__

from blockflow.backend import instance_args
from blockflow.backend.chain_answers import ChainAnswers, Waiting
from blockflow.backend.gpu_waits import GpuWaits
from blockflow.backend.health import Health, Metrics
from blockflow.backend.link_loop import LinkLoop
from blockflow.backend.replies import EarlyReply, failed_response, split, trimmed
from blockflow.backend.request_inputs import RequestInputs
from blockflow.backend.runtime import BlockRunner
from blockflow.backend.stage_cache import StageCache
from blockflow.backend.tensormq.releases import Release
from blockflow.backend.tensormq_ends import TensorMQEnds
from blockflow.backend.trace import tracer_for
from blockflow.core import cuda, env
from blockflow.core.errors import BlockError, RequestError
from blockflow.core.spec import ModelSpec

# How long an unloading producer waits for its outstanding tickets to be released (never past the lease).
DRAIN_S = 10.0


def _to_stderr(message: str) -> None:
    """A thread of the block's own logs here: Triton's logger can block, holding the GIL, once the server
    is gone (docs/triton-notes.md), and such a thread outlives the server's calls."""
    print(message, file=sys.stderr, flush=True)


class TritonPythonModel:
    """Triton's entry points for one block instance.

    Its roles: ``health`` (server watch, stack dumps, activity stamp), ``tracer`` (a no-op unless
    tracing), ``runners`` (the block itself), ``ends`` (the TensorMQ hand-over: producer, consumer,
    relay), ``inputs`` (the input path) and ``metrics``.
    """

    def initialize(self, args: dict[str, str]) -> None:
        # Where a block's start-up time goes (the stub's start and imports, building, warming up),
        # written on its ready line: live plan changes wait for it.
        t0 = time.monotonic()
        started = max(0.0, time.time() - psutil.Process().create_time())
        model, instance = args["model_name"], args["model_instance_name"]
        self.health = Health(model, instance)  # first: a block whose server dies while it builds or warms up exits too
        if problems := env.switch_problems(os.environ):  # a hand-started server's, which no `blockflow serve` checked
            raise BlockError("; ".join(problems))
        self.logger = pb_utils.Logger
        self.spec = spec = instance_args.spec_from_config(json.loads(args["model_config"]))
        self.device = instance_args.device(args)
        self.schedule = ""  # BLOCKFLOW_CUDA_SCHEDULE, where set (a GPU block)
        if self.device.type == "cuda":
            # A GPU block's host work is Python and copies; torch's intra-op thread pool in each of
            # several processes only fights over the cores (a 4-instance ingest model on an H200 fell
            # from 20,150/s to ~150/s with torch's default threads).
            torch.set_num_threads(1)
            self.schedule = os.environ.get(env.CUDA_SCHEDULE, "")
            if self.schedule:  # before torch makes the context, which reads the flag once
                cuda.set_schedule(self.device.index or 0, self.schedule)
        self.in_names, self.out_names = instance_args.tensor_names(spec)
        self.out_name = self.out_names[0]
        self.tracer = tracer_for(model, instance, self.device)
        self.tracer.start()
        self._build(spec)
        t_built = time.monotonic()
        self.tracer.memory("weights")
        self._warm_up()
        t_warm = time.monotonic()
        self.tracer.memory("warmup")
        self.ends = TensorMQEnds.open(args, spec, self.device, self.out_name, self.stream, self.health, self.tracer)
        self.inputs = RequestInputs(spec, self.in_names, self.device, self.ends, self.stream, self.tracer)
        # A chain's link (plan option hand_over: chain) runs what it is handed on a thread of its own.
        self.link_loop = (LinkLoop(self.ends, self.runner, spec.in_shapes, self.device, max(1, spec.max_batch_size),
                                     self.health.touch, _to_stderr, self.waits)
                           if spec.hand_over is not None and spec.hand_over.link and self.ends.relay is not None else None)
        # A chain's head that its tail answers: the requests that wait for those answers.
        self.answers = (ChainAnswers(self.ends.answer_in, spec.task_outputs, spec.tensormq.lease_s if spec.tensormq else 30.0,
                                     spec.name, _to_stderr)
                        if self.ends.answer_in is not None else None)
        self.metrics = Metrics(model, instance, self.device, self.ends.producer, self.ends.consumer, spec.monitor_period_s, self.tracer,
                               link=self.link_loop, answers=self.answers)
        # Outputs handed to Triton (on the GPU, or copied to the host without blocking) need one
        # sync per execute; TensorMQ tickets need none (consumers wait on the slot's event).
        self.sync_outputs = self.device.type == "cuda" and self.ends.producer is None
        self.logger.log_info(
            f"blockflow: {model} instance {instance} ready on {self.device} "
            f"(stages {spec.first_stage}-{spec.last_stage}{f', {len(spec.heads)} heads' if spec.heads else ''}, {spec.precision}, "
            f"graphs={'on' if self.runner.use_graphs else 'off'}, transport={spec.transport}"
            f"{f', CUDA waits {self._waits()}' if self.schedule else ''}); "
            f"start-up s: process and imports {started:.2f}, build {t_built - t0:.2f}, warm-up {t_warm - t_built:.2f}, "
            f"rest {time.monotonic() - t_warm:.2f}"
        )

    def _waits(self) -> str:
        """The wait mode the block's CUDA context runs (``BLOCKFLOW_CUDA_SCHEDULE``), for its ready line."""
        try:
            return cuda.schedule()
        except BlockError as exc:  # said, never a reason to fail a block that is ready
            return f"unknown ({exc})"

    def _build(self, spec: ModelSpec) -> None:
        """The block: a runner per output (a head pack, several tasks' heads in this one process, has
        one per task's head; every other model has one), its stream, and where its outputs go."""
        cache = StageCache.configured()
        if spec.heads:
            self.runners = {out: BlockRunner(s, self.device, cache) for out, s in spec.head_specs()}
        else:
            self.runners = {self.out_name: BlockRunner(spec, self.device, cache)}
        self.runner = next(iter(self.runners.values()))
        # The stream every block's work goes on (torch's current stream, fixed for the instance's
        # life); read once here, as each lookup costs a torch call on the request path.
        self.stream = int(torch.cuda.current_stream(self.device).cuda_stream) if self.device.type == "cuda" else 0
        self.pins_host_inputs = any(r.pins_host_inputs for r in self.runners.values())  # see BlockRunner.settle_inputs
        self.waits = GpuWaits(self.device, self.stream)  # how its threads wait for its GPU (backend/gpu_waits.py)
        # Logits leave the GPU here, in the process that made them, with one copy per execute.
        # Handed to Triton on the GPU, they cost a CUDA IPC hand-off and a device-to-host copy in
        # the server's own CUDA context (its HTTP and gRPC responses need them in host memory);
        # without MPS that context waits for a time slice behind the block processes, which made
        # the last block the pipeline's bottleneck under load (docs/triton-notes.md, "The ensemble
        # copies each output into the client's region, in the server's CUDA context").
        logits_on_gpu = os.environ.get(env.LOGITS_ON_GPU) == "1"
        self.to_host = self.device.type == "cuda" and (spec.transport == "triton-cpu" or (spec.gives_logits and not logits_on_gpu))
        # A detector's outputs padded to the batch's largest count, cut to each request's (``replies.trimmed``).
        self.ragged = tuple(i for i, o in enumerate(spec.outputs) if o.shape[:1] == (-1,)) if spec.gives_logits else ()

    def _warm_up(self) -> None:
        # A pack's heads run one after another on one stream, so their CUDA graphs share one memory pool.
        pool = torch.cuda.graph_pool_handle() if self.spec.heads and self.runner.use_graphs else None
        for runner in self.runners.values():
            runner.warmup(pool)

    def execute(self, requests: list[Any]) -> list[Any]:
        self.health.touch(len(requests))
        if self.link_loop is not None:
            why = RequestError(f"block {self.spec.name!r} is a link of a chain (hand_over: chain): it takes its input "
                               "from the block before it directly; send requests to the task's model")
            return [failed_response(why, self.spec.name) for _ in requests]
        self.tracer.begin()
        responses = self._execute(requests)
        self.tracer.end(len(requests))
        return responses

    def _execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        tracer = self.tracer
        self.ends.begin()
        releases: list[Release] = []
        batch, owners = self.inputs.read_all(requests, responses, releases)  # each readable request's input tensors
        if not batch:  # every request failed alone (and gave back what it had claimed: Consumer.gather_tensors)
            return responses
        outputs: list[list[Any]] = [[] for _ in batch]  # each request's output tensors
        failed: set[int] = set()  # positions in ``batch``
        early = EarlyReply(requests[0], self.out_name) if self.ends.early and len(requests) == 1 and owners else None
        waiting: dict[int, Waiting] = {}  # a chain's head: the positions whose requests its tail answers
        synced = False
        try:
            if self.inputs.device_inputs is not None and not self._own_inputs(responses, owners, batch):
                return responses
            tracer.mark()  # inputs read
            tracer.gpu_begin()
            for name, ks in self._groups(requests, owners).items():
                sizes = [int(batch[k][0].shape[0]) for k in ks]
                try:
                    runner = self.runners[name]
                    joined = batch[ks[0]] if len(ks) == 1 else runner.join([[batch[k][j] for k in ks]
                                                                            for j in range(len(batch[ks[0]]))])
                    expect = partial(self._expect, waiting, ks, sizes) if self.answers is not None else None
                    results = self._run(runner, joined, early, expect)
                    if (early is not None and early.sent) or self.answers is not None:
                        continue  # answered with its tickets already, or by the chain's tail (below)
                    names = [name] if len(results) == 1 else self.out_names
                    columns = [split(result, sizes) for result in results]
                    if self.ragged:
                        columns = trimmed(columns, self.ragged)
                    for out_name, column in zip(names, columns, strict=True):
                        for k, rows in zip(ks, column, strict=True):
                            if rows.dim() == 1:  # a value per sample: declared [1] (blockflow.core.arch.task_outputs)
                                rows = rows.unsqueeze(1)
                            outputs[k].append(pb_utils.Tensor.from_dlpack(out_name, to_dlpack(rows)))
                except Exception as exc:  # a failed batch (in a pack, one head's) fails its requests, never the stub
                    for k in ks:
                        waiting.pop(k, None)  # its tail's answers, if any come, are dropped
                    failed.update(ks)
                    self._fail(responses, owners, batch, ks, exc)
            if self.sync_outputs:
                synced = self._sync(responses, owners, batch, failed, len(requests))  # what read the producers' slots is done too
            tracer.mark()  # work done (TensorMQ: queued)
            if early is not None and early.sent:
                responses[0] = None  # answered already (even if its batch then failed): one response per request
                return responses
            if waiting and self.answers is not None:  # a chain's head: its tail's answers, waited for here
                self.answers.collect(list(waiting.values()))
                tracer.lap("respond:answers")
            for k, i in enumerate(owners):
                if k in waiting and self.answers is not None:
                    responses[i] = self.answers.response(waiting[k])
                elif k not in failed:
                    responses[i] = pb_utils.InferenceResponse(output_tensors=outputs[k])
        finally:
            if self.answers is not None:
                self.answers.end_call()
            self.ends.end_sends()
            if self.pins_host_inputs:
                self._settle_inputs(len(requests))
            self.ends.end(releases, synced, bool(failed))
        return responses

    def _expect(self, waiting: dict[int, Waiting], ks: list[int], sizes: list[int], tickets: list[bytes]) -> None:
        """A chain's head, before it hands ``tickets`` over: the requests at batch positions ``ks`` wait for
        its tail's answers (``backend/chain_answers.py``)."""
        assert self.answers is not None
        waiting.update(zip(ks, self.answers.expect(sizes, tickets), strict=True))

    def _own_inputs(self, responses: list[Any], owners: list[int], batch: list[list[torch.Tensor]]) -> bool:
        """Whether the call's GPU inputs are the block's own now (``RequestInputs.own``); if not, its requests failed."""
        try:
            self.inputs.own(batch)
            return True
        except Exception as exc:  # a copy that cannot run fails this call's requests, never the stub
            self._fail(responses, owners, batch, range(len(batch)), exc)
            return False

    def _sync(self, responses: list[Any], owners: list[int], batch: list[list[torch.Tensor]], failed: set[int], requests: int) -> bool:
        """Wait for the call's GPU work; whether it is done (if not, the requests not failed yet fail).

        Triton reads the outputs once execute returns, so their kernels (and copies to the host) must
        be done by then. One wait for the whole call: a pack queues every head's work first.
        """
        try:
            self.waits.stream_done(requests)
            return True
        except Exception as exc:
            rest = [k for k in range(len(batch)) if k not in failed]
            failed.update(rest)
            self._fail(responses, owners, batch, rest, exc)
            return False

    def _settle_inputs(self, requests: int) -> None:
        """Before ``execute`` returns, what reads the requests' host inputs must be done (Triton frees them)."""
        waited = False
        spin_s = self.waits.spin_s(requests)
        for runner in self.runners.values():
            try:
                waited = runner.settle_inputs(spin_s) or waited
            except BlockError as exc:  # the GPU failed: the call's outcome is decided already
                self.logger.log_error(f"blockflow: {self.spec.name}: waiting for the input copies failed: {exc!r}")
        if waited:
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

    def _run(self, runner: BlockRunner, xs: list[torch.Tensor], early: EarlyReply | None = None,
             expect: Callable[[list[bytes]], None] | None = None) -> list[torch.Tensor]:
        """One batch through ``runner``: its outputs (on the host for logits and triton-cpu), or TensorMQ
        tickets (``TensorMQEnds.produce``; ``early`` answers with them before the GPU work is queued;
        ``expect``, a chain's head, notes the requests its tail answers before it hands them over)."""
        if self.ends.producer is not None:
            return self.ends.produce(runner, xs, early, expect)
        outs = runner.run_all(xs)
        # Into pinned memory (torch's caching host allocator) without blocking; _execute waits once.
        # A detector's counts are read on the host right away (``replies.trimmed``): copied at once.
        return [out.to("cpu", non_blocking=not self.ragged) for out in outs] if self.to_host else outs

    def finalize(self) -> None:
        if self.link_loop is not None:
            self.link_loop.close()
        if self.answers is not None:
            self.answers.close()
        self.health.close()
        self.tracer.close()
        self.metrics.close()
        self.ends.close(drain_s=DRAIN_S)
        self.waits.close()
        self.runner = None  # type: ignore[assignment]
        self.runners = {}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
