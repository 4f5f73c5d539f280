"""The block runtime: builds a block's stages and runs batches through them.

Pure PyTorch, no Triton: ``blockflow.backend.model`` wraps it for the Python backend and
tests drive it directly. On a GPU it runs channels-last, in the plan's
precision, and (optionally) replays one CUDA graph per batch-size bucket (``blockflow.backend.graphs``);
inputs and outputs at its edges are in standard layout, in the hop's dtype (a task's image as the
plan gives it, converted by ``blockflow.backend.image_input`` inside what the block runs; a side
input in its own dtype, float32 or int64: ``blockflow.backend.side_inputs``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from blockflow.backend.graphs import PLAIN_HOPS, Graph, PlainHop, batch_buckets, bucket_for, capture
from blockflow.backend.host_pins import HostPins, join_to_device
from blockflow.backend.image_input import ImageConversion, fed_shapes, feed_dtype
from blockflow.backend.parts import Chain, EagerTail, build_parts, fold_batchnorm, on_device, side_positions, split_eager_tail
from blockflow.backend.side_inputs import check_sides, side_casts, side_dtypes, side_ins, side_zeros
from blockflow.backend.stage_cache import StageCache
from blockflow.core import cuda, detection, env
from blockflow.core.errors import RequestError
from blockflow.core.spec import BOXES, ORIGINAL_SIZE, ModelSpec

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def _same_bytes(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst.copy_(src)`` needs no conversion: one dtype, one shape, both contiguous."""
    return src.dtype == dst.dtype and src.shape == dst.shape and src.is_contiguous() and dst.is_contiguous()


