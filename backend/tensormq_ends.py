"""A block's TensorMQ ends: the producer that writes its outputs into pool slots and hands out tickets,
the consumer that reads the tickets it is given, and the relay of direct hand-overs
(``backend/tensormq/__init__.py`` has the protocol). A block of another transport has none of them.

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from blockflow.backend import gpu_waits
from blockflow.backend.health import Health
from blockflow.backend.replies import EarlyReply, Packed, packer, ticket_tensor
from blockflow.backend.runtime import BlockRunner
from blockflow.backend.tensormq.answers import AnswerIn, AnswerOut
from blockflow.backend.tensormq.consumer import Consumer
from blockflow.backend.tensormq.handout import HandOut
from blockflow.backend.tensormq.handover import Relay
from blockflow.backend.tensormq.producer import Producer
from blockflow.backend.tensormq.releases import Release
from blockflow.backend.tensormq.wire import NO_ORIGIN
from blockflow.backend.trace import NoTracer, Tracer
from blockflow.core import also_accepts, env, runtime_dir
from blockflow.core.spec import ModelSpec


class TensorMQEnds:
    """Opens, runs a call through and closes one block instance's producer, consumer and relay."""

    def __init__(self, producer: Producer | None, consumer: Consumer | None, relay: Relay | None, answers_early: bool,
                 spec: ModelSpec, stream: int, tracer: Tracer | NoTracer, answer_in: AnswerIn | None = None,
                 answer_out: AnswerOut | None = None) -> None:
        self.producer, self.consumer, self.relay = producer, consumer, relay
        # A chain's head that its tail answers: where the answers come; the tail: how it sends them.
        self.answer_in, self.answer_out = answer_in, answer_out
        self.out_shapes = spec.out_shapes
        self.sender: HandOut | None = relay.out if relay is not None else None  # of direct hand-overs
        self.early = producer is not None and answers_early
        self.stream, self.tracer = stream, tracer
        self.committed: int | None = None  # the event of the current call's last committed pool slot
        # Releases wait on an event of their thread's own, asleep, rather than on the slot's interprocess
        # event, whose wait spun a core in each link (backend/gpu_waits.py); BLOCKFLOW_GPU_WAIT=spin: on the slot's.
        self.own_release_event = gpu_waits.sleeping()

    @classmethod
    def open(cls, args: dict[str, str], spec: ModelSpec, device: torch.device, out_name: str, stream: int,
             health: Health, tracer: Tracer | NoTracer) -> TensorMQEnds:
        """The ends ``spec`` gives the instance Triton describes in ``args``; their files go when the server does."""
        # A call of one request answers it with its tickets before queuing its GPU work (replies.EarlyReply)
        # where the spec allows it (ModelSpec.answers_early) and BLOCKFLOW_TMQ_EARLY is not "0".
        answers_early = spec.answers_early and os.environ.get(env.TMQ_EARLY) != "0"
        if spec.transport != "tensormq" or spec.tensormq is None:
            return cls(None, None, None, answers_early, spec, stream, tracer)
        model = args["model_name"]
        # BLOCKFLOW_RUNTIME_DIR under `blockflow serve`; beside the repository under a tritonserver started by hand.
        runtime = runtime_dir.locate(Path(args["model_repository"]).parent)
        runtime_dir.ensure_tensormq(runtime)
        t = spec.tensormq
        producer = consumer = None
        if not spec.gives_logits:
            producer = Producer(f"{model}/{args['model_instance_name']}", runtime, device,
                                t.pool_mb * 2**20, t.slots, t.lease_s, t.wait_s, model=model,
                                max_samples=spec.max_batch_size, claim_s=t.claim_window_s,
                                prepare=os.environ.get(env.TMQ_PREPARE) != "0", pack=packer(out_name if answers_early else None))
            health.on_gone(producer.remove_files)
        if not spec.takes_image:
            consumer = Consumer(runtime, device, accepts_from=spec.accepts_from,
                                also_accepts=Path(args["model_repository"]) / also_accepts.FILE)
        role = spec.hand_over
        answer_in = AnswerIn(runtime) if role is not None and role.answered_by else None
        if answer_in is not None:
            health.on_gone(answer_in.remove_file)
        relay = Relay.open(runtime, model, role, consumer, producer is not None, t.claim_window_s,
                           origin=answer_in.origin if answer_in is not None else NO_ORIGIN)
        if relay is not None:
            health.on_gone(relay.remove_files)
        answer_out = AnswerOut(runtime) if role is not None and role.tail else None
        tracer.memory("tensormq")
        return cls(producer, consumer, relay, answers_early, spec, stream, tracer, answer_in, answer_out)

    def begin(self) -> None:
        """A new call."""
        self.committed = None
        if self.relay is not None:
            self.relay.begin()  # a sender's keys and a receiver's wait start afresh with each call

    def produce(self, runner: BlockRunner, xs: list[torch.Tensor], early: EarlyReply | None,
                before_send: Callable[[list[bytes]], object] | None = None) -> list[torch.Tensor]:
        """One batch through ``runner`` straight into a pool slot: its event recorded, its tickets handed out. No host sync.

        ``early``: sends the tickets as the call's response before the GPU work is queued (a
        failure after that marks them failed: their consumer refuses them). ``before_send``: given
        the tickets before a sender hands them over (a chain's head notes the keys it waits for)."""
        producer, tracer, lap = self.producer, self.tracer, self.tracer.part_lap
        assert producer is not None  # the block's _run asked
        reservation = producer.reserve_tensors(int(xs[0].shape[0]), self.out_shapes, runner.out_dtype)
        tracer.lap("run:reserve")
        # A prepared reservation's tickets come packed (by the preparer thread, between two calls).
        packed: Packed | None = reservation.packed
        handed = packed.tensor if packed is not None else None  # the tickets as the block hands them on
        try:
            sender = self.sender
            if early is not None or sender is not None:
                tickets = producer.issue(reservation)  # marks them handed on early, also when packed
                handed = ticket_tensor(tickets) if handed is None else handed
                if sender is not None:
                    if before_send is not None:
                        before_send(tickets)
                    sender.send(tickets, must_reach=before_send is not None)
                if early is not None:
                    early(handed, packed.response if packed is not None else None)
                tracer.lap("run:reply")
            runner.run_all(xs, outs=reservation.views, lap=lap)
        except BaseException:
            producer.abort(reservation)
            raise
        tracer.lap("run:graph")
        tickets = producer.commit(reservation, self.stream, lap)
        self.committed = producer.done_event(reservation)
        tracer.lap("run:commit")
        return [handed if handed is not None else ticket_tensor(tickets)]

    def end_sends(self) -> None:
        """The call is over: a sender fails the hand-overs of the keys it took but never sent."""
        if self.sender is not None:
            self.sender.finish("the batch failed before its tickets were issued")

    def end(self, releases: list[Release], synced: bool, failed: bool) -> None:
        """After the call's responses: release its producers' slots and prepare this block's next one."""
        if self.consumer is not None and releases:
            # Release the producers' slots once the GPU work that read them is done (see blockflow.backend.tensormq):
            # at once after the stream's sync; else after an event recorded now (or, waits spinning, after
            # this block's own slot event, recorded at its commit after that work: one driver call less).
            try:
                after = None if failed or self.own_release_event else self.committed
                self.consumer.release_after(releases, None if synced else self.stream, after)
            except Exception:  # no event could be recorded: a sticky CUDA error, after which nothing reads them
                self.consumer.release_now(releases)
            self.tracer.lap("respond:release")
        if self.producer is not None:
            self.producer.prepare_ahead()  # the next small batch's slot and tickets, while this block waits
            self.tracer.lap("respond:prepare")

    def close(self, drain_s: float) -> None:
        if self.relay is not None:
            self.relay.close()
        if self.answer_out is not None:
            self.answer_out.close()
        if self.consumer is not None:
            self.consumer.close()  # sends the releases still queued
        if self.producer is not None:
            # Triton unloads an instance once its own requests are done, but tickets it issued may
            # still be on their way to the next block (a plan update, a reload): wait for them.
            self.producer.close(drain_s=drain_s)
