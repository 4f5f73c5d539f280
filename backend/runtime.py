"""The block runtime: builds a block's stages and runs batches through them.

Pure PyTorch, no Triton: ``backend.model`` wraps it for the Python backend and
tests drive it directly. On a GPU it runs channels-last, in the plan's
precision, and (optionally) replays one CUDA graph per batch-size bucket;
inputs and outputs at its edges are always fp32 in standard layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blockflow.core import arch, env
from blockflow.core.errors import BlockError, RequestError
from blockflow.core.spec import ModelSpec, Part

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def batch_buckets(max_batch_size: int) -> list[int]:
    """Powers of two up to ``max_batch_size``, and ``max_batch_size`` itself."""
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    out.append(max_batch_size)
    return out


def bucket_for(batch: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= batch:
            return b
    raise RequestError(f"batch of {batch} exceeds the block's max_batch_size {buckets[-1]}")


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise BlockError(f"weights file not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for a bad file
        raise BlockError(f"cannot read weights file {path}: {exc}") from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise BlockError(f"weights file {path} holds a {type(state).__name__}, not a state dict")
    return state


def build_part(spec: ModelSpec, part: Part) -> nn.Module:
    """The stages of one part with its weights (CPU, fp32, eval mode)."""
    seed = part.weights.seed if part.weights.seed is not None else 0
    net = arch.build_network(spec.arch, spec.num_classes, seed, spec.input_shape)
    stages = arch.slice_stages(net, spec.arch, spec.cut_points, part.first, part.last)
    if part.weights.file is not None:
        # Keys are those of the full torchvision model (the stages keep its names); the file may hold
        # the whole model or just this block.
        state = _load_state_dict(part.weights.file)
        wanted = set(stages.state_dict())
        missing = sorted(wanted - state.keys())
        if missing:
            raise BlockError(f"weights file {part.weights.file} lacks {len(missing)} tensor(s) of block "
                             f"{part.block!r}, e.g. {missing[:3]}; keys must be named as in torchvision's {spec.arch}")
        try:
            stages.load_state_dict({k: state[k] for k in wanted}, strict=True)
        except RuntimeError as exc:
            raise BlockError(f"weights file {part.weights.file} does not fit block {part.block!r}: {exc}") from exc
    return stages


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: torch.Tensor


class BlockRunner:
    """Runs one :class:`ModelSpec` on one device."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.dtype = DTYPES[spec.precision]
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            torch.cuda.set_device(device)
            # Per-process switches: each block instance is its own process. cuDNN allows TF32 by default,
            # which would break fp32's accuracy contract, so set both explicitly.
            tf32 = spec.precision == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            torch.backends.cudnn.benchmark = True
        module = nn.Sequential(*(build_part(spec, p) for p in spec.parts)).eval()
        self.memory_format = torch.channels_last if self.is_cuda and len(spec.in_shape) == 3 else torch.contiguous_format
        self.module = module.to(device=device, dtype=self.dtype).to(memory_format=self.memory_format)
        self.buckets = batch_buckets(spec.max_batch_size)
        self.use_graphs = self.is_cuda and spec.cuda_graphs and os.environ.get(env.DISABLE_CUDA_GRAPHS) != "1"
        self._graphs: dict[int, _Graph] = {}

    @torch.inference_mode()
    def warmup(self, pool: Any = None) -> None:
        """Run every bucket once (capturing its CUDA graph) so no request pays first-call costs.

        ``pool``: a graph memory pool to capture into (``torch.cuda.graph_pool_handle()``), shared by
        every runner of one process whose graphs never run at the same time (the heads of a pack).
        Sharing is safe because ``run`` copies a graph's output out before the next replay on the
        same stream, and each graph's static input and output stay allocated for its lifetime.
        """
        sizes = sorted(self.buckets, reverse=True) if self.is_cuda else [1]
        if self.use_graphs:
            pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            for b in sizes:  # largest first, so smaller graphs reuse its pool
                self._graphs[b] = self._capture(b, pool)
        else:
            for b in sizes:
                self._eager(torch.zeros((b, *self.spec.in_shape), device=self.device))
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            # cuDNN's algorithm search (benchmark mode) leaves large workspaces cached in the allocator;
            # a block process keeps them for its lifetime unless released here (bench.memory measures it).
            if os.environ.get(env.KEEP_ALLOCATOR_CACHE) != "1":
                torch.cuda.empty_cache()

    def _capture(self, batch: int, pool: Any) -> _Graph:
        static_in = torch.zeros((batch, *self.spec.in_shape), device=self.device, dtype=self.dtype)
        static_in = static_in.contiguous(memory_format=self.memory_format)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # cuDNN picks algorithms on the first calls; keep that out of the graph
                self.module(static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            static_out = self.module(static_in)
        return _Graph(graph, static_in, static_out)

    def _eager_bucketed(self, x: torch.Tensor) -> torch.Tensor:
        """Eager run on a GPU at the batch's bucket size (zero rows appended, then cut off).

        With cuDNN benchmark mode every new input shape starts an algorithm search (hundreds of
        ms for a whole network), and dynamic batching makes any size up to max_batch_size; only
        the buckets are searched during warm-up, so other sizes run padded to their bucket.
        """
        batch = int(x.shape[0])
        bucket = bucket_for(batch, self.buckets)
        if not self.is_cuda or bucket == batch:
            return self._eager(x)
        padded = torch.zeros((bucket, *self.spec.in_shape), device=self.device, dtype=self.dtype)
        padded = padded.contiguous(memory_format=self.memory_format)
        padded[:batch].copy_(x, non_blocking=True)
        return self._eager(padded)[:batch]

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(device=self.device, dtype=self.dtype, non_blocking=True).contiguous(memory_format=self.memory_format)
        out: torch.Tensor = self.module(x)
        return out

    @torch.inference_mode()
    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run a batch. ``x``: ``[B, *in_shape]`` on any device, any float dtype.

        Returns fp32 ``[B, *out_shape]`` on this device, row-major; or, when ``out`` is given
        (e.g. a TensorMQ pool slot), writes the result there in ``out``'s dtype and returns it.
        """
        if tuple(x.shape[1:]) != self.spec.in_shape or x.shape[0] < 1:
            raise RequestError(f"input shape {list(x.shape)} does not match [batch, {', '.join(map(str, self.spec.in_shape))}]")
        batch = int(x.shape[0])
        result: torch.Tensor | None = None
        if self.use_graphs:
            g = self._graphs.get(bucket_for(batch, self.buckets))
            if g is not None:
                full = batch == g.static_in.shape[0]  # the usual case at batch 1: no slicing calls
                (g.static_in if full else g.static_in[:batch]).copy_(x, non_blocking=True)
                g.graph.replay()
                result = g.static_out if full else g.static_out[:batch]
        if result is None:
            result = self._eager_bucketed(x)
        if out is not None:
            out.copy_(result)  # converts dtype and layout in one pass
            return out
        # A fresh tensor: a graph's output buffer is overwritten by its next replay.
        return result.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
