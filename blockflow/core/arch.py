"""Base networks and how they are cut into stages: any torchvision classification, semantic
segmentation or object detection model (``blockflow.core.detection``), or a user's own model
exported with ``torch.export`` (a ``.pt2`` file: ``blockflow.core.programs``).

A network is named by a torchvision model name or by the path of its ``.pt2`` file. A torchvision
network is traced into a graph with torch.fx (torchvision's own ``NodePathTracer``, which names
every node by the module it runs in, e.g. ``features.4.block.2``); an exported program already is
one (``blockflow.core.programs``). A cut names a module by its dotted path (``layer2``,
``features.4``, ``encoder.layers.encoder_layer_5``) or a node (``flatten``): the stage boundary
falls right after the last node of that module. A cut is legal where every value live across the
boundary is a tensor (at most ``MAX_HOP_TENSORS`` of them): they are what the hop carries, in the
order the network computed them. Inside a residual block that is two tensors (the block's input,
kept for the skip, and the branch so far); between blocks, one. Stage ``i`` runs from just after
cut ``i-1`` up to and including cut ``i``; the last stage runs to the end. A stage takes one
argument per tensor that enters it, then one per side input its nodes read (an exported program's
arguments after the image, ``blockflow.core.programs.program_side_inputs``: never a value a hop
carries, they reach each stage from the task), and returns one tensor, or a tuple when several leave it. Each
stage is its own ``GraphModule`` holding the same nodes, in the same order, as the whole traced
network: running the stages one after another is exactly the unsplit forward pass.

Parameters and buffers keep their names (``layer2.0.conv1.weight``), so a weights file keyed as
the model's own ``state_dict`` fits every block. Seeded weights are made by building the whole
network under a fixed seed and then cutting it, so a block's weights equal the same stages of the
full model built with that seed, in every process.

A segmentation network returns ``{'out': logits}`` (its auxiliary classifier is left out): its
output is that one tensor, ``[num_classes, H, W]`` per sample. It reads the image's size at the
start and resizes its logits to it at the end; that size is fixed by the plan's ``input_shape``,
so a network built for one (``build_network`` records it) is traced with the size as a constant
(``blockflow.core.folding``), and no hop has to carry it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import torch
from torch import fx, nn

from blockflow.core import detection
from blockflow.core.cuts import Cut, Cuts, HopTensor
from blockflow.core.folding import fold_input_size
from blockflow.core.in_place import mutates
from blockflow.core.programs import (
    SIDE_INPUTS_ATTR,
    is_program,
    load_program,
    module_path,
    program_input,
    program_output_names,
    program_side_inputs,
    recorded_tensor,
)
from blockflow.core.spec import TaskOutput

# The most tensors one hop may carry: each is a Triton input/output of the blocks on both sides.
MAX_HOP_TENSORS = 8


@lru_cache(maxsize=1)
def supported_archs() -> tuple[str, ...]:
    """Every classification, semantic segmentation and detection model torchvision builds by name
    (Keypoint R-CNN aside)."""
    import torchvision.models as tvm

    return tuple(sorted({*tvm.list_models(module=tvm), *segmentation_archs(), *detection.detection_archs()}))


@lru_cache(maxsize=1)
def segmentation_archs() -> frozenset[str]:
    """torchvision's semantic segmentation models (DeepLabV3, FCN, LR-ASPP)."""
    import torchvision.models as tvm

    return frozenset(tvm.list_models(module=tvm.segmentation))


# The attribute ``build_network`` records the per-sample input shape in (what ``trace`` folds in).
INPUT_SHAPE_ATTR = "_blockflow_input_shape"