def _memcpy_ok(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``dst.copy_(src)`` is a plain device-to-device memcpy of the same bytes."""
    return src.is_cuda and src.device == dst.device and _same_bytes(dst, src)


class BlockRunner:
    """Runs one :class:`ModelSpec` on one device."""

    def __init__(self, spec: ModelSpec, device: torch.device, cache: StageCache | None = None) -> None:
        self.spec = spec
        self.device = device
        self.dtype = DTYPES[spec.precision]
        self.in_dtype = feed_dtype(spec) or DTYPES[spec.in_dtype]  # what the block is fed
        self.out_dtype = DTYPES[spec.out_dtype]  # what the next block takes (fp32 for logits)
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            torch.cuda.set_device(device)
            # Per-process switches: each block instance is its own process. cuDNN allows TF32 by default,
            # which would break fp32's accuracy contract, so set both explicitly.
            tf32 = spec.precision == "tf32"
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            # Not for a detector's heads: they run on as many proposals as each image has, and each
            # new size would start an algorithm search.
            torch.backends.cudnn.benchmark = not spec.outputs
        parts = build_parts(spec, cache)
        if self.is_cuda:
            parts = [fold_batchnorm(on_device(p, device)) for p in parts]
        graphs = self.is_cuda and spec.cuda_graphs and os.environ.get(env.DISABLE_CUDA_GRAPHS) != "1"
        # A detector's last stages: what its graph traced (the backbone's rest, the FPN) replays as CUDA
        # graphs; its eager node (proposals, heads, NMS: sizes a graph cannot hold) runs after each replay.
        self.tail: EagerTail | None = None
        if graphs and spec.outputs:
            split = split_eager_tail(parts[-1])
            if split is not None:
                parts[-1], self.tail = split
        mixed = any(p.precision not in (None, spec.precision) for p in spec.parts)
        module = Chain(parts, [DTYPES[p.precision or spec.precision] for p in spec.parts] if mixed else None,
                       side_positions(spec)).eval()
        self.in_shapes = fed_shapes(spec)  # the hop's tensors; an encoded image: as decoded (blockflow.backend.image_decode)
        # Side inputs, taken after the hop's tensors: in their declared dtype, floating ones converted to
        # the block's (its parts' where they differ: the chain casts each part's) inside what the block runs.
        self.hops = len(self.in_shapes)
        self.sides = spec.side_inputs
        self.side_dtypes = side_dtypes(spec.side_inputs)
        self.side_casts = side_casts(self.side_dtypes, self.dtype, mixed)
        self.input_count = self.hops + len(self.sides)
        # Where a detector's task gives each image's original size (read after the stages, by no stage).
        self.original_size = next((self.hops + i for i, s in enumerate(self.sides) if s.name == ORIGINAL_SIZE), None) \
            if any(o.name == BOXES for o in spec.outputs) else None
        # Channels-last for image-like tensors on a GPU (each input converted on its own).
        self.formats = [torch.channels_last if self.is_cuda and len(s) == 3 else torch.contiguous_format for s in self.in_shapes]
        # A uint8, HWC or normalised image: converted on the device before the first stage.
        self.image = (ImageConversion(spec.image, device, self.dtype, self.formats[0])
                      if spec.takes_image and spec.image is not None else None)
        # Parts in several precisions: each cast from its own weights once (not through the spec's dtype).
        self.module = module.to(device=device) if mixed else module.to(device=device, dtype=self.dtype)
        module.cast_parts()
        if self.is_cuda and all(len(s) == 3 for s in self.in_shapes):
            self.module = self.module.to(memory_format=torch.channels_last)
        self.buckets = batch_buckets(spec.max_batch_size, quarters=os.environ.get(env.GRAPH_BUCKETS) == "quarter")
        # Other networks of several outputs (an exported program's) run eagerly.
        self.use_graphs = graphs and (not spec.outputs or self.tail is not None)
        self._graphs: dict[int, Graph] = {}
        # Hops of one input and one output already checked, by the ids of their tensors (held, so
        # an id cannot be reused while its entry lives).
        self._plain: dict[tuple[int, int], PlainHop] = {}
        self._stream = int(torch.cuda.current_stream(device).cuda_stream) if self.is_cuda else 0
        # A first block's host image: copied by DMA from the backend's shared memory once that is
        # page-locked (blockflow.backend.host_pins), then waited for before the call returns.
        pin = self.is_cuda and spec.takes_image and os.environ.get(env.PIN_HOST_INPUTS) != "0"
        self._pins = HostPins() if pin else None
        self._copied = cuda.event_create() if self._pins is not None else 0  # after the last DMA queued
        self._dma = False  # a DMA out of host inputs was queued (and _copied recorded after it)
        self._host_inputs = False  # torch's copies read page-locked host inputs: wait for the stream

    def _zeros(self, batch: int) -> list[torch.Tensor]:
        if self.image is not None:  # converted by the block itself: as it arrives
            xs = [torch.zeros((batch, *self.in_shapes[0]), device=self.device, dtype=self.in_dtype)]
        else:
            xs = [torch.zeros((batch, *s), device=self.device, dtype=self.dtype).contiguous(memory_format=f)
                  for s, f in zip(self.in_shapes, self.formats, strict=True)]
        return xs + side_zeros(self.sides, self.side_dtypes, batch, self.device)

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
            for b in sizes:  # largest first, so smaller graphs reuse its pool and its static inputs
                self._graphs[b] = self._capture(b, pool, self._graphs[sizes[0]].static_ins if b != sizes[0] else None)
                if self.tail is not None:  # its first calls' costs too, on what the graph gives for zeros
                    self.replay_bucket(b)
        else:
            for b in sizes:
                self._eager(self._zeros(b))
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            # cuDNN's algorithm search (benchmark mode) leaves large workspaces cached in the allocator;
            # a block process keeps them for its lifetime unless released here (blockflow.bench.memory measures it).
            if os.environ.get(env.KEEP_ALLOCATOR_CACHE) != "1":
                torch.cuda.empty_cache()

    def replay_bucket(self, batch: int) -> list[torch.Tensor]:
        """Replay the CUDA graph of bucket ``batch`` on what its static inputs hold, a detector's eager node
        after it: its static outputs, or the eager node's (fresh tensors)."""
        g = self._graphs[batch]
        g.graph.replay()
        return g.static_outs if self.tail is None else list(self.tail(*g.static_outs))

    def _graph_forward(self, static_ins: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What a graph captures: the inputs as they arrive (row-major, the hop's dtype) converted
        to the block's dtype and layout, the block, its outputs converted to the next hop's dtype,
        row-major. Conversions inside the graph leave a request's copies in and out as plain
        same-layout memcpys (``Tensor.copy_`` across layouts cost ~25 us of host time each)."""
        ys: list[torch.Tensor] = self.module(*self._hop_ins(static_ins[:self.hops]), *side_ins(static_ins[self.hops:], self.side_casts))
        if self.tail is not None:  # the eager node's inputs, as it takes them
            return ys
        return [y.to(self.out_dtype).contiguous() for y in ys]

    def _hop_ins(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The hop's tensors (on this device) as the block takes them: the image converted, others in its dtype and layout."""
        if self.image is not None:
            return [self.image(xs[0])]
        return [x.to(self.dtype).contiguous(memory_format=f) for x, f in zip(xs, self.formats, strict=True)]

    def _capture(self, batch: int, pool: Any, largest: list[torch.Tensor] | None) -> Graph:
        # Static inputs as requests give them: the hop's dtype, each side input's own. A smaller bucket's
        # are the first rows of the largest's (one copy of the inputs, whatever the number of buckets):
        # a runner replays one graph at a time, on one stream.
        if largest is not None:
            return capture(self._graph_forward, [x[:batch] for x in largest], self.device, pool)
        static_ins = [torch.zeros((batch, *s), device=self.device, dtype=self.in_dtype) for s in self.in_shapes]
        static_ins += side_zeros(self.sides, self.side_dtypes, batch, self.device)
        return capture(self._graph_forward, static_ins, self.device, pool)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """``dst.copy_(src)`` on this block's stream; a driver memcpy when no conversion is needed.
        Whether it queued a DMA out of page-locked host memory (to be marked by :meth:`_inputs_copied`)."""
        if _memcpy_ok(dst, src):
            cuda.memcpy_async(dst.data_ptr(), src.data_ptr(), dst.nbytes, self._stream)
        elif (self._pins is not None and not src.is_cuda and _same_bytes(dst, src)
              and self._pins.pinned(src.data_ptr(), src.nbytes)):
            cuda.memcpy_async(dst.data_ptr(), src.data_ptr(), dst.nbytes, self._stream)
            return True
        else:
            dst.copy_(src, non_blocking=True)
        return False

    def _eager_bucketed(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Eager run on a GPU at the batch's bucket size (zero rows appended, then cut off).

        With cuDNN benchmark mode every new input shape starts an algorithm search (hundreds of
        ms for a whole network), and dynamic batching makes any size up to max_batch_size; only
        the buckets are searched during warm-up, so other sizes run padded to their bucket.
        """
        batch = int(xs[0].shape[0])
        bucket = bucket_for(batch, self.buckets)
        if not self.is_cuda or bucket == batch or self.spec.outputs:  # a detector: no search to spare
            return self._eager(xs)
        padded = self._zeros(bucket)
        for p, x in zip(padded, xs, strict=True):
            p[:batch].copy_(x, non_blocking=True)
        self._inputs_copied()
        return [y[:batch] for y in self._eager(padded)]

    def _eager(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.sides:
            on = [x.to(device=self.device, non_blocking=True) for x in xs]
            ins = [*self._hop_ins(on[:self.hops]), *side_ins(on[self.hops:], self.side_casts)]
        elif self.image is not None:
            ins = [self.image(xs[0].to(device=self.device, non_blocking=True))]
        else:
            ins = [x.to(device=self.device, dtype=self.dtype, non_blocking=True).contiguous(memory_format=f)
                   for x, f in zip(xs, self.formats, strict=True)]
        self._inputs_copied()
        out: list[torch.Tensor] = self.module(*ins)
        return out if self.tail is None else list(self.tail(*out))

    def _answer(self, results: list[torch.Tensor], xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A detector's answer with its boxes in each image's original pixels, where its task gives them."""
        if self.original_size is None:
            return results
        return detection.in_original_pixels(results, xs[self.original_size], self.spec.input_shape)

    def _inputs_copied(self, dma: bool = False) -> None:
        """Mark the end of a call's copies out of page-locked host inputs (torch's own copies from
        such memory are asynchronous too; ``dma``: :meth:`_copy` queued one), so :meth:`settle_inputs`
        waits for them, not for the block's GPU work queued after them. One event record a call."""
        if self._host_inputs or dma:
            cuda.event_record(self._copied, self._stream)
            self._dma = True

    def run_all(self, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor] | None = None,
                lap: Callable[[str], None] | None = None) -> list[torch.Tensor]:
        """Run a batch. ``xs``: one ``[B, *shape]`` tensor per input, on any device: the hop's, any float
        dtype (a task's image: the plan's dtype, uint8 or float32), then each side input's
        (``spec.side_inputs``) in its declared dtype, float32 or int64.

        Returns one ``[B, *shape]`` tensor per output on this device, row-major, in the hop's dtype
        (``spec.out_dtype``: fp32 for logits, the block's fp16/bf16 for a hop); or, when
        ``outs`` is given (e.g. views of a TensorMQ pool slot), writes the results there in their
        dtype and returns them. ``lap`` (a block's tracer): called at the end of a CUDA graph's steps
        (checks, input copies, replay), on the usual TensorMQ hop and where inputs come from the host.
        """
        if self._pins is not None and self._pins.any_pinned and (not xs[0].is_cuda or (self.sides and not all(x.is_cuda for x in xs))):
            self._host_inputs = True
        if outs is not None and len(xs) == 1 and len(outs) == 1:
            hit = self._plain.get((id(xs[0]), id(outs[0])))
            if hit is not None and hit.x is xs[0] and hit.out is outs[0]:
                hit.replay(self._stream, lap)
                return list(outs)
        if len(xs) != self.input_count:
            raise RequestError(f"{len(xs)} input tensor(s) given; this block takes {self.input_count}")
        batch = int(xs[0].shape[0])
        for x, shape in zip(xs[:self.hops] if self.sides else xs, self.in_shapes, strict=True):
            if tuple(x.shape[1:]) != shape or x.shape[0] < 1 or int(x.shape[0]) != batch:
                raise RequestError(f"input shape {list(x.shape)} does not match [{batch}, {', '.join(map(str, shape))}]")
        if self.sides:
            check_sides(xs[self.hops:], self.sides, self.side_dtypes, batch)
        if self.image is not None and xs[0].dtype != self.in_dtype:  # a float image would not be scaled as uint8 is
            raise RequestError(f"the image is {xs[0].dtype}; this block takes {self.in_dtype}")
        if self.use_graphs and outs is not None and self.tail is None:
            g = self._graphs.get(batch)
            # The usual TensorMQ hop: a graph of exactly this batch, every copy a plain memcpy. No
            # grad-mode context (its Python costs ~10-20 us a call on a host that woke for the
            # request, bench.hop_host): a replay and driver memcpys record nothing for autograd.
            if g is not None and all(map(_memcpy_ok, g.static_ins, xs)) and all(map(_memcpy_ok, outs, g.static_outs)):
                hop = PlainHop(xs, outs, g)
                if len(xs) == 1 and len(outs) == 1:
                    if len(self._plain) >= PLAIN_HOPS:
                        self._plain.clear()
                    self._plain[(id(xs[0]), id(outs[0]))] = hop
                hop.replay(self._stream, lap)
                return list(outs)
        with torch.inference_mode():
            return self._run_all(batch, xs, outs, lap)

    def _run_all(self, batch: int, xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor] | None,
                 lap: Callable[[str], None] | None = None) -> list[torch.Tensor]:
        results: list[torch.Tensor] | None = None
        if self.use_graphs:
            g = self._graphs.get(bucket_for(batch, self.buckets))
            if g is not None:
                full = batch == g.static_ins[0].shape[0]  # the usual case at batch 1: no slicing calls
                if lap is not None:
                    lap("run:checks")
                dma = False
                for static, x in zip(g.static_ins, xs, strict=True):
                    dma |= self._copy(static if full else static[:batch], x)
                self._inputs_copied(dma)
                if lap is not None:
                    lap("run:copy_in")  # a first block's host image: out of Triton's shared memory
                g.graph.replay()
                if lap is not None:
                    lap("run:replay")
                results = g.static_outs if full else [y[:batch] for y in g.static_outs]
                if self.tail is not None:
                    results = self._answer(list(self.tail(*results)), xs)
                if outs is not None:
                    for out, result in zip(outs, results, strict=True):
                        self._copy(out, result)
                    return list(outs)
        if results is None:
            results = self._answer(self._eager_bucketed(xs), xs)
        if outs is not None:
            for out, result in zip(outs, results, strict=True):
                out.copy_(result)  # converts dtype and layout in one pass
            return list(outs)
        # Fresh tensors: a graph's output buffers are overwritten by its next replay. Integer outputs
        # (a detector's counts and labels) keep their dtype.
        return [r.to(dtype=self.out_dtype if r.is_floating_point() else r.dtype, memory_format=torch.contiguous_format,
                     copy=not self.spec.outputs) for r in results]  # a detector's outputs are its own already

    def join(self, columns: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """Each input's per-request tensors as one batch on this device (``torch.cat``), by DMA out
        of page-locked host memory where they are there (see :meth:`settle_inputs`)."""
        out = []
        for parts in columns:
            joined = None if self._pins is None else join_to_device(self._pins, parts, self.device, self._stream)
            if joined is None:
                joined = torch.cat([p.to(self.device) for p in parts])
            else:
                self._dma = True
            out.append(joined)
        if self._dma:
            cuda.event_record(self._copied, self._stream)
        return out

    @property
    def pins_host_inputs(self) -> bool:
        """Whether this runner copies host inputs out of page-locked memory (and so must :meth:`settle_inputs`)."""
        return self._pins is not None

    def settle_inputs(self, spin_s: float = 0.0) -> bool:
        """Wait until what this call queued has read its host inputs, where that may still be under
        way (a DMA out of page-locked memory): Triton frees them once ``execute`` returns. Only the
        DMA is waited for, not the block's GPU work after it, on the usual path; polled for up to
        ``spin_s``, then asleep (``backend/gpu_waits.py``). Whether it waited."""
        if not (self._dma or self._host_inputs):
            return False
        if not self._dma:  # copies no step marked: after everything queued so far
            cuda.event_record(self._copied, self._stream)
        self._host_inputs = self._dma = False
        cuda.wait_event(self._copied, spin_s)
        return True

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`run_all` for a block that takes and gives one tensor."""
        return self.run_all([x], None if out is None else [out])[0]
