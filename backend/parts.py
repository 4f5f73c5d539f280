"""A block's stages as modules: cut from the plan's network with its weights, or loaded from
pre-cut stage files; and what a GPU runs instead (BatchNorms folded into their convolutions)."""

from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from blockflow.backend.stage_cache import NetworkKey, StageCache
from blockflow.core import arch, detection, programs, stage_files
from blockflow.core.errors import BlockError
from blockflow.core.spec import ModelSpec, Part
from blockflow.core.trained_weights import trained_weights


class Chain(nn.Module):
    """Parts run one after another; a part that gives several tensors hands them all to the next.
    With ``dtypes`` (parts in several precisions), each part's floating inputs are cast to its dtype.

    With ``sides`` (a block that reads side inputs, :func:`side_positions`), the chain takes its
    entering tensors, then the spec's side inputs; part ``k`` takes what enters it, then the side
    inputs at positions ``sides[1][k]`` of the ``sides[0]`` given."""

    def __init__(self, parts: Sequence[nn.Module], dtypes: Sequence[torch.dtype] | None = None,
                 sides: tuple[int, Sequence[Sequence[int]]] | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.dtypes = list(dtypes) if dtypes is not None else None
        self.side_count = sides[0] if sides is not None else 0
        self.sides = [tuple(s) for s in sides[1]] if sides is not None else []
        if sides is not None and len(self.sides) != len(self.parts):
            raise ValueError(f"side inputs given for {len(self.sides)} parts of {len(self.parts)}")

    def forward(self, *xs: torch.Tensor) -> list[torch.Tensor]:
        if self.side_count:
            return self._with_sides(xs)
        for k, part in enumerate(self.parts):
            if self.dtypes is not None:
                xs = tuple(x.to(self.dtypes[k]) if x.is_floating_point() else x for x in xs)
            out = part(*xs)
            xs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return list(xs)

    def _with_sides(self, given: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        hops = len(given) - self.side_count
        xs, side = given[:hops], given[hops:]
        for k, part in enumerate(self.parts):
            ins = (*xs, *(side[i] for i in self.sides[k]))
            if self.dtypes is not None:  # the side inputs too, each part from the values given
                ins = tuple(x.to(self.dtypes[k]) if x.is_floating_point() else x for x in ins)
            out = part(*ins)
            xs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return list(xs)

    def cast_parts(self) -> None:
        """Each part in its own dtype."""
        if self.dtypes is not None:
            for part, dtype in zip(self.parts, self.dtypes, strict=True):
                part.to(dtype=dtype)


def side_positions(spec: ModelSpec) -> tuple[int, list[tuple[int, ...]]] | None:
    """What :class:`Chain` takes as ``sides`` for ``spec``'s parts (None where it takes no side input):
    how many side inputs the block takes, and each part's as positions in ``spec.side_inputs``."""
    if not spec.side_inputs:
        return None
    at = {s.name: i for i, s in enumerate(spec.side_inputs)}
    return len(at), [tuple(at[n] for n in p.side_inputs) for p in spec.parts]


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file, or from a torch file read with ``weights_only``
    (no code in either runs)."""
    if not Path(path).is_file():
        raise BlockError(f"weights file not found: {path}")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            state: Any = load_file(path, device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch and safetensors raise many kinds for a bad file
        raise BlockError(f"cannot read weights file {path}: {exc}") from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise BlockError(f"weights file {path} holds a {type(state).__name__}, not a state dict")
    return state


def build_parts(spec: ModelSpec, cache: StageCache | None = None) -> list[nn.Module]:
    """:func:`build_part` for each of ``spec``'s parts; a network that several of them are cut from (a
    reference's blocks of one seed) is built once."""
    keys = [network_key(part_spec(spec, p), p) for p in spec.parts]
    networks: dict[NetworkKey, arch.Traced] = {}
    built = []
    for i, (p, k) in enumerate(zip(spec.parts, keys, strict=True)):
        shared = k is not None and keys.count(k) > 1
        built.append(build_part(spec, p, cache, networks if shared else None))
        if k is not None and shared and k not in keys[i + 1:]:
            networks.pop(k, None)  # its last part is cut: the rest of the network can go
    return built


def build_part(spec: ModelSpec, part: Part, cache: StageCache | None = None,
               networks: dict[NetworkKey, arch.Traced] | None = None) -> nn.Module:
    """The stages of one part with its weights (CPU, fp32, eval mode), from ``cache`` if it has them.

    The network it is cut from comes from ``networks`` (networks this process built for other parts; the
    part then gets its own copy of its stages), else from ``cache``'s networks (kept by the first process
    that built it, while the others that need it wait: building means importing torchvision), else is built.
    """
    spec = part_spec(spec, part)
    # Keyed once, before the build: a weights file replaced meanwhile must not file the old bytes' part under the new digest.
    entry = cache.path(spec, part) if cache is not None else None
    if cache is not None and entry is not None:
        kept = cache.load(entry)
        if kept is not None:
            return kept
    kept_networks = cache if cache is not None and cache.keeps_networks else None
    key = network_key(spec, part)
    if key is not None and (networks is not None or kept_networks is not None):
        traced = networks.get(key) if networks is not None else None
        if traced is None:
            build = functools.partial(_network, spec, part)
            traced = kept_networks.network(key, build) if kept_networks is not None else build()
            if networks is not None:
                networks[key] = traced
        stages = _cut_part(spec, part, traced, own_copy=networks is not None)
    else:
        stages = _build_part(spec, part)
    if cache is not None and entry is not None:
        cache.store(entry, stages)
    return stages


def part_spec(spec: ModelSpec, part: Part) -> ModelSpec:
    """``spec`` with the network ``part`` is cut from (its own, on a path across models)."""
    if part.network is None:
        return spec
    return spec.model_copy(update=part.network.model_dump())


def network_key(spec: ModelSpec, part: Part) -> NetworkKey | None:
    """What defines the whole network ``part`` is cut from (``spec``: :func:`part_spec`'s): a torchvision network
    built under its seed (a weights file or torchvision's weights are loaded into its stages after the cut).
    None for pre-cut stage files and exported programs (they bring their own graphs and weights)."""
    if spec.stage_files or programs.is_program(spec.arch):
        return None
    return spec.arch, spec.num_classes, tuple(int(d) for d in spec.input_shape), _seed(part)


def _seed(part: Part) -> int:
    return part.weights.seed if part.weights.seed is not None else 0


def _network(spec: ModelSpec, part: Part) -> arch.Traced:
    """The whole network ``part`` is cut from, built under its seed and traced."""
    try:
        net = arch.build_network(spec.arch, spec.num_classes, _seed(part), spec.input_shape)
    except ValueError as exc:  # an exported program that no longer loads
        raise BlockError(str(exc)) from None
    return arch.trace(net)


def _build_part(spec: ModelSpec, part: Part) -> nn.Module:
    if spec.stage_files:  # pre-cut: each file is one stage, with its weights
        try:
            return Chain([stage_files.load_stage_file(f) for f in spec.stage_files[part.first:part.last + 1]]).eval()
        except ValueError as exc:
            raise BlockError(str(exc)) from None
    return _cut_part(spec, part, _network(spec, part))


def _cut_part(spec: ModelSpec, part: Part, traced: arch.Traced, own_copy: bool = False) -> nn.Module:
    """Stages ``part.first..part.last`` of ``traced`` with the part's weights. They share the network's
    modules, or with ``own_copy`` (a network other parts are cut from too) are a copy of their own."""
    stages: nn.Module = arch.stage_module(traced, spec.cut_points, part.first, part.last)
    if own_copy:
        stages = copy.deepcopy(stages)
    if part.weights.file is not None:
        _load_into(stages, part, _load_state_dict(part.weights.file), f"weights file {part.weights.file}", spec.arch)
    elif part.weights.torchvision is not None:
        _load_into(stages, part, _trained_state_dict(spec.arch, part.weights.torchvision),
                   f"torchvision's {spec.arch} weights {part.weights.torchvision}", spec.arch)
    return stages


def _load_into(stages: nn.Module, part: Part, state: dict[str, torch.Tensor], what: str, network: str) -> None:
    """Load ``state`` (keyed as the full network; it may hold the whole model or just this block) into ``stages``."""
    wanted = set(stages.state_dict())
    missing = sorted(wanted - state.keys())
    if missing:
        raise BlockError(f"{what} lacks {len(missing)} tensor(s) of block {part.block!r}, e.g. {missing[:3]}; keys must "
                         f"be named as in {_state_dict_of(network)}")
    try:
        stages.load_state_dict({k: state[k] for k in wanted}, strict=True)
    except RuntimeError as exc:
        raise BlockError(f"{what} does not fit block {part.block!r}: {exc}") from exc


def _trained_state_dict(network: str, name: str) -> dict[str, torch.Tensor]:
    """torchvision's trained weights ``name`` of ``network``: from torch hub's cache, downloaded there first if they
    are not (torchvision's weights API); where they can be neither, an error that says which file to put where."""
    trained = trained_weights(network, name)
    if Path(trained.cached).is_file():
        return _load_state_dict(trained.cached)
    try:
        torch.hub.load_state_dict_from_url(trained.url, progress=False, map_location="cpu", weights_only=True)
    except Exception as exc:  # no network, a proxy, a full disk: urllib and torch raise many kinds
        raise BlockError(f"torchvision's {network} weights {name} are not in torch hub's cache and could not be "
                         f"downloaded ({type(exc).__name__}: {exc}); on a machine that is online, download {trained.url} "
                         f"and put it at {trained.cached} (the cache is $TORCH_HOME/hub/checkpoints)") from exc
    return _load_state_dict(trained.cached)


def _state_dict_of(network: str) -> str:
    return f"the state_dict of program {network}" if programs.is_program(network) else f"torchvision's {network}"


TENSOR = object()  # where an :class:`EagerTail` takes a tensor of the prefix


class EagerTail:
    """The eager node a detector's graph ends in (``blockflow.core.detection``: region proposals, heads,
    NMS), run on the tensors the rest of the graph gives it."""

    def __init__(self, target: Callable[..., Any], args: Sequence[Any]) -> None:
        self.target = target
        self.args = list(args)  # constants, and TENSOR where a tensor of the prefix goes, in order

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        given = iter(tensors)
        out: tuple[torch.Tensor, ...] = self.target(*(next(given) if a is TENSOR else a for a in self.args))
        return out


def split_eager_tail(part: nn.Module) -> tuple[fx.GraphModule, EagerTail] | None:
    """``part`` (a detector's last stages) as the traced prefix a CUDA graph can hold, giving the tensors
    the eager node takes, and that node (:class:`EagerTail`); None where the graph does not end in one.

    The modules the node takes (heads, anchors, transform) stay submodules of the prefix, so moving or
    casting the prefix moves and casts them too."""
    if not isinstance(part, fx.GraphModule):
        return None
    nodes = list(part.graph.nodes)
    output = nodes[-1]
    eager = output.args[0] if output.op == "output" else None
    if not (isinstance(eager, fx.Node) and eager.op == "call_function"
            and eager.target in detection.EAGER_NODES) or eager.kwargs:
        return None
    modules = [a for a in eager.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    tensors = [a for a in eager.args if isinstance(a, fx.Node) and a.op != "get_attr"]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node is not eager and node is not output:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[a] for a in tensors))
    prefix = fx.GraphModule(part, graph, f"{type(part).__name__}_prefix").eval()
    constants = {a: operator.attrgetter(str(a.target))(prefix) for a in modules}
    prefix.graph.eliminate_dead_code()  # the get_attr nodes only the eager node read (their modules stay)
    prefix.recompile()
    args = [constants.get(a, TENSOR) if isinstance(a, fx.Node) else a for a in eager.args]
    return prefix, EagerTail(eager.target, args)


def on_device(part: nn.Module, device: torch.device) -> nn.Module:
    """``part`` with the devices its graphs name as constants (an exported program's ``torch.arange(...,
    device='cpu')``: the device it was exported on) made ``device``, so its new tensors are made where it runs."""
    for module in part.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            given = node.kwargs.get("device")
            if isinstance(given, torch.device) and given != device:
                node.kwargs = {**node.kwargs, "device": device}
                changed = True
        if changed:
            module.recompile()
    return part


def fold_batchnorm(part: nn.Module) -> nn.Module:
    """``part`` with each BatchNorm that follows a convolution folded into it (eval mode).

    On a GPU, where a block's CUDA graph launch costs host time per kernel: ResNet-50 has a
    BatchNorm after every convolution, a third of its kernels. The folded weights round
    differently (7e-7 relative on a ResNet-50 stage in fp32), so CPU blocks, which the
    CPU tests compare to 1e-5 with networks run whole, keep theirs.
    """
    if not isinstance(part, fx.GraphModule):
        return part
    from torch.fx.experimental.optimization import fuse

    try:
        return fuse(part)
    except Exception:  # a graph fuse cannot rewrite: run it as it is (no numbers change)
        return part
