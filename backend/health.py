"""A block instance's health and metrics: its life bound to the server's, its threads' stacks on
demand, its activity for the server's CPU pollers, and its series on Triton's metrics endpoint.

Inside a stub only (it needs ``triton_python_backend_utils``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Callable
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils

from blockflow.backend.monitor import BlockMonitor, metric_labels
from blockflow.backend.server_watch import ServerWatch
from blockflow.backend.tensormq.consumer import Consumer
from blockflow.backend.tensormq.metrics import AnswerCounts, LinkCounts, TmqMetrics
from blockflow.backend.tensormq.producer import Producer
from blockflow.backend.trace import NoTracer, Tracer
from blockflow.core import env
from blockflow.core.activity import ActivityStamp


class Health:
    """The server watch, the stack dump on SIGUSR2 and the activity stamp of one block instance.

    Made first in ``initialize``: a block whose server dies while it builds or warms up exits too.
    """

    def __init__(self, model: str, instance: str) -> None:
        self.watch = ServerWatch(f"{model} instance {instance}")
        # `kill -USR2 <block pid>`: every thread's Python stack to the stub's stderr (the server's log),
        # written by the signal handler without the GIL, so it also shows a block whose threads hang.
        faulthandler.register(signal.SIGUSR2, all_threads=True)
        # A block that crashes (a fault in a native library) leaves its Python stack in the server's
        # log too, where the server itself reports only "Stub process ... is not healthy".
        faulthandler.enable(all_threads=True)
        # Under --warm-cores-ms: each execute tells the server's CPU pollers that requests are flowing.
        stamp = os.environ.get(env.ACTIVITY_FILE)
        self.activity: ActivityStamp | None = None
        if stamp:
            try:
                self.activity = ActivityStamp(Path(stamp), writable=True)
            except (OSError, ValueError) as exc:  # the pollers then sleep: slower, never wrong
                pb_utils.Logger.log_warn(f"blockflow: {model}: {env.ACTIVITY_FILE}={stamp} unusable ({exc}); "
                                         "the server's CPU pollers will not see this block's requests")

    def touch(self, requests: int) -> None:
        if self.activity is not None:
            self.activity.touch(requests)

    def on_gone(self, cleanup: Callable[[], object]) -> None:
        """Run ``cleanup`` (removing files others would find) before the process exits with its server."""
        self.watch.on_gone(cleanup)

    def close(self) -> None:
        self.watch.close()
        if self.activity is not None:
            self.activity.close()


class Metrics:
    """The block's series on Triton's metrics endpoint: its TensorMQ pools and consumer, and the block monitor.

    Each samples on a thread of its own; a backend without custom metrics gets neither.
    """

    def __init__(self, model: str, instance: str, device: torch.device, producer: Producer | None, consumer: Consumer | None,
                 monitor_period_s: float, tracer: Tracer | NoTracer, link: LinkCounts | None = None,
                 answers: AnswerCounts | None = None) -> None:
        self.tmq: TmqMetrics | None = None
        self.monitor: BlockMonitor | None = None
        labels = metric_labels(model, instance, device)
        if (producer or consumer) and hasattr(pb_utils, "MetricFamily"):
            self.tmq = TmqMetrics(pb_utils, labels, producer, consumer, link=link, answers=answers)
        if monitor_period_s > 0 and hasattr(pb_utils, "MetricFamily"):
            self.monitor = BlockMonitor(pb_utils, labels, device, monitor_period_s)
            tracer.memory("monitor")

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.tmq is not None:
            self.tmq.close()
