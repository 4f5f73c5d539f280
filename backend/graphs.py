"""A block's CUDA graphs: one per batch-size bucket, captured at warm-up and replayed per request.

What a graph holds, how it is captured, and the usual TensorMQ hop's replay (driver memcpys
around it, no other torch call). :class:`blockflow.backend.runtime.BlockRunner` decides what a
graph runs and when; this module knows nothing of a block's stages or inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from blockflow.core import cuda
from blockflow.core.errors import RequestError

PLAIN_HOPS = 1024  # checked hops kept; more than a block's pools hand out views for


def batch_buckets(max_batch_size: int, quarters: bool = False) -> list[int]:
    """The batch sizes a block captures a graph for: powers of two up to ``max_batch_size`` and
    ``max_batch_size`` itself; with ``quarters`` (``BLOCKFLOW_GRAPH_BUCKETS=quarter``) the quarter steps
    between two powers of two from 16 on too (20, 24, 28, 40, ...), so a batch above 16 runs at most a
    quarter of padding. Powers of two alone by default: on an H200 the quarter steps cut the split's
    GPU energy per inference by ~4% and moved no throughput, for 14-175 MiB more GPU memory per process
    (docs/performance.md, "Levers tried and not adopted")."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        if quarters and b >= 16:
            out += [q for q in (b * 5 // 4, b * 3 // 2, b * 7 // 4) if q < max_batch_size]
        b *= 2
    out.append(max_batch_size)
    return out


def bucket_for(batch: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= batch:
            return b
    raise RequestError(f"batch of {batch} exceeds the block's max_batch_size {buckets[-1]}")


@dataclass
class Graph:
    """One bucket's captured graph and the static tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    static_ins: list[torch.Tensor]
    static_outs: list[torch.Tensor]


def capture(forward: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]], static_ins: list[torch.Tensor],
            device: torch.device, pool: Any) -> Graph:
    """``forward`` on ``static_ins`` captured as a CUDA graph into memory pool ``pool``, after warm-up calls."""
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):  # cuDNN picks algorithms on the first calls; keep that out of the graph
            forward(static_ins)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        static_outs = forward(static_ins)
    return Graph(graph, static_ins, static_outs)


class PlainHop:
    """A TensorMQ hop checked once: its input and output tensors (the same pool views come back
    request after request), its graph, and the plain copies' addresses. Checking a hop costs ~20
    torch calls, ~16-18 us a call on an H100 host that woke for the request (docs/performance.md,
    "The split's cost"); finding it again costs a dict lookup."""

    __slots__ = ("x", "out", "graph", "copies_in", "copies_out")

    def __init__(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], g: Graph) -> None:
        self.x, self.out, self.graph = xs[0], outs[0], g.graph
        self.copies_in = [(s.data_ptr(), x.data_ptr(), s.nbytes) for s, x in zip(g.static_ins, xs, strict=True)]
        self.copies_out = [(o.data_ptr(), r.data_ptr(), o.nbytes) for o, r in zip(outs, g.static_outs, strict=True)]

    def replay(self, stream: int, lap: Callable[[str], None] | None) -> None:
        """Copy in, replay, copy out on ``stream``: the usual TensorMQ hop, with no torch call but the replay."""
        if lap is not None:
            lap("run:checks")
        for dst, src, nbytes in self.copies_in:
            cuda.memcpy_async(dst, src, nbytes, stream)
        if lap is not None:
            lap("run:copy_in")
        self.graph.replay()
        if lap is not None:
            lap("run:replay")
        for dst, src, nbytes in self.copies_out:
            cuda.memcpy_async(dst, src, nbytes, stream)