def _factory_kwargs(arch: str, num_classes: int, input_shape: Sequence[int]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    if arch in segmentation_archs():
        # No backbone weights (torchvision would download ImageNet ones) and no auxiliary head.
        kwargs.update(weights_backbone=None, aux_loss=False)
    if arch.startswith("vit_"):  # a ViT's position embedding is sized for one image size
        kwargs["image_size"] = int(input_shape[-1])
    return kwargs


def build_network(arch: str, num_classes: int, seed: int, input_shape: Sequence[int] = (3, 224, 224)) -> nn.Module:
    """The whole torchvision network with weights drawn from ``seed`` (CPU, eval mode).

    Weights are torchvision's initialisation under ``seed``, so that the answers depend on the
    input at a scale every precision represents: weight matrices it starts at zero (a ViT's
    classifier) are drawn from N(0, 0.02); and where the answers to N(0, 1) inputs still vanish
    (below 1e-3: with batch-norm statistics at their defaults, a MobileNetV3 at 32×32 answers
    about 1e-10, which fp16 cannot represent), batch-norm statistics become those of one batch of
    such inputs. The global RNG is forked so building a block never disturbs the caller's. An exported program
    brings its own weights (``seed`` does not apply).
    """
    if is_program(arch):
        return load_program(arch)
    import torchvision.models as tvm

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if detection.is_detection(arch):
            det = detection.build(arch, num_classes, input_shape)
            setattr(det, INPUT_SHAPE_ATTR, tuple(int(d) for d in input_shape))
            return det.eval()
        net: nn.Module = tvm.get_model(arch, **_factory_kwargs(arch, num_classes, input_shape))
        if next(net.parameters()).device.type != "meta":
            _like_trained(net, input_shape)
    setattr(net, INPUT_SHAPE_ATTR, tuple(int(d) for d in input_shape))
    return net.eval()


def network_output(value: Any) -> Any:
    """The one output of a network's result (a segmentation network's ``out``)."""
    return value["out"] if isinstance(value, dict) and "out" in value else value


def _like_trained(net: nn.Module, input_shape: Sequence[int]) -> None:
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() >= 2 and not p.any():
                p.normal_(0.0, 0.02)
        norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms and float(network_output(net.eval()(torch.randn(2, *input_shape))).abs().max()) < 1e-3:
            for m in norms:
                m.reset_running_stats()
                m.momentum = None  # a cumulative average: after one batch, that batch's statistics
            # Enough samples that the deepest layers (1×1 at small inputs) get sound statistics.
            net.train()
            net(torch.randn(max(4, min(64, 65536 // math.prod(input_shape[1:]))), *input_shape))
            for m in norms:
                m.momentum = 0.1  # torchvision's default


@dataclass(frozen=True)
class Traced:
    """A network's graph: its nodes in execution order, each with the module path it runs in."""

    module: fx.GraphModule
    nodes: tuple[fx.Node, ...]
    paths: tuple[str, ...]  # dotted module path of each node (``features.4.block.2``; a node's name at top level)
    last_use: tuple[int, ...]  # index of the last node that uses each node's value (its own index if none)
    # Index of each side input's placeholder (an exported program's arguments after the image), in order.
    sides: tuple[int, ...] = ()

    @classmethod
    def of(cls, module: fx.GraphModule, paths: Sequence[str], sides: tuple[int, ...] = ()) -> Traced:
        """``module``'s graph, ``paths`` giving each node's module path in the graph's order."""
        nodes = tuple(module.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        last_use = tuple(max((index[u] for u in n.users), default=i) for i, n in enumerate(nodes))
        return cls(module, nodes, tuple(paths), last_use, sides)

    def end_of(self, cut: str) -> int:
        """Index of the last node of module (or node) ``cut``; ``KeyError`` if the network has none."""
        hits = [i for i, p in enumerate(self.paths) if p == cut or p.startswith(cut + ".")]
        if not hits:
            raise KeyError(cut)
        return max(hits)

    def live_after(self, boundary: int) -> list[fx.Node]:
        """Values computed at or before ``boundary`` that a later node still uses (parameters and side
        inputs excluded: no hop carries them)."""
        return [n for i, n in enumerate(self.nodes[:boundary + 1])
                if n.op != "get_attr" and self.last_use[i] > boundary and i not in self.sides]

    def side_users(self) -> tuple[tuple[int, ...], ...]:
        """Indices of the nodes that read each side input (the output node among them, if it does)."""
        index = {n: i for i, n in enumerate(self.nodes)}
        return tuple(tuple(sorted(index[u] for u in self.nodes[s].users)) for s in self.sides)


def trace(net: nn.Module) -> Traced:
    """``net``'s graph. An exported program's arguments after the first are its side inputs where it
    was loaded as a whole model (``load_program(single=True)``), tensors entering it otherwise (a
    pre-cut stage file); a torchvision network has none."""
    if isinstance(net, fx.GraphModule):  # an exported program: already a graph
        nodes = tuple(net.graph.nodes)
        placeholders = [i for i, n in enumerate(nodes) if n.op == "placeholder"]
        sides = tuple(placeholders[1:]) if getattr(net, SIDE_INPUTS_ATTR, False) else ()
        return Traced.of(net, [module_path(n) or n.name for n in nodes], sides)
    from torchvision.models.feature_extraction import NodePathTracer

    tracer = NodePathTracer()
    graph = tracer.trace(net)
    input_shape = getattr(net, INPUT_SHAPE_ATTR, None)
    if input_shape is not None:
        fold_input_size(graph, tuple(input_shape))
    module = fx.GraphModule(tracer.root, graph, type(net).__name__)
    names: dict[fx.Node, str] = tracer.node_to_qualname
    return Traced.of(module, [names.get(n, n.name) for n in module.graph.nodes])


def stage_module(traced: Traced, cut_points: Sequence[str], first: int, last: int) -> fx.GraphModule:
    """Stages ``first..last`` (inclusive) as one module taking the tensors live at cut ``first-1``
    (the network's inputs other than side inputs, for stage 0), then the side inputs its nodes read
    (in the network's argument order: ``blockflow.core.side_inputs.stage_side_inputs``)."""
    bounds = [traced.end_of(c) for c in cut_points]
    start = bounds[first - 1] + 1 if first > 0 else 0
    output = next(n for n in traced.nodes if n.op == "output")
    end = bounds[last] if last < len(bounds) else traced.nodes.index(output) - 1
    stage = traced.nodes[start:end + 1]
    readers = {*stage, *([output] if last >= len(bounds) else [])}
    sides = [traced.nodes[s] for s in traced.sides if not readers.isdisjoint(traced.nodes[s].users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if first > 0:
        entering = traced.live_after(bounds[first - 1])
        prefix = "x"  # the hop tensors' argument names, unlike any side input's
        while any(re.fullmatch(re.escape(prefix) + r"\d*", str(s.target)) for s in sides):
            prefix += "_"
        for i, node in enumerate(entering):
            env[node] = graph.placeholder(prefix if len(entering) == 1 else f"{prefix}{i}")
    else:
        entering = [n for i, n in enumerate(traced.nodes) if n.op == "placeholder" and i not in traced.sides]
        for node in entering:
            env[node] = graph.node_copy(node, env.__getitem__)
    for node in sides:
        env[node] = graph.node_copy(node, env.__getitem__)
    for node in [*entering, *sides]:
        # A stage's inputs may be another process's memory (a TensorMQ pool, read-only on the CPU):
        # a stage that would change one in place (a ReLU(inplace=True) or ``+=`` right after the
        # cut) works on its own copy.
        if any(mutates(user, node) for user in node.users if user in stage):
            env[node] = graph.call_method("clone", (env[node],))
    for node in stage:
        if node.op in ("get_attr", "placeholder"):
            # A parameter is fetched where a node of this stage uses it (below), never for a later
            # stage; the inputs the stage takes are placeholders already (above).
            continue
        for used in node.all_input_nodes:  # parameters read by this stage but fetched earlier in the whole graph
            if used not in env and used.op == "get_attr":
                env[used] = graph.node_copy(used, env.__getitem__)
        if node not in env:
            env[node] = graph.node_copy(node, env.__getitem__)
    if last < len(bounds):
        leaving = [env[n] for n in traced.live_after(bounds[last])]
        graph.output(leaving[0] if len(leaving) == 1 else tuple(leaving))
    else:
        graph.output(fx.map_arg(only_output(output), env.__getitem__))
    graph.lint()
    return fx.GraphModule(traced.module, graph, f"stages_{first}_{last}").eval()


def only_output(output: fx.Node) -> Any:
    """What the network returns (an exported program returns its one output in a tuple; a
    segmentation network a dict, whose ``out`` is its output)."""
    value = network_output(output.args[0])
    return value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value


def slice_stages(net: nn.Module, arch: str, cut_points: Sequence[str], first: int, last: int) -> fx.GraphModule:
    """Stages ``first..last`` (inclusive) of ``net``, sharing its parameters."""
    return stage_module(trace(net), cut_points, first, last)


def meta_network(arch: str, num_classes: int, input_shape: Sequence[int]) -> nn.Module:
    """The network without memory for its weights (meta device), where its constructor allows that.

    A few constructors compute with tensors (RegNet derives its widths with ``torch`` ops); those
    are built on the CPU instead, as is an exported program (it is read with its weights).
    """
    if is_program(arch):
        return load_program(arch).to("meta")
    try:
        with torch.device("meta"):
            return build_network(arch, num_classes, 0, input_shape)
    except (NotImplementedError, RuntimeError):
        return build_network(arch, num_classes, 0, input_shape).to("meta")


def legal_cuts(arch: str, input_shape: tuple[int, ...], num_classes: int) -> Cuts:
    """Every module path (and top-level node) after which the network can be cut, found on the meta device.

    For an exported program, ``input_shape`` and ``num_classes`` are the program's own (the
    arguments are ignored) and the shapes are those it was exported with. Raises ``ValueError``
    when the network cannot take ``input_shape``, or the program cannot be served (the message says why).
    """
    if is_program(arch):
        try:
            st = os.stat(arch)
        except OSError as exc:
            raise ValueError(f"cannot read exported program {arch}: {exc.strerror}") from None
        return _program_cuts(arch, st.st_mtime_ns, st.st_size)  # a file changed in place is read again
    return _torchvision_cuts(arch, input_shape, num_classes)


@lru_cache(maxsize=32)
def _torchvision_cuts(arch: str, input_shape: tuple[int, ...], num_classes: int) -> Cuts:
    from torch.fx.passes.shape_prop import ShapeProp

    traced = trace(meta_network(arch, num_classes, input_shape))
    try:
        # Two samples, so a tensor whose first dimension is not the batch (nothing a hop could split
        # per request) is told apart from one that is.
        ShapeProp(traced.module).propagate(torch.empty((2, *input_shape), device="meta"))
    except Exception as exc:  # the network's own error for a size it cannot take
        raise ValueError(f"{arch} cannot take inputs of shape {list(input_shape)}: {exc}") from None
    return _find_cuts(traced, _shape_prop_tensor, input_shape)


@lru_cache(maxsize=8)
def _program_cuts(path: str, mtime_ns: int, size: int) -> Cuts:
    traced = trace(load_program(path))
    batch, sample_shape = program_input(traced.module, path)
    sides = program_side_inputs(traced.module, path)
    cuts = _find_cuts(traced, lambda node: recorded_tensor(node, batch), sample_shape)
    return replace(cuts, sides=sides, side_users=traced.side_users())


def _shape_prop_tensor(node: fx.Node) -> HopTensor | None:
    """What ``node`` gives per sample, from shape propagation at batch 2 (None: not a batch-first tensor)."""
    from torch.fx.passes.shape_prop import TensorMetadata

    m = node.meta.get("tensor_meta")
    if isinstance(m, TensorMetadata) and len(m.shape) >= 1 and m.shape[0] == 2:
        return HopTensor(tuple(int(d) for d in m.shape[1:]), m.dtype)
    return None


def _find_cuts(traced: Traced, hop_tensor: Any, input_shape: tuple[int, ...]) -> Cuts:
    output = next(i for i, n in enumerate(traced.nodes) if n.op == "output")
    ends: dict[str, int] = {}
    for i, path in enumerate(traced.paths):
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            ends[".".join(parts[:k])] = i
    found, found_ends = [], []
    for name, end in sorted(ends.items(), key=lambda kv: (kv[1], kv[0].count("."), kv[0])):
        if end >= output - 1 or traced.nodes[end].op in ("placeholder", "get_attr"):
            continue  # nothing would be left for a next stage, or nothing computed yet
        live = traced.live_after(end)
        if not 1 <= len(live) <= MAX_HOP_TENSORS or all(n.op == "placeholder" for n in live):
            continue  # too many values, or nothing computed that a next stage needs
        # Every value must be a floating-point tensor with the batch first (a block runs its inputs
        # in its precision, and a hop splits them per request).
        tensors = [hop_tensor(n) for n in live]
        if all(t is not None and t.dtype.is_floating_point for t in tensors):
            found.append(Cut(name, tuple(tensors)))
            found_ends.append(end)
    result = only_output(traced.nodes[output])
    if isinstance(result, fx.Node) and result.target in detection.EAGER_NODES:
        return Cuts(tuple(found), tuple(found_ends), (1,), input_shape)  # a detector's outputs: detection.task_outputs
    if isinstance(result, (tuple, list)) and all(isinstance(n, fx.Node) for n in result):  # several outputs
        outs = [hop_tensor(n) for n in result]
        bad = [i for i, t in enumerate(outs) if t is None or not (t.dtype.is_floating_point or t.dtype == torch.int64)]
        if bad:
            raise ValueError(f"the network's output {bad[0]} is not a floating-point or int64 tensor with the batch first")
        return Cuts(tuple(found), tuple(found_ends), outs[0].shape, input_shape, tuple(outs))
    out = hop_tensor(result) if isinstance(result, fx.Node) else None
    if out is None:
        raise ValueError("the network's output is not one tensor with the batch first")
    return Cuts(tuple(found), tuple(found_ends), out.shape, input_shape)


def task_outputs(arch: str, input_shape: Sequence[int]) -> tuple[TaskOutput, ...]:
    """What a task whose path ends in network ``arch`` answers with, where that is not LOGITS (a
    detector's outputs, or an exported program's several, named by
    :func:`blockflow.core.programs.program_output_names`); empty otherwise."""
    if is_program(arch):
        outs = legal_cuts(arch, (), 0).outputs
        # A value per sample answers as [batch, 1]: Triton gives a batched output one axis at least.
        return tuple(TaskOutput(name=n, dtype="int64" if t.dtype == torch.int64 else "fp32", shape=t.shape or (1,))
                     for n, t in zip(program_output_names(arch, len(outs)), outs, strict=True))
    if not detection.is_detection(arch):
        return ()
    return tuple(TaskOutput(name=n, dtype=d, shape=s) for n, d, s in detection.task_outputs(arch, input_shape))  # type: ignore[arg-type]


def stage_output_shapes(
    arch: str, cut_points: Sequence[str], input_shape: Sequence[int], num_classes: int
) -> list[tuple[tuple[int, ...], ...]]:
    """Per-sample shapes of the tensors each stage gives (meta device: no weights, no compute)."""
    cuts = legal_cuts(arch, tuple(input_shape), num_classes)
    return [*(cut.shapes for cut in cuts.at(cut_points, arch)), (cuts.output_shape,)]
